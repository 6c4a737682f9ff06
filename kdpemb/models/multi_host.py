"""`FedEmbModel.fit` over several hosts: what is checked and shared first.

Under `jax.distributed` (JAX, with `keras.distribution.DataParallel`) or a
`tf.distribute.MultiWorkerMirroredStrategy` of several workers
(TensorFlow), every host runs the same script. Before the first round,
`prepare_fit`

1. refuses an engine set-up that would not sum one round over all hosts
   (a JAX distribution that does not span every process's devices or
   that would shard the rounds itself; a worker with several replicas);
2. joins the round source to the hosts (`VirtualClients.join_hosts`): the
   chief's sampling seed, one epoch number, the plan compared across
   hosts, and each host serving only its slice of every round's rows;
3. on TensorFlow, gives Keras each worker's slice as a distributed
   dataset (the strategy would otherwise shard rounds, not rows).

Once every callback has begun (one may restore a backup), `HostsGuard`
compares the model's variables (noise seeds and `private_steps`
included) across hosts. The noise itself is drawn once per round: by the
one global program on JAX, by the replica that holds replica 0 on
TensorFlow (`backends.noise_share`).
"""

import hashlib

import keras
import numpy as np

from kdpemb import distribute


def prepare_fit(model, x, clients, kwargs):
    """Returns `(hosts, x, kwargs)` for `fit`: unchanged on one host."""
    hosts = distribute.current_hosts(model)
    if hosts.count == 1:
        return hosts, x, kwargs
    if clients is None:
        raise ValueError(
            f"On {hosts.count} hosts FedEmbModel trains on a "
            f"kdpemb.data.VirtualClients (or its to_tf_dataset()), whose "
            f"sampling seed the chief shares; got {type(x).__name__}, and no "
            "host could check that it yields the same round on every host."
        )
    if keras.backend.backend() == "jax":
        _check_jax_distribution(hosts)
        if x is not clients:
            raise ValueError(
                "On several JAX hosts, fit on the VirtualClients itself (each "
                f"host serves its slice of the rows), not {type(x).__name__}."
            )
        clients.join_hosts(hosts)
        return hosts, x, kwargs
    strategy = model._distribute_strategy
    replicas = distribute.local_device_count(model)
    if replicas != 1:
        raise ValueError(
            f"This worker holds {replicas} replicas of the "
            "MultiWorkerMirroredStrategy; kdpemb supports one replica per "
            "worker. Start one worker process per accelerator (e.g. with "
            "CUDA_VISIBLE_DEVICES=<i> and a TF_CONFIG entry each)."
        )
    steps = kwargs.get("steps_per_epoch")
    if steps is not None and steps != len(clients):
        raise ValueError(
            f"steps_per_epoch={steps}: on several TensorFlow workers an epoch "
            f"is the VirtualClients' {len(clients)} rounds. Leave "
            "steps_per_epoch None (or change rounds_per_epoch)."
        )
    clients.join_hosts(hosts)
    x = strategy.distribute_datasets_from_function(
        lambda context: _worker_rounds(context, clients, hosts)
    )
    return hosts, x, {**kwargs, "steps_per_epoch": len(clients)}


def _worker_rounds(context, clients, hosts):
    """This worker's rows of every round, one epoch after another."""
    if (
        context.num_input_pipelines != hosts.count
        or context.input_pipeline_id != hosts.index
    ):
        raise RuntimeError(
            f"The strategy's input pipeline {context.input_pipeline_id} of "
            f"{context.num_input_pipelines} is not host {hosts.index} of "
            f"{hosts.count}."
        )
    # Each pass over `to_tf_dataset()` is a new epoch of rounds; Keras
    # takes `len(clients)` of them per Keras epoch from one iterator.
    return clients.to_tf_dataset().repeat()


def _check_jax_distribution(hosts):
    import jax

    distribution = keras.distribution.distribution()
    if not isinstance(distribution, keras.distribution.DataParallel):
        raise ValueError(
            f"On {hosts.count} JAX processes, FedEmbModel needs "
            "keras.distribution.set_distribution(keras.distribution."
            "DataParallel(auto_shard_dataset=False)) over every process's "
            f"devices; the distribution is {type(distribution).__name__}."
        )
    devices = int(distribution.device_mesh.devices.size)
    if devices != jax.device_count():
        raise ValueError(
            f"The DataParallel mesh spans {devices} devices but the "
            f"{hosts.count} processes hold {jax.device_count()}: build it with "
            "keras.distribution.DataParallel(auto_shard_dataset=False), which "
            "takes every device."
        )
    if distribution.auto_shard_dataset:
        raise ValueError(
            "keras.distribution.DataParallel() shards the input over hosts "
            "itself, while each host's VirtualClients already serves its own "
            "slice of every round: build it with "
            "DataParallel(auto_shard_dataset=False)."
        )


def variables_digest(model):
    """A digest of every variable of `model` (weights, optimizer, seeds,
    `private_steps`), to compare across hosts."""
    digest = hashlib.blake2b(digest_size=32)
    for variable in model.variables:
        value = np.ascontiguousarray(keras.ops.convert_to_numpy(variable.value))
        digest.update(variable.path.encode())
        digest.update(str(value.dtype).encode())
        digest.update(value.tobytes())
    return digest.digest()


class HostsGuard(keras.callbacks.Callback):
    """Last in the callbacks: once every callback has begun (a backup may
    have been restored), refuses hosts whose models differ, before the
    first round."""

    def __init__(self, hosts):
        super().__init__()
        self.hosts = hosts

    def on_train_begin(self, logs=None):
        model = self.model
        settings = (
            model.noise_multiplier,
            model.clip_norm,
            model.planned_steps,
            model.noise,
            repr(model.schedule),
        )
        self.hosts.check_agree(
            {
                "model variables": variables_digest(model),
                "privacy settings": repr(settings),
            }
        )
