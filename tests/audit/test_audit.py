"""White-box audits: below the claimed ε for kdpemb's mechanisms, above it
for deliberately broken variants (noise / 10, clipping removed)."""

import numpy as np
import pytest

from kdpemb.audit import audit
from kdpemb.privacy import gaussian_sum

CONFIDENCE = 0.95
DELTA = 1e-5


@pytest.fixture
def noise_divided_by_10(monkeypatch):
    real = gaussian_sum.gaussian_noise

    def weak(clipped_sum, noise_multiplier, seed_generator):
        return [n / 10 for n in real(clipped_sum, noise_multiplier, seed_generator)]

    monkeypatch.setattr(gaussian_sum, "gaussian_noise", weak)


@pytest.fixture
def clipping_removed(monkeypatch):
    real = gaussian_sum.clip_factors

    def unclipped(norms, clip_norm, mask=None):
        factors, finite = real(norms, clip_norm, mask)
        return np.where(np.asarray(factors) > 0, 1.0, 0.0).astype("float32"), finite

    monkeypatch.setattr(gaussian_sum, "clip_factors", unclipped)


def gaussian_sum_audit(seed):
    return audit.audit_gaussian_sum(
        2.0, DELTA, trials=2000, confidence=CONFIDENCE, seed=seed
    )


def test_gaussian_sum_audit_stays_below_the_claimed_epsilon():
    result = gaussian_sum_audit(seed=0)
    assert 1.5 < result.claimed_epsilon < 2.5
    assert not result.violated, result


def test_gaussian_sum_audit_catches_noise_divided_by_10(noise_divided_by_10):
    result = gaussian_sum_audit(seed=0)
    assert result.violated, result


def test_gaussian_sum_audit_catches_clipping_removed(clipping_removed):
    result = gaussian_sum_audit(seed=0)
    assert result.violated, result


def test_audit_scores_with_a_fixed_threshold_counts_every_trial():
    result = audit.audit_scores([1, 2, 3], [0, 0, 5], 1.0, DELTA, threshold=1.5)
    assert (result.true_positives, result.positives) == (2, 3)
    assert (result.false_positives, result.negatives) == (1, 3)
    assert result.trials == 6


def test_audit_scores_refuses_non_finite_scores():
    with pytest.raises(ValueError, match="finite"):
        audit.audit_scores([1, np.nan], [0, 0], 1.0, DELTA)


@pytest.fixture
def host_noise_divided_by_10(monkeypatch):
    from kdpemb.privacy import host_noise

    for name in ("gaussian_noise", "symmetric_noise"):
        real = getattr(host_noise, name)
        monkeypatch.setattr(
            host_noise, name, lambda *a, real=real, **k: real(*a, **k) / 10
        )


def dp_ls_audit():
    return audit.audit_last_layer_dp_ls(
        2.0, DELTA, trials=1200, confidence=CONFIDENCE, seed=0
    )


def test_last_layer_dp_ls_audit_stays_below_the_claimed_epsilon():
    result = dp_ls_audit()
    assert 1.5 < result.claimed_epsilon < 2.5
    assert not result.violated, result


def test_last_layer_dp_ls_audit_catches_noise_divided_by_10(host_noise_divided_by_10):
    result = dp_ls_audit()
    assert result.violated, result
