"""Empirical lower bounds on ε from membership-test counts (NumPy/SciPy only).

An (ε, δ)-DP mechanism limits every membership test: for any test that
says "in" with true positive rate TPR (canary included) and false
positive rate FPR (canary left out),

    TPR <= e^ε FPR + δ   and   1 − FPR <= e^ε (1 − TPR) + δ.

An audit only observes counts, so it replaces TPR by a one-sided
Clopper–Pearson lower bound and FPR by an upper bound; the ε that the
inequalities then force holds with the stated confidence. It is a *lower*
bound: a bound far below the claimed ε says the audit's test is weak, not
that the mechanism is more private; a bound above the claimed ε says the
claim is wrong (a bug), up to a 1 − confidence chance.

`one_run_epsilon_lower_bound` is the δ = 0 bound of the one-run audit of
Steinke, Nasr and Jagielski (2023).

This module does not import Keras.

Example:

>>> round(epsilon_lower_bound(990, 1000, 10, 1000, delta=1e-5), 2)
3.98
"""

import math
import numbers

import numpy as np
from scipy import special, stats

__all__ = [
    "clopper_pearson",
    "epsilon_lower_bound",
    "one_run_epsilon_lower_bound",
]


def _check_count(value, name, maximum=None, maximum_name=None):
    integral = isinstance(value, (numbers.Integral, np.integer))
    if not integral or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}.")
    if maximum is not None and value > maximum:
        raise ValueError(
            f"{name}={value!r} is larger than {maximum_name}={maximum!r}: it "
            f"counts a subset of the {maximum_name}."
        )
    return int(value)


def _check_confidence(confidence):
    if (
        not isinstance(confidence, numbers.Real)
        or isinstance(confidence, bool)
        or not 0.0 < confidence < 1.0
    ):
        raise ValueError(
            f"confidence must be in (0, 1), e.g. 0.95, got {confidence!r}."
        )
    return float(confidence)


def _check_audit_delta(delta):
    if (
        not isinstance(delta, numbers.Real)
        or isinstance(delta, bool)
        or not 0.0 <= delta < 1.0
    ):
        raise ValueError(
            f"delta must be in [0, 1), got {delta!r}. It is the δ of the "
            "(ε, δ) claim being audited."
        )
    return float(delta)


def clopper_pearson(successes, trials, confidence=0.95):
    """One-sided Clopper–Pearson bounds on a binomial success probability.

    `low` is the smallest p for which seeing `successes` or more is not
    rarer than 1 − confidence: P[Binomial(trials, low) >= successes] =
    1 − confidence (0 when successes = 0); `high` likewise from above
    (1 when successes = trials). Each bound alone holds with probability
    at least `confidence`.

    Args:
        successes: int in [0, trials].
        trials: int >= 1.
        confidence: float in (0, 1).

    Returns:
        `(low, high)`: floats.

    Example:

    >>> low, high = clopper_pearson(0, 100, 0.95)
    >>> low, round(high, 4)
    (0.0, 0.0295)
    """
    trials = _check_count(trials, "trials")
    if trials == 0:
        raise ValueError("trials must be >= 1: there is nothing to bound.")
    successes = _check_count(successes, "successes", trials, "trials")
    alpha = 1.0 - _check_confidence(confidence)
    low = 0.0
    if successes > 0:
        low = float(stats.beta.ppf(alpha, successes, trials - successes + 1))
    high = 1.0
    if successes < trials:
        high = float(stats.beta.ppf(1.0 - alpha, successes + 1, trials - successes))
    return low, high


