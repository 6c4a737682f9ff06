"""The Gaussian sum query in `keras.ops`: clip, sum, add noise once.

Every kdpemb trainer privatises the same way: each contribution (a virtual
client's model update, or one example's gradient) is clipped to L2 norm C
as one vector over all its tensors, the clipped contributions are summed,
and Gaussian noise N(0, (z C)² I) is added once to the sum. This module
does exactly that on either backend, and nothing else.

- `clip_and_sum` returns a `ClippedSum` that carries the clip norm it
  guarantees, so `add_gaussian_noise` takes the noise scale from it and
  never from a second, separately configured number.
- A contribution with a NaN or infinite value anywhere is replaced by
  zeros (norm 0 <= C) and counted, so one diverged client can neither
  poison the sum nor break the sensitivity bound.
- Noise comes from a `keras.random.SeedGenerator`, which advances on every
  draw: each tensor and each call gets a fresh, independent draw. An
  integer seed would give every tensor of the same shape the same noise,
  so it is refused.

This module imports Keras, as `quantile_clip` and `tree_noise` do; the
rest of `kdpemb.privacy` does not.
"""

import secrets
from typing import NamedTuple

import keras
import numpy as np

from kdpemb import _validation as validation
from kdpemb.privacy import mechanisms


class ClippedSum(NamedTuple):
    """The sum of clipped contributions, and what it guarantees.

    Formal guarantees: every contribution's L2 norm (over all its tensors)
    is at most `clip_norm`, so removing one contribution moves `total` by
    at most `clip_norm` and replacing one by another by at most
    2 · `clip_norm` (`sensitivity`). The noise multiplier z of
    `gaussian_noise` is relative to `clip_norm`, as dp-accounting's events
    expect: its accountants apply the relation themselves.

    Attributes:
        total: list of tensors. Sum over contributions of the clipped
            updates, one tensor per variable (without the leading axis).
        clip_norm: float. The L2 bound of one contribution, C.
        count: int tensor. Contributions included (after the mask).
        num_nonfinite: int tensor. Included contributions that were zeroed
            because they held NaN or infinite values.
        num_within_clip: int tensor or None. Included contributions whose
            norm was finite and at most `clip_norm` (left unscaled): what
            adaptive clipping releases, with noise
            (`kdpemb.privacy.quantile_clip`).

    `clip_norm` is a Python float, or a float tensor where it is model
    state (adaptive clipping), then positive by construction.

    Example:

    >>> import numpy as np
    >>> clipped = clip_and_sum([np.ones((3, 2))], clip_norm=0.5)
    >>> clipped.sensitivity("add_or_remove_one"), clipped.sensitivity("replace_one")
    (0.5, 1.0)
    """

    total: list
    clip_norm: float
    count: object
    num_nonfinite: object
    num_within_clip: object = None

    def sensitivity(self, relation):
        """The L2 sensitivity of `total` under a neighbouring relation.

        Args:
            relation: "add_or_remove_one", "replace_one", "replace_special"
                (replace by a zero record) or a
                `dp_accounting.NeighboringRelation`.
        """
        relation = mechanisms.relation_from_name(relation)
        if relation == mechanisms.Relation.REPLACE_ONE:
            return 2.0 * self.clip_norm
        return self.clip_norm


def global_norms(updates):
    """Per-contribution L2 norm over all tensors: shape `[m]`.

    Args:
        updates: list of tensors, each `[m, ...]` (one row per
            contribution).

    Example:

    >>> import numpy as np
    >>> norms = global_norms([np.array([[3.0], [0.0]]), np.array([[4.0], [1.0]])])
    >>> np.asarray(norms).tolist()
    [5.0, 1.0]
    """
    ops = keras.ops
    squares = [
        ops.sum(
            ops.reshape(ops.square(ops.cast(u, "float32")), (ops.shape(u)[0], -1)),
            axis=1,
        )
        for u in updates
    ]
    return ops.sqrt(sum(squares[1:], squares[0]))


