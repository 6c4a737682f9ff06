"""`FedEmbModel`'s argument checks: the client optimizer, the schedule,
and rounds and round sources, before and at a round."""

import numbers

import keras
from keras import ops

from kdpemb.datasets import inputs
from kdpemb.privacy import Schedule


def as_schedule(schedule):
    """A `Schedule` (or its config) of user-level rounds, or a clear error."""
    if isinstance(schedule, dict):
        schedule = Schedule.from_config(schedule)
    if not isinstance(schedule, Schedule):
        raise TypeError(
            "schedule must be a kdpemb.privacy.Schedule, e.g. clients.schedule "
            "of the VirtualClients or Schedule.virtual_clients(...); got "
            f"{type(schedule).__name__}."
        )
    if schedule.unit != "user":
        raise ValueError(
            f"FedEmbModel protects users, but the schedule samples "
            f"{schedule.unit}s: use clients.schedule of the VirtualClients or "
            "Schedule.virtual_clients(...)."
        )
    return schedule


def schedule_differences(mine, theirs):
    mine, theirs = mine.get_config(), theirs.get_config()
    return "; ".join(
        f"{key}: model {mine[key]!r}, rounds {theirs[key]!r}"
        for key in mine
        if mine[key] != theirs[key]
    )


def round_shape(x):
    """`(M_max, local steps)` of a round source whose element spec tells
    them (a `tf.data.Dataset`); None where unknown."""
    spec = getattr(x, "element_spec", None)
    if not isinstance(spec, dict) or "images" not in spec:
        return None, None
    shape = getattr(spec["images"], "shape", None)
    if shape is None or len(shape) < 2:
        return None, None
    return tuple(None if d is None else int(d) for d in tuple(shape)[:2])


def round_image_shape(x):
    """The image shape of a round source whose element spec tells it (a
    `tf.data.Dataset` of rounds `(M, S, B, *image)`), or None."""
    spec = getattr(x, "element_spec", None)
    if not isinstance(spec, dict) or "images" not in spec:
        return None
    shape = getattr(spec["images"], "shape", None)
    if shape is None or shape.rank is None or shape.rank < 4:
        return None
    return tuple(None if d is None else int(d) for d in tuple(shape)[3:])


def check_image_shape(backbone, image_shape, where):
    """Refuses rounds of images the backbone was not built for (`extract`
    refuses them alike): a convolutional backbone would otherwise train on
    them without a word."""
    inputs.check_input_shape(
        inputs.model_input_shape(backbone), (None, *image_shape), where
    )


