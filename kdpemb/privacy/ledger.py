"""The privacy ledger: a write-ahead count of the private steps a run began.

A checkpoint taken every k steps leaves out the steps that ran after it
when the process is killed; what those steps released may already have
been seen (logs, other checkpoints). The ledger is a small JSON file that
is rewritten atomically (`kdpemb._atomic`) before each private step with
the number of steps that will then have begun, so it never holds fewer
than the steps that ran. `kdpemb.callbacks.PrivacyLedger` keeps it during
`fit` and raises a restored model's `private_steps` to it; this module
reads and writes the file and states the ε of its count.

The file records the model's class and the mechanism's parameters
(`Mechanism.parameters()`): the count composes only steps of that
mechanism, and a ledger is refused for any other. A model with a
`target_epsilon` also records its plan (`plan_record`): rerun unchanged,
the same script's model adopts it rather than calibrating again, and
`plan_arguments` rebuilds the model's constructor arguments from it.

Example:

>>> import os, tempfile
>>> from kdpemb import privacy
>>> mechanism = privacy.dp_sgd(1.1, batch_size=256, num_examples=60_000)
>>> path = os.path.join(tempfile.mkdtemp(), "ledger.json")
>>> write_ledger(path, mechanism, steps=14_063, model="MyDPModel")
>>> read_ledger(path, mechanism)["steps"]
14063
>>> round(ledger_statement(path, mechanism, delta=1e-5).epsilon, 2)
2.38
"""

import json
import os

from kdpemb import _atomic
from kdpemb import _validation as validation
from kdpemb.privacy.mechanisms import Mechanism
from kdpemb.privacy.statement import PrivacyStatement

FORMAT = "kdpemb.privacy_ledger"
VERSION = 1


def mechanism_parameters(mechanism):
    """The mechanism's parameters as they read back from JSON."""
    if not isinstance(mechanism, Mechanism):
        raise TypeError(
            f"mechanism must be a kdpemb.privacy.Mechanism, got "
            f"{type(mechanism).__name__}."
        )
    return json.loads(json.dumps(mechanism.parameters(), default=str))


def ledger_record(mechanism, steps, model=None, plan=None):
    """The ledger's content as a dict (see `write_ledger`)."""
    record = {
        "format": FORMAT,
        "version": VERSION,
        "model": model,
        "mechanism": mechanism_parameters(mechanism),
        "steps": validation.check_steps(steps, minimum=0),
    }
    if plan is not None:
        record["plan"] = check_plan_record(plan)
    return record


def write_ledger(path, mechanism, steps, model=None, durable=True, plan=None):
    """Atomically replaces the ledger at `path` with `steps` of `mechanism`.

    Args:
        path: str or path. The ledger file (JSON).
        mechanism: `kdpemb.privacy.Mechanism`. The mechanism of every step.
        steps: int. Private steps begun so far.
        model: str or None. The model's class name, checked on resume.
        durable: bool. True (default) fsyncs, so the ledger survives a
            power loss; False survives a killed process only (faster).
        plan: dict or None. The target-ε plan of the steps (`plan_record`).
    """
    write_record(path, ledger_record(mechanism, steps, model, plan), durable)


# The constructor arguments of a target-ε plan, as kdpemb's models name them.
PLAN_ARGUMENTS = (
    "target_epsilon",
    "delta",
    "planned_steps",
    "calibrated_noise_multiplier",
    "schedule",
)


