"""Float64 NumPy references for `LastLayerDPClassifier`'s tests.

Written from the formulas in the class docstring and docs/last_layer.md,
without `kdpemb.models.last_layer.last_layer_stats`: per-example softmax gradients
(also by backend autodiff), full-batch and Poisson-batch DP-SGD steps,
ridge least squares, Newton steps with the block-diagonal Hessian, the
covariance-preconditioned steps of DP-FC, and the noise each method
should add. Plus recorders that read what the model releases, and
statistical checks with explicit standard-error bounds.
"""

import math

import keras
import numpy as np
from scipy import stats

from kdpemb.models._shared import backends

# ------------------------------------------------------------- basics --


def clip_rows(features, clip_norm):
    """Rows scaled to L2 norm at most `clip_norm` (None or inf: unchanged)."""
    features = np.asarray(features, np.float64)
    if clip_norm is None or math.isinf(clip_norm):
        return features
    norms = np.sqrt(np.sum(features**2, axis=1, keepdims=True))
    scale = np.ones_like(norms)
    big = norms > clip_norm
    scale[big] = clip_norm / norms[big]
    return features * scale


def softmax(logits):
    logits = logits - logits.max(axis=-1, keepdims=True)
    e = np.exp(logits)
    return e / e.sum(axis=-1, keepdims=True)


def one_hot(labels, num_classes):
    return np.eye(num_classes)[np.asarray(labels)]


def to_numpy(value):
    return np.asarray(keras.ops.convert_to_numpy(value), np.float64)


# ------------------------------------------------- per-example autodiff --


def per_example_gradients(kernel, bias, features, labels):
    """Each example's gradient of softmax cross-entropy of a keras Dense layer.

    Computed one example at a time with the backend's autodiff
    (`kdpemb.models._shared.backends.current().value_and_grad`). Returns a list of
    (kernel gradient [d, K], bias gradient [K] or None) in float64.
    """
    dim, num_classes = kernel.shape
    layer = keras.layers.Dense(num_classes, use_bias=bias is not None)
    layer.build((None, dim))
    layer.set_weights([kernel] + ([] if bias is None else [bias]))

    def loss(params, x, y):
        logits, _ = layer.stateless_call(params, [], x)
        return keras.ops.sum(
            keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
        )

    value_and_grad = backends.current().value_and_grad(loss)
    params = [keras.ops.convert_to_tensor(v.value) for v in layer.trainable_variables]
    gradients = []
    for i in range(len(features)):
        x = keras.ops.convert_to_tensor(np.asarray(features[i : i + 1], "float32"))
        y = keras.ops.convert_to_tensor(np.asarray(labels[i : i + 1], "int32"))
        _, grads = value_and_grad(params, x, y)
        grads = [to_numpy(g) for g in grads]
        gradients.append((grads[0], grads[1] if bias is not None else None))
    return gradients


def flat_norm(gradient):
    kernel_grad, bias_grad = gradient
    total = np.sum(kernel_grad**2)
    if bias_grad is not None:
        total += np.sum(bias_grad**2)
    return math.sqrt(total)


# -------------------------------------------------------------- DP-SGD --


def sgd_step(kernel, bias, features, labels, *, lr, denominator, clip_norm=np.inf,
             l2=0.0, mask=None):  # fmt: skip
    """One noiseless DP-SGD step: per-example clip of the softmax gradient
    (x(p − y)ᵀ, p − y), sum over the masked rows, divide by the
    *expected* batch size, add l2 · W to the kernel gradient, SGD."""
    features = np.asarray(features, np.float64)
    mask = np.ones(len(features)) if mask is None else np.asarray(mask, np.float64)
    residuals = softmax(features @ kernel + bias) - one_hot(labels, kernel.shape[1])
    norms = np.linalg.norm(residuals, axis=1) * np.sqrt(
        np.sum(features**2, axis=1) + 1.0
    )
    factors = np.minimum(1.0, clip_norm / np.maximum(norms, 1e-300)) * mask
    clipped = residuals * factors[:, None]
    grad_kernel = features.T @ clipped / denominator + l2 * kernel
    grad_bias = clipped.sum(axis=0) / denominator
    return kernel - lr * grad_kernel, bias - lr * grad_bias


def full_batch_gradient_descent(features, labels, num_classes, *, lr, l2, epochs,
                                clip_norm=np.inf):  # fmt: skip
    """Full-batch GD on the mean softmax cross-entropy + l2/2 ‖W‖²."""
    kernel = np.zeros((features.shape[1], num_classes))
    bias = np.zeros(num_classes)
    for _ in range(epochs):
        kernel, bias = sgd_step(
            kernel, bias, features, labels, lr=lr, denominator=len(features),
            clip_norm=clip_norm, l2=l2,
        )  # fmt: skip
    return kernel, bias


# ------------------------------------------------- closed-form methods --


