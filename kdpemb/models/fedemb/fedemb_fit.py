"""`FedEmbModel.fit` and `train_on_batch`: every check before the first
round (the round source, the schedule, the epochs of rounds without
sampling, the hosts, the plan), then Keras' loop, then what it refused."""

import warnings

import keras
from keras import ops

from kdpemb import distribute
from kdpemb.callbacks.count_progbar import with_count_progbar
from kdpemb.errors import (
    DataDependentScheduleWarning,
    HostsDisagreeError,
    RoundsOutOfEpochError,
)
from kdpemb.models._shared import privacy_plan
from kdpemb.models.fedemb import fedemb_checks, fedemb_privacy
from kdpemb.models.fedemb import fedemb_multi_host as multi_host
from kdpemb.privacy import protocol

# The first round's compilation, measured on 2 idle CPU cores for the
# models of examples/train_dp_fedemb.py (quick and full sizes).
COMPILE_TIMES = {"tensorflow": "about 10 s", "jax": "15 s to a minute"}


def fit(model, keras_fit, x, kwargs):
    """`FedEmbModel.fit`: checks, then `keras_fit(x, **kwargs)`."""
    hosts = distribute.current_hosts(model)
    # Every host checks alone, then they tell each other whether all
    # passed (one host refusing would leave the others waiting).
    model._calibrated_this_fit = False
    try:
        with hosts.together("FedEmbModel.fit"):
            x, kwargs, clients, verbose = checked_fit(model, x, kwargs, hosts)
    except HostsDisagreeError:
        # Another host refused: keep no plan this host fixed alone.
        if model._calibrated_this_fit:
            fedemb_privacy.forget_plan(model)
        raise
    x = multi_host.join_fit(model, x, clients, hosts)
    fedemb_privacy.reseed(model, hosts)
    schedule = model.schedule
    if verbose and model.train_function is None:
        print(
            "FedEmbModel: compiling the round (the first round waits for "
            f"it; {COMPILE_TIMES[keras.backend.backend()]} on 2 CPU cores, "
            "more on a busy machine)…",
            flush=True,
        )
    if not schedule.pool_is_public:
        warnings.warn(
            f"The schedule's {schedule.pool_size} virtual clients are "
            f"ceil(N / k) of the private user count N = "
            f"{schedule.population} (k = {schedule.users_per_client}): "
            "adding or removing one user can change P, and with it every "
            "user's client. Pass num_clients from a public count (e.g. "
            "enrolled users) to VirtualClients or Schedule.virtual_clients.",
            DataDependentScheduleWarning,
            stacklevel=3,
        )
    misaligned = misaligned_count(model)
    history = keras_fit(x, **kwargs)
    multi_host.check_rounds_aligned(model._hosts_guard)
    skipped = misaligned_count(model) - misaligned
    if skipped:
        raise RoundsOutOfEpochError(
            f"{skipped} round(s) of this fit were not rounds of the model's "
            f"current epoch of {model.schedule.steps_per_epoch} rounds "
            "(another epoch layout, or a round already taken) and were "
            "not trained (they released nothing and are not counted): a "
            "user could otherwise take part twice in one epoch of the "
            "accounting. Training stopped there. Fit on the VirtualClients "
            "itself (or its to_tf_dataset()) with whole epochs; the model "
            "is as after its last counted round."
        )
    return history


def checked_fit(model, x, kwargs, hosts):
    """`fit`'s checks, before any round; returns `(x, kwargs, clients,
    verbose)` to fit with (guards added)."""
    from kdpemb.data import VirtualClients
    from kdpemb.data.virtual_clients import clients_of

    for name in ("validation_data", "validation_split"):
        if kwargs.get(name):
            raise ValueError(
                f"FedEmbModel.fit does not take {name}: there is no loss "
                "to validate. Use the kdpemb.callbacks.RecallAtFAR "
                "callback on held-out identities."
            )
    fedemb_checks.check_strategy(model)
    fedemb_checks.check_known_length(model, x, kwargs.get("steps_per_epoch"))
    clients = x if isinstance(x, VirtualClients) else clients_of(x)
    if clients is not None:
        check_clients(model, clients)
    elif model.schedule is None:
        raise ValueError(
            f"fit got {type(x).__name__}, which carries no schedule: a "
            "FedEmbModel fit on anything but a kdpemb.data.VirtualClients or "
            "its to_tf_dataset() (e.g. a dataset derived from it by .map) "
            "needs it given, "
            "FedEmbModel(..., schedule=clients.schedule). You then vouch "
            "that the rounds are sampled as it states."
        )
    else:
        rows, steps = fedemb_checks.round_shape(x)
        if steps is not None:
            fedemb_checks.check_round_steps(steps, model.schedule.local_steps)
        fedemb_checks.check_rows_split(rows)
        image_shape = fedemb_checks.round_image_shape(x)
        if image_shape is not None:
            fedemb_checks.check_image_shape(model.backbone, image_shape, "the rounds")
        model._head_columns = None
    kwargs = multi_host.check_fit(model, x, clients, kwargs, hosts)
    arguments = privacy_plan.fit_arguments((), kwargs)
    verbose = privacy_plan.is_verbose(arguments)
    model._hosts_guard = None
    if hosts.count > 1:
        model._hosts_guard = multi_host.HostsGuard(hosts)
        callbacks = privacy_plan.with_guard(
            arguments.get("callbacks"), model._hosts_guard, model
        )
        arguments = {**arguments, "callbacks": callbacks}
        kwargs = arguments
    if model.schedule.sampling == "epochs":
        check_epoch_alignment(model, arguments)
        # Checked again after every other callback (one may restore a
        # model saved mid-epoch), and at every round.
        callbacks = privacy_plan.with_guard(
            arguments.get("callbacks"), EpochGuard(), model
        )
        arguments = {**arguments, "callbacks": callbacks}
        kwargs = arguments
    if model.target_epsilon is not None:
        kwargs = fedemb_privacy.plan_fit(model, x, arguments, verbose)
    kwargs = {**kwargs, "callbacks": with_count_progbar(kwargs.get("callbacks"))}
    return x, kwargs, clients, verbose


