"""The ε lower bounds, checked against brute force and Monte Carlo (no Keras)."""

import math

import numpy as np
import pytest
from scipy import stats

from kdpemb.audit import bounds
from kdpemb.privacy import analytic_gaussian


def bisect(function, low, high, iterations=200):
    """The root of an increasing `function` on [low, high], by bisection."""
    for _ in range(iterations):
        middle = 0.5 * (low + high)
        if function(middle) < 0:
            low = middle
        else:
            high = middle
    return 0.5 * (low + high)


def brute_clopper_pearson(k, n, confidence):
    """Both bounds as roots of binomial tails, found by bisection."""
    alpha = 1 - confidence
    low = 0.0 if k == 0 else bisect(lambda p: stats.binom.sf(k - 1, n, p) - alpha, 0, 1)
    high = 1.0 if k == n else bisect(lambda p: alpha - stats.binom.cdf(k, n, p), 0, 1)
    return low, high


@pytest.mark.parametrize(
    ("k", "n"), [(0, 10), (3, 10), (10, 10), (17, 400), (399, 400)]
)
@pytest.mark.parametrize("confidence", [0.9, 0.975])
def test_clopper_pearson_matches_the_binomial_tails(k, n, confidence):
    got = bounds.clopper_pearson(k, n, confidence)
    np.testing.assert_allclose(got, brute_clopper_pearson(k, n, confidence), atol=1e-9)


@pytest.mark.parametrize("p", [0.02, 0.3, 0.5, 0.93])
def test_clopper_pearson_covers_p_with_the_stated_confidence(p):
    n, confidence = 60, 0.9
    k = np.arange(n + 1)
    pmf = stats.binom.pmf(k, n, p)
    limits = np.array([bounds.clopper_pearson(int(i), n, confidence) for i in k])
    assert pmf[limits[:, 0] > p].sum() <= 1 - confidence
    assert pmf[limits[:, 1] < p].sum() <= 1 - confidence


def test_epsilon_lower_bound_is_the_epsilon_the_dp_inequalities_force():
    tp, pos, fp, neg, delta, confidence = 180, 200, 15, 220, 1e-3, 0.9
    each = 1 - (1 - confidence) / 2
    tpr_low = brute_clopper_pearson(tp, pos, each)[0]
    fpr_high = brute_clopper_pearson(fp, neg, each)[1]

    def violated(eps):
        first = tpr_low > math.exp(eps) * fpr_high + delta
        second = 1 - fpr_high > math.exp(eps) * (1 - tpr_low) + delta
        return first or second

    got = bounds.epsilon_lower_bound(tp, pos, fp, neg, delta, confidence)
    assert violated(got - 1e-6) and not violated(got + 1e-6)
    # Symmetric: swapping the datasets and the answer proves the same ε.
    swapped = bounds.epsilon_lower_bound(
        neg - fp, neg, pos - tp, pos, delta, confidence
    )
    assert swapped == pytest.approx(got)


def test_nothing_significant_gives_zero():
    assert bounds.epsilon_lower_bound(51, 100, 49, 100) == 0.0
    assert bounds.epsilon_lower_bound(100, 100, 0, 100, delta=0.99) == 0.0


def randomized_response_counts(epsilon, trials, repeats, rng):
    """TP and FP counts of the optimal test against ε-randomized response."""
    p = math.exp(epsilon) / (1 + math.exp(epsilon))
    return rng.binomial(trials, p, repeats), rng.binomial(trials, 1 - p, repeats)


def test_randomized_response_bound_holds_at_the_confidence_and_is_nearly_tight():
    rng = np.random.default_rng(0)
    epsilon, confidence, repeats = 2.0, 0.95, 2000
    tp, fp = randomized_response_counts(epsilon, 5000, repeats, rng)
    found = np.array(
        [
            bounds.epsilon_lower_bound(int(a), 5000, int(b), 5000)
            for a, b in zip(tp, fp, strict=True)
        ]
    )
    assert np.mean(found > epsilon) <= 1 - confidence
    assert np.median(found) > 0.85 * epsilon


