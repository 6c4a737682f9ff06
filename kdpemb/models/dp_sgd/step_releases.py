"""`DPModel`'s opt-in releases beside the noisy gradient: a noised training
loss and adaptive clipping.

With `noised_loss=kdpemb.privacy.LossRelease(bound=B_l, noise_multiplier=z_l)`
each step also releases Σᵢ clip(lossᵢ) + N(0, (z_l B_l)²), each loss
clipped to |loss| <= B_l, divided by the expected batch size B (logged as
`noised_loss`). With `adaptive_clipping=kdpemb.privacy.AdaptiveClipping(...)`
it releases Σᵢ (1[‖gᵢ‖ <= C] − 1/2) + N(0, σ_b²) and moves C towards the
target quantile of the examples' gradient norms (Andrew et al. 2021,
`kdpemb.privacy.quantile_clip`, as `FedEmbModel` does; logged as
`clip_norm`). The step clips to, and noises with, the C before its update.

Every release is a Gaussian on the step's sampled examples, each from its
own `SeedGenerator`: the step is one Gaussian mechanism of multiplier
z_eff = (z⁻² + z_l⁻² + (2σ_b)⁻²)^(-1/2)
(`kdpemb.privacy.gaussian_release.effective_noise_multiplier`), the
mechanism the accountant counts (a
`kdpemb.privacy.composed_step.ComposedSampledGaussian`, which names each
release and its noise for the statement and the ledger), and the one a
`target_epsilon` calibrates (the gradient keeps what the others leave,
`gradient_noise`). With both off the step and its mechanism are DP-SGD's
alone. Both divide by the expected batch size B, never by the realised
(private) one. `history["noised_loss"]` is each epoch's last step (as
`clip_norm`); a step past a target-ε plan logs NaN and leaves C.

Example:

>>> import keras
>>> from kdpemb.models import DPModel
>>> from kdpemb.privacy import AdaptiveClipping, LossRelease
>>> network = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
>>> model = DPModel(network, noise_multiplier=1.0,
...                 noised_loss=LossRelease(bound=2.0, noise_multiplier=4.0),
...                 adaptive_clipping=AdaptiveClipping(count_stddev=2.0))
>>> [r.name for r in extra_releases(model, batch_size=64)]
['count within the clip norm', 'clipped training loss sum']
"""

import math
import warnings

from keras import ops

from kdpemb.errors import CostlyReleaseWarning
from kdpemb.models._shared import private_state
from kdpemb.models.dp_sgd import user_level
from kdpemb.privacy import gaussian_release, gaussian_sum, quantile_clip
from kdpemb.privacy.adaptive_clipping import AdaptiveClipping
from kdpemb.privacy.composed_step import ComposedSampledGaussian
from kdpemb.privacy.loss_release import LossRelease

# The seed generators of the releases, after the gradient's `noise_seed`
# (with a fixed seed, generator i is drawn from seed + i).
SEED_NAMES = ("count_seed", "loss_seed")
# The gradient's release in the mechanism: std z·C on sensitivity C, at
# the step's C (which adaptive clipping moves).
GRADIENT_RELEASE = "clipped gradient sum, per unit of the clip norm C"


def configure(model, noised_loss, adaptive_clipping, seed):
    """Checks and sets `model.noised_loss` and `model.adaptive_clipping`
    (after its `clip_norm` and `per_layer_clipping`), adds the state they
    need (C, `current_clip_norm`: saved and restored with the model), and
    every seed generator of the model's noise (`noise_seed` for the
    gradient, then one per release, from `seed`: see
    `private_state.noise_seed_generators`)."""
    model.noised_loss = (
        None if noised_loss is None else LossRelease.from_config(noised_loss)
    )
    model.adaptive_clipping = (
        None
        if adaptive_clipping is None
        else AdaptiveClipping.from_config(adaptive_clipping)
    )
    if model.adaptive_clipping is not None:
        if model.per_layer_clipping:
            raise ValueError(
                "adaptive_clipping follows one quantile of the examples' whole "
                "gradient norms; per_layer_clipping would need a count, and a "
                "release, per layer. Use one of the two."
            )
        refuse_unnoised_count(model.adaptive_clipping, model.noise_multiplier)
        model.current_clip_norm = private_state.add_state(
            model, "current_clip_norm", initializer=model.clip_norm
        )
    used = (model.adaptive_clipping is not None, model.noised_loss is not None)
    extra = [name for name, on in zip(SEED_NAMES, used, strict=True) if on]
    names = ("noise_seed", *extra)
    generators = private_state.noise_seed_generators(
        seed,
        names,
        "DPModel",
        stacklevel=4,  # Through `DPModel.__init__`.
    )
    for name, generator in zip(names, generators, strict=True):
        setattr(model, name, generator)


