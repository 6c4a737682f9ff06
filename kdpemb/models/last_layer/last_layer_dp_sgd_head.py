"""DP-SGD on a softmax head, without per-example gradients.

The per-example gradient of a dense layer with logits `z = x W + b` under
softmax cross-entropy is `(x (p − y)ᵀ, p − y)`, so each example's exact
gradient norm is `‖p − y‖ · (‖x‖² + 1)^½` (`dense_gradient_norms`) and
the clipped sum over a batch is one matrix product of the features with
the scaled residuals. The sum is kept as one `[d + 1, K]` tensor (the
kernel's rows, then the bias), clipped by
`kdpemb.privacy.gaussian_sum.clipped_sum_from_norms` and noised by
`gaussian_sum.gaussian_noise` in a single draw per step. At user level
each sampled user's mean gradient is clipped instead, its norm from the
Gram matrices of the user's rows (`clipped_user_head_gradient`).
"""

import keras
from keras import ops

from kdpemb.models._shared import backends
from kdpemb.privacy import gaussian_sum


def dense_gradient_norms(features, residuals, use_bias=True):
    """Exact per-example L2 norms of a dense layer's gradient.

    For logits `z = x W + b` and a loss with `∂ℓ/∂z = r`, example i's
    gradient is `(x_i r_iᵀ, r_i)`, whose norm is
    `‖r_i‖ · (‖x_i‖² + 1)^½` (without the 1 when there is no bias).

    Args:
        features: [B, d]. The layer's inputs.
        residuals: [B, K]. `∂ℓ_i/∂z_i` (for softmax cross-entropy, p − y).
        use_bias: bool.

    Returns:
        [B] norms, in the wider of the two inputs' float dtypes.

    Example:

    >>> import numpy as np
    >>> norms = dense_gradient_norms(np.array([[3.0, 4.0]]),
    ...                              np.array([[1.0, 0.0]]), use_bias=False)
    >>> ops.convert_to_numpy(norms).tolist()
    [5.0]
    """
    features, residuals = (
        ops.convert_to_tensor(features),
        ops.convert_to_tensor(residuals),
    )
    dtype = keras.backend.result_type(features.dtype, residuals.dtype, float)
    features, residuals = ops.cast(features, dtype), ops.cast(residuals, dtype)
    squared_x = ops.sum(ops.square(features), axis=-1)
    if use_bias:
        squared_x = squared_x + 1.0
    return ops.sqrt(ops.sum(ops.square(residuals), axis=-1) * squared_x)


def clipped_head_gradient(features, residuals, clip_norm, mask):
    """The `ClippedSum` of the per-example gradients of a dense head with bias.

    Its one tensor is `[d + 1, K]`: Σᵢ fᵢ xᵢ rᵢᵀ over the kernel's rows,
    then Σᵢ fᵢ rᵢ for the bias, with fᵢ = min(1, C / ‖gᵢ‖) (0 where
    `mask` is false).

    Example:

    >>> import numpy as np
    >>> clipped = clipped_head_gradient(np.array([[3.0, 4.0]], "float32"),
    ...                                 np.array([[1.0, 0.0]], "float32"),
    ...                                 clip_norm=1.0, mask=np.array([True]))
    >>> np.round(ops.convert_to_numpy(clipped.total[0]).astype("float64"), 4).tolist()
    [[0.5883, 0.0], [0.7845, 0.0], [0.1961, 0.0]]
    """
    norms = dense_gradient_norms(features, residuals, use_bias=True)
    return gaussian_sum.clipped_sum_from_norms(
        norms, clip_norm, lambda factors: _weighted_sum(features, residuals, factors),
        mask,
    )  # fmt: skip


def _weighted_sum(features, residuals, factors):
    """`[Σᵢ fᵢ xᵢ rᵢᵀ; Σᵢ fᵢ rᵢ]`, one matrix product; a row with fᵢ = 0 adds
    exactly 0 even where its features or residuals are not finite."""
    keep = factors[:, None] > 0  # where() before the product: NaN · 0 is NaN.
    scaled = ops.where(keep, residuals, 0.0) * factors[:, None]
    kernel = ops.einsum("bd,bk->dk", ops.where(keep, features, 0.0), scaled)
    return [ops.concatenate([kernel, ops.sum(scaled, axis=0)[None]], axis=0)]


