"""Training on several hosts: which process this is, and what they share.

kdpemb runs a DP-FedEmb job over several machines on the engine you
already use: `jax.distributed` with `keras.distribution.DataParallel` on
JAX, `tf.distribute.MultiWorkerMirroredStrategy` on TensorFlow. The same
script runs on every host; `FedEmbModel.fit` then

- shares the chief's sampling seed with every host's `VirtualClients`
  and the chief's noise seeds with every host's model;
- has each host build only its slice of every round's client rows;
- checks that every host holds the same round plan, weights and step
  count before the first round;
- and the engine sums the clipped updates over all hosts, with the noise
  added once.

`AtomicBackupAndRestore`, `PrivacyLedger` and `kdpemb.saving` write on
the chief only. See the "Scaling out" guide.

Example:

>>> from kdpemb.distribute import current_hosts
>>> hosts = current_hosts()
>>> hosts.count, hosts.is_chief  # One process here.
(1, True)
"""

import importlib

import keras

from kdpemb.distribute.hosts import Hosts

__all__ = ["Hosts", "current_hosts"]


def current_hosts(model=None):
    """The `Hosts` of this process.

    On JAX, the processes of `jax.distributed` (or
    `keras.distribution.initialize`). On TensorFlow, the workers of
    `model`'s `tf.distribute` strategy, or else of the strategy whose
    scope is open; one host for any other strategy.

    Args:
        model: keras.Model or None. On TensorFlow, the model whose
            strategy to ask.

    Returns:
        `Hosts`.

    Example:

    >>> current_hosts().index
    0
    """
    backend = keras.backend.backend()
    if backend == "jax":
        return _backend("jax").hosts()
    if backend == "tensorflow":
        return _backend("tensorflow").hosts(_strategy(model))
    return Hosts.single()


def local_device_count(model=None):
    """The devices (TensorFlow: replicas) this host splits its rows over."""
    if keras.backend.backend() == "jax":
        return _backend("jax").local_device_count()
    strategy = _strategy(model)
    if strategy is None:
        return 1
    return len(_backend("tensorflow").local_replica_ids(strategy))


def _strategy(model):
    strategy = getattr(model, "_distribute_strategy", None)
    if strategy is None and keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        if tf.distribute.has_strategy():
            strategy = tf.distribute.get_strategy()
    return strategy


def _backend(backend):
    return importlib.import_module(f"kdpemb.distribute._{backend}_backend")