def clip_factors(norms, clip_norm, mask=None):
    """Per-contribution scale factors `min(1, C / norm)`: shape `[m]`.

    A contribution with a non-finite norm, or with `mask` false, gets
    factor 0. This is the one place where kdpemb turns norms into clip
    factors, whether the norms come from materialised updates
    (`clip_and_sum`) or are computed without them (the dense-layer norm
    trick of `kdpemb.models.dense_gradient_norms`, ghost clipping).

    Args:
        norms: float tensor `[m]`. Each contribution's L2 norm.
        clip_norm: float > 0. C.
        mask: bool tensor `[m]` or None. Which contributions take part.

    Returns:
        `(factors, finite)`: float32 factors `[m]` and the bool tensor of
        rows whose norm is finite.

    Example:

    >>> import numpy as np
    >>> factors, finite = clip_factors(np.array([2.0, 0.5, np.inf]), clip_norm=1.0)
    >>> np.asarray(factors).tolist(), np.asarray(finite).tolist()
    ([0.5, 1.0, 0.0], [True, True, False])
    """
    clip_norm = _checked_clip_norm(clip_norm)
    ops = keras.ops
    norms = ops.cast(ops.convert_to_tensor(norms), "float32")
    finite = ops.isfinite(norms)
    safe_norms = ops.where(finite, norms, 0.0)
    factors = ops.minimum(1.0, clip_norm / ops.maximum(safe_norms, 1e-30))
    keep = finite if mask is None else ops.logical_and(finite, _as_mask(mask))
    return ops.where(keep, factors, 0.0), finite


def _checked_clip_norm(clip_norm):
    """A Python clip norm checked (> 0), or a float32 tensor (model state)."""
    if isinstance(clip_norm, (int, float, np.number)):
        return validation.check_positive(clip_norm, "clip_norm")
    return keras.ops.cast(clip_norm, "float32")


def _as_mask(mask):
    return keras.ops.cast(keras.ops.convert_to_tensor(mask), "bool")


def clipped_sum_from_norms(norms, clip_norm, weighted_sum, mask=None):
    """The `ClippedSum` of contributions known by their norms and a weighted sum.

    For trainers that never materialise per-contribution updates: they
    compute each contribution's norm, and `weighted_sum(factors)` returns
    Σᵢ factorsᵢ · gᵢ (one tensor per variable). Rows with factor 0 must
    add exactly 0 (zero their inputs with `ops.where`, since NaN · 0 is
    NaN).

    Args:
        norms: float tensor `[m]`. Each contribution's exact L2 norm.
        clip_norm: float > 0. C.
        weighted_sum: callable `factors [m] -> list of tensors`.
        mask: bool tensor `[m]` or None. Which contributions take part.

    Example:

    >>> import numpy as np
    >>> rows = np.array([[3.0, 4.0], [0.3, 0.4]])
    >>> clipped = clipped_sum_from_norms(
    ...     np.linalg.norm(rows, axis=1), 1.0,
    ...     lambda f: [keras.ops.sum(rows * f[:, None], axis=0)])
    >>> np.round(np.asarray(clipped.total[0], dtype=float), 6).tolist()
    [0.9, 1.2]
    """
    clip_norm = _checked_clip_norm(clip_norm)
    factors, finite = clip_factors(norms, clip_norm, mask)
    ops = keras.ops
    rows = ops.shape(factors)[0]
    included = ops.ones((rows,), "int32") if mask is None else _as_mask(mask)
    included = ops.cast(included, "int32")
    # NaN <= C is false: a non-finite contribution is never within C.
    within = ops.cast(ops.cast(norms, "float32") <= clip_norm, "int32")
    return ClippedSum(
        total=list(weighted_sum(factors)),
        clip_norm=clip_norm,
        count=ops.sum(included),
        num_nonfinite=ops.sum(included * ops.cast(ops.logical_not(finite), "int32")),
        num_within_clip=ops.sum(included * within),
    )


