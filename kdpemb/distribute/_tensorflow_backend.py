"""TensorFlow's hosts: the workers of a `MultiWorkerMirroredStrategy`,
sharing through the strategy's all-reduce."""

import numpy as np
import tensorflow as tf

from kdpemb.distribute.hosts import Hosts


def is_multi_worker(strategy):
    """True for a `MultiWorkerMirroredStrategy` (of any number of workers)."""
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)


def local_replica_ids(strategy):
    """The global replica ids (`replica_id_in_sync_group`) of this worker."""
    ids = strategy.experimental_distribute_values_from_function(
        lambda context: tf.constant(context.replica_id_in_sync_group)
    )
    return [int(i) for i in strategy.experimental_local_results(ids)]


def hosts(strategy):
    """This job's `Hosts` under `strategy` (one host unless it is a
    `MultiWorkerMirroredStrategy` of several workers). A worker's index is
    that of its replicas: the worker holding replica 0 (which adds the
    round's noise) is the chief."""
    if strategy is None or not is_multi_worker(strategy):
        return Hosts.single()
    replicas = strategy.num_replicas_in_sync
    local = local_replica_ids(strategy)
    per_host = len(local)
    count = replicas // per_host
    if count == 1:
        return Hosts.single()
    index = local[0] // per_host

    def all_gather(words):
        words = np.asarray(words, np.int32)

        def value(context):
            row = np.zeros((count, words.size), np.int32)
            if context.replica_id_in_sync_group == local[0]:
                row[index] = words  # One replica per host contributes.
            return tf.constant(row)

        rows = strategy.experimental_distribute_values_from_function(value)
        total = strategy.reduce(tf.distribute.ReduceOp.SUM, rows, axis=None)
        return np.asarray(total)

    return Hosts(index, count, all_gather, engine="MultiWorkerMirroredStrategy")
