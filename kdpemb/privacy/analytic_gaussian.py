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
answer is rounded in the safe direction: ε up, δ up, σ up.

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

# log δ is computed to about 1e-13 relative; a decision "δ(ε) <= δ_target"
# is taken only with this much room, so that rounding never favours ε.
_LOG_SLACK = 1e-9
_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


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


def log_delta(noise, epsilon):
    """log δ(ε) of a Gaussian with sensitivity 1 and std `noise` (may be -inf)."""
    if epsilon == math.inf:
        return -math.inf
    shift = 0.5 / noise
    scaled = epsilon * noise
    first = log_ndtr(shift - scaled)
    second = epsilon + log_ndtr(-shift - scaled)
    if second >= first:  # Only by rounding: δ(ε) > 0 for every finite ε.
        return -math.inf
    return first + math.log(-math.expm1(second - first))


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
