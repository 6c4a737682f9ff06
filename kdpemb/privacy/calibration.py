"""Noise calibration: the smallest noise multiplier that meets a target ε.

How the PLD accountant is searched. Where the schedule is one Gaussian
mechanism (full batch, `GaussianReleases`) its ε is exact and costs
microseconds, so any search is fast. A Poisson-sampled schedule needs a
privacy loss distribution (PLD) per candidate, whose cost grows with the
width of its loss range over the grid step: small multipliers (large ε)
on the accountant's default grid of 1e-4 take seconds to minutes each.
The search therefore runs on coarser grids h = 1e-4 · 2^k:

- dp-accounting discretises pessimistically, and a grid that is a
  multiple of a finer one gives nearly always an ε at least as large (the
  connect-the-dots distribution on the coarse grid dominates the one on
  the fine grid). Not always: the FFT round-off of a finer grid adds mass
  to its tails, and beyond ε ≈ 745 dp-accounting returns grid values; we
  measured a finer grid up to 4e-4 above a coarser one at δ >= 1e-9, and
  more below δ = 1e-10. So a grid k > 0 is used as a bound with margins:
  ε_k(z) at δ - max(1e-3 δ, 1e-13), plus one step h of that grid, must
  meet the target; `tests/privacy/test_calibration.py` checks that this
  bounds ε on the default grid. Below δ = 1e-10 only the default grid is
  used.
- The grid is only as coarse as the accuracy allows: the search stops on
  a grid once the bound is within rtol/2 of the target, and accepts the
  grid if the margins plus the grid's error (estimated by the next
  coarser grid's ε minus this one's) stay within rtol/2 of the target;
  otherwise it moves to a finer grid, down to 1e-4 itself.
- The first grid scales with the target (a relative accuracy needs a grid
  step proportional to ε), a scouting search on an 8x coarser grid lands
  near the answer for little, and the first candidate comes from the
  central limit theorem of Poisson-sampled Gaussians (Dong, Roth and
  Su 2019). Steps towards less noise are at most a factor of 2, so the
  expensive evaluations are few and never far below the answer.
"""

import contextlib
import logging
import math
from typing import NamedTuple

from kdpemb import _validation as validation
from kdpemb.errors import CalibrationError
from kdpemb.privacy import analytic_gaussian
from kdpemb.privacy.accountant import Accountant, resolve_accountant
from kdpemb.privacy.mechanisms import Mechanism, Relation

DEFAULT_INTERVAL = 1e-4  # The PLD accountant's default grid.
# Coarse grids meet the target at δ - max(1e-3 δ, 1e-13): room for the
# round-off of the default grid's FFTs, which adds mass to its tails. Below
# δ = 1e-10 that round-off can exceed the slack: the default grid only.
DELTA_SLACK, DELTA_FLOOR, MIN_COARSE_DELTA = 1e-3, 1e-13, 1e-10
EXACT_RTOL = 1e-6  # The slack left below the target where ε is exact.
MAX_GRID_LEVEL = 10  # The coarsest search grid: 2**10 · 1e-4 ≈ 0.1.
SCOUT_LEVELS = 3  # The scouting grid is 2**3 times the first one.


# dp-accounting's RDP accountant logs this (through absl) for each
# fractional order it cannot evaluate at small noise, and drops the order:
# its ε is still an upper bound. A search visits many small multipliers on
# its way, so it would print dozens of such lines.
RDP_DROPPED_ORDER = "_compute_log_a_frac failed to converge"


@contextlib.contextmanager
def quiet_dropped_rdp_orders():
    """Mutes dp-accounting's line for each RDP order it drops.

    Example:

    >>> with quiet_dropped_rdp_orders():
    ...     pass
    """
    logger = logging.getLogger("absl")

    def keep(record):
        return not str(record.msg).startswith(RDP_DROPPED_ORDER)

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


class _Unreachable(Exception):
    """The multiplier cap does not meet the target on this grid."""


