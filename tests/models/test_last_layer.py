"""LastLayerDPClassifier: its four methods against NumPy, noise, privacy, errors.

Every method with zero noise and huge clip norms must equal its
non-private counterpart written in float64 NumPy (`last_layer_reference`);
with noise, what each step releases is read off the weights (DP-SGD: the
kernel's change on all-zero features is the noise alone) or off the
solver's inputs (closed-form methods: `make_psd` and `solve_ridge` are
wrapped), and tested against the documented noise standard deviations
with explicit standard-error bounds. Tiny data throughout.
"""

import math
import warnings

import keras
import numpy as np
import pytest

from kdpemb import privacy
from kdpemb.callbacks import PrivacyBudget
from kdpemb.data import poisson_batches
from kdpemb.data.poisson_batches import PoissonBatches
from kdpemb.errors import DegenerateFeaturesWarning, PrivacyBudgetExhaustedError
from kdpemb.models import ReproducibleNoiseWarning
from kdpemb.models._shared import backends
from kdpemb.models.last_layer import (
    ClipFeatures,
    LastLayerDPClassifier,
    dense_gradient_norms,
)
from kdpemb.models.last_layer.last_layer_stats import make_psd
from kdpemb.privacy import host_noise, protocol
from tests.models import last_layer_reference as ref

pytestmark = [
    pytest.mark.filterwarnings("ignore::kdpemb.errors.ReproducibleNoiseWarning"),
    # All-zero features isolate the noise in several tests below.
    pytest.mark.filterwarnings("ignore::kdpemb.errors.DegenerateFeaturesWarning"),
]

DELTA = 1e-3
CLOSED_FORM = ("dp-ls", "dp-newton", "dp-fc")


def make_data(n=30, dim=5, num_classes=3, seed=0, balanced=False, spread=None):
    """Gaussian class clusters; `spread` scales rows by e^N(0, spread²)."""
    rng = np.random.default_rng(seed)
    labels = np.arange(n) % num_classes if balanced else rng.integers(0, num_classes, n)
    centers = 1.5 * rng.normal(size=(num_classes, dim))
    features = rng.normal(size=(n, dim)) + centers[labels]
    if spread is not None:
        features *= np.exp(spread * rng.normal(size=(n, 1)))
    return features.astype("float32"), labels.astype("int32")


def make_model(num_classes, method="dp-sgd", optimizer=None, **overrides):
    """A non-private (z = 0, huge clip norms), seeded, compiled classifier."""
    settings = {"seed": 0, **overrides}
    if "target_epsilon" not in settings:
        settings.setdefault("noise_multiplier", 0.0)
    if method == "dp-sgd":
        settings.setdefault("clip_norm", 1e9)
    else:
        settings.setdefault("feature_clip_norm", 1e9)
    model = LastLayerDPClassifier(num_classes, method, **settings)
    model.compile(optimizer=optimizer)
    return model


def steps_of(model):
    return protocol.read_private_steps(model)


def kernel_of(model):
    return ref.to_numpy(model.head.kernel)


def bias_of(model):
    return ref.to_numpy(model.head.bias)


def predict(model, features):
    return np.asarray(model.predict(features, verbose=0), np.float64)


# -------------------------------------------- per-example gradient norms --


@pytest.mark.parametrize("use_bias", [True, False], ids=["bias", "no_bias"])
def test_dense_gradient_norms_equal_per_example_autodiff(use_bias):
    rng = np.random.default_rng(1)
    n, dim, k = 7, 5, 4
    kernel = rng.normal(size=(dim, k)).astype("float32")
    bias = rng.normal(size=k).astype("float32") if use_bias else None
    features = (rng.normal(size=(n, dim)) * rng.uniform(0.1, 3, (n, 1))).astype(
        "float32"
    )
    labels = rng.integers(0, k, n)
    brute = [ref.flat_norm(g) for g in ref.per_example_gradients(
        kernel, bias, features, labels)]  # fmt: skip
    logits = features.astype(np.float64) @ kernel + (0 if bias is None else bias)
    residuals = ref.softmax(logits) - ref.one_hot(labels, k)
    norms = ref.to_numpy(
        dense_gradient_norms(features, residuals.astype("float32"), use_bias=use_bias)
    )
    assert np.ptp(brute) > 0.5  # Norms that differ, so a wrong factor shows.
    np.testing.assert_allclose(norms, brute, rtol=1e-5)


def test_dense_gradient_norms_take_mixed_dtypes():
    features = np.array([[3.0, 4.0], [0.0, 1.0]], "float32")
    residuals = np.array([[0.5, -0.5], [1.0, 0.0]])  # float64
    norms = ref.to_numpy(dense_gradient_norms(features, residuals))
    np.testing.assert_allclose(norms, [math.sqrt(0.5 * 26), math.sqrt(2)], rtol=1e-6)
    norms = ref.to_numpy(dense_gradient_norms(features.astype("int32"), residuals))
    np.testing.assert_allclose(norms, [math.sqrt(0.5 * 26), math.sqrt(2)], rtol=1e-6)


def test_a_dp_sgd_step_adds_the_individually_clipped_autodiff_gradients():
    # One full-batch step with SGD(1.0) and z = 0 from a random head moves
    # the head by −(Σ_i clip(g_i)) / N, g_i each example's autodiff gradient
    # (kernel and bias together), clipped to C: the median norm, so that
    # half of the examples are clipped.
    rng = np.random.default_rng(2)
    n, dim, k = 10, 4, 3
    kernel = rng.normal(size=(dim, k)).astype("float32")
    bias = rng.normal(size=k).astype("float32")
    features = (rng.normal(size=(n, dim)) * rng.uniform(0.2, 3, (n, 1))).astype(
        "float32"
    )
    labels = rng.integers(0, k, n)
    gradients = ref.per_example_gradients(kernel, bias, features, labels)
    norms = np.array([ref.flat_norm(g) for g in gradients])
    clip_norm = float(np.median(norms))
    factors = np.minimum(1.0, clip_norm / norms)
    assert 0 < np.sum(factors < 1) < n
    expected_kernel = (
        kernel - sum(f * g[0] for f, g in zip(factors, gradients, strict=True)) / n
    )
    expected_bias = (
        bias - sum(f * g[1] for f, g in zip(factors, gradients, strict=True)) / n
    )

    model = make_model(k, clip_norm=clip_norm, head_init="random")
    model.build((None, dim))
    model.head.set_weights([kernel, bias])
    model.fit(features, labels, epochs=1, verbose=0)
    np.testing.assert_allclose(kernel_of(model), expected_kernel, atol=2e-6)
    np.testing.assert_allclose(bias_of(model), expected_bias, atol=2e-6)


# ------------------------------------ no noise, no clipping = non-private --


