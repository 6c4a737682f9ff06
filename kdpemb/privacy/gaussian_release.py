"""`GaussianRelease`: one release of a statistic plus Gaussian noise.

The parts of `GaussianReleases` (DP least squares, DP-Newton) and the
one-off `setup` releases of a mechanism (e.g. the feature covariance of
DP-FC); `effective_noise_multiplier` composes several into one.

Example:

>>> releases = [GaussianRelease(2.0, 1.0, "gram"), GaussianRelease(2.0, 1.0, "sums")]
>>> round(effective_noise_multiplier(releases), 4)
1.4142
"""

import dataclasses
import math

import dp_accounting as dpa

from kdpemb import _validation as validation


@dataclasses.dataclass(frozen=True)
class GaussianRelease:
    """One release of a statistic plus Gaussian noise N(0, noise_std² I).

    Args:
        noise_std: float. Standard deviation of the noise on each coordinate.
        sensitivity: float. Bound on the L2 norm of one unit's contribution
            to the statistic (e.g. `C_x**2` for a Gram matrix of features
            clipped to norm `C_x`): its sensitivity under add/remove. Like
            dp-accounting's events, the accountant doubles it under
            replace-one.
        name: str. What is released, for the privacy statement.

    Example:

    >>> GaussianRelease(noise_std=2.0, sensitivity=0.5, name="gram").noise_multiplier
    4.0
    """

    noise_std: float
    sensitivity: float
    name: str = ""

    def __post_init__(self):
        if validation.check_finite_real(self.noise_std, "noise_std") < 0:
            raise ValueError(f"noise_std must be >= 0, got {self.noise_std!r}.")
        validation.check_positive(self.sensitivity, "sensitivity")
        # The accountants' range applies to the multiplier, not to the std
        # (which scales with the sensitivity).
        validation.check_noise_multiplier(
            self.noise_std / self.sensitivity, "noise_std / sensitivity"
        )

    @classmethod
    def from_noise_multiplier(cls, noise_multiplier, sensitivity, name=""):
        """The release whose noise std is `noise_multiplier · sensitivity`.

        The one place where a noise multiplier becomes a noise scale for a
        release of a full-data statistic.

        Example:

        >>> GaussianRelease.from_noise_multiplier(4.0, 0.5, "gram").noise_std
        2.0
        """
        noise_multiplier = validation.check_noise_multiplier(noise_multiplier)
        sensitivity = validation.check_positive(sensitivity, "sensitivity")
        return cls(noise_multiplier * sensitivity, sensitivity, name)

    @property
    def noise_multiplier(self):
        return self.noise_std / self.sensitivity

    def scaled(self, factor):
        """The same release with `factor` times the noise multiplier."""
        return type(self)(self.noise_std * factor, self.sensitivity, self.name)

    def event(self):
        return dpa.GaussianDpEvent(self.noise_multiplier)


def effective_noise_multiplier(releases):
    """The single Gaussian equivalent to independent Gaussian releases.

    Releasing f_i + N(0, σ_i²) for i = 1..m with sensitivities Δ_i is, after
    scaling each output by 1/σ_i, one Gaussian mechanism with unit noise and
    L2 sensitivity sqrt(Σ (Δ_i/σ_i)²): its noise multiplier is
    (Σ z_i⁻²)^(-1/2) with z_i = σ_i/Δ_i.
    """
    multipliers = [r.noise_multiplier for r in releases]
    if any(z == 0 for z in multipliers):
        return 0.0
    return sum(z**-2 for z in multipliers) ** -0.5


def remaining_noise_multiplier(effective, others, remedy=""):
    """The z of a release of sensitivity 1 that, with `others`, makes one
    Gaussian of multiplier at least `effective` (a calibrated z_eff).

    z = (z_eff⁻² − Σ z_i⁻²)^(-1/2) over the others' multipliers z_i,
    rounded up so that round-off never leaves the composition below
    `effective`.

    Args:
        effective: float > 0. z_eff of the whole composition.
        others: sequence of `GaussianRelease`. The other releases.
        remedy: str. What to raise, for the error.

    Raises:
        ValueError: if the others alone spend it (their composition's
            multiplier is at most `effective`).

    Example:

    >>> count = GaussianRelease(noise_std=5.0, sensitivity=0.5, name="count")
    >>> z = remaining_noise_multiplier(0.995, [count])
    >>> round(z, 4), effective_noise_multiplier(
    ...     [GaussianRelease(z, 1.0), count]) >= 0.995
    (1.0, True)
    """
    effective = validation.check_positive(effective, "effective_noise_multiplier")
    others = check_releases(others, "others")
    rest = effective_noise_multiplier(others) if others else math.inf
    if rest <= effective:
        named = "; ".join(f"{r.name or 'release'}: {r.noise_multiplier:.4g}"
                          for r in others)  # fmt: skip
        raise ValueError(
            f"The other releases of each step ({named}) have together a noise "
            f"multiplier of {rest:.4g}, at or below the {effective:.4g} that the "
            f"whole budget needs: they alone spend more than it. {remedy}".strip()
        )
    if not others:
        return effective
    z = (effective**-2 - rest**-2) ** -0.5

    def composed(z):
        return effective_noise_multiplier([GaussianRelease(z, 1.0), *others])

    while composed(z) < effective:
        z = math.nextafter(z, math.inf)
    return z


def check_releases(items, name):
    """`items` as a tuple of `GaussianRelease`, or a TypeError naming `name`.

    Example:

    >>> check_releases([GaussianRelease(2.0, 1.0)], "setup")
    (GaussianRelease(noise_std=2.0, sensitivity=1.0, name=''),)
    """
    try:
        releases = tuple(items)
    except TypeError as error:
        raise TypeError(
            f"{name} must be a sequence of GaussianRelease, got {items!r}."
        ) from error
    for release in releases:
        if not isinstance(release, GaussianRelease):
            raise TypeError(
                f"{name} must hold GaussianRelease objects (see "
                f"kdpemb.privacy.GaussianRelease), got {release!r}."
            )
    return releases
