"""The plan of a `LastLayerDPClassifier`: its schedule, fixed at the first fit.

The classifier plans at its first `fit` whatever its noise: the schedule
(N examples and batch B, or at user level U users and B_u users per step,
`Schedule.users`), the planned steps (that fit's) and, for a
`target_epsilon`, the noise calibrated over them. Later fits must keep N
(U) and B; `privacy_plan.check_later_fit` refuses steps past a target's plan. A
saved classifier restores its plan from its config (`restored_plan`),
configs saved before the `Schedule` included.

Example:

>>> restored_plan(None, None, None, 1.0)
(None, None, None)
"""

from kdpemb import _validation as validation
from kdpemb import privacy
from kdpemb.models._shared import privacy_plan


def first_fit_plan(
    model, method, num_examples, batch_size, epochs, verbose=False, num_users=None
):
    """Plans the schedule at the first fit of `model` (a
    `LastLayerDPClassifier` of `method`); checks later fits against it.
    `num_users` (U) is the population at user level.

    Returns the steps per epoch and, at the first fit, the plan
    `(schedule, planned_steps, calibrated_noise_multiplier)` that
    the classifier adopts once the fit is accepted (None later).
    """
    if not method.sampled and batch_size is not None:
        raise ValueError(
            f"{model.method} uses all the data at every step: fit it with "
            "batch_size=None."
        )
    users = num_users is not None
    population = num_users if users else num_examples
    try:
        batch_size, steps_per_epoch = privacy_plan.example_batches(
            population, batch_size
        )
    except ValueError as error:
        if not users:
            raise
        raise ValueError(
            f"{error} (with unit='user', batch_size is the expected number of "
            f"users per step, out of the {population} users in the data)"
        ) from None
    if model.schedule is not None:
        trained_batch = (
            None
            if model.schedule.sampling == "full_batch"
            else model.schedule.sample_size
        )
        for name, trained, value in (
            (
                "num_users" if users else "num_examples",
                model.schedule.population,
                population,
            ),
            ("batch_size", trained_batch, batch_size),
        ):
            if trained != value:
                raise ValueError(
                    f"This classifier was trained with {name}={trained}; "
                    f"fitting with {value} would change the mechanism of the "
                    "steps already counted. Keep the data and batch size, or "
                    "start a new classifier."
                )
        return steps_per_epoch, None
    privacy_plan.refuse_unplanned_steps(model)
    if model.delta is not None:
        validation.check_delta(model.delta, population, model.unit)
    if users:
        schedule = privacy.Schedule.users(
            num_users, batch_size, examples_per_user=model.examples_per_user
        )
    else:
        schedule = privacy.Schedule.examples(num_examples, batch_size)
    planned = epochs * steps_per_epoch
    calibrated = None
    if model.target_epsilon is not None:
        _, z = privacy_plan.calibrate_first_plan(
            model, method.mechanism(1.0, schedule, planned), planned, verbose,
            shown=method.noise_multiplier_of,
        )  # fmt: skip
        calibrated = method.noise_multiplier_of(z)
    plan = (schedule, planned, None if calibrated is None else float(calibrated))
    return steps_per_epoch, plan


def restored_plan(
    schedule, planned_steps, calibrated, noise_multiplier, examples_per_user=None
):
    """`(Schedule, planned_steps, calibrated z)` from a saved config, for a
    classifier of examples, or of users with cap `examples_per_user`.

    Reads configs saved before the `Schedule` too (a dict with
    `num_examples`, `batch_size`, `planned_steps` and `noise_multiplier`).
    """
    if schedule is None:
        if planned_steps is not None or calibrated is not None:
            raise ValueError(
                "planned_steps and calibrated_noise_multiplier are set by the "
                "first fit, with the schedule; build the classifier without them."
            )
        return None, None, None
    if isinstance(schedule, dict) and "num_examples" in schedule:  # Old format.
        if planned_steps is not None or calibrated is not None:
            raise ValueError(f"Unreadable saved schedule {schedule!r}.")
        z = schedule["noise_multiplier"]
        planned_steps = schedule["planned_steps"]
        calibrated = None if noise_multiplier is not None else z
        schedule = privacy.Schedule.examples(
            schedule["num_examples"], schedule["batch_size"]
        )
    schedule = privacy.Schedule.from_config(schedule)
    unit = "example" if examples_per_user is None else "user"
    if (
        schedule.unit != unit
        or schedule.users_per_client != 1
        or schedule.examples_per_user != examples_per_user
    ):
        cap = "" if examples_per_user is None else f", k={examples_per_user}"
        raise ValueError(
            f"This LastLayerDPClassifier protects each {unit}{cap}; got the "
            f"schedule {schedule}. Build it with the unit and examples_per_user "
            "it was trained with."
        )
    planned_steps = validation.check_positive_int(planned_steps, "planned_steps")
    if (calibrated is None) == (noise_multiplier is None):
        raise ValueError(
            "A saved classifier has either a noise_multiplier or a "
            f"calibrated_noise_multiplier; got noise_multiplier={noise_multiplier!r}, "
            f"calibrated_noise_multiplier={calibrated!r}."
        )
    if calibrated is not None:
        calibrated = validation.check_noise_multiplier(
            calibrated, "calibrated_noise_multiplier"
        )
    return schedule, planned_steps, calibrated
