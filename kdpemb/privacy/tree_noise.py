"""Tree-aggregation noise for DP-FTRL, in `keras.ops`.

DP-FTRL (Kairouz et al. 2021) releases the *prefix sums* of the rounds'
clipped sums, S_j = Σ_{s<=j} x_s, through a binary tree over the rounds of
a tree (an epoch, then it restarts): every completed node of the tree (the
sum over a dyadic block of rounds) gets its own noise N(0, σ²), σ = z·C,
and the noisy prefix sum S_j is the sum of the noisy nodes of j's binary
decomposition (one node per set bit of j). The server optimizer sees the
difference of consecutive noisy prefix sums, so that after j rounds the
model has moved by the noisy S_j (plain SGD is then exactly FTRL).

So round j's noise is `N(j) − N(j−1)`, where N(j) is the summed noise of
j's decomposition. Going from j−1 to j, the nodes of j−1 below level
ℓ* = (trailing zeros of j) close, and the node of level ℓ* that ends at
j opens:

    noise_j = n(new node at level ℓ*) − Σ_{ℓ < ℓ*} open[ℓ]

The state is the noise of the open nodes, one per level (`open_noise`,
`[levels, *shape]` per tensor): model state, saved and restored, so a
resumed run adds exactly the noise an uninterrupted one would. A node's
noise is drawn once, when it completes, and is subtracted once, when its
parent completes: it is never drawn twice nor dropped.

Honaker's "efficient" estimator (`efficient=True`) uses every released
node: a node's estimate is the inverse-variance weighting of its own noisy
value and the sum of its children's estimates, which lowers the variance
of every prefix sum at no privacy cost (it is post-processing of the same
node releases). With σ² = 1 a leaf's estimate has variance u_0 = 1 and a
node at level ℓ u_ℓ = 2u_{ℓ−1} / (1 + 2u_{ℓ−1}), which is also the weight
of its own value. It draws the noise of every node on the new node's
right spine (levels 0..ℓ*).

The privacy accounting is `kdpemb.privacy.TreeAggregation`.

Example:

>>> import keras, numpy as np
>>> from kdpemb.privacy import gaussian_sum
>>> clipped = gaussian_sum.clip_and_sum([np.zeros((3, 4), "float32")], 1.0)
>>> levels = tree_levels(4)
>>> state = initial_open_noise(clipped, levels)
>>> seed = keras.random.SeedGenerator(0)
>>> prefix = 0
>>> for j in (1, 2, 3):
...     noise, state = tree_noise(clipped, 2.0, seed, state, j)
...     prefix = prefix + noise[0]
>>> # After 3 rounds the prefix noise is the sum of the open nodes [1,2], [3].
>>> bool(np.allclose(prefix, state[0][0] + state[0][1]))
True
"""

import keras
from keras import ops

from kdpemb import _validation as validation
from kdpemb.privacy import gaussian_sum, mechanisms

ESTIMATORS = ("standard", "efficient")


def tree_levels(leaves_per_tree):
    """Levels a tree over `leaves_per_tree` rounds completes: floor(log2 n) + 1."""
    return mechanisms.tree_depth(leaves_per_tree)


def efficient_variances(levels):
    """u_ℓ, the variance (over σ²) of Honaker's estimate of a level-ℓ node.

    >>> [round(u, 4) for u in efficient_variances(3)]
    [1.0, 0.6667, 0.5714]
    """
    variances = [1.0]
    for _ in range(1, validation.check_positive_int(levels, "levels")):
        twice = 2 * variances[-1]
        variances.append(twice / (1 + twice))
    return variances


def initial_open_noise(clipped_sum, levels):
    """Zeros `[levels, *shape]` for each tensor of the sum: no node open."""
    return [
        ops.zeros((levels, *ops.shape(total)), "float32") for total in clipped_sum.total
    ]


def _trailing_zeros(round_in_tree, levels):
    """ℓ*: the level of the node that completes at round j (j >= 1)."""
    j = ops.cast(round_in_tree, "int32")
    divisible = [
        ops.cast(ops.equal(j % (2**lvl), 0), "int32") for lvl in range(1, levels)
    ]
    return sum(divisible, ops.zeros((), "int32"))


def _closing_levels(levels, new_level):
    """1.0 for the open levels that close when a node at `new_level` opens."""
    return ops.cast(ops.arange(levels) < new_level, "float32")


def _per_level(mask, tensor):
    """`mask [levels]` broadcast against `tensor [levels, *shape]`."""
    return ops.reshape(mask, (-1,) + (1,) * (len(tensor.shape) - 1))


def tree_noise(
    clipped_sum,
    noise_multiplier,
    seed_generator,
    open_noise,
    round_in_tree,
    *,
    efficient=False,
):
    """Round j's tree noise, and the open nodes' noise after it.

    Args:
        clipped_sum: `gaussian_sum.ClippedSum`: the round's sum; its
            `clip_norm` sets σ = z · C.
        noise_multiplier: float. z, noise std per tree node over C.
        seed_generator: `keras.random.SeedGenerator` (fresh draws).
        open_noise: list of `[levels, *shape]` tensors, the state
            (`initial_open_noise` for a new model).
        round_in_tree: int tensor. j >= 1, the round's position in its
            tree; j = 1 starts a new tree (what was open is dropped).
        efficient: bool. Honaker's estimator. Defaults to False.

    Returns:
        `(noise, open_noise)`: the noise to add to the round's sum (one
        tensor per tensor of the sum), and the new state.
    """
    noise_multiplier = validation.check_noise_multiplier(noise_multiplier)
    if not isinstance(clipped_sum, gaussian_sum.ClippedSum):
        raise TypeError(
            "The noise is scaled from the ClippedSum of clip_and_sum, which "
            "carries the clip norm that sets it."
        )
    if not isinstance(seed_generator, keras.random.SeedGenerator):
        raise TypeError(
            "seed_generator must be a keras.random.SeedGenerator, got "
            f"{type(seed_generator).__name__}."
        )
    levels = open_noise[0].shape[0]
    if noise_multiplier == 0.0:
        return [ops.zeros_like(t) for t in clipped_sum.total], list(open_noise)
    stddev = noise_multiplier * clipped_sum.clip_norm
    new_level = _trailing_zeros(round_in_tree, levels)
    closing = _closing_levels(levels, new_level)
    opening = ops.cast(ops.equal(ops.arange(levels), new_level), "float32")
    weights = efficient_variances(levels)
    noise, state = [], []
    for total, open_ in zip(clipped_sum.total, open_noise, strict=True):
        shape = tuple(ops.shape(total))
        if efficient:
            # The right spine's fresh draws, one per level; only levels
            # <= ℓ* are used.
            draws = keras.random.normal(
                (levels, *shape), stddev=stddev, seed=seed_generator
            )
            estimate = draws[0]
            for level in range(1, levels):
                combined = weights[level] * draws[level] + (1 - weights[level]) * (
                    open_[level - 1] + estimate
                )
                estimate = ops.where(level <= new_level, combined, estimate)
        else:
            estimate = keras.random.normal(shape, stddev=stddev, seed=seed_generator)
        closed = ops.sum(_per_level(closing, open_) * open_, axis=0)
        noise.append(estimate - closed)
        opened = _per_level(opening, open_)
        state.append(opened * ops.expand_dims(estimate, 0) + (1 - opened) * open_)
    return noise, state