def misaligned_count(model):
    """Rounds refused so far as not of the model's epoch
    (`fedemb_step.aligned_epoch`)."""
    if not hasattr(model, "misaligned_rounds"):
        return 0
    return int(ops.convert_to_numpy(model.misaligned_rounds.value))


def check_epoch_alignment(model, arguments):
    """Rounds without sampling (`sampling="epochs"`) are accounted per
    epoch of the schedule's R rounds, counted from the model's first
    round: every fit must start at an epoch boundary and run whole
    epochs of R rounds, or a user could take part twice in what the
    accounting counts as one epoch (one tree)."""
    check_whole_epochs(model)
    rounds = model.schedule.steps_per_epoch
    steps_per_epoch = arguments.get("steps_per_epoch")
    if steps_per_epoch is not None and steps_per_epoch != rounds:
        raise ValueError(
            f"steps_per_epoch={steps_per_epoch}: with sampling='epochs' an "
            f"epoch is the schedule's {rounds} rounds (each user at most "
            "once). Leave steps_per_epoch None."
        )


def check_whole_epochs(model):
    """Refuses to train a model whose last epoch was cut short."""
    rounds = model.schedule.steps_per_epoch
    taken = protocol.read_private_steps(model)
    if taken % rounds:
        raise ValueError(
            f"This model has taken {taken} rounds, which is not a whole "
            f"number of epochs of {rounds} rounds (sampling='epochs'): the "
            "last epoch was cut short. A new fit starts a new epoch of the "
            "data, in which its users take part again, while the "
            "accounting (and the tree noise) would count those rounds in "
            "the unfinished epoch. Resume from a checkpoint saved at the "
            "end of an epoch (ModelCheckpoint's and BackupAndRestore's "
            "default save_freq='epoch')."
        )


def train_on_batch(model, keras_train_on_batch, args, kwargs):
    """`FedEmbModel.train_on_batch`: one round, within the plan and epoch."""
    fedemb_privacy.check_round_budget(model)
    misaligned = misaligned_count(model)
    logs = keras_train_on_batch(*args, **kwargs)
    if misaligned_count(model) > misaligned:
        raise RoundsOutOfEpochError(
            "This round is not one of the rounds of the model's current "
            f"epoch of {model.schedule.steps_per_epoch} rounds (another "
            "epoch layout, or a round already taken): it was not trained "
            "(it released nothing and is not counted)."
        )
    return logs


def check_clients(model, clients):
    """Checks the model against its `VirtualClients`, then adopts their
    schedule (if it has none) and head width; a fit refused by these
    checks adopts nothing."""
    fedemb_checks.check_image_shape(
        model.backbone, clients.image_shape, "the VirtualClients (image_shape)"
    )
    if (
        model.aggregation == "partial"
        and clients.users_per_client == 1
        and clients.max_identities_per_user == 1
    ):
        raise ValueError(
            "Every virtual client holds a single identity (one user of one "
            "identity each), so its local softmax head has one class, a "
            "zero loss and no gradient: the backbone would never change. "
            "Group users into virtual clients with users_per_client > 1 "
            "(e.g. 4 to 16) in VirtualClients."
        )
    if model.aggregation == "full" and model.num_classes != clients.num_classes:
        raise ValueError(
            f"The model's global head has num_classes={model.num_classes} "
            f"columns but the VirtualClients have {clients.num_classes} "
            "identities; build both with the same num_classes."
        )
    fedemb_checks.check_rows_split(clients.max_clients_per_round)
    fedemb_privacy.adopt_schedule(model, clients.schedule)
    # Local heads need one column per identity a client can hold.
    model._head_columns = clients.max_local_classes


class EpochGuard(keras.callbacks.Callback):
    """Rounds without sampling: once every other callback has run its
    `on_train_begin` (one may restore a model saved mid-epoch), refuses a
    model whose last epoch was cut short, before any round; then stops
    training at the first round that did not belong to the model's epoch
    (`fit` raises after it)."""

    def on_train_begin(self, logs=None):
        check_whole_epochs(self.model)
        self._misaligned = misaligned_count(self.model)

    def on_train_batch_end(self, batch, logs=None):
        if misaligned_count(self.model) > self._misaligned:
            self.model.stop_training = True
