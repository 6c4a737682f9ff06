"""Batches of sampled users, k examples each, for user-level DP-SGD.

User-level DP protects all data of one user. Each step samples users, not
examples: every user joins independently with probability q = B_u / U
(Poisson; or exactly B_u users, `sampling="fixed"`), from the U distinct
ids of `users`. Of each sampled user at most `examples_per_user` (k)
examples are taken, chosen uniformly at random without replacement,
afresh each step and independently per user: a public cap, so one user
adds one contribution (their mean gradient, clipped) however much data
they hold.

A batch is S user *slots* of exactly k rows: rows j*k to j*k + k - 1 are
slot j. A slot holds one sampled user's chosen examples, then padding
rows (index 0, mask 0); a whole slot may be padding. S is the number of
sampled users padded as `PoissonIndices` pads a batch (`padding`), and a
multiple of `multiple_of`. Which users are drawn depends only on the
count U (a `PoissonIndices` over U users, with a generator of its own),
and a user's rows only on that user's examples.
"""

import secrets
import threading

import keras
import numpy as np

from kdpemb import _validation as validation
from kdpemb.data.poisson_batches import PoissonIndices, check_rows, check_seed

INDEX_INT32_LIMIT = np.iinfo(np.int32).max  # More examples: int64 indices.


class UserIndices(keras.utils.PyDataset):
    """`steps` batches `(indices, mask)` of sampled users, k rows per user.

    A `keras.utils.PyDataset`. `indices` (int32; int64 beyond 2³¹ − 1
    examples) has S * k entries, slot j (one user) in rows j*k to
    j*k + k - 1: the user's chosen examples in increasing order, then
    zeros; `mask` (float32) is 1 for a chosen example, 0 for padding.
    Slots follow the users' sorted ids.

    Args:
        users: array `(N,)` of ints or strings. The user of each example.
        users_per_step: float or None. Expected users per step B_u
            (q = B_u / U for the U distinct users); an int with
            `sampling="fixed"`. None: every user in every step.
        examples_per_user: int. k, the most examples of one user per step.
        steps: int. Batches per epoch.
        seed: int or None. None draws the sampling from OS entropy.
        padding: "bound" (default), "multiple" or "none", of the number of
            slots, as for `PoissonIndices`.
        sampling: "poisson" (default) or "fixed": exactly `users_per_step`
            users, drawn uniformly without replacement.
        multiple_of: int. The number of slots is also a multiple of it
            (e.g. a physical batch size over k).

    Attributes:
        num_users, num_examples, examples_per_user, sampling_probability:
            U, N, k and q.
        max_users: int. The bound on the users of one step (exceeded with
            probability at most 1e-9 with Poisson sampling).
        max_rows: int. `max_users * examples_per_user`.
        user_ids: array `(U,)`. The distinct ids, sorted (slot order).
        examples_of_user: int64 array `(U,)`. Examples of each user.

    Example:

    >>> users = np.repeat(np.arange(100), 3)  # 100 users, 3 examples each
    >>> batches = UserIndices(users, users_per_step=10, examples_per_user=2,
    ...                       steps=5, seed=0)
    >>> indices, mask = batches[0]
    >>> indices.shape == mask.shape == (batches.max_rows,), len(batches)
    (True, 5)
    >>> slots = users[indices].reshape(-1, 2)[mask.reshape(-1, 2).all(1)]
    >>> bool(np.all(slots[:, 0] == slots[:, 1]))  # one user per slot
    True
    """

    def __init__(
        self,
        users,
        users_per_step,
        examples_per_user,
        steps,
        seed=None,
        padding="bound",
        *,
        sampling="poisson",
        multiple_of=1,
    ):
        super().__init__()
        self.user_ids, user_of_example = index_user_ids(users)
        self.num_users = int(self.user_ids.size)
        self.num_examples = int(user_of_example.size)
        self.examples_per_user = validation.check_positive_int(
            examples_per_user,
            "examples_per_user",
            "It is k, the most examples of one user per step (e.g. 4).",
        )
        if users_per_step is not None:
            users_per_step = validation.check_sample_size(
                users_per_step, self.num_users, "users_per_step", sampling
            )
        self.steps = validation.check_positive_int(steps, "steps")
        seed = _entropy(seed)
        # The users' draw sees only the count U, never their data; the rows
        # are drawn from a generator of their own.
        self._draw_users = PoissonIndices(
            self.num_users,
            users_per_step,
            self.steps,
            seed=[*seed, 0],
            padding=padding,
            sampling=sampling,
            multiple_of=multiple_of,
        )
        self.padding, self.sampling = padding, sampling
        self.multiple_of = self._draw_users.multiple_of
        self.users_per_step = self._draw_users.batch_size
        self.sampling_probability = self._draw_users.sampling_probability
        self.max_users = (
            int(self.users_per_step)
            if sampling == "fixed" and users_per_step is not None
            else self._draw_users.max_batch_size
        )
        self.max_rows = self.max_users * self.examples_per_user
        self.index_dtype = np.dtype(
            np.int32 if self.num_examples <= INDEX_INT32_LIMIT else np.int64
        )
        self.examples_of_user = np.bincount(
            user_of_example, minlength=self.num_users
        ).astype(np.int64)
        self._offsets = np.concatenate([[0], np.cumsum(self.examples_of_user)])
        self._examples_by_user = np.argsort(user_of_example, kind="stable")
        self._rng = np.random.default_rng([*seed, 1])
        self._lock = threading.Lock()  # Prefetch threads share the generator.

    def __len__(self):
        return self.steps

    def __getitem__(self, index):
        return self.sample(index)

    def sample(self, index):
        """Batch `index`: freshly sampled users and rows, as `(indices, mask)`."""
        user_slots, user_mask = self._draw_users.sample(index)
        chosen = user_slots[user_mask == 1].astype(np.int64)
        k = self.examples_per_user
        slot, rows = self._choose_rows(chosen)
        # Row r of slot j is rank r of the slot's rows, in increasing order.
        order = np.lexsort((rows, slot))
        slot, rows = slot[order], rows[order]
        starts = np.searchsorted(slot, np.arange(chosen.size))
        rank = np.arange(slot.size) - starts[slot]
        indices = np.zeros(user_slots.size * k, dtype=self.index_dtype)
        mask = np.zeros(user_slots.size * k, dtype=np.float32)
        indices[slot * k + rank] = rows
        mask[slot * k + rank] = 1.0
        return indices, mask

    def _choose_rows(self, chosen):
        """`(slot, example)` pairs: min(n_u, k) examples of each chosen user
        u (slot j for `chosen[j]`), uniformly without replacement.

        Each example of a user with more than k draws a uniform key and the
        user's k smallest keys win, a uniform k-subset drawn from the
        user's own keys only; a user with at most k examples gives them all.
        """
        k = self.examples_per_user
        counts = self.examples_of_user[chosen]
        slot = np.repeat(np.arange(chosen.size), counts)
        # Position of each entry inside its user's examples.
        within = np.arange(slot.size) - np.repeat(np.cumsum(counts) - counts, counts)
        examples = self._examples_by_user[self._offsets[chosen][slot] + within]
        many = counts[slot] > k
        if many.any():
            with self._lock:
                keys = self._rng.random(int(many.sum()))
            big_slot, big_examples = slot[many], examples[many]
            order = np.lexsort((keys, big_slot))
            big_slot, big_examples = big_slot[order], big_examples[order]
            starts = np.searchsorted(big_slot, big_slot, side="left")
            keep = np.arange(big_slot.size) - starts < k
            slot = np.concatenate([slot[~many], big_slot[keep]])
            examples = np.concatenate([examples[~many], big_examples[keep]])
        return slot, examples


