"""`DPModel.fit` on several devices and hosts: the batches each one
serves, and the hosts' checks.

A logical batch is one Poisson sample (of examples, or of users), padded
to whole physical batches on every device
(`data_parallel.device_count`). On several hosts every host draws the
same samples (the chief's seed) and serves only its share of each
batch's rows (`data_parallel.HostBatches`); a `HostsGuard` compares the
hosts' models and settings before the first step, and every step
compares the hosts' batch digests: a step of mixed samples releases
nothing, and `fit` raises `HostsDisagreeError` after it.

Example:

>>> from kdpemb.distribute import Hosts
>>> join_hosts(None, "batches", [], {}, Hosts.single(), None, None, None)
('batches', [], {}, None)
"""

import hashlib
import json

import numpy as np

from kdpemb.errors import HostsDisagreeError
from kdpemb.models._shared import backends, data_parallel, hosts_agreement, privacy_plan
from kdpemb.models.dp_sgd import user_level
from kdpemb.privacy import ledger, protocol


def batches(model, x, y, users, batch_size, steps, hosts, randbits):
    """The fit's batches: `PoissonBatches` of examples, or `UserBatches`
    with `users`; with a fixed `model.seed` seeded by it and the step
    count, else by the chief's `randbits(128)` on several hosts (None: OS
    entropy)."""
    from kdpemb.data.poisson_batches import PoissonBatches

    if model.seed is not None:
        seed = [model.seed, protocol.read_private_steps(model)]
    else:
        seed = None if randbits is None else randbits(128)
    devices = data_parallel.device_count(model)
    padding = backends.current().batch_padding(model)
    if hosts.count > 1:
        # One batch shape on every host (w.p. 1 - 1e-9), whatever the
        # sample: a JAX global array of differently shaped local parts is
        # undefined, so a host out of step must still reach the step's check.
        padding = "bound"
    if users is not None:
        return user_level.batches(
            model, x, y, users, batch_size, steps, seed, padding, devices
        )
    return PoissonBatches(
        x, y, batch_size, steps, seed=seed, padding=padding,
        sampling=model.sampling,
        multiple_of=devices * (model.physical_batch_size or 1),
    )  # fmt: skip


def join_hosts(model, batches, callbacks, kwargs, hosts, x, y, users):
    """`(batches, callbacks, kwargs, guard)` of the fit: unchanged on one
    host; on several, this host's rows of each batch, a `HostsGuard`
    after the callbacks, and an epoch of `len(batches)` steps."""
    if hosts.count == 1:
        return batches, callbacks, kwargs, None
    guard = hosts_agreement.HostsGuard(hosts, _settings(x, y, users))
    callbacks = privacy_plan.with_guard(callbacks, guard, model)
    host_batches = data_parallel.HostBatches(batches, hosts)
    kwargs = {**kwargs, "steps_per_epoch": len(host_batches)}
    fed = data_parallel.distribute_host_batches(model, host_batches)
    return fed, callbacks, kwargs, guard


def build_optimizer(model):
    """Before the first step on TensorFlow under a strategy: Keras would
    read a batch (a sample lost) and average it over the replicas (which
    fails on several workers) to build what is unbuilt. `fit` built the
    network, loss and metrics; the optimizer is built in the strategy's
    scope."""
    strategy = getattr(model, "_distribute_strategy", None)
    if strategy is None:  # Keras builds nothing here without a strategy.
        return
    with strategy.scope():
        if not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)


def check_aligned(guard):
    """After `fit`: raises `HostsDisagreeError` if `guard` saw a step whose
    hosts served rows of different samples."""
    if guard is None or not guard.misaligned_steps:
        return
    raise HostsDisagreeError(
        f"{guard.misaligned_steps} step(s) of this fit held rows of different "
        "samples on different hosts (a host's batches went out of step) and "
        "trained nothing (released nothing, not counted); training stopped "
        "there. Run the same script on every host, on the same x, y (and "
        "users)."
    )


def _settings(x, y, users):
    """`HostsGuard`'s settings of a fit on `x`, `y` (and `users`): what the
    model releases and how it is accounted, and the data (`data_digest`)."""
    data = data_digest(x, y, users)

    def settings(model):
        config = model.get_config()
        for key in ("network", "name", "trainable", "dtype"):
            config.pop(key, None)
        mechanism = ledger.mechanism_parameters(protocol.check_private_model(model))
        return json.dumps(
            (mechanism, config, model.noise_multiplier, model.seed is None,
             model.planned_steps, data),
            sort_keys=True, default=repr,
        )  # fmt: skip

    return settings


def data_digest(x, y, users, rows=256):
    """A digest of the data the hosts must share: the shapes, every user id,
    and `rows` rows of `x` and `y` spread evenly over them (a read of a few
    rows, not of all of `x`: different files or orders show; one changed
    example between the sampled rows does not)."""
    digest = hashlib.blake2b(digest_size=16)
    positions = np.unique(np.linspace(0, len(x) - 1, min(len(x), rows)).astype(int))
    digest.update(repr((len(x), np.shape(x[:1]), np.shape(y[:1]))).encode())
    for part in (x[positions], y[positions]):
        digest.update(np.ascontiguousarray(np.asarray(part)).tobytes())
    if users is not None:
        # As text: ids in an object array would hash their addresses.
        digest.update(np.asarray(users).astype(str).tobytes())
    return digest.hexdigest()