def ridge_least_squares(features, labels, num_classes, l2):
    """argmin (1/2N)‖XW − Y‖² + l2/2 ‖W‖²: (XᵀX + l2·N·I)⁻¹ XᵀY."""
    n, d = features.shape
    targets = one_hot(labels, num_classes)
    return np.linalg.solve(
        features.T @ features + l2 * n * np.eye(d), features.T @ targets
    )


def logistic_gradient(features, labels, kernel):
    """Σ_i x_i (p_i − y_i)ᵀ (a sum, not a mean)."""
    return features.T @ (softmax(features @ kernel) - one_hot(labels, kernel.shape[1]))


def hessian_blocks(features, kernel):
    """Per class c: Σ_i p_ic (1 − p_ic) x_i x_iᵀ, stacked [K, d, d]."""
    probs = softmax(features @ kernel)
    return np.stack(
        [
            (features * (probs[:, c] * (1 - probs[:, c]))[:, None]).T @ features
            for c in range(kernel.shape[1])
        ]
    )


def newton(features, labels, num_classes, *, l2, steps, lr=1.0):
    """Newton on Σ_i ℓ_i + λ/2 ‖W‖² (λ = l2 · N) with the block-diagonal Hessian."""
    n, d = features.shape
    ridge = l2 * n
    kernel = np.zeros((d, num_classes))
    for _ in range(steps):
        gradient = logistic_gradient(features, labels, kernel) + ridge * kernel
        blocks = hessian_blocks(features, kernel)
        direction = np.stack(
            [
                np.linalg.solve(blocks[c] + ridge * np.eye(d), gradient[:, c])
                for c in range(num_classes)
            ],
            axis=1,
        )
        kernel = kernel - lr * direction
    return kernel


def covariance_preconditioned(features, labels, num_classes, *, l2, steps, lr=1.0):
    """DP-FC without noise: (Σ (1/K)(1 − 1/K) + λI)⁻¹ (∇ + λW) steps."""
    n, d = features.shape
    ridge = l2 * n
    k = num_classes
    system = features.T @ features * (1 / k) * (1 - 1 / k) + ridge * np.eye(d)
    kernel = np.zeros((d, num_classes))
    for _ in range(steps):
        gradient = logistic_gradient(features, labels, kernel) + ridge * kernel
        kernel = kernel - lr * np.linalg.solve(system, gradient)
    return kernel


def expected_stds(method, noise_multiplier, feature_clip_norm, budget_split,
                  planned_steps):  # fmt: skip
    """{statistic: (noise std, sensitivity)} from the documented rules.

    Sensitivities (add/remove one example with ‖x̃‖ ≤ C_x): Gram matrix
    and covariance C_x², class sums C_x, logistic gradient √2 C_x, the
    stack of Hessian blocks C_x²/2. A step costs a Gaussian of multiplier
    z split between its two releases in zCDP (1/z² = s/z₂² + (1 − s)/z₁²,
    s = budget_split for the second-order statistic); DP-FC's one covariance
    release takes s of the whole planned run's T steps.
    """
    z, s, cx = noise_multiplier, budget_split, feature_clip_norm
    first = z / math.sqrt(1 - s)
    if method == "dp-ls":
        return {
            "Gram matrix": (z / math.sqrt(s) * cx**2, cx**2),
            "per-class feature sums": (first * cx, cx),
        }
    gradient = (first * math.sqrt(2) * cx, math.sqrt(2) * cx)
    if method == "dp-newton":
        return {
            "per-class Hessians": (z / math.sqrt(s) * cx**2 / 2, cx**2 / 2),
            "logistic gradient": gradient,
        }
    assert method == "dp-fc"
    return {
        "feature covariance": (z / math.sqrt(s * planned_steps) * cx**2, cx**2),
        "logistic gradient": gradient,
    }


# ----------------------------------------------------------- recorders --


