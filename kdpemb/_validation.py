"""Argument checks shared by every kdpemb module (the bottom floor).

Each check raises `ValueError` naming the offending value and what to do,
so a wrong schedule fails before any accounting or training happens.
Imports nothing from kdpemb.
"""

import math
import numbers

import numpy as np


def is_real(value):
    """Whether `value` is a real number (not a bool)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_finite_real(value, name):
    if not is_real(value) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite real number, got {value!r}.")
    return float(value)


def check_choice(value, choices, name):
    """Checks that `value` is one of the strings `choices`.

    >>> check_choice("pld", ("pld", "rdp"), "accountant")
    'pld'
    """
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}.")
    return value


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


# Multipliers the accountants can evaluate: below 1e-6 (other than 0) ε is
# above 1e12 and their arithmetic underflows; above 1e12 it overflows.
MIN_NOISE_MULTIPLIER, MAX_NOISE_MULTIPLIER = 1e-6, 1e12


def check_noise_multiplier(value, name="noise_multiplier"):
    """Checks `value` = 0 (no noise and no privacy: ε = inf) or in [1e-6, 1e12]."""
    value = check_finite_real(value, name)
    if value < 0:
        raise ValueError(
            f"{name} must be >= 0, got {value!r}. It is the noise standard "
            "deviation divided by the clip norm (sensitivity)."
        )
    if value and not MIN_NOISE_MULTIPLIER <= value <= MAX_NOISE_MULTIPLIER:
        raise ValueError(
            f"{name}={value!r} is outside [{MIN_NOISE_MULTIPLIER:g}, "
            f"{MAX_NOISE_MULTIPLIER:g}], where ε can be computed (below it ε "
            "is above 1e12: pass 0 for no noise)."
        )
    return value


def check_positive(value, name):
    value = check_finite_real(value, name)
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}.")
    return value


def check_sample_size(value, pool, name="batch_size", sampling="poisson"):
    """Checks an expected sample per step in (0, pool], whole when "fixed".

    >>> check_sample_size(256, 60_000)
    256.0
    """
    value = check_positive(value, name)
    if value > pool:
        raise ValueError(
            f"{name}={value:g} is more than the {pool} units it is drawn from; "
            f"use at most {pool} per step."
        )
    if isinstance(sampling, str) and sampling == "fixed" and value != int(value):
        raise ValueError(
            f"{name} must be a whole number with sampling='fixed' (a fixed-size "
            f"batch), got {value:g}."
        )
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


def check_bool(value, name):
    """Checks True or False (a NumPy bool too), not a truthy stand-in.

    >>> check_bool(True, "log_local_loss")
    True
    """
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {value!r}.")
    return bool(value)


# Seeds of the models' noise generators: a Keras SeedGenerator on JAX holds
# uint32 values, and a model derives up to a few generators as seed + i.
MAX_SEED = 2**31


def check_seed(value, name="seed", maximum=MAX_SEED):
    """Checks `None` (OS entropy) or an int in [0, maximum).

    >>> check_seed(0), check_seed(None)
    (0, None)
    """
    if value is None:
        return None
    if (
        not isinstance(value, numbers.Integral)
        or isinstance(value, bool)
        or not 0 <= value < maximum
    ):
        raise ValueError(
            f"{name} must be None or an int in [0, {maximum}), got {value!r}. "
            "Leave it None (OS entropy) for a model or sampling you release."
        )
    return int(value)


# The PLD accountant's grid step h: ε is rounded up to a multiple of h (and
# composition adds up to about h per step of error), so h above 1 makes ε a
# meaningless bound (e.g. 599 for a true ε of 0.7 at h = 100).
MAX_VALUE_DISCRETIZATION_INTERVAL = 1.0


def check_value_discretization_interval(value):
    """Checks the PLD grid step h in (0, 1].

    >>> check_value_discretization_interval(1e-4)
    0.0001
    """
    value = check_positive(value, "value_discretization_interval")
    if value > MAX_VALUE_DISCRETIZATION_INTERVAL:
        raise ValueError(
            f"value_discretization_interval={value!r} is above "
            f"{MAX_VALUE_DISCRETIZATION_INTERVAL:g}: the PLD accountant rounds ε "
            "up to multiples of it, so ε would be a uselessly loose bound. Use "
            "the default 1e-4 (or up to 1e-2 for a quick estimate)."
        )
    return value


def check_deployment_scale(value):
    """Checks a deployment scale s >= 1 (s times the noise and the clients).

    >>> check_deployment_scale(64)
    64.0
    """
    value = check_finite_real(value, "scale")
    if value < 1:
        raise ValueError(
            f"scale must be >= 1, got {value!r}. A simulated deployment has s "
            "times the run's noise multiplier and clients per round (s >= 1); "
            "s = 1 is the run's own schedule. For the run itself, state its "
            "own PrivacyStatement."
        )
    return value


def check_deployment_clients(value, users, users_per_client):
    """Checks a deployment's virtual clients P' in [ceil(N'/k), N'].

    With k users per client the N' users make at least ceil(N'/k) clients
    and at most N' (one user each); with k = 1, exactly N'.

    >>> check_deployment_clients(300, users=1_000, users_per_client=4)
    300
    """
    value = check_positive_int(value, "deployment_clients")
    low = -(-users // users_per_client)
    if users_per_client == 1 and value != users:
        raise ValueError(
            f"deployment_clients={value} with one user per virtual client: the "
            f"deployment's {users} users make exactly {users} clients. Leave "
            "deployment_clients out (or use the run's users_per_client > 1)."
        )
    if not low <= value <= users:
        raise ValueError(
            f"deployment_clients={value} is outside [{low}, {users}]: "
            f"{users} deployment users in virtual clients of at most "
            f"{users_per_client} users make at least ceil({users}/"
            f"{users_per_client}) = {low} and at most {users} clients. Use a "
            "deployment_clients in that range, or change deployment_users."
        )
    return value


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
            f"e.g. {suggest_delta(population):.0e}."
        )
    return delta


def suggest_delta(population):
    """A power of ten at most 1/(10·population)."""
    return 10.0 ** math.floor(math.log10(1.0 / (10.0 * population)))


def check_target_epsilon(value, name="target_epsilon"):
    return check_positive(value, name)


def check_labels(labels, num_examples=None, num_classes=None):
    """Returns `labels` as a 1-D int64 array of non-negative class indices.

    Floats are accepted when they are whole numbers. Raises `ValueError`
    naming the first offending label and the fix.

    Args:
        labels: array-like `(N,)`.
        num_examples: int or None. The required length N, if known.
        num_classes: int or None. Labels must be below it, if given.

    Example:

    >>> check_labels([0, 2.0, 1]).tolist()
    [0, 2, 1]
    """

    try:
        array = np.asarray(labels)
    except Exception as error:
        raise ValueError(
            f"labels must be a 1-D array of non-negative integers ({error})."
        ) from error
    if num_examples is not None and array.shape != (num_examples,):
        raise ValueError(
            f"labels must have shape ({num_examples},), one per image, got "
            f"{array.shape}."
        )
    if array.ndim != 1:
        raise ValueError(
            f"labels must be 1-D, one class per example, got shape {array.shape}; "
            "flatten one-hot or (N, 1) labels first (e.g. labels.argmax(-1) or "
            "labels.reshape(-1))."
        )
    if array.size == 0:
        raise ValueError("labels is empty: there are no examples.")
    if array.dtype == bool or array.dtype.kind not in "iuf":
        raise ValueError(
            f"labels must be non-negative integers, got dtype {array.dtype}; map "
            "class names to integers first (e.g. np.unique(names, "
            "return_inverse=True)[1])."
        )
    if array.dtype.kind == "f":
        bad = ~np.isfinite(array) | (array != np.round(array))
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                "labels must be whole numbers (integer identity indices), but "
                f"labels[{i}] = {array[i].item()!r}; pass integer class labels, "
                "not scores or NaN."
            )
    if (array < 0).any():
        i = int(np.argmax(array < 0))
        raise ValueError(
            f"labels must be >= 0 (non-negative), but labels[{i}] = "
            f"{array[i].item()!r}. Map identities to 0..num_classes-1."
        )
    if num_classes is not None and (array >= num_classes).any():
        i = int(np.argmax(array >= num_classes))
        raise ValueError(
            f"labels must be < num_classes={num_classes}, got {array[i].item()!r} "
            f"at index {i}. Raise num_classes or re-index the labels."
        )
    return array.astype(np.int64)


def check_real_dtype(array, name, what="values"):
    """Checks that the rows of `array` hold real numbers (bool, int or float).

    Reads the dtype of the first row only (an array or a lazy array-like,
    e.g. a memory map). Raises `ValueError` naming the dtype and the fix.

    >>> check_real_dtype(np.zeros((3, 2)), "x")
    >>> try:
    ...     check_real_dtype(np.array(["a", "b"]), "y", "targets")
    ... except ValueError as error:
    ...     print(str(error)[:38])
    y must hold real numbers, got dtype <U
    """
    dtype = np.asarray(array[:1]).dtype
    if dtype.kind not in "biuf":
        raise ValueError(
            f"{name} must hold real numbers, got dtype {dtype}; convert the "
            f"{what} to numbers (e.g. {name}.astype('float32')) first."
        )


HEADS = ("softmax", "cosine")


def check_head(head, scale, margin):
    """`(head, scale, margin)` checked, or a ValueError naming the fix."""
    if not isinstance(head, str) or head not in HEADS:
        raise ValueError(
            f"head must be one of {HEADS}, got {head!r}; pass head='cosine' "
            "for a normalised softmax or head='softmax' for plain logits."
        )
    scale = check_positive(scale, "head_scale")
    margin = check_finite_real(margin, "head_margin")
    if not 0.0 <= margin < 1.0:
        raise ValueError(
            f"head_margin must be in [0, 1) (a cosine margin), got {margin!r}; "
            "pass e.g. head_margin=0.0 or 0.2."
        )
    if head == "softmax" and margin:
        raise ValueError(
            "head_margin applies to head='cosine' only; pass head_margin=0.0 "
            "with head='softmax'."
        )
    return head, float(scale), float(margin)
