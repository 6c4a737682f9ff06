"""Which virtual client each user joins, decided by the user's own id.

A user's virtual client in a round is a keyed hash of that user's id and a
per-round salt, reduced modulo the number of virtual clients P. It never
looks at any other user, so, for a fixed P, adding or removing one user
changes the content of exactly one virtual client in every round: the
property the replace-one accounting of `kdpemb.privacy.virtual_clients`
relies on. P is a public hyperparameter: if it moved with the data (e.g.
ceil(N / k) when N crosses a multiple of k), everyone would be re-hashed. (A
shuffle of all users into groups of k would not have it: removing one user
would shift every later group.)

The price is that client sizes vary: with N users hashed into
P = ceil(N / k) clients, a client holds about Poisson(k) users. The keys
are `kdpemb.datasets.user_hash.user_keys`.
"""

import numpy as np

from kdpemb._moved import moved_names

# Still read here by `VirtualClients` (kdpemb.data.virtual_clients); the
# keys belong to `kdpemb.datasets.user_hash`, with the user-shards format.
from kdpemb.datasets.user_hash import (
    keyed_hash,
    user_keys,  # noqa: F401
)


def assign_virtual_clients(keys, num_clients, salt):
    """The virtual client (0..num_clients-1) of each user in one round.

    Args:
        keys: uint64 array. `user_keys` of the users.
        num_clients: int. P, the number of virtual clients.
        salt: int in [0, 2**64). The round's salt.

    Returns:
        int64 array, one client index per key.

    Example:

    >>> from kdpemb.datasets.user_hash import user_keys
    >>> keys = user_keys(np.arange(6))
    >>> a = assign_virtual_clients(keys, 3, salt=12345)
    >>> b = assign_virtual_clients(keys[:5], 3, salt=12345)  # user 5 leaves
    >>> bool((a[:5] == b).all())
    True
    """
    hashed = keyed_hash(keys, salt)
    return (hashed % np.uint64(num_clients)).astype(np.int64)


def hash_uniform(keys, salt):
    """A uniform number in [0, 1) per key and salt (53 random bits)."""
    return (keyed_hash(keys, salt) >> np.uint64(11)).astype(np.float64) * 2.0**-53


# Moved in 0.x (issue 32); the old path goes next.
__getattr__ = moved_names(__name__, {"mix64": "kdpemb.datasets.user_hash"})