@pytest.mark.parametrize("feature_clip_norm", [None, 2.0], ids=["raw", "clipped"])
def test_dp_sgd_without_noise_is_full_batch_gradient_descent(feature_clip_norm):
    features, labels = make_data(n=30, dim=5, num_classes=3, seed=3)
    if feature_clip_norm is not None:
        norms = np.linalg.norm(features, axis=1)
        assert 0 < np.sum(norms > feature_clip_norm) < len(norms)
    lr, l2, epochs = 0.5, 0.05, 4
    model = make_model(
        3,
        optimizer=keras.optimizers.SGD(lr),
        l2=l2,
        feature_clip_norm=feature_clip_norm,
    )
    model.fit(features, labels, epochs=epochs, verbose=0)
    clipped = ref.clip_rows(features, feature_clip_norm)
    kernel, bias = ref.full_batch_gradient_descent(
        clipped, labels, 3, lr=lr, l2=l2, epochs=epochs
    )
    assert np.abs(kernel).max() > 0.1
    np.testing.assert_allclose(kernel_of(model), kernel, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(bias_of(model), bias, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(
        predict(model, features), clipped @ kernel + bias, rtol=1e-4, atol=1e-5
    )
    assert steps_of(model) == epochs


@pytest.mark.parametrize(
    "make_optimizer",
    [lambda: keras.optimizers.Lamb(0.1), lambda: keras.optimizers.Adam(0.05)],
    ids=["lamb", "adam"],
)
def test_dp_sgd_hands_its_mean_gradient_to_any_keras_optimizer(make_optimizer):
    # DP-LAMB is DP-SGD compiled with Lamb: without noise or clipping, its
    # full-batch steps must be Keras' own Lamb (or Adam) steps on the mean
    # softmax cross-entropy of a zero-initialised Dense head.
    # 37 examples: no class holds exactly 1/4 of them, so no first-step bias
    # gradient is zero (whose sign an adaptive step would amplify from noise).
    features, labels = make_data(n=37, dim=6, num_classes=4, seed=5)
    model = make_model(4, optimizer=make_optimizer())
    model.fit(features, labels, epochs=3, verbose=0)
    plain = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(4, kernel_initializer="zeros")]
    )
    plain.compile(
        optimizer=make_optimizer(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    plain.fit(features, labels, batch_size=37, epochs=3, shuffle=False, verbose=0)
    kernel, bias = (ref.to_numpy(w) for w in plain.layers[0].weights)
    assert np.abs(kernel).max() > 0.05
    # Adaptive steps divide by root mean squares of gradients near zero, so
    # float32 summation order shows at 1e-4; a wrong gradient moves 1e-2.
    np.testing.assert_allclose(kernel_of(model), kernel, rtol=2e-3, atol=3e-4)
    np.testing.assert_allclose(bias_of(model), bias, rtol=2e-3, atol=3e-4)


def replay_dp_sgd(batches, kernel, bias, *, lr, l2, clip_norm, denominator):
    """Noise-free DP-SGD in NumPy on recorded batches; also counts clipped rows."""
    clipped = 0
    for batch_features, batch_labels, mask in batches:
        assert set(np.unique(mask)) <= {0.0, 1.0}
        x = np.asarray(batch_features, np.float64)
        k = kernel.shape[1]
        residuals = ref.softmax(x @ kernel + bias) - ref.one_hot(batch_labels, k)
        norms = np.linalg.norm(residuals, axis=1) * np.sqrt(np.sum(x**2, 1) + 1)
        clipped += int(np.sum((norms > clip_norm) * mask))
        kernel, bias = ref.sgd_step(
            kernel, bias, x, batch_labels, lr=lr, denominator=denominator,
            clip_norm=clip_norm, l2=l2, mask=mask,
        )  # fmt: skip
    return kernel, bias, clipped


def force_host_gathering(monkeypatch):
    """The device "has no room" for the rows: fit gathers them on the host."""

    def out_of_memory(arrays, held):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating the rows")

    monkeypatch.setattr(backends.current(), "hold_rows", out_of_memory)


@pytest.mark.parametrize("gathered_on", ["device", "host"])
def test_poisson_dp_sgd_divides_by_the_expected_batch_size_and_pads_overflows(
    monkeypatch, gathered_on
):
    # Six Poisson steps of expected size B = 10 (q = 1/3), replayed in NumPy
    # from the samples fit drew: the clipped sum over the masked rows, over
    # B (not over the realised size), with clipping active. Batches above B
    # must be trained on whole. On the host, the static bound is forced
    # down to B, so those batches overflow it and must be padded to a
    # larger shape; on the device, batches are padded per the backend.
    if gathered_on == "host":
        force_host_gathering(monkeypatch)
        monkeypatch.setattr(
            poisson_batches, "max_clients_per_round", lambda n, q, tolerance: 10
        )
    recorded = ref.RecordedBatches(monkeypatch)
    features, labels = make_data(n=30, dim=4, num_classes=3, seed=4)
    lr, l2, clip_norm = 0.5, 0.02, 0.6
    model = make_model(
        3, optimizer=keras.optimizers.SGD(lr), l2=l2, clip_norm=clip_norm, seed=11
    )
    if gathered_on == "host":
        with pytest.warns(UserWarning, match="do not fit in device memory"):
            model.fit(features, labels, batch_size=10, epochs=2, verbose=0)
    else:
        model.fit(features, labels, batch_size=10, epochs=2, verbose=0)
    assert model._rows.on_device == (gathered_on == "device")
    assert steps_of(model) == 6
    if gathered_on == "device":  # Every sample drawn is trained on.
        assert len(recorded.batches) == 6
    batches = recorded.used(3, 2, features, labels)
    sizes = [int(mask.sum()) for _, _, mask in batches]
    assert any(size != 10 for size in sizes)
    assert any(size > 10 for size in sizes)  # Trained on whole.
    pairs = [
        (size, len(mask)) for size, (_, _, mask) in zip(sizes, batches, strict=True)
    ]
    if gathered_on == "host":
        assert any(0 < size < width for size, width in pairs)
        assert all(width % 128 == 0 for size, width in pairs if size > 10)
    elif backends.current().batch_padding(model) == "multiple":
        # A power of two >= 2σ, σ² = 30 · 1/3 · 2/3, and at least 8.
        assert all(width == 8 * max(1, math.ceil(size / 8)) for size, width in pairs)
    else:
        assert all(width == size for size, width in pairs)

    kernel, bias, clipped = replay_dp_sgd(
        batches, np.zeros((4, 3)), np.zeros(3),
        lr=lr, l2=l2, clip_norm=clip_norm, denominator=10,
    )  # fmt: skip
    assert clipped > 0
    np.testing.assert_allclose(kernel_of(model), kernel, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(bias_of(model), bias, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("feature_clip_norm", [1e9, 2.0], ids=["raw", "clipped"])
def test_dp_ls_without_noise_is_ridge_least_squares(feature_clip_norm):
    features, labels = make_data(n=30, dim=5, num_classes=3, seed=5)
    l2 = 0.1
    model = make_model(3, "dp-ls", feature_clip_norm=feature_clip_norm, l2=l2)
    model.fit(features, labels, verbose=0)
    clipped = ref.clip_rows(features, feature_clip_norm)
    if feature_clip_norm < 1e9:
        assert np.abs(clipped - features).max() > 0.1
    kernel = np.linalg.solve(
        clipped.T @ clipped + l2 * len(features) * np.eye(5),
        clipped.T @ ref.one_hot(labels, 3),
    )
    np.testing.assert_allclose(kernel_of(model), kernel, rtol=1e-4, atol=1e-6)
    scores = clipped @ kernel
    np.testing.assert_allclose(predict(model, features), scores, rtol=1e-4, atol=1e-5)
    assert steps_of(model) == 1


def test_evaluate_reports_the_loss_and_accuracy_over_all_examples():
    # 100 examples in batches of 32: the means over all of them, not over
    # the last batch.
    rng = np.random.default_rng(33)  # Overlapping classes: some errors.
    features = rng.normal(size=(100, 4)).astype("float32")
    labels = rng.integers(0, 3, 100)
    model = make_model(3, "dp-ls", feature_clip_norm=2.0, l2=0.1)
    model.fit(features, labels, verbose=0)
    scores = ref.clip_rows(features, 2.0) @ kernel_of(model)
    cross_entropy = -np.log(ref.softmax(scores)[np.arange(100), labels])
    correct = scores.argmax(axis=1) == labels
    # Misclassified examples last: the last batch's means are far off.
    order = np.argsort(~correct, kind="stable")
    assert 4 <= np.sum(~correct) < 90
    logs = model.evaluate(
        features[order], labels[order], batch_size=32, verbose=0, return_dict=True
    )
    assert logs["loss"] == pytest.approx(cross_entropy.mean(), rel=1e-4)
    assert logs["accuracy"] == pytest.approx(correct.mean(), abs=1e-6)


@pytest.mark.parametrize("lr", [1.0, 0.5])
def test_dp_newton_without_noise_is_newton_with_the_block_diagonal_hessian(lr):
    features, labels = make_data(n=30, dim=5, num_classes=3, seed=6)
    l2, steps = 0.05, 3
    optimizer = None if lr == 1.0 else keras.optimizers.SGD(lr)  # Default SGD(1).
    model = make_model(
        3, "dp-newton", optimizer=optimizer, feature_clip_norm=2.5, l2=l2
    )
    model.fit(features, labels, epochs=steps, verbose=0)
    clipped = ref.clip_rows(features, 2.5)
    kernel = ref.newton(clipped, labels, 3, l2=l2, steps=steps, lr=lr)
    one_step = ref.newton(clipped, labels, 3, l2=l2, steps=1, lr=lr)
    assert np.abs(kernel - one_step).max() > 1e-2  # Later steps matter.
    np.testing.assert_allclose(kernel_of(model), kernel, rtol=1e-4, atol=1e-5)
    assert steps_of(model) == steps


def test_dp_fc_without_noise_is_covariance_preconditioned_descent():
    features, labels = make_data(n=30, dim=5, num_classes=3, seed=7)
    l2, steps = 0.05, 3
    model = make_model(3, "dp-fc", feature_clip_norm=2.5, l2=l2)
    model.fit(features, labels, epochs=steps, verbose=0)
    clipped = ref.clip_rows(features, 2.5)
    kernel = ref.covariance_preconditioned(clipped, labels, 3, l2=l2, steps=steps)
    assert (
        np.abs(kernel - ref.newton(clipped, labels, 3, l2=l2, steps=steps)).max() > 1e-3
    )
    np.testing.assert_allclose(kernel_of(model), kernel, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(
        ref.to_numpy(model.covariance), clipped.T @ clipped, rtol=1e-5, atol=1e-5
    )
    assert steps_of(model) == steps


# ------------------------------------------------------ DP-SGD's noise --


def zero_feature_updates(batch_size, epochs=3, seed=5, n=40, dim=40, k=6, **kwargs):
    """Per-step kernel updates on all-zero features: the noise alone."""
    labels = np.random.default_rng(0).integers(0, k, n)
    settings = {"noise_multiplier": 1.3, "clip_norm": 0.7, "seed": seed, **kwargs}
    model = make_model(k, optimizer=keras.optimizers.SGD(0.5), **settings)
    weights = ref.EpochWeights()
    model.fit(
        np.zeros((n, dim), "float32"), labels, batch_size=batch_size, epochs=epochs,
        verbose=0, callbacks=[weights],
    )  # fmt: skip
    return model, np.stack(weights.kernel_updates())


@pytest.mark.parametrize("batch_size", [None, 30], ids=["full_batch", "poisson"])
def test_dp_sgd_noise_has_std_z_c_lr_over_b_fresh_per_class_and_step(batch_size):
    # With x = 0 the kernel's clipped gradient sum is 0, so each step moves
    # it by −lr · N(0, (zC)²) / B, B the expected batch (N for full batch;
    # with N = 40 and B = 30 Poisson sampling takes one step per epoch).
    model, updates = zero_feature_updates(batch_size)
    denominator = batch_size or 40
    assert steps_of(model) == 3
    sigma = 1.3 * 0.7 * 0.5 / denominator
    ref.assert_normal(updates, sigma)
    # Fresh per class: the columns (over all steps) are uncorrelated.
    ref.assert_uncorrelated([updates[:, :, c] for c in range(6)])
    # Fresh per step.
    ref.assert_uncorrelated(list(updates))


def test_dp_sgd_noise_is_fresh_for_every_fit_and_reproducible_only_by_seed():
    def one_step(model=None, **kwargs):
        if model is None:
            return zero_feature_updates(None, epochs=1, dim=20, k=5, **kwargs)
        weights = ref.EpochWeights()
        model.fit(
            np.zeros((40, 20), "float32"), np.arange(40) % 5, epochs=1, verbose=0,
            callbacks=[weights],
        )  # fmt: skip
        return model, np.stack(weights.kernel_updates())

    _, first = one_step(seed=None)
    _, second = one_step(seed=None)
    ref.assert_uncorrelated([first, second])
    seeded, before = one_step(seed=8)
    _, resumed = one_step(seeded)  # The same model's second fit.
    ref.assert_uncorrelated([before, resumed])
    _, again = one_step(seed=8)  # A new model with the same seed.
    np.testing.assert_array_equal(again, before)
    for updates in (first, second, resumed):
        ref.assert_normal(updates, 1.3 * 0.7 * 0.5 / 40)


def test_a_loaded_model_draws_noise_that_the_saved_file_does_not_predict(tmp_path):
    # The noise generator's state is saved with the model; each fit must
    # reseed it from OS entropy, or every copy loaded from one file would
    # draw the same noise (known to whoever holds the file).
    model, _ = zero_feature_updates(None, epochs=1, dim=20, k=5, seed=None)
    path = tmp_path / "classifier.keras"
    model.save(path)
    updates = []
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            loaded = keras.saving.load_model(path)
        weights = ref.EpochWeights()
        loaded.fit(
            np.zeros((40, 20), "float32"), np.arange(40) % 5, epochs=1, verbose=0,
            callbacks=[weights],
        )  # fmt: skip
        updates.append(np.stack(weights.kernel_updates()))
        ref.assert_normal(updates[-1], 1.3 * 0.7 * 0.5 / 40)
    ref.assert_uncorrelated(updates)


# ------------------------------- one step from zero = centroid classifier --


def centroid_step(features, labels, k, clip_norm, lr):
    """W₁, b₁ of one noiseless full-batch step from a zero head, by formula.

    With W = 0 every p = 1/K, so example i's gradient is x_i (1/K − y_i)ᵀ,
    of norm √((K−1)/K) · √(‖x_i‖² + 1): clip factor c_i. Then
    W₁[:, c] = lr/N (Σ_{i∈c} c_i x_i − (1/K) Σ_i c_i x_i) and likewise
    b₁[c] with x_i replaced by 1.
    """
    features = np.asarray(features, np.float64)
    n = len(features)
    norms = math.sqrt((k - 1) / k) * np.sqrt(np.sum(features**2, axis=1) + 1)
    factors = np.minimum(1.0, clip_norm / norms)
    one_hot = ref.one_hot(labels, k)
    sums = features.T @ (one_hot * factors[:, None])  # Σ_{i∈c} c_i x_i.
    counts = factors @ one_hot  # Σ_{i∈c} c_i.
    kernel = lr / n * (sums - (features.T @ factors)[:, None] / k)
    bias = lr / n * (counts - factors.sum() / k)
    return kernel, bias, sums, counts, factors


@pytest.mark.parametrize("clipped", [True, False], ids=["clipped", "unclipped"])
def test_one_step_from_a_zero_head_is_the_centroid_classifier(clipped):
    k, lr = 3, 0.5
    features, labels = make_data(n=24, dim=6, num_classes=k, seed=9, balanced=True)
    norms = math.sqrt((k - 1) / k) * np.sqrt(np.sum(features**2, axis=1) + 1)
    clip_norm = float(np.median(norms)) if clipped else 1e9
    model = make_model(k, optimizer=keras.optimizers.SGD(lr), clip_norm=clip_norm)
    model.fit(features, labels, epochs=1, verbose=0)
    kernel, bias, sums, counts, factors = centroid_step(
        features, labels, k, clip_norm, lr
    )
    assert np.any(factors < 1) == clipped
    np.testing.assert_allclose(kernel_of(model), kernel, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(bias_of(model), bias, rtol=1e-5, atol=1e-7)

    test_features, _ = make_data(n=60, dim=6, num_classes=k, seed=10)
    predicted = predict(model, test_features).argmax(axis=1)
    centroid = (test_features @ sums + counts).argmax(axis=1)
    np.testing.assert_array_equal(predicted, centroid)
    if not clipped:  # Balanced classes: argmax_c xᵀ μ_c, μ_c the class means.
        means = np.stack([features[labels == c].mean(axis=0) for c in range(k)], 1)
        np.testing.assert_array_equal(predicted, (test_features @ means).argmax(1))
    assert len(set(predicted)) == k


def test_one_noisy_step_is_the_centroid_classifier_plus_gaussian_noise():
    # Many classes, so that the K bias coordinates are enough draws to see
    # their noise (a bias without noise is 5 standard errors off).
    k, lr, z, n = 40, 0.5, 0.8, 80
    features, labels = make_data(n=n, dim=8, num_classes=k, seed=11, balanced=True)
    clip_norm = 2.0
    model = make_model(
        k, optimizer=keras.optimizers.SGD(lr), clip_norm=clip_norm,
        noise_multiplier=z, seed=12,
    )  # fmt: skip
    model.fit(features, labels, epochs=1, verbose=0)
    kernel, bias, *_, factors = centroid_step(features, labels, k, clip_norm, lr)
    assert np.any(factors < 1)
    sigma = z * clip_norm * lr / n
    kernel_noise, bias_noise = kernel_of(model) - kernel, bias_of(model) - bias
    ref.assert_normal(kernel_noise, sigma)
    ref.assert_normal(bias_noise, sigma)
    # The noise does not depend on the signal it is added to.
    assert abs(ref.correlation(kernel_noise, kernel - kernel.mean())) < 5 / math.sqrt(
        kernel.size
    )


# --------------------------------------------- closed-form methods' noise --


def noisy_closed_form(monkeypatch, method, features, labels, k, epochs, **settings):
    model = make_model(k, method, **settings)
    releases = ref.ClosedFormReleases(monkeypatch, model)
    model.fit(features, labels, epochs=epochs, verbose=0)
    return model, releases


def check_stds(model, method, z, cx, split, planned_steps):
    """The mechanism's releases against the documented rule, exactly."""
    expected = ref.expected_stds(method, z, cx, split, planned_steps)
    mechanism = model.privacy_mechanism()
    released = {r.name: (r.noise_std, r.sensitivity) for r in mechanism.releases}
    released_once = {r.name: (r.noise_std, r.sensitivity) for r in mechanism.setup}
    if method == "dp-fc":
        assert set(released_once) == {"feature covariance"}
    else:
        assert not released_once
    for name, (std, sensitivity) in expected.items():
        assert {**released, **released_once}[name] == pytest.approx(
            (std, sensitivity), rel=1e-12
        )
    return {name: std for name, (std, _) in expected.items()}


def test_dp_ls_noise_on_the_gram_matrix_and_class_sums(monkeypatch):
    n, dim, k = 30, 40, 8
    z, cx, split, l2 = 1.7, 2.0, 0.3, 0.1
    features, labels = make_data(n=n, dim=dim, num_classes=k, seed=13, spread=1.0)
    features /= 5
    clipped = ref.clip_rows(features, cx)
    assert 0 < np.sum(np.linalg.norm(features, axis=1) > cx) < n
    model, releases = noisy_closed_form(
        monkeypatch, "dp-ls",
        features, labels, k, 1, noise_multiplier=z, feature_clip_norm=cx,
        budget_split=split, l2=l2, seed=14,
    )  # fmt: skip
    stds = check_stds(model, "dp-ls", z, cx, split, 1)
    ((_, gram),) = releases.second_order
    ((_, sums, ridge),) = releases.solves
    assert ridge == pytest.approx(l2 * n)
    gram_noise = gram - clipped.T @ clipped
    np.testing.assert_allclose(gram_noise, gram_noise.T, atol=1e-9)
    ref.assert_normal(ref.upper_triangle(gram_noise), stds["Gram matrix"])
    sums_noise = sums - clipped.T @ ref.one_hot(labels, k)
    ref.assert_normal(sums_noise, stds["per-class feature sums"])
    ref.assert_uncorrelated(list(sums_noise.T))  # Fresh per class.


def gradient_noise(clipped, labels, step):
    """Released gradient (+ λW) minus the exact X̃ᵀ(P − Y) + λW at that step's W."""
    kernel, right_hand_side, ridge = step
    return right_hand_side - (
        ref.logistic_gradient(clipped, labels, kernel) + ridge * kernel
    )


def test_dp_newton_noise_on_the_gradient_and_every_hessian_block(monkeypatch):
    n, dim, k, steps = 30, 16, 8, 3
    z, cx, split, l2 = 1.2, 1.5, 0.3, 0.2
    features, labels = make_data(n=n, dim=dim, num_classes=k, seed=15, spread=1.0)
    clipped = ref.clip_rows(features, cx)
    assert 0 < np.sum(np.linalg.norm(features, axis=1) > cx) < n
    model, releases = noisy_closed_form(
        monkeypatch, "dp-newton", features, labels, k, steps, noise_multiplier=z,
        feature_clip_norm=cx, budget_split=split, l2=l2, seed=16,
    )  # fmt: skip
    stds = check_stds(model, "dp-newton", z, cx, split, steps)
    gradient_steps = releases.gradient_steps(k)
    assert len(releases.second_order) == len(gradient_steps) == steps
    hessian_noise, gradients = [], []
    for (kernel, hessians), step in zip(
        releases.second_order, gradient_steps, strict=True
    ):
        np.testing.assert_array_equal(kernel, step[0])
        assert step[2] == pytest.approx(l2 * n)
        noise = hessians - ref.hessian_blocks(clipped, kernel)
        np.testing.assert_allclose(noise, np.swapaxes(noise, 1, 2), atol=1e-9)
        hessian_noise.append(ref.upper_triangle(noise))  # [K, d(d+1)/2]
        gradients.append(gradient_noise(clipped, labels, step))
    assert not gradient_steps[0][0].any() and gradient_steps[2][0].any()
    # Each class's column is solved with its own released block, made PSD.
    assert len(releases.matrices) == steps * k
    for t, (_, hessians) in enumerate(releases.second_order):
        np.testing.assert_allclose(
            np.stack(releases.matrices[t * k : (t + 1) * k]),
            make_psd(hessians),
            atol=1e-9 * np.abs(hessians).max(),
        )
    hessian_noise = np.stack(hessian_noise)
    ref.assert_normal(hessian_noise, stds["per-class Hessians"])
    ref.assert_normal(np.stack(gradients), stds["logistic gradient"])
    for t in range(steps):
        ref.assert_uncorrelated(list(hessian_noise[t]))  # Fresh per class.
    ref.assert_uncorrelated(list(hessian_noise))  # Fresh per step.
    ref.assert_uncorrelated(gradients)
    ref.assert_uncorrelated(list(np.concatenate(gradients, axis=0).T))


def test_dp_fc_noise_on_the_one_covariance_and_every_gradient(monkeypatch):
    n, dim, k, steps = 30, 24, 8, 3
    z, cx, split, l2 = 1.2, 1.5, 0.3, 0.2
    features, labels = make_data(n=n, dim=dim, num_classes=k, seed=17, spread=1.0)
    clipped = ref.clip_rows(features, cx)
    model, releases = noisy_closed_form(
        monkeypatch, "dp-fc", features, labels, k, steps, noise_multiplier=z,
        feature_clip_norm=cx, budget_split=split, l2=l2, seed=18,
    )  # fmt: skip
    stds = check_stds(model, "dp-fc", z, cx, split, steps)
    ((kernel, covariance),) = releases.second_order  # Once, in the first step.
    assert not kernel.any()
    noise = covariance - clipped.T @ clipped
    np.testing.assert_allclose(noise, noise.T, atol=1e-9)
    ref.assert_normal(ref.upper_triangle(noise), stds["feature covariance"])
    # The model keeps the release with its negative eigenvalues raised to 0.
    values, vectors = np.linalg.eigh((covariance + covariance.T) / 2)
    assert values.min() < 0
    kept = (vectors * np.maximum(values, 0)) @ vectors.T
    np.testing.assert_allclose(
        ref.to_numpy(model.covariance), kept, atol=1e-5 * np.abs(kept).max()
    )
    gradient_steps = releases.gradient_steps(k)
    assert len(gradient_steps) == steps
    # Every step solves with the released covariance times p(1 - p), p = 1/K.
    assert len(releases.matrices) == steps
    for matrix in releases.matrices:
        np.testing.assert_allclose(
            matrix,
            ref.to_numpy(model.covariance) * (1 / k) * (1 - 1 / k),
            rtol=1e-6,
            atol=1e-9,
        )
    gradients = [gradient_noise(clipped, labels, step) for step in gradient_steps]
    assert all(step[2] == pytest.approx(l2 * n) for step in gradient_steps)
    ref.assert_normal(np.stack(gradients), stds["logistic gradient"])
    ref.assert_uncorrelated(gradients)  # Fresh per step.
    ref.assert_uncorrelated(list(np.concatenate(gradients, axis=0).T))  # Per class.


def test_closed_form_noise_is_fresh_for_every_fit_and_reproducible_only_by_seed(
    monkeypatch,
):
    n, dim, k = 30, 12, 4
    features, labels = make_data(n=n, dim=dim, num_classes=k, seed=19)
    clipped = ref.clip_rows(features, 2.0)
    settings = {"noise_multiplier": 1.0, "feature_clip_norm": 2.0, "l2": 0.1}

    def dp_ls_noise(seed):
        _, releases = noisy_closed_form(
            monkeypatch, "dp-ls", features, labels, k, 1, seed=seed, **settings
        )
        ((_, gram),) = releases.second_order
        ((_, sums, _),) = releases.solves
        gram_noise = ref.upper_triangle(gram - clipped.T @ clipped)
        sums_noise = sums - clipped.T @ ref.one_hot(labels, k)
        return np.concatenate([gram_noise, sums_noise.ravel()])

    ref.assert_uncorrelated([dp_ls_noise(None), dp_ls_noise(None)])
    np.testing.assert_array_equal(dp_ls_noise(3), dp_ls_noise(3))

    # A seeded model's second fit (a resumed run) draws new noise.
    model, releases = noisy_closed_form(
        monkeypatch, "dp-newton", features, labels, k, 1, seed=4, **settings
    )
    model.fit(features, labels, epochs=1, verbose=0)
    assert steps_of(model) == 2
    first, second = (
        np.concatenate(
            [
                ref.upper_triangle(h - ref.hessian_blocks(clipped, w)).ravel(),
                gradient_noise(clipped, labels, step).ravel(),
            ]
        )
        for (w, h), step in zip(
            releases.second_order, releases.gradient_steps(k), strict=True
        )
    )
    ref.assert_uncorrelated([first, second])


@pytest.mark.parametrize("method", CLOSED_FORM)
def test_the_default_ridge_is_twice_the_second_order_noise_times_root_d(
    monkeypatch, method
):
    n, dim, k, z, cx, split = 30, 6, 3, 0.9, 2.0, 0.4
    epochs = 1 if method == "dp-ls" else 2
    features, labels = make_data(n=n, dim=dim, num_classes=k, seed=20)
    _, releases = noisy_closed_form(
        monkeypatch, method, features, labels, k, epochs, noise_multiplier=z,
        feature_clip_norm=cx, budget_split=split,
    )  # fmt: skip
    second_order_std = next(
        iter(ref.expected_stds(method, z, cx, split, epochs).values())
    )[0]
    ridges = [ridge for *_, ridge in releases.solves]
    # DP-LS solves once; DP-FC once a step (one covariance for all classes);
    # DP-Newton once a step and class.
    solves = {"dp-ls": 1, "dp-fc": epochs, "dp-newton": epochs * k}[method]
    assert len(ridges) == solves
    assert ridges == pytest.approx(
        [2 * second_order_std * math.sqrt(dim)] * len(ridges)
    )
    # Without noise: a tiny data-independent floor, 1e-6 · N.
    _, noiseless = noisy_closed_form(
        monkeypatch, method, features, labels, k, epochs, feature_clip_norm=cx
    )
    ridges = [ridge for *_, ridge in noiseless.solves]
    assert ridges == pytest.approx([1e-6 * n] * len(ridges))


# ------------------------------------------------------------- privacy --


def private_settings(method):
    if method == "dp-sgd":
        return {"clip_norm": 0.5}
    return {"feature_clip_norm": 2.0, "budget_split": 0.3}


def independent_mechanism(method, z, n, batch_size, planned_steps):
    """The mechanism of one step, built from the documented rules."""
    if method == "dp-sgd":
        if batch_size is None:
            return privacy.full_batch(z, n)
        return privacy.dp_sgd(z, batch_size, n)
    stds = ref.expected_stds(method, z, 2.0, 0.3, planned_steps)
    releases = [
        privacy.GaussianRelease(std, sensitivity, name)
        for name, (std, sensitivity) in stds.items()
    ]
    if method == "dp-fc":
        return privacy.gaussian_releases(releases[1:], n, setup=releases[:1])
    return privacy.gaussian_releases(releases, n)


@pytest.mark.parametrize(
    ("method", "batch_size", "epochs", "steps"),
    [
        ("dp-sgd", 12, 2, 6),  # round(40 / 12) = 3 a epoch (not ceil: 4).
        ("dp-sgd", 15, 2, 6),  # round(40 / 15) = 3 a epoch (not floor: 2).
        ("dp-sgd", None, 3, 3),
        ("dp-ls", None, 1, 1),
        ("dp-newton", None, 3, 3),
        ("dp-fc", None, 3, 3),
    ],
)
def test_private_steps_count_every_step(method, batch_size, epochs, steps):
    features, labels = make_data(n=40, dim=4, num_classes=3, seed=21)
    model = make_model(3, method, noise_multiplier=1.0, **private_settings(method))
    history = model.fit(
        features, labels, batch_size=batch_size, epochs=epochs, verbose=0
    )
    assert steps_of(model) == steps
    assert history.history["private_steps"][-1] == steps
    assert model.schedule == privacy.Schedule.examples(40, batch_size)
    assert model.planned_steps == steps
    assert model.step_noise_multiplier == 1.0
    assert model.calibrated_noise_multiplier is None


PRIVACY_CASES = [
    ("dp-sgd", 12, 2),
    ("dp-sgd", None, 3),
    ("dp-ls", None, 1),
    ("dp-newton", None, 3),
    ("dp-fc", None, 3),
]


@pytest.mark.parametrize(("method", "batch_size", "epochs"), PRIVACY_CASES)
def test_privacy_budget_reports_the_epsilon_of_the_mechanism(
    method, batch_size, epochs
):
    features, labels = make_data(n=40, dim=4, num_classes=3, seed=22)
    model = make_model(
        3, method, noise_multiplier=4.0, seed=None, **private_settings(method)
    )  # Much noise keeps the PLD accounting fast.
    budget = PrivacyBudget(DELTA, verbose=0)
    history = model.fit(
        features, labels, batch_size=batch_size, epochs=epochs, verbose=0,
        callbacks=[budget],
    )  # fmt: skip
    steps = steps_of(model)
    assert steps == model.planned_steps
    expected = privacy.epsilon(model.privacy_mechanism(), steps, DELTA)
    assert budget.epsilon == pytest.approx(expected, rel=1e-9)
    assert len(history.history["epsilon"]) == epochs
    assert history.history["epsilon"][-1] == pytest.approx(expected, rel=1e-9)
    assert budget.statement.steps == steps
    independent = independent_mechanism(method, 4.0, 40, batch_size, steps)
    assert privacy.epsilon(independent, steps, DELTA) == pytest.approx(
        expected, rel=1e-6
    )
    statement = model.privacy_statement(DELTA)
    assert statement.steps == steps and statement.population == 40
    assert statement.epsilon == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize(("method", "batch_size", "epochs"), PRIVACY_CASES)
def test_target_epsilon_is_met_by_the_planned_run(method, batch_size, epochs):
    features, labels = make_data(n=40, dim=4, num_classes=3, seed=23)
    target = 0.5  # Much noise keeps the PLD accounting fast.
    model = make_model(
        3, method, target_epsilon=target, delta=DELTA, seed=None,
        **private_settings(method),
    )  # fmt: skip
    assert model.schedule is None and model.noise_multiplier is None
    model.fit(features, labels, batch_size=batch_size, epochs=epochs, verbose=0)
    planned = (1 if batch_size is None else round(40 / batch_size)) * epochs
    assert model.planned_steps == planned == steps_of(model)
    z = model.calibrated_noise_multiplier
    # As DPModel's and FedEmbModel's: noise_multiplier holds the calibrated z.
    assert model.step_noise_multiplier == z == model.noise_multiplier
    assert model.get_config()["noise_multiplier"] is None
    rebuilt = LastLayerDPClassifier.from_config(model.get_config())
    assert rebuilt.noise_multiplier == z
    epsilon = privacy.epsilon(
        independent_mechanism(method, z, 40, batch_size, planned), planned, DELTA
    )
    assert 0.99 * target <= epsilon <= target * (1 + 1e-9)
    assert model.privacy_statement().epsilon == pytest.approx(epsilon, rel=1e-6)


@pytest.mark.parametrize("method", CLOSED_FORM)
def test_a_closed_form_run_costs_as_much_as_gaussian_steps_of_multiplier_z(method):
    # The budget split only divides a step's cost between its releases:
    # T steps cost what T Gaussians of multiplier z cost (DP-FC: its one
    # covariance release plus T gradients together).
    features, labels = make_data(n=40, dim=4, num_classes=3, seed=24)
    epochs = 1 if method == "dp-ls" else 4
    model = make_model(3, method, noise_multiplier=4.0, **private_settings(method))
    model.fit(features, labels, epochs=epochs, verbose=0)
    got = model.privacy_statement(DELTA).epsilon
    gaussian = privacy.epsilon(privacy.full_batch(4.0, 40), epochs, DELTA)
    assert got == pytest.approx(gaussian, rel=2e-3)


def save_and_load(model, tmp_path):
    path = tmp_path / "classifier.keras"
    model.save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return keras.saving.load_model(path)


def test_a_saved_dp_sgd_classifier_keeps_its_schedule_and_counting(tmp_path):
    features, labels = make_data(n=40, dim=4, num_classes=3, seed=25)
    model = make_model(
        3, noise_multiplier=4.0, clip_norm=0.5, seed=None,
        optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
    )  # fmt: skip
    model.fit(features, labels, batch_size=10, epochs=1, verbose=0)
    loaded = save_and_load(model, tmp_path)
    assert isinstance(loaded, LastLayerDPClassifier)
    assert steps_of(loaded) == 4
    assert loaded.schedule == model.schedule
    assert loaded.privacy_mechanism() == model.privacy_mechanism()
    np.testing.assert_array_equal(predict(loaded, features), predict(model, features))
    for bad in (loaded, model):
        for batch_size in (8, None):
            with pytest.raises(ValueError, match="batch_size"):
                bad.fit(features, labels, batch_size=batch_size, verbose=0)
        with pytest.raises(ValueError, match="num_examples"):
            bad.fit(features[:-1], labels[:-1], batch_size=10, verbose=0)
        assert steps_of(bad) == 4
    loaded.fit(features, labels, batch_size=10, epochs=1, verbose=0)
    assert steps_of(loaded) == 8
    assert loaded.privacy_statement(DELTA).epsilon == pytest.approx(
        privacy.epsilon(model.privacy_mechanism(), 8, DELTA), rel=1e-9
    )


def test_a_saved_calibrated_classifier_keeps_its_noise_multiplier(tmp_path):
    features, labels = make_data(n=40, dim=4, num_classes=3, seed=26)
    model = make_model(
        3, "dp-newton", target_epsilon=0.5, delta=DELTA, seed=None,
        **private_settings("dp-newton"),
    )  # fmt: skip
    model.fit(features, labels, epochs=3, verbose=0, callbacks=[StopAfter(2)])
    assert steps_of(model) == 2 and model.planned_steps == 3
    loaded = save_and_load(model, tmp_path)
    assert loaded.schedule == model.schedule and steps_of(loaded) == 2
    assert loaded.calibrated_noise_multiplier == model.calibrated_noise_multiplier
    assert loaded.target_epsilon == 0.5 and loaded.planned_steps == 3
    np.testing.assert_array_equal(kernel_of(loaded), kernel_of(model))
    # The planned step not taken yet, with no new calibration.
    loaded.fit(features, labels, epochs=1, verbose=0)
    assert loaded.privacy_mechanism() == model.privacy_mechanism()
    assert steps_of(loaded) == 3
    with pytest.raises(ValueError, match="num_examples"):
        loaded.fit(features[:-1], labels[:-1], verbose=0)
    assert loaded.privacy_statement(DELTA).epsilon == pytest.approx(
        privacy.epsilon(model.privacy_mechanism(), 3, DELTA), rel=1e-9
    )
    assert loaded.privacy_statement().epsilon <= 0.5 * (1 + 1e-9)


class StopAfter(keras.callbacks.Callback):
    """Stops a fit after `epochs` epochs (as early stopping would)."""

    def __init__(self, epochs):
        super().__init__()
        self.epochs = epochs

    def on_epoch_end(self, epoch, logs=None):
        if epoch + 1 >= self.epochs:
            self.model.stop_training = True


TARGET_CASES = [
    ("dp-sgd", 10, 1),
    ("dp-sgd", None, 2),
    ("dp-ls", None, 1),
    ("dp-newton", None, 2),
    ("dp-fc", None, 2),
]


@pytest.mark.parametrize(("method", "batch_size", "epochs"), TARGET_CASES)
def test_a_fit_past_the_target_epsilon_is_refused_before_any_step(
    method, batch_size, epochs, tmp_path
):
    features, labels = make_data(n=40, dim=4, num_classes=3, seed=41)
    target = 0.5  # Much noise keeps the PLD accounting fast.
    model = make_model(
        3, method, target_epsilon=target, delta=DELTA, seed=None,
        **private_settings(method),
    )  # fmt: skip
    model.fit(features, labels, batch_size=batch_size, epochs=epochs, verbose=0)
    planned = model.planned_steps
    assert steps_of(model) == planned
    spent = model.privacy_statement().epsilon
    assert spent <= target * (1 + 1e-9)
    loaded = save_and_load(model, tmp_path)
    assert loaded.target_epsilon == target and loaded.planned_steps == planned
    for fitted in (model, loaded):
        weights = [ref.to_numpy(w) for w in fitted.weights]
        with pytest.raises(PrivacyBudgetExhaustedError) as refusal:
            fitted.fit(features, labels, batch_size=batch_size, epochs=1, verbose=0)
        message = str(refusal.value)
        assert f"target_epsilon={target}" in message
        assert f"{spent:.4g}" in message  # ε so far.
        assert "larger target_epsilon" in message  # The fix.
        assert steps_of(fitted) == planned
        for before, after in zip(weights, fitted.weights, strict=True):
            np.testing.assert_array_equal(ref.to_numpy(after), before)
        assert fitted.privacy_statement().epsilon == pytest.approx(spent, rel=1e-9)


class RestoresSteps(keras.callbacks.Callback):
    """Restores 3 private steps at train begin (as `BackupAndRestore`
    restores a crashed run's)."""

    def on_train_begin(self, logs=None):
        self.model.private_steps.assign(3)


@pytest.mark.parametrize(("method", "batch_size", "epochs"), TARGET_CASES)
def test_steps_a_callback_restores_at_train_begin_are_refused_and_unplanned(
    method, batch_size, epochs
):
    # Steps restored into a classifier whose first fit just calibrated
    # were taken at a noise its plan does not know (before the fix they
    # were added to the plan's: ε went past the target unnoticed).
    features, labels = make_data(n=40, dim=4, num_classes=3, seed=43)
    model = make_model(
        3, method, target_epsilon=0.5, delta=DELTA, seed=None,
        **private_settings(method),
    )  # fmt: skip
    model.build(features.shape)
    weights = [ref.to_numpy(w) for w in model.trainable_weights]
    with pytest.raises(ValueError, match="restored 3 private steps"):
        model.fit(features, labels, batch_size=batch_size, epochs=epochs,
                  verbose=0, callbacks=[RestoresSteps()])  # fmt: skip
    assert steps_of(model) == 3  # Restored, and none taken.
    for before, after in zip(weights, model.trainable_weights, strict=True):
        np.testing.assert_array_equal(ref.to_numpy(after), before)
    assert model.schedule is None and model.planned_steps is None
    assert model.calibrated_noise_multiplier is None is model.noise_multiplier


def test_a_loaded_plan_that_misses_its_target_is_refused_before_a_step():
    features, labels = make_data(n=40, dim=4, num_classes=3, seed=44)
    schedule = privacy.Schedule.examples(40, 10).get_config()
    model = make_model(
        3, "dp-sgd", target_epsilon=0.5, delta=DELTA, seed=None, schedule=schedule,
        planned_steps=8, calibrated_noise_multiplier=0.3, clip_norm=1.0,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"more than its target_epsilon=0\.5"):
        model.fit(features, labels, batch_size=10, epochs=1, verbose=0)
    assert steps_of(model) == 0


def test_a_classifier_with_a_fixed_noise_multiplier_may_fit_again():
    # Without a target there is no budget to exceed: ε grows with the steps.
    features, labels = make_data(n=40, dim=4, num_classes=3, seed=42)
    model = make_model(3, "dp-ls", noise_multiplier=4.0, **private_settings("dp-ls"))
    model.fit(features, labels, verbose=0)
    model.fit(features, labels, verbose=0)
    assert steps_of(model) == 2
    assert model.privacy_statement(DELTA).epsilon == pytest.approx(
        privacy.epsilon(model.privacy_mechanism(), 2, DELTA), rel=1e-9
    )


def test_a_config_saved_with_the_old_schedule_dict_is_read():
    old = {
        "num_examples": 40, "batch_size": 10, "planned_steps": 8,
        "noise_multiplier": 1.3,
    }  # fmt: skip
    calibrated = LastLayerDPClassifier(3, target_epsilon=1.0, delta=DELTA, schedule=old)
    assert calibrated.schedule == privacy.Schedule.examples(40, 10)
    assert calibrated.planned_steps == 8
    assert calibrated.calibrated_noise_multiplier == 1.3
    fixed = LastLayerDPClassifier(3, noise_multiplier=1.3, schedule=old)
    assert fixed.calibrated_noise_multiplier is None
    assert fixed.privacy_mechanism() == calibrated.privacy_mechanism()


def test_dp_fc_releases_the_covariance_once_across_fits_and_saving(
    monkeypatch, tmp_path
):
    features, labels = make_data(n=40, dim=4, num_classes=3, seed=27)
    model, releases = noisy_closed_form(
        monkeypatch, "dp-fc", features, labels, 3, 2, noise_multiplier=4.0,
        seed=None, **private_settings("dp-fc"),
    )  # fmt: skip
    assert len(releases.second_order) == 1
    covariance = ref.to_numpy(model.covariance)
    mechanism = model.privacy_mechanism()
    assert len(mechanism.setup) == 1
    model.fit(features, labels, epochs=1, verbose=0)
    loaded = save_and_load(model, tmp_path)
    loaded.fit(features, labels, epochs=1, verbose=0)
    assert len(releases.second_order) == 1  # Neither fit released it again.
    assert len(releases.solves) == 4  # But both took their gradient steps.
    for fitted in (model, loaded):
        np.testing.assert_array_equal(ref.to_numpy(fitted.covariance), covariance)
        assert fitted.privacy_mechanism() == mechanism
    assert steps_of(loaded) == 4
    # ε of one covariance release and four noisy gradients.
    expected = privacy.epsilon(
        independent_mechanism("dp-fc", 4.0, 40, None, 2), 4, DELTA
    )
    assert loaded.privacy_statement(DELTA).epsilon == pytest.approx(expected, rel=1e-6)


# ---------------------------------------------------- Poisson sampling --


def identified(n):
    """Features that name their example: row i is [i + 1]; label i."""
    return np.arange(1, n + 1, dtype="float32")[:, None], np.arange(n)


def test_poisson_batch_sizes_are_binomial():
    n, b, steps = 200, 20, 2000
    features, labels = identified(n)
    batches = PoissonBatches(features, labels, b, steps, seed=0)
    assert len(batches) == steps
    sizes = np.array([batches[i][2].sum() for i in range(steps)])
    q = b / n
    variance = n * q * (1 - q)
    assert abs(sizes.mean() - b) < 5 * math.sqrt(variance / steps)
    # The sample variance has standard error about var · √(2 / (steps − 1)).
    assert abs(sizes.var(ddof=1) - variance) < 5 * variance * math.sqrt(2 / (steps - 1))


def test_poisson_batches_mask_each_sampled_example_once():
    n, b, steps = 50, 10, 400
    features, labels = identified(n)
    batches = PoissonBatches(features, labels, b, steps, seed=1)
    counts = np.zeros(n)
    for i in range(steps):
        batch_features, batch_labels, mask = batches[i]
        assert batch_features.shape == (batches.max_batch_size, 1)
        assert mask.dtype == np.float32 and set(np.unique(mask)) <= {0.0, 1.0}
        real = batch_labels[mask == 1]
        np.testing.assert_array_equal(batch_features[mask == 1, 0], real + 1)
        assert len(np.unique(real)) == len(real)  # No example twice.
        counts[real] += 1
    # Each example joins each batch with probability q, independently.
    q = b / n
    chi2 = np.sum((counts - steps * q) ** 2 / (steps * q * (1 - q)))
    assert abs(chi2 - n) < 5 * math.sqrt(2 * n)
    with pytest.raises(IndexError):
        batches[steps]

    full = PoissonBatches(features, labels, None, 2)
    for i in range(2):
        batch_features, batch_labels, mask = full[i]
        np.testing.assert_array_equal(np.sort(batch_labels), np.arange(n))
        np.testing.assert_array_equal(mask, np.ones(n, "float32"))


def test_poisson_batches_include_examples_independently_of_each_other():
    # Joint inclusion of two examples must be q², as for independent draws.
    # Neighbouring indices are where a sampler that draws windows, blocks
    # or strides would show (a window of the same size gives about q).
    n, b, steps = 50, 10, 2000
    features, labels = identified(n)
    batches = PoissonBatches(features, labels, b, steps, seed=2)
    included = np.zeros((steps, n))
    for i in range(steps):
        _, batch_labels, mask = batches[i]
        included[i, batch_labels[mask == 1]] = 1
    q = b / n
    neighbours = np.sum(included[:, :-1] * included[:, 1:])
    pairs = (n - 1) * steps
    assert abs(neighbours - pairs * q**2) < 5 * math.sqrt(pairs * q**2 * (1 - q**2))
    apart = np.sum(included[:, : n // 2] * included[:, n // 2 :])
    pairs = (n // 2) * steps
    assert abs(apart - pairs * q**2) < 5 * math.sqrt(pairs * q**2 * (1 - q**2))


def test_an_overflowing_poisson_batch_is_padded_not_truncated():
    n, b = 200, 20
    features, labels = identified(n)
    bounded = PoissonBatches(features, labels, b, 5, seed=3)
    small = PoissonBatches(features, labels, b, 5, seed=3)
    small.max_batch_size = 4  # Every batch overflows.
    for i in range(5):
        _, expected_labels, expected_mask = bounded[i]
        batch_features, batch_labels, mask = small[i]
        assert mask.sum() > 4 and len(mask) >= mask.sum()
        assert len(batch_features) == len(batch_labels) == len(mask)
        np.testing.assert_array_equal(
            np.sort(batch_labels[mask == 1]),
            np.sort(expected_labels[expected_mask == 1]),
        )


# -------------------------------------------------------------- errors --


def data_cases():
    features, labels = make_data(n=10, dim=3, num_classes=3, seed=28)
    nan, inf = features.copy(), features.copy()
    nan[2, 1], inf[4, 0] = np.nan, -np.inf
    return [
        ("nan", nan, labels, "NaN or infinite"),
        ("inf", inf, labels, "NaN or infinite"),
        ("rank_1", features[:, 0], labels, r"\[num_examples, dim\]"),
        ("rank_3", features[:, :, None], labels, r"\[num_examples, dim\]"),
        ("complex", features.astype(complex), labels, "real numbers"),
        ("label_too_big", features, np.where(labels == 0, 3, labels), "< num_classes"),
        ("negative_label", features, np.where(labels == 0, -1, labels), ">= 0"),
        ("labels_2d", features, labels[:, None], "labels must have shape"),
        ("labels_short", features, labels[:-1], "labels must have shape"),
        ("float_labels", features, labels + 0.5, "whole numbers"),
        ("empty", np.zeros((0, 3), "float32"), np.zeros(0, "int32"), "empty"),
        ("lists", features.tolist(), labels.tolist(), "NumPy arrays"),
    ]


@pytest.mark.parametrize(
    ("features", "labels", "match"),
    [case[1:] for case in data_cases()],
    ids=[case[0] for case in data_cases()],
)
@pytest.mark.parametrize("method", ["dp-sgd", "dp-ls"])
def test_bad_data_is_refused_before_any_step(method, features, labels, match):
    model = make_model(3, method, noise_multiplier=1.0)
    with pytest.raises(ValueError, match=match):
        model.fit(features, labels, verbose=0)
    assert steps_of(model) == 0 and model.schedule is None


def test_float_labels_that_are_whole_numbers_are_accepted():
    features, labels = make_data(n=10, dim=3, num_classes=3, seed=29)
    model = make_model(3, "dp-ls", noise_multiplier=1.0)
    model.fit(features, labels.astype("float64"), verbose=0)
    assert steps_of(model) == 1


@pytest.mark.parametrize(
    ("method", "settings", "match"),
    [
        ("dp-sgd", {"noise_multiplier": 1.0, "target_epsilon": 1.0, "delta": DELTA},
         "exactly one"),
        ("dp-sgd", {}, "exactly one"),
        ("dp-ls", {"feature_clip_norm": 1.0}, "exactly one"),
        ("dp-sgd", {"target_epsilon": 1.0}, "needs delta"),
        ("dp-ls", {"noise_multiplier": 1.0}, "feature_clip_norm"),
        ("dp-newton", {"noise_multiplier": 1.0}, "feature_clip_norm"),
        ("dp-fc", {"noise_multiplier": 1.0}, "feature_clip_norm"),
        ("dp-newton", {"noise_multiplier": 1.0, "feature_clip_norm": 1.0,
                       "clip_norm": 1.0}, "clip_norm is DP-SGD"),
        ("dp-ls", {"noise_multiplier": 1.0, "feature_clip_norm": 1.0,
                   "clip_norm": 1.0}, "clip_norm is DP-SGD"),
        ("dp-adam", {"noise_multiplier": 1.0}, "method must be"),
        ("dp-sgd", {"noise_multiplier": -1.0}, "noise_multiplier"),
        ("dp-sgd", {"noise_multiplier": 1.0, "budget_split": 1.0}, "budget_split"),
        ("dp-sgd", {"noise_multiplier": 1.0, "l2": -0.1}, "l2"),
        ("dp-sgd", {"noise_multiplier": 1.0, "head_init": "ones"}, "head_init"),
    ],
)  # fmt: skip
def test_bad_settings_are_refused(method, settings, match):
    with pytest.raises(ValueError, match=match):
        LastLayerDPClassifier(3, method, **settings)


@pytest.mark.parametrize(
    ("method", "settings", "fit_kwargs", "error", "match"),
    [
        ("dp-sgd", {"target_epsilon": 1.0, "delta": 0.2}, {}, ValueError,
         "1/population"),
        ("dp-ls", {"target_epsilon": 1.0, "delta": 0.1}, {}, ValueError,
         "1/population"),
        ("dp-sgd", {"target_epsilon": 1e-4, "delta": 1e-10}, {},
         privacy.CalibrationError, "cannot be met"),
        ("dp-sgd", {"noise_multiplier": 1.0}, {"batch_size": 11}, ValueError,
         "exceeds"),
        ("dp-newton", {"noise_multiplier": 1.0}, {"batch_size": 5}, ValueError,
         "batch_size=None"),
        ("dp-ls", {"noise_multiplier": 1.0}, {"epochs": 2}, ValueError, "epochs=1"),
        ("dp-sgd", {"noise_multiplier": 1.0}, {"sample_weight": np.ones(10)},
         ValueError, "sample_weight"),
        ("dp-sgd", {"noise_multiplier": 1.0}, {"class_weight": {0: 2.0}},
         ValueError, "class_weight"),
        ("dp-fc", {"noise_multiplier": 1.0}, {"class_weight": {0: 2.0}},
         ValueError, "class_weight"),
        ("dp-sgd", {"noise_multiplier": 1.0}, {"validation_split": 0.2},
         ValueError, "validation_split"),
        ("dp-sgd", {"noise_multiplier": 1.0}, {"steps_per_epoch": 2},
         ValueError, "steps_per_epoch"),
        ("dp-newton", {"noise_multiplier": 1.0},
         {"validation_data": (np.zeros((2, 3)), np.zeros(2))}, ValueError,
         "validation_data"),
    ],
)  # fmt: skip
def test_bad_fits_are_refused_before_any_step(
    method, settings, fit_kwargs, error, match
):
    features, labels = make_data(n=10, dim=3, num_classes=3, seed=30)
    model = make_model(3, method, **settings)
    with pytest.raises(error, match=match):
        model.fit(features, labels, verbose=0, **fit_kwargs)
    assert steps_of(model) == 0 and model.schedule is None


def test_use_before_fit_and_a_loss_are_refused():
    model = make_model(3, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="fit the classifier first"):
        model.privacy_mechanism()
    with pytest.raises(ValueError, match="Fit the classifier"):
        model.stack_on(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
    with pytest.raises(ValueError, match="without loss"):
        model.compile(optimizer="sgd", loss="mse")


def test_settings_are_fixed_after_construction():
    # The accounting of past steps and the traced step depend on them.
    features, labels = make_data(n=10, dim=3, num_classes=3, seed=34)
    model = make_model(3, "dp-newton", noise_multiplier=1.0, feature_clip_norm=2.0)
    model.fit(features, labels, verbose=0)
    schedule = model.schedule
    for name, value in [
        ("noise_multiplier", 0.1),
        ("feature_clip_norm", 10.0),
        ("budget_split", 0.9),
        ("l2", 0.0),
        ("schedule", privacy.Schedule.examples(10, 5)),
        ("planned_steps", 100),
        ("calibrated_noise_multiplier", 0.1),
    ]:
        with pytest.raises(AttributeError, match=name):
            setattr(model, name, value)
    assert model.noise_multiplier == 1.0 and model.schedule == schedule
    assert model.planned_steps == 1
    sgd = make_model(3, noise_multiplier=1.0, clip_norm=0.5)
    with pytest.raises(AttributeError, match="clip_norm"):
        sgd.clip_norm = 5.0


def test_a_random_head_draws_its_kernel_from_normal_one_over_d():
    # As FedEmb's random heads: N(0, 1/d), not Glorot uniform.
    dim, k = 400, 50
    keras.utils.set_random_seed(3)
    model = make_model(k, head_init="random", noise_multiplier=1.0)
    model.build((None, dim))
    ref.assert_normal(kernel_of(model), 1 / math.sqrt(dim))
    assert not bias_of(model).any()
    zeros = make_model(k, noise_multiplier=1.0)
    zeros.build((None, dim))
    assert not kernel_of(zeros).any()


def test_host_noise_takes_its_scale_from_the_release_and_is_fresh_per_call():
    release = privacy.GaussianRelease.from_noise_multiplier(1.5, 2.0, "sums")
    assert release.noise_std == 3.0 and release.noise_multiplier == 1.5
    rng = np.random.default_rng(7)
    draws = [host_noise.gaussian_noise(release, (40, 30), rng) for _ in range(2)]
    ref.assert_normal(np.stack(draws), 3.0)
    ref.assert_uncorrelated(draws)  # Fresh per call.
    ref.assert_uncorrelated(list(draws[0].T))  # Independent per class.
    stack = host_noise.symmetric_noise(release, 30, rng, count=4)
    np.testing.assert_array_equal(stack, np.swapaxes(stack, 1, 2))
    triangles = [ref.upper_triangle(m) for m in stack]
    ref.assert_normal(np.stack(triangles), 3.0)
    ref.assert_uncorrelated(triangles)  # Independent per matrix of a stack.
    with pytest.raises(TypeError, match="GaussianRelease"):
        host_noise.gaussian_noise(3.0, (2,), rng)
    with pytest.raises(TypeError, match="Generator"):
        host_noise.gaussian_noise(release, (2,), 0)


def test_a_fixed_seed_warns_and_none_does_not():
    with pytest.warns(ReproducibleNoiseWarning, match="seed"):
        LastLayerDPClassifier(3, noise_multiplier=1.0, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReproducibleNoiseWarning)
        LastLayerDPClassifier(3, noise_multiplier=1.0)


# ------------------------------------------- stacking, feature clipping --


@pytest.mark.parametrize("method", ["dp-sgd", "dp-ls"])
def test_stack_on_scores_like_the_backbone_then_predict(method):
    backbone = keras.Sequential(
        [keras.Input((4, 4, 1)), keras.layers.Flatten(), keras.layers.Dense(6)]
    )
    rng = np.random.default_rng(31)
    images = rng.normal(size=(30, 4, 4, 1)).astype("float32")
    labels = rng.integers(0, 3, 30)
    features = np.asarray(backbone.predict(images, verbose=0))
    cx = float(np.median(np.linalg.norm(features, axis=1)))
    clip = {"clip_norm": 1.0} if method == "dp-sgd" else {}
    model = make_model(3, method, feature_clip_norm=cx, noise_multiplier=0.5, **clip)
    model.fit(features, labels, epochs=1, verbose=0)
    assert np.abs(kernel_of(model)).max() > 1e-2
    stacked = model.stack_on(backbone)
    scores = np.asarray(stacked.predict(images, verbose=0), np.float64)
    np.testing.assert_allclose(scores, predict(model, features), rtol=1e-5, atol=1e-6)
    bias = bias_of(model) if method == "dp-sgd" else 0.0
    expected = ref.clip_rows(features, cx) @ kernel_of(model) + bias
    np.testing.assert_allclose(scores, expected, rtol=1e-4, atol=1e-5)


def test_clip_features_scales_only_the_rows_above_the_norm():
    rng = np.random.default_rng(32)
    features = rng.normal(size=(6, 4)) * np.array([[0.1], [0.5], [1], [2], [5], [0]])
    layer = ClipFeatures(1.5)
    got = ref.to_numpy(layer(features.astype("float32")))
    np.testing.assert_allclose(got, ref.clip_rows(features, 1.5), rtol=1e-6, atol=1e-7)
    assert ClipFeatures.from_config(layer.get_config()).clip_norm == 1.5


# ------------------------------------------- training rows on the device --


@pytest.mark.parametrize("first_fit", ["device", "host"])
def test_a_later_fit_gathers_the_rows_it_was_given(monkeypatch, first_fit):
    # Two fits, the second on other features of the same shape (the device
    # copy is refreshed in place on TensorFlow); the first gathers on the
    # device or, when the device "has no room", on the host (the step then
    # reads its rows another way and must be traced anew). A replay of
    # the recorded samples in NumPy must match: a step that still read the
    # first fit's rows would not.
    recorded = ref.RecordedBatches(monkeypatch)
    features, labels = make_data(n=60, dim=4, num_classes=3, seed=5)
    other = features[::-1] * 1.5
    lr, l2, clip_norm = 0.5, 0.01, 0.8
    model = make_model(
        3, optimizer=keras.optimizers.SGD(lr), l2=l2, clip_norm=clip_norm, seed=9
    )
    with monkeypatch.context() as patch:
        if first_fit == "host":
            force_host_gathering(patch)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(features, labels, batch_size=12, epochs=2, verbose=0)
    assert model._rows.on_device == (first_fit == "device")
    assert any("device memory" in str(w.message) for w in caught) == (
        first_fit == "host"
    )
    first = recorded.used(5, 2, features, labels)
    recorded.batches.clear()
    model.fit(other, labels, batch_size=12, epochs=1, verbose=0)
    assert model._rows.on_device
    second = recorded.used(5, 1, other, labels)

    settings = {"lr": lr, "l2": l2, "clip_norm": clip_norm, "denominator": 12}
    after_first = replay_dp_sgd(first, np.zeros((4, 3)), np.zeros(3), **settings)
    kernel, bias, clipped = replay_dp_sgd(second, *after_first[:2], **settings)
    assert clipped > 0
    np.testing.assert_allclose(kernel_of(model), kernel, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(bias_of(model), bias, rtol=1e-4, atol=1e-6)
    # The replay tells the two data sets apart: the same samples of the
    # first fit's features end elsewhere.
    stale = recorded.used(5, 1, features, labels)
    stale_kernel, _, _ = replay_dp_sgd(stale, *after_first[:2], **settings)
    assert np.abs(stale_kernel - kernel_of(model)).max() > 1e-3


def test_an_error_other_than_out_of_memory_is_not_swallowed(monkeypatch):
    def broken(arrays, held):
        raise RuntimeError("INVALID_ARGUMENT: not a memory problem")

    monkeypatch.setattr(backends.current(), "hold_rows", broken)
    features, labels = make_data(n=30, dim=4, num_classes=3)
    model = make_model(3)
    with pytest.raises(RuntimeError, match="not a memory problem"):
        model.fit(features, labels, batch_size=10, verbose=0)


def test_the_device_copy_of_the_training_rows_is_never_saved(tmp_path):
    # 4,000 x 32 float32 features are 500 KiB; the model's state is a
    # 32 x 10 head and a few counters.
    features, labels = make_data(n=4000, dim=32, num_classes=10, seed=6)
    model = make_model(10, noise_multiplier=1.0, clip_norm=1.0)
    model.fit(features, labels, batch_size=400, epochs=1, verbose=0)
    assert model._rows.on_device
    assert all(math.prod(v.shape) < features.size // 10 for v in model.variables), [
        v.shape for v in model.variables
    ]
    path = tmp_path / "head.keras"
    model.save(path)
    assert path.stat().st_size < features.nbytes // 10
    weights = tmp_path / "head.weights.h5"
    model.save_weights(weights)
    assert weights.stat().st_size < features.nbytes // 10


@pytest.mark.parametrize("method", ["dp-sgd", "dp-newton"])
def test_weights_loaded_into_a_new_classifier_cannot_restart_the_plan(method, tmp_path):
    # load_weights restores private_steps but not the schedule, the plan or
    # the calibrated noise: a fresh plan would account the old steps at the
    # new noise and could go past the target (review finding).
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, 300)
    features = rng.normal(size=(300, 4)).astype("float32")
    sampled = method == "dp-sgd"
    settings = dict(
        target_epsilon=0.5, delta=1e-3,
        **({"clip_norm": 1.0} if sampled else {"feature_clip_norm": 2.0}),
    )  # fmt: skip
    batch = 100 if sampled else None
    model = LastLayerDPClassifier(3, method, **settings)
    model.fit(features, labels, batch_size=batch, epochs=2, verbose=0)
    path = str(tmp_path / "head.weights.h5")
    model.save_weights(path)
    fresh = LastLayerDPClassifier(3, method, **settings)
    fresh.build((None, 4))
    fresh.load_weights(path)
    assert protocol.read_private_steps(fresh) == protocol.read_private_steps(model)
    for epochs in (4, 2):  # A refused fit must not leave a plan behind.
        with pytest.raises(ValueError, match="load_model"):
            fresh.fit(features, labels, batch_size=batch, epochs=epochs, verbose=0)
    assert fresh.schedule is None


def test_initial_epoch_must_leave_at_least_one_epoch():
    features = np.zeros((50, 3), "float32")
    labels = np.arange(50) % 2
    model = LastLayerDPClassifier(2, "dp-sgd", noise_multiplier=1.0)
    for initial_epoch in (2, 3, -1):
        with pytest.raises(ValueError, match="initial_epoch"):
            model.fit(features, labels, epochs=2, initial_epoch=initial_epoch)
    assert model.schedule is None
    with pytest.raises(NotImplementedError, match="only through fit"):
        model.train_on_batch(features, labels)


@pytest.mark.parametrize(
    ("method", "settings", "scale"),
    [
        ("dp-sgd", {"clip_norm": 2.0}, 2.0),
        ("dp-ls", {"feature_clip_norm": 4.0}, 4.0),
    ],
)
def test_near_zero_features_warn_before_any_step_with_no_statistic(
    method, settings, scale
):
    # Review finding: features of norm ~1e-10 (an untrained backbone) were
    # fitted without a word and gave chance accuracy.
    features, labels = make_data(n=20, dim=4, seed=3)
    model = LastLayerDPClassifier(
        3, method, noise_multiplier=1.0, delta=DELTA, seed=0, **settings
    )
    messages = []
    for degenerate in (features * 1e-10, features * 1e-9 * scale):
        with warnings.catch_warnings():
            warnings.simplefilter("error", DegenerateFeaturesWarning)
            with pytest.raises(DegenerateFeaturesWarning, match="yes/no") as info:
                model.fit(degenerate, labels, batch_size=None, verbose=0)
        messages.append(str(info.value))
    assert steps_of(model) == 0  # Warned (here: raised) before any step.
    # Only the public threshold is stated, never a value of the data.
    assert messages[0] == messages[1]
    assert f"{1e-6 * scale:.3g}" in messages[0]


def test_the_warning_is_one_bit_whether_half_the_rows_are_below_the_threshold():
    features, labels = make_data(n=10, dim=4, seed=4)
    norms = np.linalg.norm(features, axis=1, keepdims=True)
    unit = features / norms
    for tiny_rows, warns in ((4, False), (5, True), (10, True)):
        rows = unit.copy()
        rows[:tiny_rows] *= 0.99e-6  # Just below 1e-6 x clip_norm = 1e-6.
        rows[tiny_rows:] *= 1.01e-6  # Just above it.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            make_model(3, clip_norm=1.0).fit(rows, labels, verbose=0)
        degenerate = [w for w in caught if w.category is DegenerateFeaturesWarning]
        assert bool(degenerate) == warns, tiny_rows
    # Small features at a clip norm of their own scale are fine.
    with warnings.catch_warnings():
        warnings.simplefilter("error", DegenerateFeaturesWarning)
        make_model(3, "dp-ls", feature_clip_norm=1e-9).fit(
            features * 1e-10, labels, verbose=0
        )


def test_dp_fc_refuses_to_release_its_covariance_again_after_a_lost_checkpoint(
    tmp_path, monkeypatch
):
    from kdpemb.callbacks import PrivacyLedger
    from kdpemb.errors import LostReleaseError

    features, labels = make_data()
    ledger = str(tmp_path / "ledger.json")
    settings = dict(noise_multiplier=1.0, feature_clip_norm=1.0, delta=1e-3)
    first = make_model(3, "dp-fc", **settings)
    first.fit(features, labels, epochs=2, callbacks=[PrivacyLedger(ledger)], verbose=0)
    assert int(keras.ops.convert_to_numpy(first.covariance_released)) == 1
    # A crash lost every checkpoint: a new model resumes from the ledger's count.
    releases = []
    real = host_noise.symmetric_noise
    monkeypatch.setattr(
        host_noise,
        "symmetric_noise",
        lambda *a, **k: releases.append(1) or real(*a, **k),
    )
    resumed = make_model(3, "dp-fc", **settings)
    with pytest.raises(LostReleaseError, match="covariance"):
        resumed.fit(
            features, labels, epochs=2, callbacks=[PrivacyLedger(ledger)], verbose=0
        )
    assert releases == [] and steps_of(resumed) == 2