def refuse_unnoised_count(clipping, noise_multiplier):
    """Refuses `count_stddev=0` unless the gradient has no noise either
    (`noise_multiplier` 0; None: a target ε, whose noise is > 0): the
    count that moves C would be logged (`clip_norm`) without noise."""
    if clipping.count_stddev != 0 or noise_multiplier == 0:
        return
    raise ValueError(
        "AdaptiveClipping(count_stddev=0) would move the clip norm, which "
        "every step logs as clip_norm, by the count of examples within it "
        "without noise: a release of private data without a guarantee "
        "(ε = ∞), beside a noised gradient. Give count_stddev > 0 (None, "
        "the default, takes B / 20 for an expected batch of B), or "
        "noise_multiplier=0 for a run without privacy."
    )


def seed_generators(model):
    """Every `SeedGenerator` of the model's DP noise, the gradient's first."""
    return [model.noise_seed] + [
        getattr(model, name) for name in SEED_NAMES if hasattr(model, name)
    ]


def config(model):
    """The releases' entries of the model's config."""
    return {
        name: None if value is None else value.get_config()
        for name, value in (
            ("noised_loss", model.noised_loss),
            ("adaptive_clipping", model.adaptive_clipping),
        )
    }


def extra_releases(model, batch_size):
    """The `GaussianRelease`s of one step beside the gradient, for steps of
    expected size `batch_size` (the M of the count's default σ_b)."""
    releases = []
    if model.adaptive_clipping is not None:
        releases.append(model.adaptive_clipping.count_release(batch_size))
    if model.noised_loss is not None:
        releases.append(model.noised_loss.release())
    return releases


def privacy_mechanism(model):
    """The schedule's mechanism of the step; with no extra release that of
    the gradient alone (z and C), else the `ComposedSampledGaussian` of
    the gradient's and the others' releases (z_eff). With adaptive
    clipping it names no clip norm: C changes every step."""
    schedule, z = model.schedule, model.noise_multiplier
    others = extra_releases(model, schedule.sample_size)
    if not others:
        return schedule.privacy_mechanism(z, model.clip_norm)
    clip_norm = None if model.adaptive_clipping is not None else model.clip_norm
    gradient = gaussian_release.GaussianRelease(z, 1.0, GRADIENT_RELEASE)
    return ComposedSampledGaussian.compose(
        schedule.privacy_mechanism(z, clip_norm), [gradient, *others]
    )


def gradient_noise(model, z_eff, schedule, verbose):
    """The gradient's noise multiplier of a step whose releases together
    must have `z_eff` (calibrated for a target): what the other releases
    leave (`remaining_noise_multiplier`), or a `ValueError` naming the
    setting to raise if they alone spend it. `verbose` prints it."""
    others = extra_releases(model, schedule.sample_size)
    if not others:
        return z_eff
    z = gaussian_release.remaining_noise_multiplier(
        z_eff, others,
        "Raise their noise: AdaptiveClipping(count_stddev=...) or "
        "LossRelease(noise_multiplier=...), a few times the target's.",
    )  # fmt: skip
    if verbose:
        print(
            f"DPModel: with the other releases of each step, the gradient's "
            f"noise multiplier is {z:.4g}.",
            flush=True,
        )
    return z


def warn_costly_count(model):
    """Warns once per model, before its first steps, where adaptive
    clipping's count is noised less than the gradient (z_b = 2σ_b < z):
    it then spends more of each step's budget than the gradient itself
    (with the default σ_b = B / 20, below a batch of B = 10 z)."""
    clipping, z = model.adaptive_clipping, model.noise_multiplier
    if clipping is None or getattr(model, "_count_cost_warned", False):
        return
    batch_size = model.schedule.sample_size
    z_b = clipping.count_noise_multiplier(batch_size)
    if z_b >= z:
        return
    model._count_cost_warned = True
    default = " (the default B / 20)" if clipping.count_stddev is None else ""
    warnings.warn(
        f"AdaptiveClipping's count of examples within C is noised less than "
        f"the gradient: its noise multiplier z_b = 2σ_b = {z_b:.4g} (σ_b = "
        f"{z_b / 2:.4g}{default}, for an expected batch of B = {batch_size:g}) "
        f"is below the gradient's z = {z:.4g}, so the count spends more of "
        f"each step's budget than the gradient (the step's noise multiplier "
        f"is {privacy_mechanism(model).noise_multiplier:.4g}). Give "
        f"AdaptiveClipping(count_stddev=...) of a few times z / 2 (e.g. "
        f"{2.5 * z:.3g}), or a larger batch.",
        CostlyReleaseWarning,
        stacklevel=3,  # Through `DPModel.fit`.
    )


