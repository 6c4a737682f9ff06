"""Argument checks shared by every kdpemb module (the bottom floor).

Each check raises `ValueError` naming the offending value and what to do,
so a wrong schedule fails before any accounting or training happens.
Imports nothing from kdpemb.
"""

import math
import numbers


def _is_real(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_finite_real(value, name):
    if not _is_real(value) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite real number, got {value!r}.")
    return float(value)


def check_probability(value, name="sampling_probability"):
    """Checks `0 < value <= 1` (a sampling rate)."""
    value = check_finite_real(value, name)
    if not 0.0 < value <= 1.0:
        raise ValueError(
            f"{name} must be in (0, 1], got {value!r}. It is the chance that "
            "one unit (example or virtual client) takes part in a step: "
            "expected batch size / population."
        )
    return value


def check_noise_multiplier(value, name="noise_multiplier"):
    """Checks `value >= 0` (0 means no noise and no privacy: ε = inf)."""
    value = check_finite_real(value, name)
    if value < 0:
        raise ValueError(
            f"{name} must be >= 0, got {value!r}. It is the noise standard "
            "deviation divided by the clip norm (sensitivity)."
        )
    return value


def check_positive(value, name):
    value = check_finite_real(value, name)
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}.")
    return value


def check_clip_norm(value):
    """Checks an optional clip norm: `None` or a finite value > 0."""
    return None if value is None else check_positive(value, "clip_norm")


def check_positive_int(value, name, hint=""):
    """Checks an integer >= 1 (not a bool); `hint` is appended to the error.

    >>> check_positive_int(3, "local_steps")
    3
    """
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        hint = f" {hint}" if hint else ""
        raise ValueError(f"{name} must be a positive integer, got {value!r}.{hint}")
    return int(value)


def check_steps(value, name="steps", minimum=1):
    """Checks a step count: an integer >= `minimum` (1 for a schedule)."""
    is_integer = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if is_integer and value >= minimum:
        return int(value)
    hint = (
        " A schedule without a private step releases nothing; check the "
        "number of epochs, steps or the batch size."
        if minimum == 1
        else ""
    )
    raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.{hint}")


def check_delta(delta, population=None, unit="unit"):
    """Checks `0 < delta < 1`, and `delta < 1 / population` when it is known.

    kdpemb refuses δ ≥ 1/population: such a δ allows a mechanism that
    publishes one unit's data in the clear (each unit with probability δ)
    and still calls it private.
    """
    delta = check_finite_real(delta, "delta")
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}.")
    if population is not None and delta >= 1.0 / population:
        raise ValueError(
            f"delta={delta!r} is not below 1/population = 1/{population} = "
            f"{1.0 / population:.3g}. A δ that large allows publishing one "
            f"{unit}'s data outright. Choose delta well below 1/{population}, "
            f"e.g. {_suggest_delta(population):.0e}."
        )
    return delta


def _suggest_delta(population):
    """A power of ten at most 1/(10·population)."""
    return 10.0 ** math.floor(math.log10(1.0 / (10.0 * population)))


def check_target_epsilon(value, name="target_epsilon"):
    return check_positive(value, name)
