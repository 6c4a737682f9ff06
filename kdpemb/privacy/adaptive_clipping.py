"""Adaptive quantile clipping (Andrew et al. 2021): settings and accounting.

Instead of a fixed clip norm C, each round moves C towards the
`target_quantile` γ of the sampled clients' update norms:

1. every sampled client reports b = 1[‖Δ‖ ≤ C] (a non-finite update
   counts as above C), centred as b − 1/2 ∈ {−1/2, +1/2};
2. the server sums the centred reports and adds N(0, σ_b²) once, from its
   own noise stream: b̄ = (noisy sum) / M + 1/2, clipped to [0, 1], with M
   the expected clients per round (the realised count is private);
3. C ← C · exp(−η (b̄ − γ)) (geometric update), after the round's update
   was clipped to, and noised with, the old C.

Privacy. The noisy update sum (sensitivity C, std z_Δ C) and the noisy
count (sensitivity 1/2, std σ_b) are released on the same sampled
clients. Divided by their noise stds, one client moves them by at most
(1/z_Δ, 1/(2σ_b)): together by at most √(z_Δ⁻² + (2σ_b)⁻²) in L2, with
unit noise. The pair is therefore one Gaussian mechanism with noise
multiplier z_eff = (z_Δ⁻² + (2σ_b)⁻²)^(-1/2), under add/remove (k = 1) as
under replace-one on virtual clients (k > 1: one client's (Δ, b − 1/2)
is replaced by another in the same ball, so the pair moves by at most
twice that radius, which dp-accounting's REPLACE_ONE model of z_eff
covers as it does the 2C of the update alone). C itself is computed from
released values only. This is the accounting of Andrew et al. (their
Theorem 1) and of TensorFlow Federated's adaptive Gaussian aggregator.

Example:

>>> clipping = AdaptiveClipping(target_quantile=0.5, learning_rate=0.2,
...                             count_stddev=5.0)
>>> round(clipping.effective_noise_multiplier(1.0, clients_per_round=100), 4)
0.995
>>> z = clipping.update_noise_multiplier(0.995, clients_per_round=100)
>>> round(z, 4), clipping.effective_noise_multiplier(z, 100) >= 0.995
(1.0, True)
"""

import dataclasses

from kdpemb import _validation as validation
from kdpemb.privacy import gaussian_release
from kdpemb.privacy.config_dataclass import ConfigDataclass

# Andrew et al. recommend σ_b = M / 20: the count's noise std is 5% of
# the expected clients per round.
DEFAULT_COUNT_STDDEV_PER_CLIENT = 0.05
COUNT_SENSITIVITY = 0.5  # One client's centred report b - 1/2.


@dataclasses.dataclass(frozen=True)
class AdaptiveClipping(ConfigDataclass):
    """Settings of adaptive quantile clipping; see the module docstring.

    Args:
        target_quantile: float in (0, 1). γ: the share of sampled clients
            whose update should fit in C. Defaults to 0.5 (the median).
        learning_rate: float > 0. η of C ← C · exp(−η (b̄ − γ)): C moves
            by at most a factor exp(η) per round. Defaults to 0.2.
        count_stddev: float >= 0 or None. σ_b, the noise std on the
            round's count of clients within C (in clients). None (the
            default) takes M / 20, with M the expected clients per round.
            Its privacy cost is that of a noise multiplier 2σ_b (M / 10 by
            default), combined with the update's
            (`effective_noise_multiplier`): for small M (a DP-SGD batch
            of a few dozen examples) give it a few times z / 2. With 0,
            C moves (and is logged) by an unnoised count: ε = ∞, and
            `kdpemb.models.DPModel` refuses it beside a noised gradient.

    Example:

    >>> AdaptiveClipping().count_stddev_for(clients_per_round=64)
    3.2
    """

    config_argument = "adaptive_clipping"
    target_quantile: float = 0.5
    learning_rate: float = 0.2
    count_stddev: float | None = None

    def __post_init__(self):
        quantile = validation.check_finite_real(self.target_quantile, "target_quantile")
        if not 0.0 < quantile < 1.0:
            raise ValueError(
                f"target_quantile must be in (0, 1), got {self.target_quantile!r}: "
                "the share of clients whose update should fit in the clip norm."
            )
        validation.check_positive(self.learning_rate, "learning_rate")
        if self.count_stddev is not None:
            validation.check_noise_multiplier(self.count_stddev, "count_stddev")

    def count_stddev_for(self, clients_per_round):
        """σ_b for rounds of `clients_per_round` expected clients."""
        if self.count_stddev is not None:
            return float(self.count_stddev)
        clients = validation.check_positive(clients_per_round, "clients_per_round")
        return DEFAULT_COUNT_STDDEV_PER_CLIENT * clients

    def count_noise_multiplier(self, clients_per_round):
        """z_b = σ_b / (1/2): the count's noise over its sensitivity."""
        return self.count_stddev_for(clients_per_round) / COUNT_SENSITIVITY

    def count_release(self, clients_per_round):
        """The `GaussianRelease` of one round's count (std σ_b, sensitivity 1/2)."""
        return gaussian_release.GaussianRelease(
            self.count_stddev_for(clients_per_round),
            COUNT_SENSITIVITY,
            "count within the clip norm",
        )

    def effective_noise_multiplier(self, update_noise_multiplier, clients_per_round):
        """z_eff = (z_Δ⁻² + (2σ_b)⁻²)^(-1/2): the round's one Gaussian.

        Zero if either noise is zero (that release is in the clear).
        """
        releases = (
            gaussian_release.GaussianRelease(
                validation.check_noise_multiplier(update_noise_multiplier),
                1.0,
                "clipped update sum",
            ),
            self.count_release(clients_per_round),
        )
        return gaussian_release.effective_noise_multiplier(releases)

    def update_noise_multiplier(self, effective_noise_multiplier, clients_per_round):
        """The z_Δ whose `effective_noise_multiplier` is at least the given z_eff.

        Raises:
            ValueError: if the count's noise alone is not enough
                (2σ_b <= z_eff): raise `count_stddev`.
        """
        z_eff = validation.check_positive(
            effective_noise_multiplier, "effective_noise_multiplier"
        )
        z_count = self.count_noise_multiplier(clients_per_round)
        if z_count <= z_eff:
            raise ValueError(
                f"The clip-norm count alone, with noise std σ_b = {z_count / 2:g} "
                f"(noise multiplier 2σ_b = {z_count:g}), spends more than the "
                f"whole budget, which needs a noise multiplier of {z_eff:.4g}. "
                f"Give AdaptiveClipping(count_stddev=...) above {z_eff / 2:.4g} "
                "(about 5 times that leaves most of the budget to the update)."
            )
        return gaussian_release.remaining_noise_multiplier(
            z_eff, [self.count_release(clients_per_round)]
        )