def check_rows_split(rows):
    """The client rows of a round must split evenly over the devices."""
    devices = data_parallel_devices()
    if rows is not None and devices > 1 and rows % devices:
        size = -(-rows // devices) * devices
        raise ValueError(
            f"The rounds hold {rows} client rows, which do not split over "
            f"{devices} devices; build the VirtualClients with "
            f"max_clients_per_round={size}."
        )


def known_length(x):
    """Rounds in one pass over `x`, or None if unknown or infinite."""
    cardinality = getattr(x, "cardinality", None)
    if callable(cardinality):  # tf.data.Dataset
        count = int(cardinality())
        return count if count >= 0 else None
    if isinstance(x, keras.utils.PyDataset):
        return x.num_batches
    return None


def check_known_length(model, x, steps_per_epoch):
    """Under several tf.distribute replicas, refuses a round source of
    unknown length: Keras then calls the step once more at its end, on
    some replicas only, and `private_steps` stops matching the rounds."""
    strategy = getattr(model, "_distribute_strategy", None)
    if strategy is None or strategy.num_replicas_in_sync < 2:
        return
    if steps_per_epoch is not None or known_length(x) is not None:
        return
    raise ValueError(
        f"Under {type(strategy).__name__} with {strategy.num_replicas_in_sync} "
        f"replicas, fit needs to know how many rounds an epoch holds, and "
        f"{type(x).__name__} does not say (unknown or infinite cardinality, "
        "e.g. after .filter): the replicas would count different numbers of "
        "private steps. Pass steps_per_epoch (at most the rounds the dataset "
        "holds), or fit on VirtualClients.to_tf_dataset(), whose cardinality "
        "is known."
    )


def data_parallel_devices():
    distribution = keras.distribution.distribution()
    if distribution is None:
        return 1
    return int(distribution.device_mesh.devices.size)


def check_strategy(model):
    strategy = getattr(model, "_distribute_strategy", None)
    if strategy is None:
        return
    import tensorflow as tf

    if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        raise NotImplementedError(
            "FedEmbModel does not support ParameterServerStrategy: its workers "
            "step asynchronously, so a round would not be one sum of the "
            "sampled clients. Use MultiWorkerMirroredStrategy on several "
            "machines, MirroredStrategy on one."
        )


def check_round(data, local_steps):
    if isinstance(data, tuple) and data and all(d is None for d in data[1:]):
        # `(round,)`, as a Python generator must yield it, or `(round, None,
        # None)` from `train_on_batch`.
        data = data[0]
    if not isinstance(data, dict) or "client_mask" not in data:
        raise ValueError(
            "FedEmbModel trains on rounds of kdpemb.data.VirtualClients (dicts "
            "with images, labels, example_mask, client_mask, ...); got "
            f"{type(data).__name__}."
        )
    check_round_steps(data["images"].shape[1], local_steps)
    return data


def check_round_steps(steps, local_steps):
    if steps is not None and steps != local_steps:
        raise ValueError(
            f"The rounds hold {steps} local steps per client but the model's "
            f"schedule has local_steps={local_steps}: give the model the "
            "schedule of these rounds, FedEmbModel(..., schedule=clients.schedule)."
        )


def client_sgd(client_optimizer):
    """`(learning_rate, momentum, nesterov)` of the client optimizer."""
    if isinstance(client_optimizer, dict):
        client_optimizer = keras.optimizers.SGD(**client_optimizer)
    if isinstance(client_optimizer, numbers.Real) and not isinstance(
        client_optimizer, bool
    ):
        client_optimizer = keras.optimizers.SGD(float(client_optimizer))
    if type(client_optimizer) is not keras.optimizers.SGD:
        raise ValueError(
            "client_optimizer must be a learning rate (float) or a "
            "keras.optimizers.SGD (with optional momentum and nesterov); got "
            f"{client_optimizer!r}. Local optimizer state lives only inside "
            "one client's local steps, where kdpemb runs SGD itself; use any "
            "Keras optimizer as the server optimizer in compile()."
        )
    ignored = {
        name: getattr(client_optimizer, name, None)
        for name in ("weight_decay", "clipnorm", "clipvalue", "global_clipnorm")
        if getattr(client_optimizer, name, None)
    }
    if client_optimizer.use_ema:
        ignored["use_ema"] = True
    if client_optimizer.gradient_accumulation_steps:
        ignored["gradient_accumulation_steps"] = (
            client_optimizer.gradient_accumulation_steps
        )
    if ignored:
        raise ValueError(
            f"client_optimizer sets {ignored}, which local SGD does not "
            "implement; use SGD(learning_rate, momentum=..., nesterov=...) only."
        )
    learning_rate = client_optimizer.learning_rate
    if isinstance(
        client_optimizer._learning_rate,
        keras.optimizers.schedules.LearningRateSchedule,
    ):
        raise ValueError(
            "client_optimizer must have a constant learning rate; schedule the "
            "server optimizer instead."
        )
    learning_rate = float(ops.convert_to_numpy(learning_rate))
    momentum = float(client_optimizer.momentum)
    if learning_rate <= 0 or not 0 <= momentum < 1:
        raise ValueError(
            f"client_optimizer needs learning_rate > 0 and 0 <= momentum < 1, "
            f"got learning_rate={learning_rate}, momentum={momentum}."
        )
    return learning_rate, momentum, bool(client_optimizer.nesterov)
