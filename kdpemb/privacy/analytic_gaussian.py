"""Exact (ε, δ) of the Gaussian mechanism (Balle and Wang 2018), in plain math.

A release f(D) + N(0, σ²I) where f moves by at most Δ in L2 norm between
neighbours is (ε, δ)-DP exactly for

    δ(ε) = Φ(Δ/(2σ) − εσ/Δ) − e^ε Φ(−Δ/(2σ) − εσ/Δ)

(Balle and Wang, "Improving the Gaussian Mechanism for Differential
Privacy", ICML 2018, Theorem 8). Only s = σ/Δ matters. A composition of
Gaussians without sampling is one Gaussian whose 1/s² is the sum of theirs,
so this is also the exact privacy loss distribution of full-batch
schedules and of independent Gaussian releases; dp-accounting's PLD of
the same Gaussian is this curve up to its (pessimistic) discretisation.

Everything is computed in log space with `math.erfc`, so that δ down to
1e-300 and ε up to thousands neither underflow nor overflow, and every
answer is rounded in the safe direction: ε up, δ up, σ up. `log_delta` is
an upper bound on log δ(ε), not a rounded value: for large σ/Δ the two
terms of δ(ε) nearly cancel (δ is a fraction of order Δ/σ of each), so there
Φ(a) − Φ(b) is integrated directly (no cancellation), and the bound
carries the rounding error of what is left.

Example:

>>> epsilon = epsilon_for_delta(1.0, 1e-5)
>>> round(epsilon, 3)
4.377
>>> delta_for_epsilon(1.0, epsilon) <= 1e-5 < delta_for_epsilon(1.0, 4.377)
True
>>> round(noise_for_epsilon(4.377, 1e-5), 3)
1.0
"""

import math

import numpy as np

# On top of the rounding error bound of `log_delta`: room for the last
# roundings (exp, log of the target), so that rounding never favours ε.
_LOG_SLACK = 1e-9
_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)
# A bound on the absolute error of each log term of δ(ε), in units of
# roundoff of the magnitudes involved (math.erfc, exp and log are good to
# a few units; the arguments a, b carry a relative error of a few units,
# i.e. a few u·x² in log Φ(x)).
_ROUNDOFF = 2.0**-53
_ERROR_UNITS = 32
# Where the two terms of δ(ε) nearly cancel (σ/Δ >= 2 and ε <= 2: the
# half-width h = Δ/(2σ) <= 1/4 and |m|·h = ε/2 <= 1), Φ(m + h) − Φ(m − h)
# is integrated by Gauss-Legendre: its integrand cosh(m·t)·exp(−t²/2) on
# [0, h] is entire and nearly flat, and 16 nodes (exact to degree 31)
# leave an error far below roundoff.
_MAX_QUADRATURE_SHIFT = 0.25
_MAX_QUADRATURE_EPSILON = 2.0
_NODES, _WEIGHTS = (
    [float(value) for value in values] for values in np.polynomial.legendre.leggauss(16)
)


def log_ndtr(x):
    """log Φ(x), the log of the standard normal CDF, accurate in both tails."""
    if x > 0:
        return math.log1p(-0.5 * math.erfc(x / math.sqrt(2)))
    if x > -37:  # erfc stays a normal float (> 1e-300) down to here.
        return math.log(0.5 * math.erfc(-x / math.sqrt(2)))
    # Asymptotic series: Φ(x) = φ(x)/|x| · Σ (-1)^k (2k-1)!! / x^(2k).
    inverse_square = 1.0 / (x * x)
    term, series = 1.0, 1.0
    for k in range(1, 9):  # The 9th term is below 1e-20 for |x| >= 37.
        term *= -(2 * k - 1) * inverse_square
        series += term
    return -0.5 * x * x - math.log(-x) - _HALF_LOG_2PI + math.log(series)


def _log_ndtr_difference(middle, half_width):
    """log(Φ(middle + h) − Φ(middle − h)) for 0 < h <= 1/4, |middle|·h <= 1,
    to a few units of roundoff: φ(middle)·∫ exp(−middle·t − t²/2) dt over
    [−h, h], i.e. φ(middle)·2h·J with J the mean of cosh(middle·t)·exp(−t²/2)
    over [0, h], which lies in [exp(−1/32), cosh(1)]."""
    mean = 0.0
    for node, weight in zip(_NODES, _WEIGHTS, strict=True):
        t = 0.5 * half_width * (1.0 + node)
        mean += 0.5 * weight * math.cosh(middle * t) * math.exp(-0.5 * t * t)
    log_density = -0.5 * middle * middle - _HALF_LOG_2PI
    return math.log(2 * half_width) + log_density + math.log(mean)