def test_gaussian_mechanism_bound_stays_below_its_exact_epsilon_and_grows():
    rng = np.random.default_rng(1)
    sigma, delta, threshold = 0.5, 1e-5, 1.0
    claimed = analytic_gaussian.epsilon_for_delta(sigma, delta)
    tpr = stats.norm.sf(threshold, loc=1.0, scale=sigma)
    fpr = stats.norm.sf(threshold, loc=0.0, scale=sigma)
    medians = []
    for trials in (100, 1000, 10000):
        tp = rng.binomial(trials, tpr, 400)
        fp = rng.binomial(trials, fpr, 400)
        found = np.array(
            [
                bounds.epsilon_lower_bound(int(a), trials, int(b), trials, delta)
                for a, b in zip(tp, fp, strict=True)
            ]
        )
        assert np.mean(found > claimed) <= 0.05
        medians.append(np.median(found))
    assert medians[0] < medians[1] < medians[2] < claimed


def test_one_run_bound_is_the_binomial_tail_root():
    v, r, m, confidence = 140, 200, 1000, 0.95
    got = bounds.one_run_epsilon_lower_bound(v, r, m, confidence=confidence)
    p = math.exp(got) / (1 + math.exp(got))
    assert stats.binom.sf(v - 1, r, p) == pytest.approx(1 - confidence, rel=1e-6)
    assert bounds.one_run_epsilon_lower_bound(50, 100, 100) == 0.0


def test_one_run_bound_on_randomized_response_canaries_holds_and_grows():
    epsilon, confidence = 1.0, 0.95
    p = math.exp(epsilon) / (1 + math.exp(epsilon))
    # Exactly: v ~ Binomial(m, p) correct guesses when every canary is guessed.
    for m in (20, 300):
        v = np.arange(m + 1)
        found = np.array([bounds.one_run_epsilon_lower_bound(int(c), m, m) for c in v])
        assert stats.binom.pmf(v, m, p)[found > epsilon].sum() <= 1 - confidence
    # Simulated: each canary's inclusion bit released by ε-randomized response.
    rng = np.random.default_rng(2)
    repeats, medians = 1000, []
    for m in (100, 1000, 10000):
        included = rng.random((repeats, m)) < 0.5
        guesses = included ^ (rng.random((repeats, m)) >= p)
        correct = (guesses == included).sum(axis=1)
        found = np.array(
            [bounds.one_run_epsilon_lower_bound(int(c), m, m) for c in correct]
        )
        # 0.05 plus three standard errors of a 1000-run frequency.
        assert np.mean(found > epsilon) <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / repeats)
        medians.append(np.median(found))
    assert medians[0] < medians[1] < medians[2] < epsilon


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: bounds.clopper_pearson(5, 3), ValueError, "successes=5"),
        (lambda: bounds.clopper_pearson(1, 3, 1.5), ValueError, "confidence"),
        (lambda: bounds.epsilon_lower_bound(1, 0, 0, 5), ValueError, "positives=0"),
        (lambda: bounds.epsilon_lower_bound(1, 2, 0, 5, delta=-1), ValueError, "delta"),
        (
            lambda: bounds.epsilon_lower_bound(1.5, 2, 0, 5),
            ValueError,
            "true_positives",
        ),
        (
            lambda: bounds.one_run_epsilon_lower_bound(5, 10, 20, delta=1e-5),
            NotImplementedError,
            "only delta=0",
        ),
        (
            lambda: bounds.one_run_epsilon_lower_bound(5, 30, 20),
            ValueError,
            "num_guesses=30",
        ),
    ],
)
def test_bad_arguments_are_refused_by_name(call, error, match):
    with pytest.raises(error, match=match):
        call()
