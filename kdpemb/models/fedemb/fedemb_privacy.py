"""`FedEmbModel`'s schedule and privacy: the schedule it adopts, the state
that schedule needs, its noise seeds, the mechanism and statements, and
(last) the `target_epsilon` plan of its rounds."""

import contextlib
import functools
import math

from keras import ops

from kdpemb import _validation as validation
from kdpemb import privacy
from kdpemb.models._shared import plan_resume, privacy_plan, private_state
from kdpemb.models.fedemb import fedemb_checks
from kdpemb.privacy import protocol, tree_noise


def reseed(model, hosts):
    """Draws the model's noise seeds afresh (see `private_state.reseed`)."""
    # With seed=None the noise comes from OS entropy, drawn afresh at
    # construction and at every fit, so no generator state anyone has
    # seen (a copied model, a checkpoint) predicts later noise. On
    # several hosts it is the chief's entropy, the same everywhere.
    generators = [model.noise_seed, model.head_seed]
    if model.adaptive_clipping is not None:
        generators.append(model.count_seed)
    private_state.reseed(generators, model.seed, randbits=hosts.shared_bits)


def adopt_schedule(model, schedule):
    """Sets the schedule (once), after the checks that need it."""
    steps_taken = (
        protocol.read_private_steps(model) if hasattr(model, "private_steps") else 0
    )
    if model.schedule is None and steps_taken:
        raise ValueError(
            f"This FedEmbModel has taken {steps_taken} "
            "private steps but has no schedule (weights loaded into a model "
            "built without one): the schedule of those steps cannot be "
            "guessed from the data. Build it with FedEmbModel(..., "
            "schedule=<the schedule of those steps>), or load the whole "
            "model with keras.saving.load_model."
        )
    if model.schedule is not None:
        if schedule != model.schedule:
            raise ValueError(
                "The rounds are sampled with another schedule than the "
                "model's, so its privacy accounting would be wrong "
                f"({fedemb_checks.schedule_differences(model.schedule, schedule)}). "
                f"Model: {model.schedule}. Rounds: {schedule}. Fit it on "
                "rounds of the model's schedule, or build a new "
                "FedEmbModel for these."
            )
        return
    if not model.reconstruction_steps < schedule.local_steps:
        raise ValueError(
            f"reconstruction_steps={model.reconstruction_steps} must be in "
            f"[0, local_steps={schedule.local_steps}) of the schedule: "
            "with every step frozen the backbone would never change."
        )
    if model.delta is not None:
        validation.check_delta(model.delta, schedule.population, schedule.unit)
    # Checks that noise and sampling go together.
    schedule.privacy_mechanism(0.0, noise=model.noise)
    model._schedule = schedule
    if hasattr(model, "private_steps"):  # Built: else __init__ builds it.
        # At a fit under a tf.distribute strategy: its variables, like
        # the model's, are created in its scope.
        strategy = getattr(model, "_distribute_strategy", None)
        with strategy.scope() if strategy else contextlib.nullcontext():
            build_tree_state(model)
            build_epoch_state(model)


def noised_variables(model):
    """The variables whose update is clipped, noised and applied."""
    variables = list(model.backbone.trainable_variables)
    if model.aggregation == "full":
        variables.append(model.head)
    return variables


def build_epoch_state(model):
    """Rounds without sampling: the layout id of the model's current
    epoch of rounds (-1: none yet), which of its rounds were taken, and
    a count of rounds refused because they did not belong to it (see
    `fedemb_step.aligned_epoch`)."""
    if model.schedule.sampling != "epochs" or hasattr(model, "data_epoch"):
        return
    model.data_epoch = private_state.add_state(
        model, "data_epoch", dtype="int32", initializer=-1
    )
    model.epoch_rounds_taken = private_state.add_state(
        model,
        "epoch_rounds_taken",
        shape=(model.schedule.steps_per_epoch,),
        dtype="int32",
    )
    model.misaligned_rounds = private_state.add_state(
        model, "misaligned_rounds", dtype="int32"
    )


def build_tree_state(model):
    """With `noise="tree"`: the open tree nodes' noise, one
    `[levels, *shape]` variable per noised variable (zeros: none open)."""
    if model.noise != "tree" or model.tree_open_noise is not None:
        return
    levels = tree_noise.tree_levels(model.schedule.steps_per_epoch)
    model.tree_open_noise = [
        private_state.add_state(
            model, f"tree_open_noise_{index}", shape=(levels, *variable.shape)
        )
        for index, variable in enumerate(noised_variables(model))
    ]


def known_schedule(model):
    """The model's schedule, or a clear error if it has none yet."""
    if model.schedule is None:
        raise ValueError(
            "The FedEmbModel does not know its schedule yet: fit it on a "
            "kdpemb.data.VirtualClients first, or build it with "
            "FedEmbModel(..., schedule=clients.schedule)."
        )
    return model.schedule


def privacy_mechanism(model):
    """The user-level mechanism of one round (`kdpemb.privacy`)."""
    schedule = known_schedule(model)
    if model.noise_multiplier is None:
        raise ValueError(
            f"The noise for target_epsilon={model.target_epsilon} is "
            "calibrated at the first fit, over the rounds it plans: fit "
            "the model first."
        )
    if model.adaptive_clipping is None:
        return schedule.privacy_mechanism(
            model.noise_multiplier, model.clip_norm, noise=model.noise
        )
    # The update sum and the count are one Gaussian of multiplier z_eff;
    # C changes every round, so the statement names none.
    return schedule.privacy_mechanism(
        model.adaptive_clipping.effective_noise_multiplier(
            model.noise_multiplier, schedule.sample_size
        )
    )