def epsilon_lower_bound(
    true_positives, positives, false_positives, negatives, delta=0.0, confidence=0.95
):
    """The ε that a membership test's counts prove, at a confidence.

    With TPR_low and FPR_high the one-sided Clopper–Pearson bounds, each
    at confidence 1 − (1 − confidence)/2 (Bonferroni: both hold together
    with probability >= `confidence`),

        ε >= max(ln((TPR_low − δ)/FPR_high), ln((1 − FPR_high − δ)/(1 − TPR_low)))

    and 0 where neither is positive (nothing significant).

    Args:
        true_positives: int. Trials with the canary that the test called "in".
        positives: int >= 1. Trials with the canary.
        false_positives: int. Trials without the canary called "in".
        negatives: int >= 1. Trials without the canary.
        delta: float in [0, 1). The δ of the claim being audited.
        confidence: float in (0, 1). Chance that the bound is valid.

    Returns:
        float >= 0.

    Example:

    >>> epsilon_lower_bound(50, 100, 50, 100)
    0.0
    >>> round(epsilon_lower_bound(95, 100, 5, 100), 3)
    2.062
    """
    positives = _check_count(positives, "positives")
    negatives = _check_count(negatives, "negatives")
    if positives == 0 or negatives == 0:
        raise ValueError(
            f"An audit needs trials with and without the canary, got "
            f"positives={positives}, negatives={negatives}."
        )
    true_positives = _check_count(
        true_positives, "true_positives", positives, "positives"
    )
    false_positives = _check_count(
        false_positives, "false_positives", negatives, "negatives"
    )
    delta = _check_audit_delta(delta)
    each = 1.0 - (1.0 - _check_confidence(confidence)) / 2.0
    tpr_low, _ = clopper_pearson(true_positives, positives, each)
    _, fpr_high = clopper_pearson(false_positives, negatives, each)
    candidates = [0.0]
    if tpr_low - delta > 0.0:
        candidates.append(math.log((tpr_low - delta) / fpr_high))
    if 1.0 - fpr_high - delta > 0.0:
        candidates.append(math.log((1.0 - fpr_high - delta) / (1.0 - tpr_low)))
    return max(candidates)


def one_run_epsilon_lower_bound(
    num_correct, num_guesses, num_canaries, delta=0.0, confidence=0.95
):
    """The ε lower bound of a one-run audit (Steinke, Nasr, Jagielski 2023).

    `num_canaries` canaries are each included independently with
    probability 1/2 in one training run; the auditor guesses inclusion for
    `num_guesses` of them (abstaining on the rest) and `num_correct`
    guesses are right. Under ε-DP the number correct is stochastically
    dominated by Binomial(r, p(ε)) with p(ε) = e^ε / (1 + e^ε), so the
    bound is the largest ε with P[Binomial(r, p(ε)) >= v] <= 1 − confidence,
    i.e. the logit of the Clopper–Pearson lower bound on p (0 when that is
    at most 1/2).

    Only δ = 0 is supported: the paper's δ > 0 bound is not implemented,
    and a pure-ε bound must not be compared with the ε of an (ε, δ) claim
    (a Gaussian mechanism is not ε-DP for any finite ε).

    Args:
        num_correct: int v in [0, num_guesses].
        num_guesses: int r in [1, num_canaries].
        num_canaries: int m >= 1.
        delta: must be 0.
        confidence: float in (0, 1).

    Returns:
        float >= 0.

    Example:

    >>> round(one_run_epsilon_lower_bound(90, 100, 1000), 3)
    1.631
    """
    num_canaries = _check_count(num_canaries, "num_canaries")
    num_guesses = _check_count(num_guesses, "num_guesses", num_canaries, "num_canaries")
    if num_guesses == 0:
        raise ValueError("num_guesses must be >= 1: an audit needs at least one guess.")
    num_correct = _check_count(num_correct, "num_correct", num_guesses, "num_guesses")
    delta = _check_audit_delta(delta)
    if delta > 0.0:
        raise NotImplementedError(
            f"one_run_epsilon_lower_bound supports only delta=0, got "
            f"delta={delta!r}: the δ > 0 bound of Steinke, Nasr and Jagielski "
            "(2023) is not implemented. Audit a pure-ε claim, or use the "
            "many-run epsilon_lower_bound for an (ε, δ) claim."
        )
    low, _ = clopper_pearson(num_correct, num_guesses, confidence)
    if low <= 0.5:
        return 0.0
    return float(special.logit(low))
