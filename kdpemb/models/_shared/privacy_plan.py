"""The privacy plan of a `target_epsilon`: steps planned, noise calibrated once.

A model built with `target_epsilon` (and δ) instead of a noise multiplier
fixes its plan at its first `fit`: the steps planned (the model's
`planned_steps`, or that fit's steps) and the noise multiplier that
spends exactly the target over them. Both are saved with the model. Every
`fit` (the first included) that could take the step count past the plan
is refused before any step, naming ε spent, the target and the steps
left: more steps at the calibrated noise would spend more than the target.
`PlanGuard` checks again once the fit's callbacks have begun (one may
restore a checkpoint), and the model's step itself releases nothing
computed from the data past the plan and counts no step (its update is
zero; an optimizer's momentum may still move the weights). A plan given to the constructor is checked against the target
(`check_plan`).

One flow for the three trainers: `refuse_unplanned_steps` (steps taken
but no plan held), `calibrate_first_plan` at the first fit (each trainer
gives its schedule's mechanism at noise multiplier 1), `check_later_fit`
(the plan checked once against its target, then the budget) and
`forget_plan` (a refused first fit keeps no plan); `PlanGuard` checks
again after the callbacks. `plan_steps` is the whole flow of a model whose
schedule comes from its first fit. A killed run resumes by running the
same script again: the first fit adopts the plan its
`kdpemb.callbacks.PrivacyLedger` keeps (`plan_resume`), and `PlanGuard`
stops the epoch Keras reruns at the plan's end.

Example:

>>> check_settings(None, 2.0, 1e-5, 100, None)
(None, 2.0, 100, None)
>>> check_settings(1.0, 2.0, 1e-5, None, None)
Traceback (most recent call last):
...
ValueError: Pass exactly one of noise_multiplier and target_epsilon (with delta); got noise_multiplier=1.0, target_epsilon=2.0.
"""  # noqa: E501

import functools
import inspect
import warnings

import keras

from kdpemb import _validation as validation
from kdpemb import privacy
from kdpemb.callbacks.count_progbar import with_count_progbar
from kdpemb.callbacks.privacy_ledger import executed_steps
from kdpemb.errors import PrivacyBudgetExhaustedError
from kdpemb.models._shared import frozen_settings, plan_resume
from kdpemb.privacy import protocol


def check_noise_or_target(noise_multiplier, target_epsilon, delta):
    """Exactly one of `noise_multiplier` and `target_epsilon`, and a target
    only with `delta`; returns the checked target (None without one)."""
    if (noise_multiplier is None) == (target_epsilon is None):
        raise ValueError(
            "Pass exactly one of noise_multiplier and target_epsilon (with "
            f"delta); got noise_multiplier={noise_multiplier!r}, "
            f"target_epsilon={target_epsilon!r}."
        )
    if target_epsilon is None:
        return None
    target_epsilon = validation.check_target_epsilon(target_epsilon)
    if delta is None:
        raise ValueError(
            f"target_epsilon={target_epsilon:g} needs delta: the noise is "
            "calibrated for (target_epsilon, delta)-DP. Pass delta=..., well "
            "below 1 / (number of users)."
        )
    return target_epsilon


def check_settings(noise_multiplier, target_epsilon, delta, planned, calibrated):
    """`(noise_multiplier, target_epsilon, planned_steps, calibrated)`, checked.

    `noise_multiplier` is the one given, or the calibrated one (None until
    the first fit) for a `target_epsilon`.
    """
    target_epsilon = check_noise_or_target(noise_multiplier, target_epsilon, delta)
    if noise_multiplier is not None:
        if planned is not None or calibrated is not None:
            raise ValueError(
                "planned_steps and calibrated_noise_multiplier belong to a "
                "target_epsilon; with a fixed noise_multiplier, stop training "
                "at a budget with kdpemb.callbacks.PrivacyBudget(target_epsilon=...)."
            )
        return validation.check_noise_multiplier(noise_multiplier), None, None, None
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


# `fit` arguments that would change an example's contribution or the
# sampling the accounting assumes.
SAMPLING_ARGUMENTS = (
    "sample_weight",
    "class_weight",
    "validation_split",
    "steps_per_epoch",
)


def refuse_fit_arguments(kwargs, names, owner):
    """Refuses any of `names` given (not None) among `fit`'s `kwargs`."""
    for name in names:
        if kwargs.get(name) is not None:
            raise ValueError(
                f"{owner}.fit does not take {name}: it would change each "
                "example's contribution or the sampling that the privacy "
                "accounting assumes."
            )


