"""`FedEmbModel.fit` over several hosts: what is checked and shared first.

Under `jax.distributed` (JAX, with `keras.distribution.DataParallel`) or a
`tf.distribute.MultiWorkerMirroredStrategy` of several workers
(TensorFlow), every host runs the same script. Before the first round:

1. `check_fit` refuses, on each host, an engine set-up that would not sum
   one round over all hosts (a JAX distribution that does not span every
   process's devices or that would shard the rounds itself; a worker
   with several replicas; rows that do not split over the hosts), and
   turns off Keras' shuffling of the round order; the hosts then tell
   each other whether all passed (`Hosts.together`);
2. `join_fit` joins the round source to the hosts
   (`VirtualClients.join_hosts`): the chief's sampling seed, one epoch
   number, the plan compared across hosts, and each host serving only
   its slice of every round's rows; on TensorFlow it gives Keras each
   worker's slice as a distributed dataset (the strategy would otherwise
   shard rounds, not rows).

Once every callback has begun (one may restore a backup), `HostsGuard`
compares the model's variables (noise seeds and `private_steps`
included), its privacy settings and the epoch it starts at across hosts.
Every round then carries its index on every row, and a round whose rows
come from different rounds on different hosts trains nothing, is not
counted, and stops the fit with `HostsDisagreeError`. The noise itself is
added once per round: by the one global program on JAX; on TensorFlow
every replica adds the same draw to the all-reduced sum and only the
first passes it to the optimizer (`backends.optimizer_share`).
"""

import json

import keras

from kdpemb import distribute
from kdpemb.errors import HostsDisagreeError
from kdpemb.models._shared import hosts_agreement, plan_resume
from kdpemb.privacy import ledger, protocol

variables_digest = hosts_agreement.variables_digest


def check_fit(model, x, clients, kwargs, hosts):
    """Refuses, on this host alone, what cannot span the hosts; returns
    `fit`'s kwargs (on TensorFlow an epoch is `len(clients)` steps of the
    per-worker rounds, and Keras must not reorder rounds on any host)."""
    if hosts.count == 1:
        return kwargs
    if clients is None:
        raise ValueError(
            f"On {hosts.count} hosts FedEmbModel trains on a "
            f"kdpemb.data.VirtualClients (or its to_tf_dataset()), whose "
            f"sampling seed the chief shares; got {type(x).__name__}, and no "
            "host could check that it yields the same round on every host."
        )
    clients.check_hosts(hosts)
    steps = int(getattr(model, "steps_per_execution", 1) or 1)
    if steps != 1:
        raise ValueError(
            f"steps_per_execution={steps}: on several hosts every round's "
            "check that all hosts served the same round is read after each "
            "step, so compile the FedEmbModel with steps_per_execution=1 (a "
            "round is long enough that one step per call costs nothing)."
        )
    # Rounds are random already; Keras' shuffle of their order draws from
    # each host's own `random`, which may differ between hosts.
    kwargs = {**kwargs, "shuffle": False}
    if keras.backend.backend() == "jax":
        _check_jax_distribution(hosts)
        if x is not clients:
            raise ValueError(
                "On several JAX hosts, fit on the VirtualClients itself (each "
                f"host serves its slice of the rows), not {type(x).__name__}."
            )
        return kwargs
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
    return {**kwargs, "steps_per_epoch": len(clients)}


def join_fit(model, x, clients, hosts):
    """Joins the round source to the hosts (collectives: every host calls
    it after `check_fit` passed on all); returns what to fit on."""
    if hosts.count == 1:
        return x
    clients.join_hosts(hosts)
    if keras.backend.backend() == "jax":
        return x
    return model._distribute_strategy.distribute_datasets_from_function(
        lambda context: _worker_rounds(context, clients, hosts)
    )


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


def settings_digest(model):
    """What the model releases and how it is accounted, to compare across
    hosts: its mechanism's parameters and its configuration (without the
    backbone, compared by `variables_digest`, and Keras' generated name),
    and its target-ε plan with whether it was adopted from a
    `PrivacyLedger` (a rerun's plan is read on every host: one that could
    not see the ledger calibrated alone, and is refused with the others)."""
    config = model.get_config()
    for key in ("backbone", "name", "trainable", "dtype"):
        config.pop(key, None)
    mechanism = ledger.mechanism_parameters(protocol.check_private_model(model))
    settings = (
        mechanism,
        config,
        model.noise_multiplier,
        model.seed is None,
        model.tree_estimator,
        plan_resume.from_ledger(model),
        plan_resume.model_plan(model),
    )
    return json.dumps(settings, sort_keys=True, default=repr)


class HostsGuard(hosts_agreement.HostsGuard):
    """After the user's callbacks (kdpemb's own guards follow it). Once
    they have begun (a backup may have been restored), refuses hosts whose
    models, privacy settings or starting epoch differ, before the first
    round; then stops the fit at the first round whose rows came from
    different rounds on different hosts (the round trained nothing; `fit`
    raises)."""

    def __init__(self, hosts):
        super().__init__(hosts, settings_digest)

    @property
    def misaligned_rounds(self):
        return self.misaligned_steps


def check_rounds_aligned(guard):
    """After `fit`: raises `HostsDisagreeError` if `guard` saw a round whose
    hosts served different rounds."""
    if guard is not None and guard.misaligned_rounds:
        raise HostsDisagreeError(
            f"{guard.misaligned_rounds} round(s) of this fit held rows of "
            "different rounds on different hosts (a host's round source went "
            "out of step) and trained nothing (released nothing, not "
            "counted); training stopped there. Fit every host on the same "
            "VirtualClients, built the same way, and nothing else."
        )