class ClosedFormReleases:
    """Records what a closed-form step hands to its solver.

    Wraps `last_layer_stats.make_psd` (its input: the noisy Gram matrix,
    the stack of noisy Hessians or the noisy covariance) and
    `last_layer_stats.solve_ridge` (its right-hand side: the noisy class
    sums, a noisy gradient column plus λ w_c, or DP-FC's whole noisy
    gradient plus λW; and λ), each with the head's kernel at the time of
    the call; `matrices` keeps the matrix of every solve.
    """

    def __init__(self, monkeypatch, model):
        from kdpemb.models.last_layer import last_layer_stats

        self.model = model
        self.second_order = []  # (kernel, matrix)
        self.solves = []  # (kernel, right-hand side, ridge)
        self.matrices = []  # The matrix of each solve, in order.
        make_psd, solve_ridge = last_layer_stats.make_psd, last_layer_stats.solve_ridge

        def recording_make_psd(matrix, *args, **kwargs):
            self.second_order.append((self._kernel(), np.array(matrix, np.float64)))
            return make_psd(matrix, *args, **kwargs)

        def recording_solve_ridge(matrix, right_hand_side, ridge):
            self.solves.append(
                (self._kernel(), np.array(right_hand_side, np.float64), ridge)
            )
            self.matrices.append(np.array(matrix, np.float64))
            return solve_ridge(matrix, right_hand_side, ridge)

        monkeypatch.setattr(last_layer_stats, "make_psd", recording_make_psd)
        monkeypatch.setattr(last_layer_stats, "solve_ridge", recording_solve_ridge)

    def _kernel(self):
        return to_numpy(self.model.head.kernel)

    def gradient_steps(self, num_classes):
        """[(kernel, right-hand side [d, K], ridge)] per step (Newton, FC).

        DP-Newton solves each class's column with its own Hessian (K
        solves a step); DP-FC solves all K columns with the one shared
        covariance (one solve with a [d, K] right-hand side).
        """
        steps, pending = [], []
        for kernel, right_hand_side, ridge in self.solves:
            if right_hand_side.ndim == 2:
                assert not pending and right_hand_side.shape[1] == num_classes
                steps.append((kernel, right_hand_side, ridge))
                continue
            pending.append((kernel, right_hand_side, ridge))
            if len(pending) == num_classes:
                kernels = [g[0] for g in pending]
                assert all(np.array_equal(k, kernels[0]) for k in kernels)
                steps.append(
                    (kernels[0], np.stack([g[1] for g in pending], axis=1), ridge)
                )
                pending = []
        assert not pending
        return steps


class RecordedBatches:
    """Records the Poisson samples drawn for `fit` (`PoissonIndices.sample`).

    TensorFlow peeks at up to two batches to infer their spec before the
    epochs start; `used(steps, epochs, features, labels)` returns the last
    `steps · epochs` batches, which are the ones the epochs consumed
    (checked through their indices), as `(features, labels, mask)` rebuilt
    from the test's own arrays: a step that trained on other rows than
    the sampled ones disagrees with a replay of these.
    """

    def __init__(self, monkeypatch):
        from kdpemb.data import poisson_batches

        self.batches = []
        sample = poisson_batches.PoissonIndices.sample

        def recording_sample(batches, index):
            out = sample(batches, index)
            self.batches.append((index, *(np.array(a) for a in out)))
            return out

        monkeypatch.setattr(poisson_batches.PoissonIndices, "sample", recording_sample)

    def used(self, steps_per_epoch, epochs, features, labels):
        total = steps_per_epoch * epochs
        used = self.batches[-total:]
        assert [b[0] for b in used] == list(range(steps_per_epoch)) * epochs
        return [(features[idx], labels[idx], mask) for _, idx, mask in used]


class EpochWeights(keras.callbacks.Callback):
    """The head's kernel and bias after every epoch (synced on JAX)."""

    def __init__(self):
        super().__init__()
        self.kernels, self.biases = [], []

    def on_train_begin(self, logs=None):
        self._record()

    def on_epoch_end(self, epoch, logs=None):
        self._record()

    def _record(self):
        head = self.model.head
        self.kernels.append(to_numpy(head.kernel))
        self.biases.append(to_numpy(head.bias) if head.use_bias else None)

    def kernel_updates(self):
        return [b - a for a, b in zip(self.kernels[:-1], self.kernels[1:], strict=True)]


# -------------------------------------------------------- statistics --


def assert_normal(draws, sigma, *, z=5.0):
    """Draws look like i.i.d. N(0, σ²): RMS, mean and KS within bounds.

    The RMS of n draws has relative standard error 1/√(2n); the mean has
    standard error σ/√n.
    """
    draws = np.ravel(draws)
    n = draws.size
    rms = math.sqrt(np.mean(draws**2))
    assert abs(rms / sigma - 1) * math.sqrt(2 * n) < z, (rms, sigma, n)
    assert abs(draws.mean()) < z * sigma / math.sqrt(n), (draws.mean(), sigma, n)
    assert stats.kstest(draws, "norm", args=(0.0, sigma)).pvalue > 1e-4


def correlation(a, b):
    """Correlation of two zero-mean samples (about N(0, 1/n) if independent)."""
    a, b = np.ravel(a), np.ravel(b)
    return float(a @ b / math.sqrt((a @ a) * (b @ b)))


def assert_uncorrelated(samples, *, z=5.0):
    """Every pair of zero-mean samples: |r| √n < z (a reused draw gives r = 1)."""
    samples = [np.ravel(s) for s in samples]
    n = samples[0].size
    for i in range(len(samples)):
        for j in range(i):
            r = correlation(samples[i], samples[j])
            assert abs(r) * math.sqrt(n) < z, (i, j, r, n)


def upper_triangle(matrix):
    """Upper triangle (diagonal included) of [..., d, d] as a flat array."""
    d = matrix.shape[-1]
    rows, cols = np.triu_indices(d)
    return matrix[..., rows, cols]
