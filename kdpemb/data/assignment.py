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
P = ceil(N / k) clients, a client holds about Poisson(k) users.
"""

import hashlib

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def mix64(values):
    """SplitMix64's finaliser: a bijection on uint64 that scrambles bits.

    Example:

    >>> import numpy as np
    >>> a = mix64(np.arange(3, dtype=np.uint64))
    >>> a.dtype, len(set(a.tolist()))
    (dtype('uint64'), 3)
    """
    z = np.asarray(values, dtype=np.uint64) + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def user_keys(user_ids):
    """A stable 64-bit key per user id that depends only on that id.

    Integer ids map to themselves (as uint64); string or bytes ids to the
    first 8 bytes of their BLAKE2b digest. The key is an identity, not a
    secret: the per-round salt makes the assignment unpredictable.

    Example:

    >>> user_keys(np.array([3, 7]))
    array([3, 7], dtype=uint64)
    >>> user_keys(np.array(["ann", "bob"])).dtype
    dtype('uint64')
    """
    user_ids = np.asarray(user_ids)
    if user_ids.dtype.kind in "iu":
        return user_ids.astype(np.int64).view(np.uint64)
    if user_ids.dtype.kind in "USO":
        return np.array(
            [_digest(value) for value in user_ids.tolist()], dtype=np.uint64
        )
    raise TypeError(
        f"user ids must be integers or strings, got dtype {user_ids.dtype}. "
        "Pass one id per example, e.g. np.int64 user numbers."
    )


def _digest(value):
    data = value if isinstance(value, bytes) else str(value).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def keyed_hash(keys, salt):
    """A uniform-looking uint64 per key, different for every salt."""
    return mix64(mix64(keys) ^ np.uint64(salt))


def assign_virtual_clients(keys, num_clients, salt):
    """The virtual client (0..num_clients-1) of each user in one round.

    Args:
        keys: uint64 array. `user_keys` of the users.
        num_clients: int. P, the number of virtual clients.
        salt: int in [0, 2**64). The round's salt.

    Returns:
        int64 array, one client index per key.

    Example:

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