def clipped_sum_from_group_norms(group_norms, clip_norms, weighted_sum, mask=None):
    """The `ClippedSum` of contributions clipped group by group (per layer).

    Each contribution is split into groups (e.g. one per layer); its part
    in group j is scaled to norm at most `C_j`, so the whole contribution
    has norm at most C = (Σ_j C_j²)^½, the `clip_norm` of the result. A
    contribution with a non-finite norm in any group is left out whole.

    Args:
        group_norms: list of float tensors `[m]`, one per group.
        clip_norms: list of floats > 0, one per group.
        weighted_sum: callable `list of factors [m] (one per group) -> list
            of tensors`; rows with factor 0 must add exactly 0.
        mask: bool tensor `[m]` or None.

    Example:

    >>> import numpy as np
    >>> clipped = clipped_sum_from_group_norms(
    ...     [np.array([3.0]), np.array([0.5])], [1.0, 1.0],
    ...     lambda f: [f[0] * 3.0, f[1] * 0.5])
    >>> [round(float(np.asarray(t)[0]), 3) for t in clipped.total]
    [1.0, 0.5]
    >>> round(clipped.clip_norm, 4)
    1.4142
    """
    if len(group_norms) != len(clip_norms) or not group_norms:
        raise ValueError(
            f"One clip norm per group: got {len(group_norms)} groups and "
            f"{len(clip_norms)} clip norms."
        )
    clip_norms = [_checked_clip_norm(c) for c in clip_norms]
    ops = keras.ops
    norms = [ops.cast(ops.convert_to_tensor(n), "float32") for n in group_norms]
    finite = norms[0] == norms[0]
    within = ops.ones_like(finite)
    for n, c in zip(norms, clip_norms, strict=True):
        finite = ops.logical_and(finite, ops.isfinite(n))
        within = ops.logical_and(within, n <= c)
    keep = finite if mask is None else ops.logical_and(finite, _as_mask(mask))
    factors = [
        clip_factors(n, c, keep)[0] for n, c in zip(norms, clip_norms, strict=True)
    ]
    rows = ops.shape(norms[0])[0]
    included = ops.ones((rows,), "int32") if mask is None else _as_mask(mask)
    included = ops.cast(included, "int32")
    return ClippedSum(
        total=list(weighted_sum(factors)),
        clip_norm=float(np.sqrt(sum(float(c) ** 2 for c in clip_norms))),
        count=ops.sum(included),
        num_nonfinite=ops.sum(included * ops.cast(ops.logical_not(finite), "int32")),
        num_within_clip=ops.sum(included * ops.cast(within, "int32")),
    )


def clip_and_sum(updates, clip_norm, mask=None):
    """Clips each contribution to `clip_norm` and sums them.

    Each row i (over all tensors together) is scaled by
    min(1, C / ‖u_i‖₂); rows with a non-finite value become zeros; rows
    with `mask` false are left out.

    Args:
        updates: list of tensors `[m, ...]`, one row per contribution.
        clip_norm: float > 0. C.
        mask: bool tensor `[m]` or None. Which rows take part. Defaults to
            all.

    Returns:
        A `ClippedSum`.

    Example:

    >>> import numpy as np
    >>> result = clip_and_sum([np.array([[3.0, 4.0], [0.3, 0.4], [np.nan, 0.0]])],
    ...                       clip_norm=1.0)
    >>> np.round(np.asarray(result.total[0], dtype=float), 6).tolist()
    [0.9, 1.2]
    >>> int(result.count), int(result.num_nonfinite)
    (3, 1)
    """
    if not updates:
        raise ValueError("clip_and_sum needs at least one tensor of updates.")
    ops = keras.ops

    def weighted_sum(factors):
        rows = ops.shape(factors)[0]
        total = []
        for update in updates:
            update = ops.cast(update, "float32")
            shape = (rows,) + (1,) * (len(update.shape) - 1)
            factor = ops.reshape(factors, shape)
            # where() before the product: NaN * 0 would still be NaN.
            cleaned = ops.where(factor > 0, update, 0.0)
            total.append(ops.sum(cleaned * factor, axis=0))
        return total

    return clipped_sum_from_norms(global_norms(updates), clip_norm, weighted_sum, mask)


