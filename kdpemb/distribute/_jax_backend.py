"""JAX's hosts: the processes of `jax.distributed`, sharing through
`jax.experimental.multihost_utils`."""

import jax
import numpy as np

from kdpemb.distribute.hosts import Hosts


def hosts():
    """This job's `Hosts`: `jax.process_index()` of `jax.process_count()`."""
    count = jax.process_count()
    if count == 1:
        return Hosts.single()
    from jax.experimental import multihost_utils

    def all_gather(words):
        return np.asarray(multihost_utils.process_allgather(np.asarray(words)))

    return Hosts(jax.process_index(), count, all_gather, engine="jax.distributed")


def local_device_count():
    """Devices of this process (the rows of a round it holds split over them)."""
    return jax.local_device_count()