def calibrate_noise_multiplier(
    mechanism,
    steps,
    delta,
    *,
    target_epsilon,
    accountant=None,
    max_noise_multiplier=1000.0,
    min_noise_multiplier=0.01,
    rtol=0.005,
):
    """The smallest noise multiplier whose ε after `steps` is <= the target.

    The search keeps the largest multiplier known to miss the target and
    the smallest known to meet it and narrows them by regula falsi on
    (log z, log ε), which is nearly linear. It returns a multiplier that
    meets the target and wastes less than `rtol` of it. With the PLD
    accountant the ε it meets is the one `Accountant(mechanism, "pld")`
    reports (an upper bound on the true ε); Poisson-sampled schedules are
    searched on coarser, still pessimistic, grids first (see the module
    docstring), so the returned multiplier's ε on the default grid is at
    most the target and, as far as the grid's accuracy estimate goes,
    within `rtol` of it.

    Args:
        mechanism: `kdpemb.privacy.Mechanism`. The schedule; its own noise
            multiplier is ignored (see `Mechanism.with_noise_multiplier`).
        steps: int. Planned private steps.
        delta: float. The δ, below 1/population.
        target_epsilon: float. The ε to meet (keyword only).
        accountant: str or None. "pld" or "rdp"; None (default): "pld"
            where it models the mechanism, else "rdp" (fixed-size sampling).
        max_noise_multiplier: float. Largest multiplier considered.
        min_noise_multiplier: float. Smallest multiplier considered; if it
            already meets the target it is returned.
        rtol: float. Relative slack allowed below the target.

    Returns:
        float: the noise multiplier.

    Raises:
        CalibrationError: if even `max_noise_multiplier` gives ε > target.

    The RDP accountant's log line for each order it drops ("failed to
    converge", at small multipliers) is muted during the search.

    Example:

    >>> from kdpemb import privacy
    >>> m = privacy.dp_sgd(1.0, batch_size=256, num_examples=60_000)
    >>> z = privacy.calibrate_noise_multiplier(
    ...     m, target_epsilon=3.0, delta=1e-5, steps=14_063)
    >>> round(z, 2)
    0.97
    """
    return calibrate(
        mechanism,
        steps,
        delta,
        target_epsilon=target_epsilon,
        accountant=accountant,
        max_noise_multiplier=max_noise_multiplier,
        min_noise_multiplier=min_noise_multiplier,
        rtol=rtol,
    ).noise_multiplier


class Calibration(NamedTuple):
    """What `calibrate` found.

    Attributes:
        noise_multiplier: float. The multiplier, as
            `calibrate_noise_multiplier` returns it.
        epsilon: float. At most the target, and at least the ε that
            `Accountant(mechanism.with_noise_multiplier(noise_multiplier),
            accountant)` gives after the steps at δ: that ε itself where
            the search ran on the accountant's own grid (RDP, an exact
            Gaussian, PLD at δ below 1e-10), else the bound the search met
            on a coarser grid (see the module docstring), above that ε by
            less than rtol / 2 of the target as far as the grid's accuracy
            estimate goes. It costs nothing more, where the accountant's own
            grid takes seconds to minutes at small multipliers.
        accountant: str. "pld" or "rdp": the accountant searched.

    Example:

    >>> Calibration(1.1, 2.0, "pld").epsilon
    2.0
    """

    noise_multiplier: float
    epsilon: float
    accountant: str


def calibrate(
    mechanism,
    steps,
    delta,
    *,
    target_epsilon,
    accountant=None,
    max_noise_multiplier=1000.0,
    min_noise_multiplier=0.01,
    rtol=0.005,
):
    """`calibrate_noise_multiplier`, with the ε bound the multiplier meets.

    Takes the same arguments; returns a `Calibration`. The command line's
    `kdpemb privacy calibrate` states this ε.

    Example:

    >>> from kdpemb import privacy
    >>> m = privacy.dp_sgd(1.0, batch_size=256, num_examples=60_000)
    >>> found = calibrate(m, 1_000, 1e-5, target_epsilon=1.0)
    >>> round(found.noise_multiplier, 2), found.epsilon <= 1.0, found.accountant
    (0.88, True, 'pld')
    """
    if not isinstance(mechanism, Mechanism):
        raise TypeError(
            "mechanism must be a kdpemb.privacy.Mechanism (see "
            f"kdpemb.privacy.dp_sgd and friends), got {type(mechanism).__name__}."
        )
    target = validation.check_target_epsilon(target_epsilon)
    delta = validation.check_delta(delta, mechanism.population, mechanism.unit)
    steps = validation.check_steps(steps)
    z_min = validation.check_positive(min_noise_multiplier, "min_noise_multiplier")
    z_max = validation.check_positive(max_noise_multiplier, "max_noise_multiplier")
    for value, name in (
        (z_min, "min_noise_multiplier"),
        (z_max, "max_noise_multiplier"),
    ):
        validation.check_noise_multiplier(value, name)
    if z_min >= z_max:
        raise ValueError(
            f"min_noise_multiplier ({z_min}) must be below max_noise_multiplier "
            f"({z_max})."
        )
    rtol = validation.check_finite_real(rtol, "rtol")
    if not 0 < rtol < 0.5:
        raise ValueError(f"rtol must be in (0, 0.5), got {rtol!r}.")
    accountant = resolve_accountant(mechanism, accountant)
    with quiet_dropped_rdp_orders():
        z, eps = _calibrate(
            mechanism, steps, delta, target, accountant, z_min, z_max, rtol
        )
    return Calibration(float(z), float(eps), accountant)