def reseed_from_entropy(seed_generator, randbits=None):
    """Sets a `SeedGenerator`'s whole state from OS entropy; returns it.

    `keras.random.SeedGenerator(None)` seeds itself from Python's `random`
    module with about 30 bits: `keras.utils.set_random_seed` makes it
    predictable, and 30 bits can be searched. DP noise needs neither. This
    fills both words of the state from `secrets` (64 bits on JAX; about 62
    on TensorFlow, where Keras reduces each word modulo 2³¹ − 2). Call it
    again whenever the state may be known, e.g. at every `fit`. `randbits`
    (default `secrets.randbits`) draws the bits; on several hosts it is
    the chief's draw, shared, so every host adds the same noise.

    Example:

    >>> import keras
    >>> generator = reseed_from_entropy(keras.random.SeedGenerator(0))
    >>> tuple(generator.state.shape)
    (2,)
    """
    state = seed_generator.state
    dtype = keras.backend.standardize_dtype(state.dtype)
    bits = 32 if dtype in ("uint32", "int32") else 62
    if dtype == "int32":
        bits = 31
    randbits = secrets.randbits if randbits is None else randbits
    words = np.array([randbits(bits), randbits(bits)], dtype=dtype)
    state.assign(words)
    return seed_generator


def gaussian_noise(clipped_sum, noise_multiplier, seed_generator):
    """Fresh N(0, (z · clip_norm)²) draws, one tensor per tensor of the sum.

    `add_gaussian_noise` adds them to the sum. A trainer whose replicas
    each hold part of the sum uses this directly: every replica draws the
    same noise (the same seed state) for the all-reduced sum, and only one
    passes the result on (`kdpemb.models._shared.backends`).

    Args: as `add_gaussian_noise`.

    Returns:
        list of tensors shaped as `clipped_sum.total` (zeros when z = 0).
    """
    noise_multiplier = validation.check_noise_multiplier(noise_multiplier)
    if not isinstance(seed_generator, keras.random.SeedGenerator):
        raise TypeError(
            "seed_generator must be a keras.random.SeedGenerator, got "
            f"{type(seed_generator).__name__}. A fixed integer seed would draw "
            "the same noise for every tensor of one shape and every call: "
            "create one SeedGenerator and keep it."
        )
    if not isinstance(clipped_sum, ClippedSum):
        raise TypeError(
            "The noise is scaled from the ClippedSum of clip_and_sum, which "
            "carries the clip norm that sets it."
        )
    if noise_multiplier == 0.0:
        return [keras.ops.zeros_like(total) for total in clipped_sum.total]
    stddev = noise_multiplier * clipped_sum.clip_norm
    return [
        keras.random.normal(keras.ops.shape(total), stddev=stddev, seed=seed_generator)
        for total in clipped_sum.total
    ]


def add_gaussian_noise(clipped_sum, noise_multiplier, seed_generator):
    """`total + N(0, (z · clip_norm)²)`, independently per coordinate.

    Call it once per step on the sum over all contributions (on every
    replica's sum only after the cross-replica reduction), never per
    replica or per contribution.

    Args:
        clipped_sum: `ClippedSum`. From `clip_and_sum` (after any
            cross-replica reduction of its `total`).
        noise_multiplier: float >= 0. z.
        seed_generator: `keras.random.SeedGenerator`. Advanced by every
            draw. Integers are refused: they would reuse one draw.

    Returns:
        list of tensors, the noisy sum.

    Example:

    >>> import keras, numpy as np
    >>> clipped = clip_and_sum([np.zeros((4, 3))], clip_norm=2.0)
    >>> noisy = add_gaussian_noise(clipped, 0.5,
    ...                            keras.random.SeedGenerator(0))
    >>> np.asarray(noisy[0]).shape
    (3,)
    """
    noise = gaussian_noise(clipped_sum, noise_multiplier, seed_generator)
    if validation.check_noise_multiplier(noise_multiplier) == 0.0:
        return list(clipped_sum.total)
    return [total + n for total, n in zip(clipped_sum.total, noise, strict=True)]
