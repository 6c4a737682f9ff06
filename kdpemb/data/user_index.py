"""`UserIndex`: which examples each user holds, for the round planner.

Users are sorted as `np.unique` sorts their ids; user u's examples are
`examples_by_user[user_offsets[u]:user_offsets[u + 1]]`. Keras-free.

Example:

>>> import numpy as np
>>> index = index_users(np.array([7, 3, 7, 3, 3]), roster=None)
>>> index.user_names.tolist(), index.user_offsets.tolist()
([3, 7], [0, 3, 5])
>>> index.examples_by_user.tolist()
[1, 3, 4, 0, 2]
"""

import warnings
from typing import NamedTuple

import numpy as np

from kdpemb.data import assignment
from kdpemb.datasets.user_shards_reader import UserShards


class GroupedExamples:
    """`examples_by_user` of data stored grouped by user: the identity."""

    def __getitem__(self, index):
        return np.asarray(index)


GROUPED = GroupedExamples()


class UserIndex(NamedTuple):
    """The per-user index of a data set.

    Attributes:
        user_names: array `[num_users]`. User ids, sorted.
        num_users: int. Number of users.
        num_examples: int. Examples of all users.
        keys: uint64 array `[num_users]`. `assignment.user_keys(user_names)`.
        examples_by_user: int array (or `GROUPED`). Example indices,
            grouped by user.
        user_offsets: int array `[num_users + 1]`. Where each user's
            examples start in `examples_by_user`.
        shards: `UserShards` or None. The shards the index is read from.
    """

    user_names: np.ndarray
    num_users: int
    num_examples: int
    keys: np.ndarray
    examples_by_user: object
    user_offsets: np.ndarray
    shards: object = None

    def max_identities_per_user(self, labels, num_classes):
        """Most identities any one user holds (`labels` of every example)."""
        if self.shards is not None:
            return self.shards.max_identities_per_user
        counts = np.diff(self.user_offsets)
        users = np.repeat(np.arange(self.num_users), counts)
        labels = labels[self.examples_by_user].astype(np.int64)
        pairs = np.unique(users * num_classes + labels)
        return int(np.bincount(pairs // num_classes).max())


def index_users(user_ids, roster):
    """The `UserIndex` of `user_ids` (an array, or a `UserShards`).

    `roster` (the `users=` argument of `VirtualClients`, or None) must list
    every user with examples; its users without any are dropped with a
    warning that points at the caller's caller.
    """
    if isinstance(user_ids, UserShards):
        return _index_shards(user_ids, roster)
    try:
        names, user_of_example = np.unique(user_ids, return_inverse=True)
    except TypeError:
        raise ValueError(
            "user_ids mix types that cannot be ordered (e.g. ints and "
            "strings); use one type, e.g. str(user) for every id."
        ) from None
    if roster is not None:
        check_roster(names, roster, "user_ids", stacklevel=4)
    keys = assignment.user_keys(names)
    if np.unique(keys).size != keys.size:
        raise ValueError(
            "Two user ids share a 64-bit key (a BLAKE2b collision of "
            "string ids); they would share a virtual client. Rename one "
            "user or use integer ids."
        )
    counts = np.bincount(user_of_example, minlength=names.size)
    return UserIndex(
        user_names=names,
        num_users=int(names.size),
        num_examples=int(user_of_example.size),
        keys=keys,
        examples_by_user=np.argsort(user_of_example, kind="stable"),
        user_offsets=np.concatenate([[0], np.cumsum(counts)]),
    )


def _index_shards(shards, roster):
    """The per-user index of a `UserShards`, memory-mapped as written.

    Its users are sorted as `np.unique` sorts them and each user's
    examples are contiguous, in input order, so the rounds are those of
    the same data in memory; nothing per example is built.
    """
    names = shards.user_names
    if roster is not None:
        check_roster(names, roster, shards.directory, stacklevel=5)
    return UserIndex(
        user_names=names,
        num_users=shards.num_users,
        num_examples=shards.num_images,
        keys=shards.user_keys,
        examples_by_user=GROUPED,
        user_offsets=shards.user_offsets,
        shards=shards,
    )


def check_roster(names, roster, source, stacklevel):
    """Refuses users with examples (sorted unique `names`, from `source`)
    missing from the `users=` roster; warns of roster users without any."""
    roster = np.unique(np.asarray(roster))
    known = np.isin(names, roster)
    if not known.all():
        unknown = np.asarray(names[np.flatnonzero(~known)[:3]])
        raise ValueError(
            f"{int((~known).sum())} user id(s) in {source} are not in `users` "
            f"(e.g. {unknown.tolist()}). List every user who has examples in "
            "`users`."
        )
    empty = roster.size - names.size
    if empty:
        warnings.warn(
            f"{empty} of {roster.size} users have no examples and were "
            f"dropped; {names.size} users remain.",
            UserWarning,
            stacklevel=stacklevel,
        )