def _calibrate(mechanism, steps, delta, target, accountant, z_min, z_max, rtol):

    def accountant_at(z, interval=DEFAULT_INTERVAL):
        return Accountant(
            mechanism.with_noise_multiplier(z),
            accountant,
            value_discretization_interval=interval,
        )

    at_max = accountant_at(z_max)
    epsilon_at_max = at_max.epsilon(steps, delta)
    if epsilon_at_max > target:
        raise CalibrationError(
            f"target_epsilon={target:g} cannot be met for {steps} steps at "
            f"delta={delta:g}: even noise_multiplier={z_max:g} gives "
            f"ε={epsilon_at_max:.4g}. Train for fewer steps, sample less per "
            "step, allow a larger δ (still below 1/population), or raise "
            "max_noise_multiplier."
        )

    if accountant != "pld" or at_max.exact:

        def epsilon_at(z):
            if z == z_max:
                return epsilon_at_max
            return accountant_at(z).epsilon(steps, delta)

        # An exact ε costs microseconds: waste (almost) none of the target.
        window = min(rtol, EXACT_RTOL) if at_max.exact else rtol
        return _search(epsilon_at, target, window, z_min, z_max, 1.0)[:2]
    grids = _Grids(accountant_at, delta, steps, z_max, epsilon_at_max)
    return _search_grids(grids, mechanism, target, delta, steps, z_min, z_max, rtol)


class _Grids:
    """ε of one candidate on the grid 2^level · 1e-4, and the bound it gives.

    Keeps the last accountant, so that asking for another δ or the same
    candidate again composes nothing new.
    """

    def __init__(self, accountant_at, delta, steps, z_max, epsilon_at_max):
        self._accountant_at = accountant_at
        self._delta, self._steps = delta, steps
        self._z_max, self._epsilon_at_max = z_max, epsilon_at_max
        self._last = None  # (z, level, accountant)

    def epsilon(self, z, level, delta=None):
        delta = self._delta if delta is None else delta
        if z == self._z_max and level == 0 and delta == self._delta:
            return self._epsilon_at_max
        if self._last is None or self._last[:2] != (z, level):
            interval = DEFAULT_INTERVAL * 2**level
            self._last = (z, level, self._accountant_at(z, interval))
        return self._last[2].epsilon(self._steps, delta)

    def bound(self, z, level):
        """An upper bound on ε(z) on the default grid, from grid `level`."""
        if level == 0:
            return self.epsilon(z, 0)
        slack_delta = self._delta - max(DELTA_SLACK * self._delta, DELTA_FLOOR)
        return self.epsilon(z, level, slack_delta) + DEFAULT_INTERVAL * 2**level

    def excess(self, z, level):
        """How far bound(z, level) may lie above the default grid's ε(z).

        Returns:
            (margins, error): what `bound` adds to ε on this grid (the grid
            step and the δ slack), and the grid's discretisation error,
            estimated by the next coarser grid's excess over this one.
        """
        eps = self.epsilon(z, level)
        margins = self.bound(z, level) - eps
        return margins, max(self.epsilon(z, level + 1) - eps, 0.0)


def _search_grids(grids, mechanism, target, delta, steps, z_min, z_max, rtol):
    """The PLD search for sampled schedules, from coarse grids to fine ones:
    (z, the bound on its ε that the search met)."""
    z = _clt_guess(mechanism, target, delta, steps) or 1.0
    z = min(max(z, z_min), z_max)
    slope = None
    level = 0
    if delta >= MIN_COARSE_DELTA:
        level = _first_grid_level(target, rtol)
        scout = level + SCOUT_LEVELS
        try:
            z, _, slope = _search(
                lambda z: grids.bound(z, scout), target, 0.05, z_min, z_max, z
            )
        except _Unreachable:  # The coarse grid is too rough at the cap.
            z = z_max
    tolerance = rtol / 2 * target
    while True:
        try:
            z, eps, slope = _search(
                lambda z, level=level: grids.bound(z, level),
                target,
                rtol if level == 0 else rtol / 2,
                z_min,
                z_max,
                z,
                slope,
            )
        except _Unreachable:  # Only the default grid is sure to meet it at z_max.
            level, z = 0, z_max
            continue
        if level == 0 or z <= z_min:
            return z, eps
        margins, error = grids.excess(z, level)
        if margins + error <= tolerance:
            return z, eps
        level = _finer_level(level, margins, error, tolerance)


