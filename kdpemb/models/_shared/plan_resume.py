"""A killed target-ε run resumed by running the same script again.

A model with a `target_epsilon` fixes its plan at its first `fit`: the
steps planned and the noise multiplier calibrated over them. A
`kdpemb.callbacks.PrivacyLedger` in that fit writes the plan with its
count (`share_plan`), from the first step on. Rerun unchanged after a
kill, the new model's first `fit` finds the plan in its ledger
(`look_up`, before any callback runs) and adopts it instead of
calibrating (`kept_unit_noise`, `check_adopted`): the same noise, the
same planned steps, checked against the model's own arguments, so a
model built with other ones (another target, δ, data size, batch size,
number of epochs, or release beside the gradient: `noised_loss`,
`adaptive_clipping`) is refused before any step, naming the field. The
plan guard then counts the steps the killed run began and stops the
epoch Keras reruns at the plan's end (`privacy_plan.PlanGuard`).

Example:

>>> ledger_callbacks(None)
[]
"""

import dataclasses
import json

import keras

from kdpemb.callbacks.privacy_ledger import PrivacyLedger
from kdpemb.privacy import ledger

# The model's settings of the releases each step makes beside its noisy
# sum (the calibrated noise is split among them); kept with the plan.
RELEASE_SETTINGS = ("noised_loss", "adaptive_clipping")


@dataclasses.dataclass(frozen=True)
class KeptPlan:
    """The plan a ledger keeps (`ledger.plan_record`), where it was read,
    and the parameters of the mechanism its steps used."""

    path: str
    plan: dict
    mechanism: dict


def ledger_callbacks(callbacks):
    """The `PrivacyLedger`s among a fit's callbacks (a list, a
    `CallbackList` or None)."""
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    return [c for c in callbacks or () if isinstance(c, PrivacyLedger)]


def look_up(model, callbacks):
    """Reads the plan that the ledgers of this fit keep, before any
    callback runs; a plan the model already holds (given to its
    constructor, or fixed by an earlier fit) must be that plan. The first
    fit's calibration adopts it (`kept_unit_noise`)."""
    model._kept_plan = None
    model._plan_from_ledger = False
    if model.target_epsilon is None:
        return
    for callback in ledger_callbacks(callbacks):
        record = ledger.read_ledger(callback.path, model=type(model).__name__)
        if record is None or record.get("plan") is None:
            continue
        kept = KeptPlan(
            callback.path,
            ledger.check_plan_record(record["plan"], callback.path),
            record["mechanism"],
        )
        if model._kept_plan is not None and model._kept_plan.plan != kept.plan:
            raise ValueError(
                f"The privacy ledgers {model._kept_plan.path} and {kept.path} "
                "keep different plans; a fit resumes one run. Give it that "
                "run's ledger only."
            )
        model._kept_plan = kept
    if model._kept_plan is not None and model.calibrated_noise_multiplier is not None:
        check_fields(model, model.planned_steps, model.calibrated_noise_multiplier)


def kept_unit_noise(model, planned):
    """The noise multiplier that the kept plan's calibration found (for the
    schedule's mechanism at noise multiplier 1), or None where no ledger
    of this fit keeps a plan; refuses a model whose target, δ or
    `planned` steps differ from the plan's."""
    kept = getattr(model, "_kept_plan", None)
    if kept is None:
        return None
    check_fields(model, planned)
    unit = kept.plan["unit_noise_multiplier"]
    if unit is None:
        raise ValueError(
            f"The privacy ledger {kept.path} keeps the plan of a model built "
            "with it (planned_steps and calibrated_noise_multiplier given), "
            "not the calibration of its arguments. Build the model the same "
            f"way: {type(model).__name__}(..., "
            f"**kdpemb.privacy.ledger.plan_arguments({kept.path!r}))."
        )
    model._plan_from_ledger = True
    return unit


def from_ledger(model):
    """Whether this fit's plan was adopted from a ledger (not calibrated)."""
    return getattr(model, "_plan_from_ledger", False)


def check_fields(model, planned, calibrated=None):
    """Refuses a model whose plan differs from the kept one, naming the
    first field that differs and the fix."""
    kept = model._kept_plan
    fields = [
        ("target_epsilon", model.target_epsilon),
        ("delta", model.delta),
        ("planned_steps", planned),
    ]
    if calibrated is not None:
        fields.append(("calibrated_noise_multiplier", calibrated))
    for name, value in fields:
        if value != kept.plan[name]:
            refuse(model, name, kept.plan[name], value)
    releases = kept.plan.get("releases")
    if releases is None:  # Not recorded: the mechanism's check covers them.
        return
    now = release_settings(model)
    for name in sorted(set(now) | set(releases)):
        if now.get(name) != releases.get(name):
            refuse(model, name, releases.get(name), now.get(name))


def release_settings(model):
    """The model's `RELEASE_SETTINGS` it has, as configs (None: off), as
    they read back from JSON."""
    settings = {}
    for name in RELEASE_SETTINGS:
        if hasattr(model, name):
            value = getattr(model, name)
            settings[name] = None if value is None else value.get_config()
    return json.loads(json.dumps(settings))


def check_adopted(model):
    """Once the kept plan is adopted: its noise and mechanism are those of
    the steps the ledger counts."""
    kept = model._kept_plan
    check_fields(model, model.planned_steps, model.calibrated_noise_multiplier)
    now = ledger.mechanism_parameters(model.privacy_mechanism())
    for name in sorted(set(now) | set(kept.mechanism)):
        if now.get(name) != kept.mechanism.get(name):
            refuse(model, f"the mechanism's {name}", kept.mechanism.get(name),
                   now.get(name))  # fmt: skip


def refuse(model, name, kept, value):
    cls = type(model).__name__
    path = model._kept_plan.path
    raise ValueError(
        f"The privacy ledger {path} keeps the plan of the run whose steps it "
        f"counts, with {name}={kept!r}; this {cls} has {name}={value!r}. A "
        "killed run resumes with its own plan: run the same script again "
        "with the same arguments (target_epsilon, delta, the data, "
        "batch_size, epochs and the model's other settings), or build the "
        f"model from the ledger, {cls}(..., "
        f"**kdpemb.privacy.ledger.plan_arguments({path!r})). A new run "
        "needs a new ledger path (and a new backup directory)."
    )


def share_plan(model, callbacks):
    """Hands the model's plan (None without a target) to this fit's
    ledgers, which write it with their count from the first step on."""
    ledgers = ledger_callbacks(callbacks)
    if not ledgers:
        return
    plan = model_plan(model)
    for callback in ledgers:
        callback.plan = plan


def model_plan(model):
    """The `ledger.plan_record` of the plan the model holds, or None."""
    if getattr(model, "target_epsilon", None) is None:
        return None
    if model.calibrated_noise_multiplier is None:
        return None
    unit = getattr(model, "_plan_unit_noise", None)
    kept = getattr(model, "_kept_plan", None)
    if unit is None and kept is not None:  # The same plan (`look_up`).
        unit = kept.plan["unit_noise_multiplier"]
    schedule = model.schedule
    return ledger.plan_record(
        model.target_epsilon, model.delta, model.planned_steps,
        model.calibrated_noise_multiplier,
        None if schedule is None else schedule.get_config(), unit,
        release_settings(model),
    )  # fmt: skip