def ledger_resume_steps(model, counted):
    """`FedEmbModel.ledger_resume_steps`."""
    schedule = known_schedule(model)
    if schedule.sampling != "epochs":
        return counted
    rounds = schedule.steps_per_epoch
    whole = -(-counted // rounds) * rounds
    if model.target_epsilon is not None and model.planned_steps is not None:
        # No round is taken past the plan: its end is the run's end.
        whole = min(whole, max(counted, model.planned_steps))
    return whole


def simulated_deployment(
    model,
    scale,
    deployment_users,
    delta=None,
    deployment_clients=None,
    accountant="pld",
):
    """`FedEmbModel.simulated_deployment`."""
    schedule = known_schedule(model)
    if deployment_clients is None and schedule.num_clients is not None:
        deployment_clients = max(
            -(-deployment_users // schedule.users_per_client),
            math.ceil(deployment_users * schedule.pool_size / schedule.population),
        )
    return privacy.simulated_deployment(
        schedule,
        model.privacy_mechanism().noise_multiplier,
        protocol.read_private_steps(model),
        scale=scale,
        deployment_users=deployment_users,
        delta=protocol.model_delta(model, delta, who="simulated_deployment"),
        deployment_clients=deployment_clients,
        clip_norm=model.privacy_mechanism().clip_norm,
        accountant=accountant,
    )


# -- The target_epsilon plan ------------------------------------------


def plan_budget(model, steps, verbose):
    """With a `target_epsilon`: calibrates the noise at the first fit (over
    `planned_steps`, or this fit's `steps`), then refuses a fit of
    `steps` rounds that would go past the plan, before any round
    (`privacy_plan`'s flow). The plan is fixed only by a fit that passes;
    a plan given to the constructor is checked against the target once.
    Returns whether this call calibrated."""
    if steps is None:
        raise ValueError(
            "With target_epsilon, fit must know how many rounds it runs, "
            "and this round source does not say (unknown or infinite "
            "length): pass steps_per_epoch, or fit on VirtualClients or "
            "their to_tf_dataset()."
        )
    if model.calibrated_noise_multiplier is not None:
        privacy_plan.check_later_fit(model, steps, "rounds")
        return False
    privacy_plan.refuse_unplanned_steps(
        model,
        "rounds",
        remedy=", or build it with the saved planned_steps=... and "
        "calibrated_noise_multiplier=... (model.planned_steps and "
        "model.calibrated_noise_multiplier of the model that took them)",
    )
    schedule = known_schedule(model)
    planned, z_eff = privacy_plan.calibrate_first_plan(
        model, schedule.privacy_mechanism(1.0, noise=model.noise), steps, verbose,
        "rounds",
    )  # fmt: skip
    z = z_eff
    if model.adaptive_clipping is not None:
        # z is the round's z_eff: what the count leaves to the update.
        clients = schedule.sample_size
        z = model.adaptive_clipping.update_noise_multiplier(z_eff, clients)
        if verbose:
            sigma = model.adaptive_clipping.count_stddev_for(clients)
            print(
                f"FedEmbModel: with the count's noise σ_b = {sigma:.4g}, "
                f"the update's noise multiplier is {z:.4g}.",
                flush=True,
            )
    privacy_plan.adopt_first_plan(model, planned, z)
    return True


def forget_plan(model):
    """Undoes this fit's calibration: a callback restored rounds that
    were taken at a noise this model does not know."""
    privacy_plan.forget_plan(model)
    model.train_function = None


def within_plan(model):
    """With a `target_epsilon`: whether this round is within the plan (a
    traced bool), else None. The fit refuses, before any round, a fit
    that would go past the plan; this holds where a callback changed
    `private_steps` mid-fit, and no error can be raised from the traced
    round: a round past the plan releases nothing computed from the
    data (its update, C and opt-in logs are dropped) and is not
    counted."""
    if model.target_epsilon is None:
        return None
    if model.planned_steps is None:
        raise ValueError(
            "A FedEmbModel with target_epsilon plans its rounds at its "
            "first fit: fit it first."
        )
    return ops.less(model.private_steps.value, model.planned_steps)


def plan_fit(model, x, arguments, verbose):
    """With a `target_epsilon`: plans (or checks) this fit's rounds and
    returns `arguments` with the guard that checks the plan again."""

    def steps_of(initial_epoch):
        return privacy_plan.fit_steps(
            x,
            arguments,
            fedemb_checks.known_length,
            model.steps_per_execution,
            initial_epoch,
        )

    plan_resume.look_up(model, arguments.get("callbacks"))  # A killed run's.
    calibrated = plan_budget(model, steps_of(model._initial_epoch), verbose)
    model._calibrated_this_fit = calibrated
    # Checked again once the callbacks have begun (one may restore other
    # weights); the round itself never goes past the plan.
    guard = privacy_plan.PlanGuard(
        steps_of,
        on_restored_steps=functools.partial(forget_plan, model) if calibrated else None,
    )
    callbacks = privacy_plan.with_guard(arguments.get("callbacks"), guard, model)
    return {**arguments, "callbacks": callbacks}


def check_round_budget(model):
    """`train_on_batch`'s plan check: one more round within the plan."""
    if model.target_epsilon is not None:
        if model.calibrated_noise_multiplier is None:
            raise ValueError(
                "A FedEmbModel with target_epsilon calibrates its noise at "
                "its first fit, over the rounds it plans: fit it first."
            )
        privacy_plan.check_later_fit(model, 1, "rounds")