def _first_grid_level(target, rtol):
    """log2(grid / 1e-4) for a first grid whose error is about rtol/2 · target.

    From the MNIST DP-SGD schedule: a grid of about 5e-4 · ε^0.85 keeps
    the PLD's discretisation error below 0.25% of ε from ε = 0.1 to 1000;
    the error falls with the square of the grid, and the margin of one
    grid step must stay below rtol/6 of ε. Other schedules are corrected
    by the error check.
    """
    grid = 5e-4 * target**0.85 * math.sqrt(rtol / 0.005)
    grid = min(grid, rtol * target / 6)
    level = math.floor(math.log2(grid / DEFAULT_INTERVAL))
    return min(max(0, level), MAX_GRID_LEVEL)


def _finer_level(level, margins, error, tolerance):
    """The coarsest finer grid expected to keep the excess within tolerance.

    The grid step halves and the discretisation error falls about 4x per
    level; the δ slack does not shrink.
    """
    grid = DEFAULT_INTERVAL * 2**level
    slack = margins - grid
    for finer in range(level - 1, 0, -1):
        shrink = 2 ** (level - finer)
        if grid / shrink + slack + error / shrink**2 <= tolerance:
            return finer
    return 0


def _clt_guess(mechanism, target, delta, steps):
    """The multiplier the central limit theorem of sampled Gaussians predicts.

    T steps at sampling rate q and multiplier z are close to a Gaussian of
    μ = q √(T (exp(Δ²/z²) - 1)) (Dong, Roth and Su 2019, Theorem 6), with
    Δ = 1 under add/remove and 2 under replace-one; μ for the target is
    the inverse of the exact Gaussian multiplier. Only a starting point:
    None when the mechanism has no sampling rate.
    """
    q = getattr(mechanism, "sampling_probability", None)
    if not q or q >= 1:
        return None
    sensitivity = 2.0 if mechanism.neighboring_relation == Relation.REPLACE_ONE else 1
    mu = 1 / analytic_gaussian.noise_for_epsilon(target, delta)
    return sensitivity / math.sqrt(math.log1p(mu**2 / (q**2 * steps)))


def _log(eps):
    """log ε, with ε = 0 (an accountant's answer for very large noise) as -inf
    and a non-finite ε as +inf."""
    if not math.isfinite(eps):
        return math.inf
    return math.log(eps) if eps > 0 else -math.inf


def _search(epsilon_at, target, window, z_min, z_max, start, slope=None):
    """The smallest z (up to `window`) with epsilon_at(z) <= target.

    Walks from `start` by secant steps on (log z, log ε), aimed at the
    middle of [(1 - window) · target, target] and at most a factor of 2
    down (small multipliers are slow to account), until the target is
    bracketed; then Illinois regula falsi.

    Returns:
        (z, ε, slope): ε = epsilon_at(z) is in [(1 - window) · target,
        target], or z is `z_min` and ε <= target; slope is the last
        d log ε / d log z seen.

    Raises:
        _Unreachable: if epsilon_at(z_max) > target.
    """
    aim = math.log(target * (1 - window / 2))
    low = high = last = None  # (log z, log ε); low misses, high meets the target.
    met = None  # (z, ε) as evaluated at high: exp(log z) may round.
    f_low = f_high = None  # Illinois: the secant's values at low and high.
    side = 0
    z = start
    for _ in range(200):
        eps = epsilon_at(z)
        point = (math.log(z), _log(eps))
        if last is not None:
            rise, run = point[1] - last[1], point[0] - last[0]
            if run and math.isfinite(rise) and rise < 0:
                slope = rise / run
        last = point
        if eps <= target:
            if eps >= (1 - window) * target or z <= z_min:
                return z, eps, slope
            if high is None or point[0] < high[0]:
                high, f_high, met = point, point[1] - aim, (z, eps)
                if side == 1 and f_low is not None:
                    f_low /= 2
                side = 1
        else:
            if z >= z_max:
                raise _Unreachable(eps)
            if low is None or point[0] > low[0]:
                low, f_low = point, point[1] - aim
                if side == -1 and f_high is not None:
                    f_high /= 2
                side = -1
        if low is not None and high is not None:
            if high[0] - low[0] < 1e-9:
                return *met, slope
            x = (low[0] + high[0]) / 2
            if math.isfinite(f_low) and math.isfinite(f_high) and f_low != f_high:
                x = high[0] - f_high * (high[0] - low[0]) / (f_high - f_low)
                margin = 0.01 * (high[0] - low[0])
                x = min(max(x, low[0] + margin), high[0] - margin)
        else:
            step = math.log(2.0)
            if math.isfinite(point[1]):
                guess = -1.5 if slope is None else slope  # ε ∝ z^-1 to z^-2.
                step = min(max(abs((point[1] - aim) / guess), 0.002), step)
            x = point[0] + (step if eps > target else -step)
        z = min(max(math.exp(x), z_min), z_max)
    raise CalibrationError(f"The search for ε = {target:g} did not converge.")