def clipped_user_head_gradient(features, residuals, clip_norm, mask, k):
    """The `ClippedSum` of the users' mean head gradients, in the slot layout.

    Rows `j*k … j*k + k − 1` are slot j: one user's n_j ≤ k chosen rows
    (`mask` true), then padding; slot j is a user iff any of its rows is
    real. User j's gradient is `G_j = Σᵢ wᵢ ((xᵢ, 1) rᵢᵀ)` with wᵢ = 1 / n_j,
    and its exact norm comes from the slot's Gram matrices,
    `‖G_j‖² = Σᵢₗ wᵢ wₗ (xᵢ·xₗ + 1)(rᵢ·rₗ)` (`[S, k, k]`: no per-user
    gradient is built). Each `G_j` is clipped to C and the sum is one
    matrix product with row factors `f_j · wᵢ`. Padding rows add exactly
    0, even where not finite; a user with a non-finite row is left out.

    Example:

    >>> import numpy as np
    >>> features = np.array([[1.0, 0.0], [0.0, 1.0], [5.0, 5.0]], "float32")
    >>> residuals = np.array([[1.0, -1.0], [1.0, -1.0], [1.0, -1.0]], "float32")
    >>> clipped = clipped_user_head_gradient(
    ...     features[[0, 1, 2, 2]], residuals[[0, 1, 2, 2]], clip_norm=100.0,
    ...     mask=np.array([1.0, 1.0, 0.0, 0.0]), k=2)  # one user, one empty slot
    >>> np.round(ops.convert_to_numpy(clipped.total[0]), 3).tolist()
    [[0.5, -0.5], [0.5, -0.5], [1.0, -1.0]]
    >>> int(clipped.count)
    1
    """
    features, residuals = ops.cast(features, "float32"), ops.cast(residuals, "float32")
    rows = ops.cast(ops.reshape(mask, (-1,)), "bool")
    real = ops.reshape(rows, (-1, k))  # [S, k]
    counts = ops.sum(ops.cast(real, "float32"), axis=1, keepdims=True)
    weights = ops.where(real, 1.0 / ops.maximum(counts, 1.0), 0.0)
    x = ops.reshape(
        ops.where(rows[:, None], features, 0.0), (-1, k, features.shape[-1])
    )
    r = ops.reshape(
        ops.where(rows[:, None], residuals, 0.0), (-1, k, residuals.shape[-1])
    )
    gram = (ops.einsum("sid,sjd->sij", x, x) + 1.0) * ops.einsum("sic,sjc->sij", r, r)
    squared = ops.sum(weights[:, :, None] * weights[:, None, :] * gram, axis=(1, 2))
    # Rounding may leave a tiny negative; NaN < 0 is false, so NaN stays.
    norms = ops.sqrt(ops.where(squared < 0.0, 0.0, squared))

    def weighted_sum(factors):  # factors [S], one per user.
        row_factors = ops.reshape(factors[:, None] * weights, (-1,))
        return _weighted_sum(features, residuals, row_factors)

    users = ops.any(real, axis=1)
    return gaussian_sum.clipped_sum_from_norms(norms, clip_norm, weighted_sum, users)


