"""Stable 64-bit keys of user ids, and keyed hashes of them.

`user_keys` gives each user id a key that depends on that id alone: the
user-shards format stores them (`user_keys.npy`), and
`kdpemb.data.assignment` hashes them with a per-round salt (`keyed_hash`)
to place users in virtual clients. NumPy only.

Example:

>>> import numpy as np
>>> keys = user_keys(np.array(["ann", "bob"]))
>>> keyed_hash(keys, 7).dtype, bool((keyed_hash(keys, 7) != keyed_hash(keys, 8)).all())
(dtype('uint64'), True)
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
