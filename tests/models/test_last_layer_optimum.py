"""Without noise, each closed-form method reaches its own non-private optimum.

DP-Newton and DP-FC minimise the mean softmax loss plus l2/2 ‖W‖² (no
bias) on clipped features: run long enough with zero noise, they must land
on scikit-learn's `LogisticRegression` with the same penalty
(`C = 1 / (N · l2)`, no intercept), in weights, in loss and in held-out
accuracy (within 0.5 points, the acceptance bar). DP-LS must be
scikit-learn's `Ridge` on one-hot targets with `alpha = l2 · N`. A few
steps must not be enough, so the comparison can fail.
"""

import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression, Ridge

from kdpemb.models import LastLayerDPClassifier
from kdpemb.models.last_layer.last_layer_stats import clip_rows

CLIP = 2.0
L2 = 1e-2
N, DIM, K = 400, 6, 4


def overlapping_classes(n, seed):
    """Four Gaussian classes that overlap (the optimum is finite), some
    rows past the clip norm."""
    rng = np.random.default_rng(seed)
    labels = np.arange(n) % K
    centers = np.random.default_rng(99).normal(size=(K, DIM))
    features = 0.8 * centers[labels] + rng.normal(size=(n, DIM)) * 0.7
    return features.astype("float32"), labels


def fit(method, epochs, features, labels):
    model = LastLayerDPClassifier(
        K, method, feature_clip_norm=CLIP, noise_multiplier=0.0, l2=L2
    )
    model.fit(features, labels, epochs=epochs, verbose=0)
    return model


def kernel_of(model):
    return np.asarray(model.head.kernel.numpy(), np.float64)


def objective(kernel, features, labels):
    """Mean softmax cross-entropy plus l2/2 ‖W‖² on clipped features."""
    logits = clip_rows(features, CLIP) @ kernel
    logits -= logits.max(axis=1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    return -log_probs[np.arange(len(labels)), labels].mean() + L2 / 2 * np.sum(
        kernel**2
    )


def accuracy(kernel, features, labels):
    return float(((clip_rows(features, CLIP) @ kernel).argmax(1) == labels).mean())


@pytest.fixture(scope="module")
def data():
    features, labels = overlapping_classes(N, seed=0)
    norms = np.linalg.norm(features, axis=1)
    assert 0.05 < np.mean(norms > CLIP) < 0.95  # Clipping matters.
    test = overlapping_classes(4_000, seed=1)
    reference = LogisticRegression(
        C=1.0 / (N * L2), fit_intercept=False, tol=1e-10, max_iter=10_000
    ).fit(clip_rows(features, CLIP), labels)
    # scikit-learn's multinomial kernel has one column per class, like ours.
    return features, labels, test, reference.coef_.T


@pytest.mark.parametrize(
    ("method", "epochs", "few"), [("dp-newton", 40, 1), ("dp-fc", 150, 2)]
)
def test_without_noise_newton_and_fc_reach_the_logistic_optimum(
    data, method, epochs, few
):
    features, labels, test, optimum = data
    reference_accuracy = accuracy(optimum, *test)
    assert 0.5 < reference_accuracy < 0.95  # Not separable, not hopeless.

    converged = kernel_of(fit(method, epochs, features, labels))
    assert accuracy(converged, *test) == pytest.approx(reference_accuracy, abs=0.005)
    assert objective(converged, features, labels) == pytest.approx(
        objective(optimum, features, labels), rel=1e-6
    )
    # The same minimiser (softmax weights are unique up to a shift that
    # the ridge removes).
    np.testing.assert_allclose(converged, optimum, atol=2e-3 * np.abs(optimum).max())

    early = kernel_of(fit(method, few, features, labels))
    assert objective(early, features, labels) > objective(optimum, features, labels) * (
        1 + 1e-3
    )


def test_without_noise_dp_ls_is_ridge_regression(data):
    features, labels, test, _ = data
    model = fit("dp-ls", 1, features, labels)
    ridge = Ridge(alpha=L2 * N, fit_intercept=False, solver="cholesky")
    ridge.fit(clip_rows(features, CLIP), np.eye(K)[labels])
    np.testing.assert_allclose(kernel_of(model), ridge.coef_.T, rtol=1e-4, atol=1e-6)
    scores = model.predict(test[0], verbose=0)
    assert (scores.argmax(1) == ridge.predict(clip_rows(test[0], CLIP)).argmax(1)).all()
