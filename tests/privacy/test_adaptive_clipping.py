"""AdaptiveClipping's accounting and the keras.ops quantile step, checked
against direct computations."""

import math

import keras
import numpy as np
import pytest

from kdpemb.privacy import AdaptiveClipping, gaussian_sum, quantile_clip


def test_the_effective_multiplier_is_the_joint_sensitivity_over_unit_noise():
    # Scale each release by its noise std: one client moves the update by
    # C / (z C) = 1 / z and the count by (1/2) / σ_b; with unit noise the
    # pair's multiplier is 1 / (joint L2 sensitivity).
    for z, sigma_b in [(1.0, 5.0), (0.7, 0.4), (3.0, 100.0)]:
        clipping = AdaptiveClipping(count_stddev=sigma_b)
        joint = math.hypot(1 / z, 0.5 / sigma_b)
        assert clipping.effective_noise_multiplier(z, 10) == pytest.approx(1 / joint)
        assert clipping.effective_noise_multiplier(z, 10) < z
    assert AdaptiveClipping(count_stddev=0.0).effective_noise_multiplier(1.0, 10) == 0
    assert AdaptiveClipping().count_stddev_for(40) == pytest.approx(2.0)


def test_the_split_gives_back_at_least_the_calibrated_multiplier():
    clipping = AdaptiveClipping(count_stddev=3.0)
    for z_eff in (0.3, 1.0, 5.9):
        z = clipping.update_noise_multiplier(z_eff, 64)
        assert z > z_eff
        assert clipping.effective_noise_multiplier(z, 64) >= z_eff
        assert clipping.effective_noise_multiplier(z, 64) == pytest.approx(z_eff)
    with pytest.raises(ValueError, match="count_stddev"):
        clipping.update_noise_multiplier(6.0, 64)  # 2σ_b = 6 <= z_eff


def test_settings_are_checked_and_round_trip():
    clipping = AdaptiveClipping(0.8, 0.1, 2.0)
    assert AdaptiveClipping.from_config(clipping.get_config()) == clipping
    for bad in ({"target_quantile": 1.0}, {"learning_rate": 0.0},
                {"count_stddev": -1.0}):  # fmt: skip
        with pytest.raises(ValueError):
            AdaptiveClipping(**bad)


def test_the_count_is_centred_and_moves_by_half_per_client():
    rng = np.random.default_rng(0)
    updates = rng.normal(size=(9, 4)).astype("float32")
    updates[3] = np.nan
    mask = np.array([1, 1, 1, 1, 1, 1, 1, 0, 0], bool)
    norms = np.linalg.norm(updates, axis=1)
    c = float(np.nanmedian(norms))
    clipped = gaussian_sum.clip_and_sum([updates], c, mask)
    within = (norms <= c) & mask  # NaN <= c is False: above C.
    expected = within.sum() - 0.5 * mask.sum()
    assert float(quantile_clip.centred_count(clipped)) == pytest.approx(expected)
    # Adding or removing one client moves the count by exactly 1/2.
    for row in range(7):
        fewer = mask.copy()
        fewer[row] = False
        moved = quantile_clip.centred_count(
            gaussian_sum.clip_and_sum([updates], c, fewer)
        )
        assert abs(float(moved) - expected) == 0.5


def test_the_geometric_step_follows_the_noisy_share():
    clipping = AdaptiveClipping(target_quantile=0.7, learning_rate=0.3)
    c = keras.ops.convert_to_tensor(2.0)  # C as model state: a tensor.
    for noisy, m in [(0.0, 10.0), (3.0, 10.0), (-40.0, 10.0), (40.0, 10.0)]:
        share = min(max(noisy / m + 0.5, 0.0), 1.0)
        expected = 2.0 * math.exp(-0.3 * (share - 0.7))
        got = quantile_clip.next_clip_norm(c, noisy, m, clipping)
        assert float(got) == pytest.approx(expected, rel=1e-6)


def test_the_count_noise_is_fresh_and_needs_a_seed_generator():
    generator = keras.random.SeedGenerator(0)
    draws = [float(quantile_clip.count_noise(2.0, generator)) for _ in range(200)]
    assert len(set(draws)) == 200
    assert np.std(draws) == pytest.approx(2.0, rel=0.2)
    assert float(quantile_clip.count_noise(0.0, generator)) == 0.0
    with pytest.raises(TypeError, match="SeedGenerator"):
        quantile_clip.count_noise(1.0, 0)