def log_delta(noise, epsilon):
    """An upper bound on log δ(ε) of a Gaussian with sensitivity 1 and std
    `noise` (may be -inf): never below the exact value, and above it only by
    the bound on its rounding error (typically 1e-12; checked against
    60-digit arithmetic for σ up to 1e9 and δ down to 1e-300).

    δ(ε) = P − N, both terms in log space: P = Φ(a), N = e^ε·Φ(b) with
    a = h − εσ, b = −h − εσ, h = 1/(2σ); or, where these nearly cancel,
    P = Φ(a) − Φ(b) (integrated, see `_log_ndtr_difference`) and
    N = (e^ε − 1)·Φ(b), which cancel far less. Each log term is within E
    (`_ERROR_UNITS` units of roundoff of the magnitudes involved) of its
    exact value; the bound takes P at its largest and N at its smallest.
    """
    if epsilon == math.inf:
        return -math.inf
    shift = 0.5 / noise
    scaled = epsilon * noise
    below = -shift - scaled
    if shift <= _MAX_QUADRATURE_SHIFT and epsilon <= _MAX_QUADRATURE_EPSILON:
        positive = _log_ndtr_difference(-scaled, shift)
        negative = (
            math.log(math.expm1(epsilon)) + log_ndtr(below)
            if epsilon > 0
            else -math.inf
        )
        squares = scaled * scaled + below * below
    else:
        above = shift - scaled
        positive = log_ndtr(above)
        negative = epsilon + log_ndtr(below)
        squares = above * above + below * below
    if positive == -math.inf:
        return -math.inf
    magnitude = 1.0 + abs(positive) + squares + epsilon
    if negative != -math.inf:
        magnitude += abs(negative)
    if math.isinf(magnitude):  # |a|, |b| > 1e154: δ far below any float.
        return 0.5 * positive  # Above log P (< 0), hence above log δ.
    error = _ERROR_UNITS * _ROUNDOFF * magnitude
    gap = positive - negative + 2 * error  # At its largest: δ at its largest.
    if gap <= 0:  # Only if the bound failed: δ(ε) > 0 always. δ <= P holds.
        return min(0.0, positive + error)
    # δ <= 1: the error term grows as 1/σ², past any δ at tiny noise.
    return min(0.0, positive + error + math.log(-math.expm1(-gap)))


def delta_for_epsilon(noise, epsilon):
    """δ(ε) of a Gaussian with sensitivity 1 and std `noise` (rounded up).

    Args:
        noise: float. σ/Δ; 0 means no noise (δ = 1) and inf no release (δ = 0).
        epsilon: float. ε >= 0.

    Returns:
        float: the smallest δ for which the mechanism is (ε, δ)-DP.

    Example:

    >>> round(delta_for_epsilon(2.0, 1.0), 4)
    0.0068
    """
    if noise == 0:
        return 1.0
    if noise == math.inf:
        return 0.0
    return min(1.0, math.exp(log_delta(noise, epsilon) + _LOG_SLACK))


def epsilon_for_delta(noise, delta):
    """ε(δ) of a Gaussian with sensitivity 1 and std `noise` (rounded up).

    The smallest ε >= 0 with δ(ε) <= `delta`, found by bisection to the
    last bits of a float; the value returned meets `delta` with room for
    the rounding of δ(ε) itself.

    Args:
        noise: float. σ/Δ >= 0; 0 means no noise (ε = inf).
        delta: float. In (0, 1).

    Returns:
        float: ε.

    Example:

    >>> round(epsilon_for_delta(2.0, 1e-6), 4)
    2.2541
    """
    if noise == 0:
        return math.inf
    if noise == math.inf:
        return 0.0
    log_target = math.log(delta) - _LOG_SLACK

    def meets(epsilon):
        return log_delta(noise, epsilon) <= log_target

    if meets(0.0):
        return 0.0
    low, high = 0.0, 1.0
    while not meets(high):
        low, high = high, 2 * high
    return _bisect(meets, low, high)


def noise_for_epsilon(epsilon, delta):
    """The smallest σ/Δ of a Gaussian that is (ε, δ)-DP (rounded up).

    Args:
        epsilon: float. ε > 0.
        delta: float. In (0, 1).

    Returns:
        float: the noise multiplier σ/Δ.

    Example:

    >>> round(noise_for_epsilon(1.0, 1e-5), 4)
    3.7306
    """
    log_target = math.log(delta) - _LOG_SLACK

    def meets(noise):
        return log_delta(noise, epsilon) <= log_target

    low, high = 0.5, 1.0
    while not meets(high):
        low, high = high, 2 * high
    while meets(low):
        low, high = low / 2, low
    return _bisect(meets, low, high)


def _bisect(meets, low, high):
    """The upper end of [low, high] (not meets(low), meets(high)) narrowed to
    adjacent floats, or 1e-15 relative."""
    while high - low > 1e-15 * high:
        middle = 0.5 * (low + high)
        if middle in (low, high):
            break
        if meets(middle):
            high = middle
        else:
            low = middle
    return high
