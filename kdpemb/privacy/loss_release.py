"""`LossRelease`: a DP-SGD step's training loss, released with noise.

Each example's loss is clipped to |loss| <= B (`bound`), the clipped
losses of the step's sample are summed, N(0, (z_l · B)²) is added once
(z_l: `noise_multiplier`) and the sum is divided by the expected batch
size. Adding or removing one example moves the sum by at most B
(replacing one, by at most 2B), so it is one more Gaussian release on the
step's sample, accounted with the gradient as one Gaussian
(`gaussian_release.effective_noise_multiplier`): z_eff = (z⁻² + z_l⁻²)^(-1/2)
for a gradient of noise multiplier z. `kdpemb.models.DPModel` takes it as
`noised_loss=` and logs the result as `noised_loss`.

Example:

>>> release = LossRelease(bound=5.0, noise_multiplier=4.0)
>>> release.noise_std
20.0
>>> from kdpemb.privacy.gaussian_release import GaussianRelease
>>> gradient = GaussianRelease.from_noise_multiplier(1.0, 1.0, "gradient")
>>> from kdpemb.privacy.gaussian_release import effective_noise_multiplier
>>> round(effective_noise_multiplier([gradient, release.release()]), 4)
0.9701
"""

import dataclasses

from kdpemb import _validation as validation
from kdpemb.privacy import gaussian_release
from kdpemb.privacy.config_dataclass import ConfigDataclass


@dataclasses.dataclass(frozen=True)
class LossRelease(ConfigDataclass):
    """Settings of a training loss released with noise; see the module docstring.

    Args:
        bound: float > 0. B: each example's loss is clipped to |loss| <= B
            before the sum, the sum's sensitivity (add or remove one
            example). Losses above it count as B: take B near the losses
            you expect (a cross-entropy over K classes starts near ln K).
        noise_multiplier: float > 0. z_l: the noise std on the sum is
            z_l · B. Its privacy cost is that of a gradient of noise
            multiplier z_l, composed with the gradient's as one Gaussian;
            z_l of a few times the gradient's z costs little. 0 is refused:
            a loss without noise is a release without a guarantee.

    Example:

    >>> LossRelease(bound=2.0, noise_multiplier=5.0).release().noise_std
    10.0
    """

    config_argument = "noised_loss"
    bound: float
    noise_multiplier: float

    def __post_init__(self):
        validation.check_positive(self.bound, "bound")
        z = validation.check_noise_multiplier(self.noise_multiplier)
        if z == 0:
            raise ValueError(
                "LossRelease(noise_multiplier=0) would log the training loss "
                "without noise: a release of private data without a "
                "guarantee. Give a noise_multiplier > 0 (a few times the "
                "gradient's costs little), or evaluate on held-out data."
            )

    @property
    def noise_std(self):
        """z_l · B, the noise std on the clipped loss sum."""
        return self.noise_multiplier * self.bound

    def release(self):
        """The `GaussianRelease` of one step's clipped loss sum."""
        return gaussian_release.GaussianRelease.from_noise_multiplier(
            self.noise_multiplier, self.bound, "clipped training loss sum"
        )