def plan_record(
    target_epsilon, delta, planned_steps, calibrated_noise_multiplier,
    schedule=None, unit_noise_multiplier=None, releases=None,
):  # fmt: skip
    """The target-ε plan that a ledger keeps with its count, as a dict.

    Args:
        target_epsilon, delta: floats. The (ε, δ) the noise was calibrated for.
        planned_steps: int. The steps the noise spends ε over.
        calibrated_noise_multiplier: float. The model's calibrated z.
        schedule: dict or None. The model's `Schedule.get_config()`.
        unit_noise_multiplier: float or None. What calibration found for the
            schedule's mechanism at noise multiplier 1 (the model derives
            `calibrated_noise_multiplier` from it); a model that adopts the
            plan instead of calibrating needs it.
        releases: dict or None. The settings of the releases each step
            makes beside the gradient, by argument name (e.g.
            `{"noised_loss": LossRelease(...).get_config()}`, None for one
            that is off); the calibration split the noise among them.

    >>> plan_record(1.0, 1e-5, 100, 1.25)["planned_steps"]
    100
    >>> plan_record(1.0, 1e-5, 100, 1.25, releases={"noised_loss": None})["releases"]
    {'noised_loss': None}
    """
    return check_plan_record(
        {
            "target_epsilon": target_epsilon,
            "delta": delta,
            "planned_steps": planned_steps,
            "calibrated_noise_multiplier": calibrated_noise_multiplier,
            "schedule": schedule,
            "unit_noise_multiplier": unit_noise_multiplier,
            "releases": releases,
        }
    )


def check_plan_record(plan, path=None):
    """A plan dict with every field checked (JSON-ready); `path` names
    the ledger it was read from in the error."""
    where = "A privacy ledger's plan" if path is None else f"The plan of {path}"
    try:
        if not isinstance(plan, dict):
            raise ValueError(f"it is a {type(plan).__name__}, not a dict")
        checked = {
            "target_epsilon": validation.check_target_epsilon(plan["target_epsilon"]),
            "delta": validation.check_delta(plan["delta"]),
            "planned_steps": validation.check_positive_int(
                plan["planned_steps"], "planned_steps"
            ),
            "calibrated_noise_multiplier": validation.check_noise_multiplier(
                plan["calibrated_noise_multiplier"], "calibrated_noise_multiplier"
            ),
            "schedule": plan.get("schedule"),
            "unit_noise_multiplier": plan.get("unit_noise_multiplier"),
            "releases": plan.get("releases"),
        }
        if checked["schedule"] is not None and not isinstance(
            checked["schedule"], dict
        ):
            raise ValueError("schedule is not a Schedule config (a dict)")
        if checked["releases"] is not None and not isinstance(
            checked["releases"], dict
        ):
            raise ValueError("releases is not a dict of release settings")
        if checked["unit_noise_multiplier"] is not None:
            checked["unit_noise_multiplier"] = validation.check_noise_multiplier(
                checked["unit_noise_multiplier"], "unit_noise_multiplier"
            )
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(
            f"{where} is unreadable ({error}). kdpemb writes the plan with "
            "the count; pass the ledger of the run itself."
        ) from None
    return json.loads(json.dumps(checked, sort_keys=True))


def read_plan(path, model=None):
    """The plan kept by the ledger at `path` (a `plan_record` dict), or
    None where there is no ledger or it keeps no plan (a fixed noise)."""
    record = read_ledger(path, model=model)
    if record is None or record.get("plan") is None:
        return None
    return check_plan_record(record["plan"], os.fspath(path))


