"""White-box audits of the Gaussian sum query: below the claimed ε, above it
for deliberately broken variants (noise / 10, clipping removed); scoring."""

import numpy as np
import pytest

from kdpemb.audit import audit

CONFIDENCE = 0.95
DELTA = 1e-5


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


def test_audit_releases_learns_the_direction_on_the_first_halves_only():
    rng = np.random.default_rng(0)
    # The second halves are shifted the other way: a direction learned on
    # them would call them "in"; learned on the first halves it does not.
    shift = np.array([3.0, 0.0])
    first, second = rng.normal(size=(2, 200, 2))
    with_canary = np.vstack([first + shift, second - shift])
    without = rng.normal(size=(400, 2))
    result = audit.audit_releases(with_canary, without, 1.0, DELTA)
    assert result.true_positives < 0.05 * result.positives
    assert not result.violated
