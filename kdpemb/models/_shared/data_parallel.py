"""Data parallelism of the DP-SGD trainers: which engines they run under,
over how many devices a logical batch splits, and each host's rows.

`DPModel` (and the DP-SGD head of `LastLayerDPClassifier`) run one step
over every device of every host: each device clips the examples of its
share of the logical batch, the clipped sums are added over the devices,
the noise is added once to the global sum, and the optimizer takes it
once (`backends.optimizer_share`). What that needs from the engine is
checked here, once for both trainers:

- TensorFlow: the model built in the scope of a `MirroredStrategy`,
  `MultiWorkerMirroredStrategy` (one replica per worker) or `TPUStrategy`
  (or no strategy); Keras splits each batch over the replicas.
- JAX: no distribution, or `keras.distribution.DataParallel` over every
  device (of every process); `DataParallel(auto_shard_dataset=False)` on
  several processes, whose rows each host serves itself.

A logical batch is padded to a multiple of the devices (times the
physical batch), so that every device holds whole physical batches (and,
at user level, whole users).

Example:

>>> device_count(None)  # No strategy, no distribution: one device.
1
"""

import contextlib
import hashlib

import keras
import numpy as np

from kdpemb import distribute

TF_STRATEGIES = ("MirroredStrategy", "MultiWorkerMirroredStrategy", "TPUStrategy")


def strategy_of(model):
    """The model's `tf.distribute` strategy (TensorFlow), or None."""
    if keras.backend.backend() != "tensorflow":
        return None
    import tensorflow as tf

    strategy = getattr(model, "_distribute_strategy", None)
    if strategy is None and tf.distribute.has_strategy():
        strategy = tf.distribute.get_strategy()
    return strategy


def engine_scope(model):
    """The scope of `model`'s `tf.distribute` strategy, in which variables
    are created on every replica; no scope otherwise."""
    strategy = strategy_of(model)
    return strategy.scope() if strategy is not None else contextlib.nullcontext()


def device_count(model):
    """The devices (replicas) over which one logical batch of `model` is
    split, on every host together: 1 without a strategy or distribution."""
    strategy = strategy_of(model)
    if strategy is not None:
        return int(strategy.num_replicas_in_sync)
    if keras.backend.backend() == "jax":
        distribution = keras.distribution.distribution()
        if distribution is not None:
            return int(distribution.device_mesh.devices.size)
    return 1


def check_engine(model, owner, steps_on_devices=True):
    """Refuses, before any step, an engine under which `owner`'s step would
    not be one sum over the devices with the noise added once; returns
    this job's `Hosts` (`kdpemb.distribute`). `steps_on_devices=False`: a
    fit computed on the host (a closed form), whose variables need not be
    placed on the devices."""
    strategy = strategy_of(model)
    if strategy is not None and strategy.num_replicas_in_sync > 1:
        name = type(strategy).__name__
        if not _known_strategy(strategy, name):
            raise ValueError(
                f"{owner} runs under MirroredStrategy, "
                f"MultiWorkerMirroredStrategy or TPUStrategy; {name} would "
                "update the weights outside the step that adds the noise. "
                "Build and fit the model in one of those strategies' scope."
            )
        if (
            getattr(model, "jit_compile", False) is True
            and not name.startswith("TPUStrategy")
            and distribute.local_device_count(model) > 1
        ):
            raise ValueError(
                f"{owner} was compiled with jit_compile=True under {name} over "
                f"{distribute.local_device_count(model)} local devices: XLA "
                "compiles the step for one device, which cannot read the other "
                "replicas' copies of the variables (a plain Keras model fails its "
                "first step so too; Keras issue #19005). Compile it with "
                "jit_compile=False."
            )
    if keras.backend.backend() == "tensorflow" and steps_on_devices:
        check_variables_in_scope(model, strategy, owner)
        _check_optimizer(model, strategy, owner)
    if keras.backend.backend() == "jax":
        _check_jax_distribution(owner)
    hosts = distribute.current_hosts(model)
    if hosts.count > 1 and keras.backend.backend() == "tensorflow":
        replicas = distribute.local_device_count(model)
        if replicas != 1:
            raise ValueError(
                f"This worker holds {replicas} replicas of the "
                f"MultiWorkerMirroredStrategy; {owner} on several workers "
                "supports one replica per worker. Start one worker process per "
                "accelerator (e.g. with CUDA_VISIBLE_DEVICES=<i> and a "
                "TF_CONFIG entry each)."
            )
    if hosts.count > 1:
        steps = int(getattr(model, "steps_per_execution", 1) or 1)
        if steps != 1:
            raise ValueError(
                f"steps_per_execution={steps}: on several hosts {owner} checks "
                "after each step that every host served the same batch; "
                "compile it with steps_per_execution=1."
            )
    return hosts


def _check_optimizer(model, strategy, owner):
    """Refuses gradient accumulation in the optimizer under several
    replicas: Keras cannot trace it there, and a restored accumulator
    would hold the first replica's gradient on every replica."""
    optimizer = getattr(model, "optimizer", None)
    steps = getattr(optimizer, "gradient_accumulation_steps", None)
    if strategy is not None and strategy.num_replicas_in_sync > 1 and steps:
        raise ValueError(
            f"{owner}'s optimizer accumulates gradients "
            f"(gradient_accumulation_steps={steps}) under "
            f"{type(strategy).__name__}, which Keras does not support there: "
            "use physical_batch_size for a larger logical batch instead (the "
            "batch's sum is accumulated before the noise)."
        )


