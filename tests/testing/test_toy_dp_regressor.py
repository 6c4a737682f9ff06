"""The toy DP-SGD model does what its docstring claims: clip, noise once, step."""

import keras
import numpy as np
import pytest

from kdpemb.testing import FullBatchSequence, ToyDPRegressor


def one_step(x, y, noise_multiplier, clip_norm, sampling_probability=1.0, lr=1.0):
    """Parameters [w, b] after one DP-SGD step from zero with SGD(lr)."""
    n, d = x.shape
    model = ToyDPRegressor(
        n, d, noise_multiplier, sampling_probability, clip_norm=clip_norm, seed=3
    )
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=lr))
    model.fit(
        FullBatchSequence(x.astype("float32"), y.astype("float32"), 1),
        epochs=1,
        verbose=0,
    )
    return np.append(
        keras.ops.convert_to_numpy(model.kernel),
        float(keras.ops.convert_to_numpy(model.bias)),
    )


def test_no_noise_and_no_clipping_is_plain_gradient_descent():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 3)), rng.normal(size=16)
    lr = 0.1
    residual = -y  # The model starts at zero.
    expected = -lr * np.append(residual @ x, residual.sum()) / len(y)
    np.testing.assert_allclose(one_step(x, y, 0.0, 1e9, lr=lr), expected, rtol=1e-5)


def test_one_example_moves_the_update_by_at_most_2c_over_the_batch():
    rng = np.random.default_rng(1)
    clip, n = 0.5, 8
    x, y = 10 * rng.normal(size=(n, 3)), 10 * rng.normal(size=n)
    changed_x, changed_y = x.copy(), y.copy()
    changed_x[0], changed_y[0] = -x[0] * 7, -y[0] * 9
    delta = one_step(x, y, 0.0, clip) - one_step(changed_x, changed_y, 0.0, clip)
    assert 0 < np.linalg.norm(delta) <= 2 * clip / n + 1e-6
    # Every clipped per-example gradient counts fully: the sum has norm <= n·C.
    assert np.linalg.norm(one_step(x, y, 0.0, clip)) <= clip + 1e-6


@pytest.mark.parametrize("z, q", [(1.0, 1.0), (2.0, 0.5)])
def test_noise_std_is_z_c_over_the_expected_batch(z, q):
    """With zero gradients the step is the noise alone: N(0, (zC / qN)²)."""
    n, d, clip = 64, 4_000, 0.3
    step = one_step(np.zeros((n, d)), np.zeros(n), z, clip, sampling_probability=q)
    expected_std = z * clip / (q * n)
    assert np.std(step[:-1]) == pytest.approx(expected_std, rel=0.06)
    assert abs(np.mean(step[:-1])) < 4 * expected_std / np.sqrt(d)


def noisy_weights_after_global_seed(global_seed):
    """Weights after one noisy step of a seedless model built after
    `keras.utils.set_random_seed(global_seed)`: the noise alone (zero data)."""
    keras.utils.set_random_seed(global_seed)
    model = ToyDPRegressor(16, 50, noise_multiplier=1.0, sampling_probability=1.0)
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=1.0))
    zeros = np.zeros((16, 50), "float32")
    model.fit(FullBatchSequence(zeros, np.zeros(16, "float32"), 1), verbose=0)
    return keras.ops.convert_to_numpy(model.kernel)


def test_a_global_keras_seed_does_not_predict_the_noise():
    # keras.utils.set_random_seed is in documented examples; it must not fix
    # the DP noise of a model built without a seed.
    first = noisy_weights_after_global_seed(0)
    second = noisy_weights_after_global_seed(0)
    assert np.abs(first).min() > 0  # The step is the noise.
    assert not np.allclose(first, second)


def test_a_fixed_seed_warns_that_the_noise_is_predictable():
    from kdpemb.errors import ReproducibleNoiseWarning

    with pytest.warns(ReproducibleNoiseWarning, match="guarantee is void"):
        ToyDPRegressor(8, 2, noise_multiplier=1.0, sampling_probability=0.5, seed=1)
    config = ToyDPRegressor(
        8, 2, noise_multiplier=1.0, sampling_probability=0.5
    ).get_config()
    assert config["seed"] is None
