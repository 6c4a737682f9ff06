"""Noise calibration: the smallest noise multiplier that meets a target ε."""

import math

from kdpemb.privacy import validation
from kdpemb.privacy.accountant import Accountant, UnsupportedMechanismError


class CalibrationError(ValueError):
    """No noise multiplier in the allowed range meets the target."""


def calibrate_noise_multiplier(
    mechanism,
    target_epsilon,
    delta,
    steps,
    *,
    accountant="pld",
    max_noise_multiplier=1000.0,
    min_noise_multiplier=0.01,
    rtol=0.005,
):
    """The smallest noise multiplier whose ε after `steps` is <= the target.

    The search keeps a bracket [z_low, z_high] with ε(z_low) > target >=
    ε(z_high) and narrows it by regula falsi on (log z, log ε), which is
    nearly linear. It returns z_high once ε(z_high) >= (1 - rtol) * target,
    so the returned multiplier always meets the target and wastes less
    than `rtol` of it.

    Args:
        mechanism: `kdpemb.privacy.Mechanism`. The schedule; its own noise
            multiplier is ignored (see `Mechanism.with_noise_multiplier`).
        target_epsilon: float. The ε to meet.
        delta: float. The δ, below 1/population.
        steps: int. Planned private steps.
        accountant: str. "pld" (default) or "rdp".
        max_noise_multiplier: float. Largest multiplier considered.
        min_noise_multiplier: float. Smallest multiplier considered; if it
            already meets the target it is returned.
        rtol: float. Relative slack allowed below the target.

    Returns:
        float: the noise multiplier.

    Raises:
        CalibrationError: if even `max_noise_multiplier` gives ε > target.

    Example:

    >>> from kdpemb import privacy
    >>> m = privacy.dp_sgd(1.0, batch_size=256, num_examples=60_000)
    >>> z = privacy.calibrate_noise_multiplier(
    ...     m, target_epsilon=3.0, delta=1e-5, steps=14_063)
    >>> round(z, 2)
    0.97
    """
    target = validation.check_target_epsilon(target_epsilon)
    delta = validation.check_delta(delta, mechanism.population, mechanism.unit)
    steps = validation.check_steps(steps)
    z_min = validation.check_positive(min_noise_multiplier, "min_noise_multiplier")
    z_max = validation.check_positive(max_noise_multiplier, "max_noise_multiplier")
    if z_min >= z_max:
        raise ValueError(
            f"min_noise_multiplier ({z_min}) must be below max_noise_multiplier "
            f"({z_max})."
        )
    if not 0 < rtol < 0.5:
        raise ValueError(f"rtol must be in (0, 0.5), got {rtol!r}.")

    def epsilon_at(z):
        return Accountant(mechanism.with_noise_multiplier(z), accountant).epsilon(
            delta, steps
        )

    epsilon_at_max = epsilon_at(z_max)
    if epsilon_at_max > target:
        raise CalibrationError(
            f"target_epsilon={target:g} cannot be met for {steps} steps at "
            f"delta={delta:g}: even noise_multiplier={z_max:g} gives "
            f"ε={epsilon_at_max:.4g}. Train for fewer steps, sample less per "
            "step, allow a larger δ (still below 1/population), or raise "
            "max_noise_multiplier."
        )
    start = _starting_guess(mechanism, target, delta, steps, accountant, z_min, z_max)
    low, high = _bracket(epsilon_at, target, start, z_min, z_max, epsilon_at_max)
    if low is None:
        return high[0]
    return _regula_falsi(epsilon_at, target, low, high, rtol)


def _starting_guess(mechanism, target, delta, steps, accountant, z_min, z_max):
    """Where to start: the (cheap) RDP calibration when PLD is asked for.

    Small noise multipliers make wide privacy loss distributions that are
    slow to compose, so the PLD search should start near its answer. RDP
    is a looser bound, so its multiplier is usually at or a little above
    PLD's; the bracketing below copes either way.
    """
    if accountant == "pld":
        try:
            return calibrate_noise_multiplier(
                mechanism,
                target,
                delta,
                steps,
                accountant="rdp",
                max_noise_multiplier=z_max,
                min_noise_multiplier=z_min,
                rtol=0.05,
            )
        except (UnsupportedMechanismError, CalibrationError):
            pass
    return min(max(1.0, z_min), z_max)


def _bracket(epsilon_at, target, start, z_min, z_max, epsilon_at_max):
    """Returns ((z, ε) with ε > target, or None; (z, ε) with ε <= target).

    Walks from `start` by secant steps on (log z, log ε), each at most a
    factor of 2 and overshooting by 5% so that it crosses the target:
    small multipliers are slow to account, so it avoids wide jumps down.
    """
    log_target = math.log(target)
    z = start
    eps = epsilon_at_max if z == z_max else epsilon_at(z)
    previous = None
    while True:
        up = eps > target  # ε too large: more noise.
        if previous is not None and (previous[1] > target) != up:
            pair = sorted([previous, (z, eps)])
            return pair[0], pair[1]
        if up and z >= z_max:  # Cannot happen: ε(z_max) <= target is checked.
            raise CalibrationError(f"ε({z_max:g}) = {eps:.4g} > {target:g}.")
        if not up and z <= z_min:
            return None, (z, eps)  # Even the smallest multiplier meets it.
        step = math.log(1.1)
        log_eps = _log_epsilon(eps)
        if (
            previous is not None
            and math.isfinite(log_eps)
            and math.isfinite(_log_epsilon(previous[1]))
            and eps != previous[1]
        ):
            slope = (log_eps - _log_epsilon(previous[1])) / (
                math.log(z) - math.log(previous[0])
            )
            if slope < 0:
                step = (
                    min(
                        max(abs((log_eps - log_target) / slope), 0.01),
                        math.log(2.0),
                    )
                    * 1.05
                )
        previous = (z, eps)
        z = min(z * math.exp(step), z_max) if up else max(z / math.exp(step), z_min)
        eps = epsilon_at_max if z == z_max else epsilon_at(z)


def _log_epsilon(eps):
    """log ε, with ε = 0 (an accountant's answer for very large noise) as -inf
    and a non-finite ε as +inf."""
    if not math.isfinite(eps):
        return math.inf
    return math.log(eps) if eps > 0 else -math.inf


def _regula_falsi(epsilon_at, target, low, high, rtol, max_iterations=100):
    """Illinois regula falsi on f(log z) = log ε - log target."""
    log_target = math.log(target)

    def f(eps):
        return _log_epsilon(eps) - log_target

    (z_low, eps_low), (z_high, eps_high) = low, high
    f_low, f_high = f(eps_low), f(eps_high)
    last_side = 0
    for _ in range(max_iterations):
        if eps_high >= (1 - rtol) * target or z_high / z_low - 1 < 1e-9:
            break
        x_low, x_high = math.log(z_low), math.log(z_high)
        if math.isfinite(f_low) and math.isfinite(f_high) and f_low != f_high:
            x = x_high - f_high * (x_high - x_low) / (f_high - f_low)
            margin = 0.01 * (x_high - x_low)
            x = min(max(x, x_low + margin), x_high - margin)
        else:
            x = (x_low + x_high) / 2
        z = math.exp(x)
        eps = epsilon_at(z)
        if eps > target:
            z_low, eps_low, f_low = z, eps, f(eps)
            if last_side == -1:
                f_high /= 2  # Illinois: avoid a stuck endpoint.
            last_side = -1
        else:
            z_high, eps_high, f_high = z, eps, f(eps)
            if last_side == 1:
                f_low /= 2
            last_side = 1
    return z_high
