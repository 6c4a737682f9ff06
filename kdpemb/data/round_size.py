"""A static bound M_max on the number of virtual clients in a Poisson round.

With Poisson sampling each of P virtual clients takes part independently
with probability q, so the count is Binomial(P, q): unbounded in shape
terms, but a compiled `train_step` needs a fixed number of client slots.
`max_clients_per_round` picks the smallest M_max whose overflow
probability P[Binomial(P, q) > M_max] is at most a tolerance (1e-9 by
default). A round that would overflow is not truncated (that would change
the sampling the accountant assumes): `VirtualClients` raises instead.
With several users per virtual client the count is over public client
slots and depends on no one's data. With one user per client it is the
number of sampled users, so the overflow probability p adds at most
e^ε · rounds · p to δ, and `VirtualClients` uses a tolerance of 1e-30.
"""

import math

import numpy as np


def _log_pmf(i, n, q):
    return (
        math.lgamma(n + 1)
        - math.lgamma(i + 1)
        - math.lgamma(n - i + 1)
        + i * math.log(q)
        + (n - i) * math.log1p(-q)
    )


def _upper_tail_terms(n, q, start, negligible=1e-300):
    """pmf(i) for i = start, start+1, ... until the terms fall below
    `negligible` past the mean (the rest of the tail is then smaller than a
    geometric series of ratio < 1 starting there)."""
    if start > n:
        return np.zeros(0)
    terms = [math.exp(_log_pmf(start, n, q))]
    ratio = q / (1.0 - q)
    i = start
    while i < n:
        nxt = terms[-1] * (n - i) / (i + 1) * ratio
        i += 1
        if nxt == 0.0 or (nxt < negligible and i > n * q):
            break
        terms.append(nxt)
    return np.asarray(terms)


def overflow_probability(num_clients, rate, bound):
    """P[Binomial(num_clients, rate) > bound].

    Example:

    >>> round(overflow_probability(10, 0.5, 5), 4)  # P[X >= 6], X ~ B(10, 1/2)
    0.377
    """
    if bound >= num_clients or rate == 0.0:
        return 0.0
    if rate == 1.0:
        return 1.0
    return float(min(1.0, _upper_tail_terms(num_clients, rate, bound + 1).sum()))


def max_clients_per_round(num_clients, rate, tolerance=1e-9):
    """The smallest M_max with P[Binomial(num_clients, rate) > M_max] <= tolerance.

    Args:
        num_clients: int. P, the number of virtual clients.
        rate: float in (0, 1]. q, each client's sampling probability.
        tolerance: float. Largest allowed overflow probability per round.
            Defaults to `1e-9`.

    Returns:
        int between ceil(P q) and P.

    Example:

    >>> max_clients_per_round(num_clients=2_500, rate=64 / 2_500)
    117
    """
    if rate >= 1.0:
        return int(num_clients)
    mean = num_clients * rate
    start = max(0, math.floor(mean))
    terms = _upper_tail_terms(num_clients, rate, start, negligible=tolerance * 1e-6)
    # tails[j] = P[X >= start + j]; we need the first m >= start with
    # P[X > m] = tails[m - start + 1] <= tolerance.
    tails = np.cumsum(terms[::-1])[::-1]
    below = np.flatnonzero(tails[1:] <= tolerance)
    if below.size:
        return int(min(num_clients, start + below[0]))
    return int(min(num_clients, start + len(terms)))