def check_variables_in_scope(model, strategy=None, owner=None):
    """Refuses variables of another strategy than the model's (a network
    built in a strategy's scope, wrapped outside it, or the reverse), and
    under several replicas variables of none (built outside the scope: each
    replica would update the one copy, e.g. count every step twice)."""
    strategy = strategy if strategy is not None else strategy_of(model)
    owner = owner or type(model).__name__
    several = strategy is not None and strategy.num_replicas_in_sync > 1
    for variable in model.variables:
        theirs = getattr(variable.value, "_distribute_strategy", None)
        if theirs is None and several:
            raise ValueError(
                f"{owner}'s variable {variable.path!r} was created outside "
                f"the scope of the {type(strategy).__name__} it is fitted "
                "under: build the network, the model and its compile() all in "
                "one `with strategy.scope():` block."
            )
        if theirs is not None and theirs is not strategy:
            raise ValueError(
                f"{owner}'s variable {variable.path!r} belongs to another "
                f"tf.distribute strategy ({type(theirs).__name__}) than the "
                f"model's ({type(strategy).__name__ if strategy else 'none'}): "
                "build the network, the model and its compile() all in one "
                "`with strategy.scope():` block."
            )


def _known_strategy(strategy, name):
    import tensorflow as tf

    # MultiWorkerMirroredStrategy's class is CollectiveAllReduceStrategy.
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return True
    return any(name.startswith(known) for known in TF_STRATEGIES)


def _check_jax_distribution(owner):
    import jax

    distribution = keras.distribution.distribution()
    if distribution is None:
        if jax.process_count() > 1:
            # Each process would train alone on its rows, with the one noise.
            raise ValueError(
                f"{owner} runs on {jax.process_count()} JAX processes with no "
                "keras.distribution set: call keras.distribution."
                "set_distribution(keras.distribution.DataParallel("
                "auto_shard_dataset=False)) on every process before building "
                "the model."
            )
        return
    if not isinstance(distribution, keras.distribution.DataParallel):
        raise ValueError(
            f"{owner} splits each batch over the devices of a "
            "keras.distribution.DataParallel; "
            f"{type(distribution).__name__} would shard the weights, which "
            "per-example clipping does not support. Set "
            "keras.distribution.DataParallel() instead."
        )
    devices = int(distribution.device_mesh.devices.size)
    if devices != jax.device_count():
        raise ValueError(
            f"The DataParallel mesh spans {devices} of the {jax.device_count()} "
            f"devices; {owner} sums each step over a mesh of every device: "
            "build it with keras.distribution.DataParallel() (all devices)."
        )
    if jax.process_count() > 1 and distribution.auto_shard_dataset:
        raise ValueError(
            f"On {jax.process_count()} processes each host serves its own rows "
            f"of every batch of {owner}: build the distribution with "
            "keras.distribution.DataParallel(auto_shard_dataset=False)."
        )


class HostBatches(keras.utils.PyDataset):
    """This host's rows of every batch of `batches` (a `PoissonBatches` or
    `UserBatches`, drawing the same samples on every host), and only those
    rows read. The batch's units (rows; at user level, slots of k rows)
    are dealt to the hosts in turn (unit i to host i mod H), so that the
    real rows, which come first, spread evenly over the hosts and the
    padding with them. A fourth array gives every row the batch's digest
    (of the whole sample), which the step compares across hosts
    (`hosts_agreement.aligned`): a host out of step makes a batch that
    releases nothing."""

    def __init__(self, batches, hosts):
        super().__init__()
        self.batches, self.hosts = batches, hosts
        self.unit = int(getattr(batches, "examples_per_user", None) or 1)

    def __len__(self):
        return len(self.batches)

    def host_rows(self, size):
        """The positions, in a batch of `size` rows, that this host serves."""
        count, unit = self.hosts.count, self.unit
        if size % (count * unit):
            raise ValueError(
                f"A batch of {size} rows does not split into whole units of "
                f"{unit} row(s) over {count} hosts."
            )
        units = np.arange(self.hosts.index, size // unit, count)
        return (units[:, None] * unit + np.arange(unit)).ravel()

    def __getitem__(self, index):
        indices, mask = self.batches.sample(index)
        rows = self.host_rows(len(indices))
        digest = hashlib.blake2b(digest_size=4)
        digest.update(np.ascontiguousarray(indices).tobytes())
        digest.update(np.ascontiguousarray(mask).tobytes())
        batch_id = int.from_bytes(digest.digest(), "big") >> 1  # Fits int32.
        mine = indices[rows]
        return (
            self.batches.features[mine],
            self.batches.labels[mine],
            mask[rows],
            np.full(len(rows), batch_id, np.int32),
        )

    def to_tf_dataset(self):
        """The batches as a `tf.data.Dataset`, repeated (an epoch is
        `len(self)` of them)."""
        import tensorflow as tf

        first = self[0]  # The shapes and dtypes (a draw that is not used).
        signature = tuple(
            tf.TensorSpec((None, *np.shape(a)[1:]), tf.as_dtype(np.asarray(a).dtype))
            for a in first
        )

        return tf.data.Dataset.from_generator(self.repeated, output_signature=signature)

    def repeated(self):
        """The batches, epoch after epoch (an epoch is `len(self)` of
        them), as a generator."""
        while True:
            for index in range(len(self)):
                yield self[index]


def distribute_host_batches(model, batches):
    """What `fit` is given for `batches` (`HostBatches`): on JAX its
    batches as a generator (each process passes its rows,
    `auto_shard_dataset=False`; a `PyDataset` may not yield four arrays);
    on TensorFlow each worker's own dataset, so that the strategy does not
    shard batches over the workers."""
    if keras.backend.backend() != "tensorflow":
        return batches.repeated()
    return strategy_of(model).distribute_datasets_from_function(
        lambda context: batches.to_tf_dataset()
    )
