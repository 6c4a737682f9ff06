"""Adaptive quantile clipping in `keras.ops`: the noisy count and the new C.

The release of adaptive clipping (Andrew et al. 2021), on either backend;
the settings and the accounting are `kdpemb.privacy.AdaptiveClipping`.
Per round:

1. `centred_count(clipped)`: Σ (bᵢ − 1/2) over this replica's sampled
   clients, with bᵢ = 1[‖Δᵢ‖ ≤ C] read off the `ClippedSum` (each term is
   ±1/2, so one client moves the sum by at most 1/2 under add/remove);
2. the replicas' centred counts are summed, and N(0, σ_b²) is added once
   (`count_noise`, from its own `SeedGenerator`: the update noise never
   shares a draw with it);
3. `next_clip_norm`: b̄ = noisy sum / M + 1/2 clipped to [0, 1], and
   C · exp(−η (b̄ − γ)).

Like `gaussian_sum`, this module imports Keras.

Example:

>>> import keras, numpy as np
>>> from kdpemb.privacy import AdaptiveClipping, gaussian_sum
>>> updates = [np.array([[0.5], [1.5], [3.0], [0.1]])]
>>> clipped = gaussian_sum.clip_and_sum(updates, clip_norm=1.0)
>>> float(centred_count(clipped))  # 2 within C, 2 above: 2 · 1/2 − 2 · 1/2
0.0
>>> clipping = AdaptiveClipping(target_quantile=0.5, learning_rate=0.2)
>>> new = next_clip_norm(1.0, 0.0, clients_per_round=4, clipping=clipping)
>>> round(float(new), 6)  # Half within C: the median is met, C stays.
1.0
>>> new = next_clip_norm(1.0, -2.0, clients_per_round=4, clipping=clipping)
>>> round(float(new), 4)  # None within C: C grows by exp(0.2 · 0.5).
1.1052
"""

import keras

from kdpemb import _validation as validation
from kdpemb.privacy.adaptive_clipping import COUNT_SENSITIVITY, AdaptiveClipping
from kdpemb.privacy.gaussian_sum import ClippedSum


def centred_count(clipped_sum):
    """Σ (1[‖Δᵢ‖ ≤ C] − 1/2) over the included contributions: float32 scalar.

    Args:
        clipped_sum: `ClippedSum` with `num_within_clip` (from
            `clip_and_sum` or `clipped_sum_from_norms`).
    """
    if not isinstance(clipped_sum, ClippedSum) or clipped_sum.num_within_clip is None:
        raise TypeError(
            "centred_count needs the ClippedSum of clip_and_sum (or "
            "clipped_sum_from_norms), which counts the contributions within C."
        )
    ops = keras.ops
    within = ops.cast(clipped_sum.num_within_clip, "float32")
    return within - COUNT_SENSITIVITY * ops.cast(clipped_sum.count, "float32")


def count_noise(stddev, seed_generator):
    """One fresh N(0, σ_b²) draw (float32 scalar); 0 when σ_b = 0.

    Draw it once per round, on one replica (`kdpemb.models._shared.backends`'
    `noise_share()`), from a `SeedGenerator` used for nothing else.
    """
    stddev = validation.check_noise_multiplier(stddev, "count_stddev")
    if not isinstance(seed_generator, keras.random.SeedGenerator):
        raise TypeError(
            "seed_generator must be a keras.random.SeedGenerator, got "
            f"{type(seed_generator).__name__}: a fixed integer seed would "
            "draw the same noise every round."
        )
    if stddev == 0.0:
        return keras.ops.zeros((), "float32")
    return keras.random.normal((), stddev=stddev, seed=seed_generator)


def next_clip_norm(clip_norm, noisy_centred_count, clients_per_round, clipping):
    """C · exp(−η (b̄ − γ)), with b̄ = noisy count / M + 1/2 in [0, 1].

    Args:
        clip_norm: float or float tensor. This round's C.
        noisy_centred_count: float tensor. The centred count summed over
            every replica, plus the round's count noise.
        clients_per_round: float. M, the expected clients per round (the
            realised number is private).
        clipping: `AdaptiveClipping`. γ and η.
    """
    if not isinstance(clipping, AdaptiveClipping):
        raise TypeError(
            f"clipping must be an AdaptiveClipping, got {type(clipping).__name__}."
        )
    clients = validation.check_positive(clients_per_round, "clients_per_round")
    ops = keras.ops
    below = ops.cast(noisy_centred_count, "float32") / clients + 0.5
    below = ops.clip(below, 0.0, 1.0)
    step = clipping.learning_rate * (below - clipping.target_quantile)
    return ops.cast(clip_norm, "float32") * ops.exp(-step)
