"""The Gaussian sum query: bounded sensitivity, noise scale, no-noise sum."""

import keras
import numpy as np
import pytest
from scipy import stats

from kdpemb.privacy.gaussian_sum import (
    ClippedSum,
    add_gaussian_noise,
    clip_and_sum,
    global_norms,
)


def updates(seed, rows=6, scale=3.0):
    rng = np.random.default_rng(seed)
    return [
        (scale * rng.normal(size=(rows, 4, 3))).astype("float32"),
        (scale * rng.normal(size=(rows, 5))).astype("float32"),
    ]


def flat(tensors):
    return np.concatenate([np.asarray(t).ravel() for t in tensors])


def test_each_clipped_contribution_has_norm_at_most_c():
    for seed in range(5):
        rows = updates(seed)
        for i in range(6):
            single = clip_and_sum([u[i : i + 1] for u in rows], clip_norm=0.7)
            assert np.linalg.norm(flat(single.total)) <= 0.7 * (1 + 1e-6)
    # Short updates are not scaled up.
    small = [u * 1e-3 for u in updates(0)]
    result = clip_and_sum([u[:1] for u in small], clip_norm=0.7)
    np.testing.assert_allclose(
        flat(result.total), flat([u[0] for u in small]), rtol=1e-6
    )


@pytest.mark.parametrize("seed", range(5))
def test_clipped_sum_has_bounded_sensitivity(seed):
    c = 0.5
    rows = updates(seed)
    changed = [u.copy() for u in rows]
    rng = np.random.default_rng(seed + 100)
    for u in changed:
        u[2] = 50 * rng.normal(size=u[2].shape)
    base = flat(clip_and_sum(rows, c).total)
    # Replacing one contribution moves the sum by at most 2C ...
    assert np.linalg.norm(flat(clip_and_sum(changed, c).total) - base) <= 2 * c * (
        1 + 1e-6
    )
    # ... and removing one (masking it out) by at most C.
    mask = np.ones(6, bool)
    mask[2] = False
    removed = flat(clip_and_sum(rows, c, mask=mask).total)
    assert np.linalg.norm(removed - base) <= c * (1 + 1e-6)


def test_antipodal_contributions_reach_the_2c_bound():
    # The bound is tight: the worst case is attained, so it is not loose.
    a = [np.array([[10.0, 0.0]], "float32")]
    b = [np.array([[-10.0, 0.0]], "float32")]
    gap = flat(clip_and_sum(a, 1.0).total) - flat(clip_and_sum(b, 1.0).total)
    assert np.linalg.norm(gap) == pytest.approx(2.0)


def test_non_finite_contributions_are_zeroed_and_counted():
    rows = updates(1)
    poisoned = [u.copy() for u in rows]
    poisoned[0][1, 0, 0] = np.nan
    poisoned[1][4, 2] = np.inf
    result = clip_and_sum(poisoned, 1.0)
    keep = np.ones(6, bool)
    keep[[1, 4]] = False
    expected = clip_and_sum(rows, 1.0, mask=keep)
    np.testing.assert_allclose(flat(result.total), flat(expected.total), rtol=1e-6)
    assert int(result.num_nonfinite) == 2 and int(result.count) == 6
    masked = clip_and_sum(poisoned, 1.0, mask=[True, False] * 3)
    # Row 1 is masked out, row 4 is included: only row 4 counts.
    assert int(masked.num_nonfinite) == 1 and int(masked.count) == 3


def test_without_noise_or_clipping_it_is_the_plain_sum():
    rows = updates(2)
    result = clip_and_sum(rows, clip_norm=1e9)
    noisy = add_gaussian_noise(result, 0.0, keras.random.SeedGenerator(0))
    for got, u in zip(noisy, rows, strict=True):
        np.testing.assert_allclose(np.asarray(got), u.sum(axis=0), rtol=1e-5)


def test_noise_has_standard_deviation_z_times_c():
    z, c = 1.3, 0.7
    zero = clip_and_sum([np.zeros((3, 200, 10), "float32")], clip_norm=c)
    generator = keras.random.SeedGenerator(1)
    noise = np.concatenate(
        [flat(add_gaussian_noise(zero, z, generator)) for _ in range(5)]
    )
    assert stats.kstest(noise, "norm", args=(0.0, z * c)).pvalue > 1e-3
    # A wrong scale (e.g. the 2C sensitivity) fails the same test.
    assert stats.kstest(noise, "norm", args=(0.0, 2 * z * c)).pvalue < 1e-6


def test_noise_is_never_reused_across_tensors_or_calls():
    zero = clip_and_sum(
        [np.zeros((2, 2000), "float32"), np.zeros((2, 2000), "float32")], 1.0
    )
    generator = keras.random.SeedGenerator(2)
    first = [np.asarray(t) for t in add_gaussian_noise(zero, 1.0, generator)]
    second = [np.asarray(t) for t in add_gaussian_noise(zero, 1.0, generator)]
    draws = [*first, *second]
    for i in range(len(draws)):
        for j in range(i):
            assert abs(np.corrcoef(draws[i], draws[j])[0, 1]) < 0.1


def test_an_integer_seed_or_a_bare_total_is_refused():
    zero = clip_and_sum([np.zeros((1, 3), "float32")], 1.0)
    with pytest.raises(TypeError, match="SeedGenerator"):
        add_gaussian_noise(zero, 1.0, 42)
    with pytest.raises(TypeError, match="ClippedSum"):
        add_gaussian_noise(zero.total, 1.0, keras.random.SeedGenerator(0))
    with pytest.raises(ValueError, match="clip_norm"):
        clip_and_sum([np.zeros((1, 3))], clip_norm=0.0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        add_gaussian_noise(zero, -1.0, keras.random.SeedGenerator(0))
    assert isinstance(zero, ClippedSum)


def test_global_norms_span_all_tensors():
    rows = updates(3)
    expected = np.sqrt(sum((u.reshape(6, -1) ** 2).sum(axis=1) for u in rows))
    np.testing.assert_allclose(np.asarray(global_norms(rows)), expected, rtol=1e-6)


def test_it_traces_inside_a_compiled_function():
    # The trainers call it inside jit / tf.function.
    rows = updates(4)
    generator = keras.random.SeedGenerator(3)

    def step(a, b):
        return add_gaussian_noise(clip_and_sum([a, b], 0.5), 0.0, generator)

    if keras.backend.backend() == "jax":
        import jax

        compiled = jax.jit(step)
    else:
        import tensorflow as tf

        compiled = tf.function(step)
    eager = flat(step(*rows))
    np.testing.assert_allclose(flat(compiled(*rows)), eager, rtol=1e-5)