def step_engine(model, engine):
    """The engine of this step: at the current C with adaptive clipping, and
    summing the clipped losses too with `noised_loss`."""
    if model.adaptive_clipping is not None:
        engine = type(engine)(
            engine.model, engine.plan, engine.loss_fn,
            [model.current_clip_norm.value],
            examples_per_user=engine.examples_per_user,
        )  # fmt: skip
    if model.noised_loss is not None:
        engine = LossSums(engine, model.noised_loss.bound, model.examples_per_user)
    return engine


class LossSums:
    """An engine (as `ClippedGradients`) that also sums each example's loss
    clipped to |loss| <= `bound` (`gaussian_sum.clip_and_sum`: a
    non-finite loss adds 0). The sums travel after the network's
    non-trainable values (`carry` adds them, `uncarry` takes them off), so
    they pass through `DPModel`'s loop over physical batches like them.
    Each batch's losses come from a forward pass at the values its
    gradients were computed at (the same dropout masks on the by-layer
    path). At user level (`examples_per_user`) each user's mean loss over
    its examples of the step is one contribution, clipped to `bound`."""

    def __init__(self, engine, bound, examples_per_user=None):
        self.engine, self.bound = engine, bound
        self.examples_per_user = examples_per_user

    @property
    def clip_norm(self):
        return self.engine.clip_norm

    def __call__(self, params, values, x, y, mask):
        fixed, (total, count, nonfinite) = values[:-3], values[-3:]
        clipped, new_fixed = self.engine(params, fixed, x, y, mask)
        losses = self.engine.example_losses(params, fixed, x, y)
        if self.examples_per_user is not None:
            losses, mask = user_level.slot_means(losses, mask, self.examples_per_user)
        part = gaussian_sum.clip_and_sum([losses], self.bound, mask)
        sums = [total + part.total[0], count + part.count,
                nonfinite + part.num_nonfinite]  # fmt: skip
        return clipped, [*new_fixed, *sums]


def carry(model, fixed):
    """`fixed` with the loss sums' zeros after it (with `noised_loss`)."""
    if model.noised_loss is None:
        return fixed
    zero = ops.zeros((), "int32")
    return [*fixed, ops.zeros((), "float32"), zero, zero]


def uncarry(model, values):
    """`(the network's non-trainable values, the loss ClippedSum or None)`."""
    if model.noised_loss is None:
        return values, None
    total, count, nonfinite = values[-3:]
    return values[:-3], gaussian_sum.ClippedSum(
        [total], model.noised_loss.bound, count, nonfinite
    )


def release(model, clipped, losses, within_plan):
    """The step's extra releases, as logs; moves C with adaptive clipping.

    Args:
        clipped: the step's gradient `ClippedSum` (at the step's C).
        losses: the loss `ClippedSum` (`uncarry`), or None.
        within_plan: traced bool or None. A step past the plan releases
            nothing: C stays, and the noised loss is logged as NaN.
    """
    logs = {}
    batch_size = float(model.schedule.sample_size)
    if losses is not None:
        (noise,) = gaussian_sum.gaussian_noise(
            losses, model.noised_loss.noise_multiplier, model.loss_seed
        )
        value = (losses.total[0] + noise) / batch_size
        logs["noised_loss"] = _only_within(
            within_plan, value, ops.full_like(value, math.nan)
        )
    if model.adaptive_clipping is not None:
        clipping = model.adaptive_clipping
        noise = quantile_clip.count_noise(
            clipping.count_stddev_for(batch_size), model.count_seed
        )
        clip_norm = clipped.clip_norm
        new = quantile_clip.next_clip_norm(
            clip_norm, quantile_clip.centred_count(clipped) + noise, batch_size,
            clipping,
        )  # fmt: skip
        new = _only_within(within_plan, new, clip_norm)
        model.current_clip_norm.assign(new)
        logs["clip_norm"] = new
    return logs


def _only_within(within_plan, value, otherwise):
    return value if within_plan is None else ops.where(within_plan, value, otherwise)
