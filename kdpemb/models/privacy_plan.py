"""The privacy plan of a `target_epsilon`: steps planned, noise calibrated once.

A model built with `target_epsilon` (and δ) instead of a noise multiplier
fixes its plan at its first `fit`: the steps planned (the model's
`planned_steps`, or that fit's steps) and the noise multiplier that
spends exactly the target over them. Both are saved with the model. Every
`fit` (the first included) that could take the step count past the plan
is refused before any step, naming ε spent, the target and the steps
left: more steps at the calibrated noise would spend more than the target.

Used by `FedEmbModel`; `LastLayerDPClassifier` keeps its own plan (its
steps per epoch come from its batch size, not from a round source).

Example:

>>> check_settings(None, 2.0, 1e-5, 100, None)
(None, 2.0, 100, None)
>>> check_settings(1.0, 2.0, 1e-5, None, None)
Traceback (most recent call last):
...
ValueError: Pass exactly one of noise_multiplier and target_epsilon (with delta); got noise_multiplier=1.0, target_epsilon=2.0.
"""  # noqa: E501

import inspect

import keras

from kdpemb import _validation as validation
from kdpemb import privacy
from kdpemb.errors import PrivacyBudgetExhaustedError
from kdpemb.privacy import protocol


def check_settings(noise_multiplier, target_epsilon, delta, planned, calibrated):
    """`(noise_multiplier, target_epsilon, planned_steps, calibrated)`, checked.

    `noise_multiplier` is the one given, or the calibrated one (None until
    the first fit) for a `target_epsilon`.
    """
    if (noise_multiplier is None) == (target_epsilon is None):
        raise ValueError(
            "Pass exactly one of noise_multiplier and target_epsilon (with "
            f"delta); got noise_multiplier={noise_multiplier!r}, "
            f"target_epsilon={target_epsilon!r}."
        )
    if noise_multiplier is not None:
        if planned is not None or calibrated is not None:
            raise ValueError(
                "planned_steps and calibrated_noise_multiplier belong to a "
                "target_epsilon; with a fixed noise_multiplier, stop training "
                "at a budget with kdpemb.callbacks.PrivacyBudget(target_epsilon=...)."
            )
        return validation.check_noise_multiplier(noise_multiplier), None, None, None
    target_epsilon = validation.check_target_epsilon(target_epsilon)
    if delta is None:
        raise ValueError(
            f"target_epsilon={target_epsilon:g} needs delta: the noise is "
            "calibrated for (target_epsilon, delta)-DP. Pass delta=..., well "
            "below 1 / (number of users)."
        )
    if planned is not None:
        planned = validation.check_positive_int(planned, "planned_steps")
    if calibrated is not None:
        if planned is None:
            raise ValueError(
                "calibrated_noise_multiplier is set by the first fit, with "
                "planned_steps; build the model without it."
            )
        calibrated = validation.check_noise_multiplier(
            calibrated, "calibrated_noise_multiplier"
        )
    return calibrated, target_epsilon, planned, calibrated


def fit_arguments(args, kwargs):
    """The arguments of a `keras.Model.fit(x, *args, **kwargs)` call, by name."""
    signature = inspect.signature(keras.Model.fit)
    bound = signature.bind(None, None, *args, **kwargs)
    return {
        name: value
        for name, value in bound.arguments.items()
        if name not in ("self", "x")
    }


def fit_steps(x, arguments, known_length):
    """The most steps a fit of `x` with these arguments can take; None if
    unknown (an endless or unsized source without `steps_per_epoch`)."""
    epochs = arguments.get("epochs", 1)
    initial_epoch = arguments.get("initial_epoch", 0)
    per_epoch = arguments.get("steps_per_epoch")
    if per_epoch is None:
        per_epoch = known_length(x)
    if per_epoch is None:
        return None
    return max(0, int(epochs) - int(initial_epoch)) * int(per_epoch)


def is_verbose(arguments):
    """Whether `fit(verbose=...)` asks for output ("auto" does), or one of
    its callbacks shows progress itself (`shows_progress`, as
    `kdpemb.callbacks.RichProgress`, which wants `verbose=0`)."""
    if arguments.get("verbose", "auto") not in (0, False):
        return True
    callbacks = arguments.get("callbacks") or ()
    return any(getattr(callback, "shows_progress", False) for callback in callbacks)


def calibrate(mechanism, planned, target_epsilon, delta, verbose, owner):
    """The noise multiplier of `mechanism` that spends `target_epsilon` at
    `delta` over `planned` steps (`kdpemb.privacy.calibrate_noise_multiplier`);
    prints a line before and after when `verbose`."""
    if verbose:
        print(
            f"{owner}: calibrating the noise for ε = {target_epsilon:g} at "
            f"δ = {delta:g} over {planned} rounds…",
            flush=True,
        )
    z = privacy.calibrate_noise_multiplier(
        mechanism, planned, delta, target_epsilon=target_epsilon
    )
    if verbose:
        print(f"{owner}: noise multiplier {z:.4g}.", flush=True)
    return float(z)


def check_budget(model, steps, noun="rounds"):
    """Refuses `steps` more steps if they would go past the planned ones.

    The noise was calibrated so that `model.planned_steps` steps meet
    `model.target_epsilon`: any step beyond them would spend more.
    """
    if model.target_epsilon is None:
        return
    taken = protocol.read_private_steps(model)
    if taken + steps <= model.planned_steps:
        return
    mechanism = model.privacy_mechanism()
    spent = privacy.epsilon(mechanism, taken, model.delta) if taken else 0.0
    after = privacy.epsilon(mechanism, taken + steps, model.delta)
    left = model.planned_steps - taken
    cls = type(model).__name__
    raise PrivacyBudgetExhaustedError(
        f"This {cls} has spent ε = {spent:.4g} of its "
        f"target_epsilon={model.target_epsilon} (δ = {model.delta}) in {taken} "
        f"of the {model.planned_steps} {noun} its noise was calibrated for; "
        f"this fit's {steps} {noun} would take ε to {after:.4g}. Fit at most "
        f"{left} more {noun}, or build a new {cls} with a larger "
        "target_epsilon or planned_steps (or a fixed noise_multiplier)."
    )
