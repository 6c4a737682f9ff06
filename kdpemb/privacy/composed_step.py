"""`ComposedSampledGaussian`: a sampled step of several Gaussian releases.

A step that releases, on the same sampled units, several statistics each
plus its own Gaussian noise (DP-SGD's clipped gradient sum with a noised
loss, or with the count of adaptive clipping) is one Gaussian mechanism
of multiplier z_eff = (Σ zᵢ⁻²)^(-1/2)
(`gaussian_release.effective_noise_multiplier`): the accountant counts
z_eff, as for a `SampledGaussian`. This mechanism also keeps the releases
it composes (`step_releases`), so that its description, the privacy
statement and a privacy ledger say what each step released and at which
noise.

Example:

>>> from kdpemb import privacy
>>> from kdpemb.privacy.gaussian_release import GaussianRelease
>>> schedule = privacy.Schedule.examples(1_000, 50)
>>> step = ComposedSampledGaussian.compose(
...     schedule.privacy_mechanism(1.0),
...     [GaussianRelease(1.0, 1.0, "clipped gradient sum"),
...      GaussianRelease(10.0, 2.0, "clipped training loss sum")])
>>> round(step.noise_multiplier, 4)
0.9806
>>> print(step.describe_noise())  # doctest: +NORMALIZE_WHITESPACE
independent Gaussian noise each step, on 2 releases of the step's sample
composed as one Gaussian: clipped gradient sum: noise multiplier 1 (std 1
on sensitivity 1); clipped training loss sum: noise multiplier 5 (std 10
on sensitivity 2)
"""

import dataclasses
import math

from kdpemb.privacy import gaussian_release
from kdpemb.privacy.mechanisms import INDEPENDENT_NOISE, SampledGaussian

# Round-off between z_eff and the composition of the releases it is of.
COMPOSITION_RTOL = 1e-12


@dataclasses.dataclass(frozen=True)
class ComposedSampledGaussian(SampledGaussian):
    """A `SampledGaussian` whose step is the composition of `step_releases`.

    Args:
        step_releases: tuple of `GaussianRelease`, two or more: what each
            step releases on its sample. `noise_multiplier` must be their
            composition (build it with `compose`).
        (the others): as `SampledGaussian`'s.

    Example:

    >>> from kdpemb import privacy
    >>> from kdpemb.privacy.gaussian_release import GaussianRelease
    >>> base = privacy.Schedule.examples(100, 10).privacy_mechanism(1.0)
    >>> releases = [GaussianRelease(2.0, 1.0), GaussianRelease(2.0, 1.0)]
    >>> round(ComposedSampledGaussian.compose(base, releases).noise_multiplier, 4)
    1.4142
    """

    step_releases: tuple = ()

    def __post_init__(self):
        super().__post_init__()
        releases = gaussian_release.check_releases(self.step_releases, "step_releases")
        if len(releases) < 2:
            raise ValueError(
                "A ComposedSampledGaussian composes two or more releases; with "
                "one, use SampledGaussian."
            )
        composed = gaussian_release.effective_noise_multiplier(releases)
        if not math.isclose(composed, self.noise_multiplier, rel_tol=COMPOSITION_RTOL):
            raise ValueError(
                f"noise_multiplier={self.noise_multiplier!r} is not the "
                f"composition {composed!r} of step_releases: build it with "
                "ComposedSampledGaussian.compose."
            )
        object.__setattr__(self, "step_releases", releases)

    @classmethod
    def compose(cls, mechanism, releases):
        """The `SampledGaussian` `mechanism` with steps of `releases`: its
        noise multiplier is theirs composed (the one `mechanism` has is
        replaced)."""
        releases = gaussian_release.check_releases(releases, "releases")
        fields = {
            field.name: getattr(mechanism, field.name)
            for field in dataclasses.fields(SampledGaussian)
        }
        fields["noise_multiplier"] = gaussian_release.effective_noise_multiplier(
            releases
        )
        return cls(**fields, step_releases=releases)

    def with_noise_multiplier(self, noise_multiplier):
        """Every release's noise scaled by the same factor, so that they
        compose to `noise_multiplier`."""
        if self.noise_multiplier == 0:
            raise ValueError(
                "A release of this step has no noise: no scaling of the "
                "releases makes their composition another noise multiplier."
            )
        factor = noise_multiplier / self.noise_multiplier
        releases = [release.scaled(factor) for release in self.step_releases]
        return self.compose(self, releases)

    def describe_noise(self):
        """The noise, and each release of the step, in words."""
        parts = [
            f"{release.name or 'release'}: noise multiplier "
            f"{release.noise_multiplier:.4g} (std {release.noise_std:.4g} on "
            f"sensitivity {release.sensitivity:.4g})"
            for release in self.step_releases
        ]
        return (
            f"{INDEPENDENT_NOISE}, on {len(parts)} releases of the step's sample "
            f"composed as one Gaussian: {'; '.join(parts)}"
        )