class DPSGDHead:
    """DP-SGD's step and mechanism for `LastLayerDPClassifier(method="dp-sgd")`.

    One step: the softmax residuals of the batch, the clipped sum of the
    per-example gradients (per-user mean gradients with
    `examples_per_user`), N(0, (z C)²) noise once on the `[d + 1, K]`
    sum, division by the expected batch size (of users), `l2 · W` on the kernel, and
    the model's optimizer. Counts the step in `model.private_steps` (with a
    `target_epsilon`, a step past the plan counts nothing and moves nothing
    but the optimizer's momentum).

    Example:

    >>> head = DPSGDHead(clip_norm=1.0)
    >>> from kdpemb.privacy import Schedule
    >>> head.mechanism(1.1, Schedule.examples(60_000, 256), 10).clip_norm
    1.0
    """

    name = "dp-sgd"
    use_bias = True
    clips_gradients = True  # Takes `clip_norm`.
    needs_feature_clip_norm = False
    sampled = True  # Poisson batches, run by Keras' fit.
    single_step = False

    def __init__(self, clip_norm, examples_per_user=None):
        self.clip_norm = clip_norm
        self.examples_per_user = examples_per_user  # k: user level.

    @classmethod
    def from_settings(cls, *, clip_norm, examples_per_user=None, **settings):
        """From the classifier's settings: `clip_norm` and, at user level,
        `examples_per_user`."""
        del settings
        return cls(clip_norm, examples_per_user)

    def mechanism(self, noise_multiplier, schedule, planned_steps):
        """The `Mechanism` of one step (`planned_steps` plays no part)."""
        del planned_steps
        return schedule.privacy_mechanism(noise_multiplier, clip_norm=self.clip_norm)

    def build(self, model, dim):
        """DP-SGD keeps no state beyond the head and the optimizer."""

    def noise_multiplier_of(self, calibrated):
        """The step's noise multiplier from the calibrated one: the same."""
        return calibrated

    def train_step(self, model, data, noise_multiplier, denominator):
        """One private step on `data`: rows `(features, labels, mask)`, or
        indices of `model`'s device rows.

        On several devices each one clips its share of the rows
        (`backends.split_over_devices`); the clipped sums are added over
        the devices, the noise added once to the global sum, and the
        optimizer takes the result once (`backends.optimizer_share`)."""
        plumbing = backends.current()
        features, labels, mask = data if len(data) == 3 else model._rows.gather(data)
        kernel, bias = model.head.kernel, model.head.bias
        clipped = self._clipped_sum(model, features, labels, mask, kernel, bias)
        (noise,) = gaussian_sum.gaussian_noise(
            clipped, noise_multiplier, model.noise_seed
        )
        # The global sum (TensorFlow: over the replicas) and the noise once:
        # every replica draws the same from the same seed state.
        total = plumbing.replica_sum(clipped.total[0]) + noise
        l2 = model.l2 or 0.0
        grads = [total[:-1] / denominator + l2 * kernel, total[-1] / denominator]
        within = None
        if model.target_epsilon is not None:
            # Past the plan (an execution of steps_per_execution steps that
            # reaches past it, as a resumed fit's first may): release
            # nothing computed from the data, count nothing.
            within = ops.less(model.private_steps.value, model.planned_steps)
            grads = [ops.where(within, g, ops.zeros_like(g)) for g in grads]
        # The optimizer (which sums the replicas' gradients on TensorFlow)
        # takes the noised gradient once, whatever it does before the sum.
        model.optimizer.apply(plumbing.optimizer_share(grads), [kernel, bias])
        model.private_steps.assign_add(
            1 if within is None else ops.cast(within, "int32")
        )
        return plumbing.replica_logs({"private_steps": model.private_steps.value})

    def _clipped_sum(self, model, features, labels, mask, kernel, bias):
        """The batch's `ClippedSum`: each device clips its rows; the counts
        are summed over every device, the `[d + 1, K]` total is this
        replica's on TensorFlow (`train_step` adds the replicas') and the
        global one on JAX."""
        plumbing = backends.current()

        def local(rows, shared):
            features, labels, mask = rows
            kernel, bias = shared
            features = ops.cast(features, "float32")
            if model.clip_features is not None:
                features = model.clip_features(features)
            probs = ops.softmax(ops.matmul(features, kernel) + bias)
            one_hot = ops.one_hot(ops.cast(labels, "int32"), model.num_classes)
            residuals = probs - one_hot
            if self.examples_per_user is None:
                clipped = clipped_head_gradient(
                    features, residuals, self.clip_norm, ops.cast(mask, "bool")
                )
            else:  # Slots of k rows, one user each (whole slots per device).
                clipped = clipped_user_head_gradient(
                    features, residuals, self.clip_norm, mask,
                    self.examples_per_user,
                )  # fmt: skip
            return (clipped.total[0], clipped.count, clipped.num_nonfinite), ()

        rows, shared = (features, labels, mask), (kernel.value, bias.value)
        (total, *counts), _ = plumbing.split_over_devices(local, rows, shared)
        count, nonfinite = (plumbing.replica_sum(c) for c in counts)
        return gaussian_sum.ClippedSum([total], self.clip_norm, count, nonfinite)