def _entropy(seed):
    """The seed as a list of ints >= 0 (NumPy's entropy); None: 128 OS bits."""
    seed = check_seed(seed)
    if seed is None:
        return [secrets.randbits(128)]
    return [int(p) for p in (seed if isinstance(seed, (list, tuple)) else [seed])]


def index_user_ids(users):
    """`(sorted distinct ids, user of each example)` of `users`, checked: one
    flat array of integer (or whole-number float) or string ids.

    >>> ids, user_of = index_user_ids(np.array([7, 3, 7]))
    >>> ids.tolist(), user_of.tolist()
    ([3, 7], [1, 0, 1])
    """
    if isinstance(users, (str, bytes)) or not hasattr(users, "__len__"):
        raise ValueError(
            f"users must be an array with one user id per example, got "
            f"{type(users).__name__}."
        )
    users = np.asarray(users)
    if users.ndim != 1:
        raise ValueError(
            f"users must be 1-D, one id per example, got shape {users.shape}. "
            "Pass a flat array (e.g. users.reshape(-1) if it is (N, 1))."
        )
    if not users.size:
        raise ValueError("users is empty: there are no examples to sample.")
    if users.dtype.kind == "f":
        bad = ~np.isfinite(users) | (users != np.round(users))
        if bad.any():
            raise ValueError(
                f"users must be integer or string ids, got the float "
                f"{float(users[np.flatnonzero(bad)[0]])!r} (at example "
                f"{int(np.flatnonzero(bad)[0])}). Give every example a "
                "whole-number or string id (drop or label examples without one)."
            )
        users = users.astype(np.int64)
    elif users.dtype.kind not in "iuUSO":
        raise ValueError(
            f"users must be integer or string ids, got dtype {users.dtype}."
        )
    try:
        return np.unique(users, return_inverse=True)
    except TypeError:
        raise ValueError(
            "users mix ids that cannot be ordered (e.g. ints and strings); "
            "use one type, e.g. str(user) for every id."
        ) from None


class UserBatches(UserIndices):
    """`steps` batches `(features, labels, mask)` of sampled users' rows.

    `UserIndices` with the rows gathered on the host (padding rows repeat
    example 0 and are masked out).

    Args:
        features: array [N, ...].
        labels: array [N].
        users: array `(N,)`. The user of each example.
        users_per_step, examples_per_user, steps, seed, padding: as for
            `UserIndices`, as are its keyword arguments `sampling` and
            `multiple_of`.

    Example:

    >>> batches = UserBatches(np.zeros((300, 4)), np.zeros(300, "int32"),
    ...                       np.arange(300) // 3, users_per_step=10,
    ...                       examples_per_user=2, steps=3, seed=0)
    >>> features, labels, mask = batches[0]
    >>> features.shape == (batches.max_rows, 4), len(batches)
    (True, 3)
    """

    def __init__(
        self,
        features,
        labels,
        users,
        users_per_step,
        examples_per_user,
        steps,
        seed=None,
        padding="bound",
        **kwargs,
    ):
        check_rows(features, labels)
        if hasattr(users, "__len__") and len(users) != len(features):
            raise ValueError(
                f"users has {len(users)} ids but features has {len(features)} "
                "rows; pass one user id per example."
            )
        super().__init__(
            users,
            users_per_step,
            examples_per_user,
            steps,
            seed=seed,
            padding=padding,
            **kwargs,
        )
        self.features, self.labels = features, labels

    def __getitem__(self, index):
        indices, mask = self.sample(index)
        return self.features[indices], self.labels[indices], mask