def plan_arguments(path):
    """The constructor arguments of the target-ε model whose steps the
    ledger at `path` counts: `target_epsilon`, `delta`, `planned_steps`,
    `calibrated_noise_multiplier` and `schedule`.

    Give them to the model's class, with its other arguments as before
    (`DPModel(network, clip_norm=1.0, **plan_arguments(path))`): the
    model then holds the ledger's plan and calibrates nothing. (Running
    the same script again does as much by itself.)

    Example:

    >>> import os, tempfile
    >>> from kdpemb import privacy
    >>> schedule = privacy.Schedule.examples(80, 8)
    >>> mechanism = schedule.privacy_mechanism(1.6, clip_norm=1.0)
    >>> plan = plan_record(1.0, 1e-3, 40, 1.6, schedule.get_config(), 1.6)
    >>> path = os.path.join(tempfile.mkdtemp(), "ledger.json")
    >>> write_ledger(path, mechanism, steps=13, model="DPModel", plan=plan)
    >>> arguments = plan_arguments(path)
    >>> arguments["planned_steps"], arguments["calibrated_noise_multiplier"]
    (40, 1.6)
    >>> sorted(arguments)
    ['calibrated_noise_multiplier', 'delta', 'planned_steps', 'schedule', 'target_epsilon']
    """  # noqa: E501
    plan = read_plan(path)
    if plan is None:
        where = os.fspath(path)
        if read_ledger(path) is None:
            raise FileNotFoundError(f"No privacy ledger at {where!r}.")
        raise ValueError(
            f"The privacy ledger {where} keeps no target-ε plan: it counts the "
            "steps of a model with a fixed noise_multiplier (or was written "
            "before ledgers kept plans). Build the model as that run did."
        )
    return {name: plan[name] for name in PLAN_ARGUMENTS}


def write_record(path, record, durable=True):
    """Atomically writes a `ledger_record` dict (its steps may be updated)."""
    text = json.dumps(record, sort_keys=True)
    _atomic.write_text(path, text + "\n", durable)


def read_ledger(path, mechanism=None, model=None):
    """The ledger at `path` as a dict, or None where there is none yet.

    Args:
        path: str or path.
        mechanism: `Mechanism` or None. If given, the ledger must record
            this mechanism (else a `ValueError` names both).
        model: str or None. If given (and recorded), the ledger must
            record this model class.
    """
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except FileNotFoundError:
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as error:  # Not written by write_ledger.
        raise ValueError(
            f"{path} is not a privacy ledger ({error}); kdpemb writes ledgers "
            "atomically, so this file was written by something else. Pass "
            "another path."
        ) from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ValueError(f"{path} is not a kdpemb privacy ledger. Pass another path.")
    if record.get("version") != VERSION:
        raise ValueError(
            f"{path} is a privacy ledger of version {record.get('version')!r}; "
            f"this kdpemb reads version {VERSION}."
        )
    record["steps"] = validation.check_steps(record.get("steps"), minimum=0)
    if model is not None and record.get("model") not in (None, model):
        raise ValueError(
            f"The privacy ledger {path} counts the steps of a "
            f"{record['model']}, not of this {model}. Give each training run "
            "its own ledger path."
        )
    if mechanism is not None and record["mechanism"] != mechanism_parameters(mechanism):
        raise ValueError(
            f"The privacy ledger {path} counts {record['steps']} steps of the "
            f"mechanism {record['mechanism']}, not of this one "
            f"{mechanism_parameters(mechanism)}: its steps cannot be composed "
            "with this mechanism's. Resume the run that wrote it with the same "
            "settings, or give a new run its own ledger path."
        )
    return record


def ledger_statement(path, mechanism, delta, accountant=None):
    """The `PrivacyStatement` of the steps the ledger at `path` counts.

    This is what a run spent even if it was killed and never resumed: every
    step it began is counted. `mechanism` must be the one recorded.

    Example:

    >>> import os, tempfile
    >>> from kdpemb import privacy
    >>> from kdpemb.privacy.ledger import write_ledger
    >>> m = privacy.dp_sgd(noise_multiplier=1.1, batch_size=256, num_examples=60_000)
    >>> with tempfile.TemporaryDirectory() as directory:
    ...     path = os.path.join(directory, "ledger.json")
    ...     write_ledger(path, m, steps=2_000)  # what PrivacyLedger writes
    ...     statement = privacy.ledger_statement(path, m, delta=1e-5)
    >>> statement.steps, round(statement.epsilon, 2)
    (2000, 0.85)
    """
    record = read_ledger(path, mechanism)
    if record is None:
        raise FileNotFoundError(f"No privacy ledger at {os.fspath(path)!r}.")
    return PrivacyStatement.compute(mechanism, record["steps"], delta, accountant)