def example_batches(num_examples, batch_size):
    """`(batch_size, steps per epoch)` of a fit over `num_examples` with an
    expected batch of `batch_size` (None: every example at every step, one
    step an epoch); an epoch is round(N / B) steps.

    >>> example_batches(100, 30)
    (30, 3)
    """
    if batch_size is None:
        return None, 1
    batch_size = validation.check_positive_int(batch_size, "batch_size")
    if batch_size > num_examples:
        raise ValueError(
            f"batch_size={batch_size} exceeds the {num_examples} examples; "
            "use batch_size=None for full-batch steps."
        )
    return batch_size, max(1, round(num_examples / batch_size))


def fit_arguments(args, kwargs):
    """The arguments of a `keras.Model.fit(x, *args, **kwargs)` call, by name."""
    signature = inspect.signature(keras.Model.fit)
    bound = signature.bind(None, None, *args, **kwargs)
    return {
        name: value
        for name, value in bound.arguments.items()
        if name not in ("self", "x")
    }


def fit_steps(x, arguments, known_length, steps_per_execution=1, initial_epoch=None):
    """The most steps a fit of `x` with these arguments can take; None if
    unknown (an endless or unsized source without `steps_per_epoch`).

    Keras runs whole executions of `steps_per_execution` (k) steps while
    data remains, so an epoch of `steps_per_epoch` s takes up to
    ceil(s / k) · k steps, and never more than one pass over a source of
    known length n; without `steps_per_epoch` it takes n (the last
    execution is cut short). A nonzero `initial_epoch` overrides the
    argument, as Keras' `model._initial_epoch` (set by `BackupAndRestore`)
    does.

    >>> fit_steps(None, {"epochs": 1, "steps_per_epoch": 3}, lambda x: 10, 2)
    4
    >>> fit_steps(None, {"epochs": 2}, lambda x: 3, 2)
    6
    """
    epochs = arguments.get("epochs", 1)
    initial_epoch = initial_epoch or arguments.get("initial_epoch", 0)
    per_epoch = arguments.get("steps_per_epoch")
    length = known_length(x)
    if not per_epoch:  # None or 0: one pass over the source.
        per_epoch = length
    elif int(per_epoch) < 0:  # Keras then runs until the source ends.
        return None
    else:
        k = int(steps_per_execution)
        per_epoch = -(-int(per_epoch) // k) * k
        if length is not None:
            per_epoch = min(per_epoch, length)
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


def calibrate(
    mechanism, planned, target_epsilon, delta, verbose, owner, noun="rounds",
    shown=float,
):  # fmt: skip
    """The noise multiplier of `mechanism` that spends `target_epsilon` at
    `delta` over `planned` steps (`kdpemb.privacy.calibrate_noise_multiplier`);
    prints a line before and after when `verbose` (the multiplier as
    `shown(z)` makes it the model's)."""
    if verbose:
        print(
            f"{owner}: calibrating the noise for ε = {target_epsilon:g} at "
            f"δ = {delta:g} over {planned} {noun}…",
            flush=True,
        )
    z = privacy.calibrate_noise_multiplier(
        mechanism, planned, delta, target_epsilon=target_epsilon
    )
    if verbose:
        print(f"{owner}: noise multiplier {shown(z):.4g}.", flush=True)
    return float(z)


def check_budget(model, steps, noun="rounds", taken=None, remedy=None):
    """Refuses `steps` more steps if they would go past the planned ones.

    The noise was calibrated so that `model.planned_steps` steps meet
    `model.target_epsilon`: any step beyond them would spend more.
    `taken` defaults to the model's `private_steps`; `remedy` is what a new
    model would need (default: a larger target or planned steps).
    """
    if model.target_epsilon is None:
        return
    if taken is None:
        taken = protocol.read_private_steps(model)
    if taken + steps <= model.planned_steps:
        return
    mechanism = model.privacy_mechanism()
    spent = privacy.epsilon(mechanism, taken, model.delta) if taken else 0.0
    after = privacy.epsilon(mechanism, taken + steps, model.delta)
    left = max(0, model.planned_steps - taken)
    cls = type(model).__name__
    raise PrivacyBudgetExhaustedError(
        f"This {cls} has spent ε = {spent:.4g} of its "
        f"target_epsilon={model.target_epsilon} (δ = {model.delta}) in {taken} "
        f"of the {model.planned_steps} {noun} its noise was calibrated for; "
        f"this fit's {steps} {noun} would take ε to {after:.4g}. Fit at most "
        f"{left} more {noun}, or build a new {cls} with "
        f"{remedy or DEFAULT_REMEDY}."
    )


DEFAULT_REMEDY = (
    "a larger target_epsilon or planned_steps (or a fixed noise_multiplier)"
)


def refuse_unplanned_steps(model, noun="steps", remedy=""):
    """Refuses a model that has taken private steps but holds no plan or
    schedule for them (its weights loaded into a new model): a new plan
    would account those steps at another mechanism and misstate ε."""
    taken = protocol.read_private_steps(model)
    if taken:
        cls = type(model).__name__
        raise ValueError(
            f"This {cls} has taken {taken} private {noun} but holds no plan "
            "for them (weights loaded into a new model?): the schedule, "
            "planned steps or calibrated noise that their ε depends on are "
            "not restored by load_weights, and a new plan would misstate ε. "
            f"Load the whole model with keras.saving.load_model{remedy}."
        )


def calibrate_first_plan(
    model, unit_mechanism, steps, verbose, noun="steps", shown=float
):
    """The first fit's plan of a model with a `target_epsilon`:
    `(planned_steps, z)`, the steps planned (the model's `planned_steps`,
    or this fit's `steps`) and the noise multiplier of `unit_mechanism`
    (the schedule's mechanism at noise multiplier 1) that spends exactly
    the target over them. Refuses, before calibrating, a fit of more steps
    than planned. The caller adopts the plan once its fit is accepted.
    Where a ledger of the fit keeps a plan (`plan_resume.look_up`), z is
    that plan's and nothing is calibrated: the steps it counts used it.
    """
    cls = type(model).__name__
    planned = model.planned_steps or steps
    kept = plan_resume.kept_unit_noise(model, planned)
    if steps > planned:
        raise PrivacyBudgetExhaustedError(
            f"This fit's {steps} {noun} are more than the planned_steps="
            f"{planned} that target_epsilon={model.target_epsilon} (δ = "
            f"{model.delta}) is spent over. Fit at most {planned} more {noun}, "
            f"or build a new {cls} with a larger planned_steps."
        )
    if kept is None:
        z = calibrate(unit_mechanism, planned, model.target_epsilon, model.delta,
                      verbose, cls, noun, shown)  # fmt: skip
    else:
        z = kept
        if verbose:
            print(
                f"{cls}: resuming the plan that the privacy ledger keeps: noise "
                f"multiplier {shown(z):.4g} over {planned} {noun}.",
                flush=True,
            )
    model._plan_unit_noise = z  # Written with the plan (`plan_resume`).
    return planned, z


def adopt_first_plan(model, planned_steps, noise_multiplier, **settings):
    """Fixes the plan of an accepted first fit: `planned_steps`, the
    calibrated noise multiplier (also the model's `noise_multiplier`) and
    `settings` (e.g. the schedule); a calibrated plan meets its target. A
    plan adopted from a ledger must have its mechanism, and is checked
    against its target; if not, nothing is adopted."""
    model._given_planned_steps = model.planned_steps  # For `forget_plan`.
    frozen_settings.adopt_plan(
        model,
        planned_steps=planned_steps,
        calibrated_noise_multiplier=noise_multiplier,
        noise_multiplier=noise_multiplier,
        **settings,
    )
    model._plan_checked = True
    if plan_resume.from_ledger(model):
        try:
            plan_resume.check_adopted(model)
            check_plan(model)
        except Exception:
            forget_plan(model, **dict.fromkeys(settings))
            raise


def check_later_fit(model, steps, noun="steps", remedy=None):
    """A fit after the plan was fixed: the plan (checked against its target
    once per model, `check_plan`) must hold `steps` more steps."""
    if model.target_epsilon is None:
        return
    if not getattr(model, "_plan_checked", False):
        check_plan(model)
        model._plan_checked = True
    check_budget(model, steps, noun, remedy=remedy)


def plan_steps(model, schedule, steps, verbose, callbacks=None, split=None):
    """The target-ε flow of a model whose schedule comes from its first
    `fit` (`DPModel`): adopts `schedule`; with a `target_epsilon`,
    calibrates the noise once (`calibrate_first_plan`, on the schedule's
    mechanism at the model's `clip_norm`, or adopts the plan a
    `PrivacyLedger` among `callbacks` keeps) and refuses, before any step,
    a fit that would go past the plan. Returns whether this call
    calibrated.

    `split`: None, or a callable `(z, schedule) -> noise multiplier` for a
    step of several releases: z is calibrated (or kept) for the whole
    step, and `split` gives the model's own share of it, before the plan
    is adopted (a `ValueError` from it refuses the fit, nothing adopted).
    """
    if model.schedule is None:
        refuse_unplanned_steps(model)
    plan_resume.look_up(model, callbacks)
    adopted = model.schedule is None
    calibrated = False
    if model.target_epsilon is not None and model.calibrated_noise_multiplier is None:
        planned, z = calibrate_first_plan(
            model, schedule.privacy_mechanism(1.0, model.clip_norm), steps, verbose
        )
        if split is not None:
            try:
                z = split(z, schedule)
            except Exception:
                model._plan_unit_noise = None  # Nothing was adopted.
                model._plan_from_ledger = False
                raise
        adopt_first_plan(model, planned, z, schedule=schedule)
        calibrated = True
    elif adopted:
        frozen_settings.adopt_plan(model, schedule=schedule)
    try:
        check_later_fit(model, steps)
    except Exception:
        if adopted:  # A refused first fit keeps no schedule.
            frozen_settings.adopt_plan(model, schedule=None)
        raise
    return calibrated


def forget_plan(model, **settings):
    """Undoes what `adopt_first_plan` fixed when the fit is then refused (a
    callback restored steps taken at an unknown noise): `planned_steps`
    back to the one given to the constructor, no calibrated noise, and
    `settings` (e.g. `schedule=None`)."""
    frozen_settings.adopt_plan(
        model,
        planned_steps=getattr(model, "_given_planned_steps", None),
        calibrated_noise_multiplier=None,
        noise_multiplier=None,
        **settings,
    )
    model._plan_checked = False
    model._plan_unit_noise = None


# Float round-off between a calibrated multiplier and the one a model
# rebuilds from it (e.g. adaptive clipping's z_eff); calibration itself
# meets the target exactly on the same accountant.
PLAN_RTOL = 1e-6


def check_plan(model):
    """Refuses a plan whose noise does not meet its target: ε of the
    model's mechanism over `planned_steps` must be at most `target_epsilon`
    (up to `PLAN_RTOL` of it). A plan calibrated by a fit meets it; this
    checks one given to the constructor (a loaded model's, or a wrong one).
    """
    cls = type(model).__name__
    epsilon = privacy.epsilon(
        model.privacy_mechanism(), model.planned_steps, model.delta
    )
    if epsilon > model.target_epsilon * (1 + PLAN_RTOL):
        raise ValueError(
            f"This {cls}'s calibrated_noise_multiplier="
            f"{model.calibrated_noise_multiplier:g} spends ε = {epsilon:.4g} "
            f"over its planned_steps={model.planned_steps} at δ = "
            f"{model.delta}, more than its target_epsilon="
            f"{model.target_epsilon}. calibrated_noise_multiplier is set by "
            "the first fit (and kept by keras.saving.load_model): build the "
            f"{cls} without it, or pass the one a fit calibrated for this "
            "target, δ, schedule and planned_steps."
        )


class PlanGuard(keras.callbacks.Callback):
    """Checks the plan again when training begins, after every other
    callback: one of them may have restored another `private_steps` or
    start epoch (`keras.callbacks.BackupAndRestore`). Refuses the fit,
    before any round, if its remaining rounds would go past the plan.

    A fit into which a callback restored steps (a killed run resumed: the
    backup's, raised to the ledger's count by
    `kdpemb.callbacks.PrivacyLedger`) resumes that run: it counts what
    ran, not what Keras replays (Keras reruns the killed epoch from its
    start), so it trains until the plan's steps are taken and stops there,
    and is refused only when none is left. With `steps_per_execution` = k
    it stops after the execution that reaches the plan's end: the model's
    step counts no step and releases nothing past its plan (as the first
    execution of a resumed fit, run whole, may reach). A resumed fit that
    ends before the plan's end (its data or epochs ran out) says so in a
    `UserWarning`.

    Args:
        steps_of: callable `initial_epoch -> most rounds of the fit`.
        noun: str. What a step is called in the message.
        on_restored_steps: callable or None. Given when this fit has just
            calibrated the noise (with no steps taken): steps found at
            train begin were then restored by a callback from rounds taken
            at a noise the plan does not know, so the fit is refused after
            calling it (to undo the calibration). A plan adopted from a
            ledger knows their noise.

    Attributes:
        stop_at: int or None. The step count at which this fit stops (the
            plan's end), when it resumes a killed run.
    """

    def __init__(self, steps_of, noun="rounds", on_restored_steps=None):
        super().__init__()
        self.steps_of, self.noun = steps_of, noun
        self.on_restored_steps = on_restored_steps
        self.stop_at = None
        self._fit_start = None
        self._steps = self._batch_begin = 0

    def set_model(self, model):
        super().set_model(model)
        if self._fit_start is None:  # Before any callback has begun.
            self._fit_start = protocol.read_private_steps(model)

    def on_train_begin(self, logs=None):
        model = self.model
        taken = protocol.read_private_steps(model)
        self.stop_at = None
        if (
            self.on_restored_steps is not None
            and taken
            and not plan_resume.from_ledger(model)
        ):
            self.on_restored_steps()
            raise ValueError(
                f"A callback restored {taken} private {self.noun} taken before "
                "(keras.callbacks.BackupAndRestore?) into a model that has just "
                "calibrated its noise: those rounds used a noise this model "
                "does not know, so ε would be misstated. Resume with the plan "
                "of the model that took them: keep a "
                "kdpemb.callbacks.PrivacyLedger in the fit's callbacks (it "
                "keeps the plan, and running the same script again adopts "
                "it); or build the model with planned_steps=... and "
                "calibrated_noise_multiplier=... (its model.planned_steps and "
                "model.calibrated_noise_multiplier), or load it with "
                "keras.saving.load_model."
            )
        restored = taken > (self._fit_start or 0)
        if model.target_epsilon is None or not restored:
            check_budget(model, self.steps_of(model._initial_epoch), self.noun)
            return
        check_budget(model, 1, self.noun)  # Refused if the plan is spent.
        self.stop_at, self._steps = model.planned_steps, taken
        if (self.params or {}).get("verbose"):
            print(
                f"{type(model).__name__}: resuming a run with {taken} of its "
                f"{self.stop_at} planned private {self.noun} taken; this fit "
                f"stops after the {self.stop_at - taken} left.",
                flush=True,
            )

    def on_epoch_begin(self, epoch, logs=None):
        if self.stop_at is not None:  # Synced here on every backend.
            self._steps = protocol.read_private_steps(self.model)

    def on_train_batch_begin(self, batch, logs=None):
        self._batch_begin = batch

    def on_train_batch_end(self, batch, logs=None):
        if self.stop_at is None:
            return
        self._steps += executed_steps(self.params, self._batch_begin, batch)
        if self._steps >= self.stop_at:
            self.model.stop_training = True

    def on_train_end(self, logs=None):
        if self.stop_at is None:
            return
        taken = protocol.read_private_steps(self.model)  # Synced at epoch end.
        if taken < self.stop_at:
            warnings.warn(
                f"{type(self.model).__name__}: this fit resumed a run and ended "
                f"with {taken} of its {self.stop_at} planned private "
                f"{self.noun} taken, {self.stop_at - taken} left (its data or "
                "epochs ran out first, or a callback stopped it). Run the same "
                "script again to take them: it resumes the plan.",
                UserWarning,
                stacklevel=2,
            )


def guard_epochs(model, callbacks, steps_per_epoch, epochs, initial_epoch, calibrated):
    """`callbacks` with a `PlanGuard` for a fit of `epochs` epochs of
    `steps_per_epoch` steps from `initial_epoch` (or the epoch a callback
    restores); `calibrated`: this fit fixed the plan, which the guard undoes
    (schedule included) if a callback restored steps taken before."""

    def steps_of(start_epoch):
        return steps_per_epoch * max(0, epochs - (start_epoch or initial_epoch))

    guard = PlanGuard(
        steps_of,
        "steps",
        on_restored_steps=(
            functools.partial(forget_plan, model, schedule=None) if calibrated else None
        ),
    )
    return with_count_progbar(with_guard(callbacks, guard, model))


def with_guard(callbacks, guard, model):
    """`callbacks` (a list, a `CallbackList` or None) with `guard` last
    (replacing a guard of the same type from an earlier fit in a
    `CallbackList`). A `PlanGuard`'s fit hands its plan to its ledgers."""
    guard.set_model(model)
    if isinstance(guard, PlanGuard):
        plan_resume.share_plan(model, callbacks)
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks.callbacks[:] = [
            c for c in callbacks.callbacks if not isinstance(c, type(guard))
        ] + [guard]
        return callbacks
    return [*(callbacks or ()), guard]
