"""`RoundPlanner`: which users, clients and examples each round holds.

Keras-free NumPy planning of DP-FedEmb rounds (see `VirtualClients` for
what a round is): Poisson, fixed-size or epoch (`sampling="epochs"`)
sampling of virtual clients, each client's examples laid out as local
batches, and the epochs of rounds that the passes over the data claim.
Every plan is a pure function of the seed and the round number.

Example:

>>> import numpy as np
>>> from kdpemb.data.round_settings import RoundSettings
>>> from kdpemb.data.user_index import index_users
>>> users = index_users(np.arange(12) // 2, roster=None)
>>> settings = RoundSettings(users.num_users, clients_per_round=2,
...                          sampling="fixed", batch_size=4)
>>> planner = RoundPlanner(settings, users, seed=None)
>>> plans = planner.plan_round(0)
>>> len(plans), [plan.example_index.shape for plan in plans.values()]
(2, [(1, 4), (1, 4)])
"""

import hashlib
import numbers
import secrets
import threading
import warnings
from typing import NamedTuple

import numpy as np

from kdpemb import _validation as validation
from kdpemb.data import assignment
from kdpemb.errors import ReproducibleSamplingWarning, RoundTruncationError

ROUND_STREAM, CLIENT_STREAM, EPOCH_STREAM, LAYOUT_ID_STREAM = 1, 2, 3, 4
MAX_SEED = 2**128


class ClientPlan(NamedTuple):
    """One sampled virtual client of a round.

    Attributes:
        users: int array. Indices (into `VirtualClients.user_names`) of the
            client's users.
        example_index: int array `[local_steps, batch_size]`. Indices of
            the examples in each local batch; -1 marks an empty slot.
    """

    users: np.ndarray
    example_index: np.ndarray


class RoundPlanner:
    """Plans the rounds of `settings` (`RoundSettings`) over `users`
    (`UserIndex`) from a sampling seed.

    `seed=None` draws the seed from OS entropy; a fixed seed warns with
    `ReproducibleSamplingWarning` (pointing at the caller's caller).

    Every pass over the rounds claims an epoch number never used before
    (`claim_epoch`), so no round is ever served for training twice;
    `epoch` is the one the current pass reads.
    """

    def __init__(self, settings, users, seed):
        self.settings = settings
        self.users = users
        # The last epochs' layouts (`epoch_layout`), shared by the threads
        # that prepare rounds.
        self._layout_lock = threading.Lock()
        self._layouts = {}
        self.seed_is_fixed = seed is not None
        if seed is None:
            self.root_seed = secrets.randbits(128)
        else:
            if (
                not isinstance(seed, numbers.Integral)
                or isinstance(seed, bool)
                or not 0 <= seed < MAX_SEED
            ):
                raise ValueError(
                    f"seed must be None or an int in [0, 2**128), got {seed!r}."
                )
            warnings.warn(
                f"VirtualClients(seed={seed!r}) makes the client sampling "
                "reproducible: anyone who knows the seed knows which users "
                "took part in each round, and the privacy guarantee assumes "
                "they do not. Use seed=None for a model you release.",
                ReproducibleSamplingWarning,
                stacklevel=3,
            )
            self.root_seed = int(seed)
        self._epoch_lock = threading.Lock()
        self.epochs_claimed = 0
        self.start_epoch()

    # ----------------------------------------------------------- epochs --

    def claim_epoch(self):
        """An epoch number that no pass has claimed before."""
        with self._epoch_lock:
            self.epochs_claimed += 1
            return self.epochs_claimed - 1

    def start_epoch(self):
        """Makes `epoch` (what the current pass reads) a new epoch."""
        self.epoch = self.claim_epoch()

    def skip_epochs(self, claimed):
        """Makes `epoch` a new epoch after the first `claimed` ones."""
        with self._epoch_lock:
            self.epochs_claimed = claimed
        self.start_epoch()

    def reseed(self, root_seed):
        """Plans from now on with `root_seed` (forgets cached layouts)."""
        self.root_seed = root_seed
        with self._layout_lock:
            self._layouts = {}

    def fingerprint(self, extra=()):
        """Bytes that differ between two planners whose rounds may differ:
        the seed, the next epoch, the settings, `extra` and the user index
        (the seed is in it, so keep it private)."""
        s = self.settings
        digest = hashlib.blake2b(digest_size=32)
        settings = (
            self.root_seed,
            self.epochs_claimed,
            repr(s.schedule),
            s.max_clients_per_round,
            s.max_examples_per_client,
            s.batch_size,
            s.rounds_per_epoch,
            s.client_order,
            *extra,
        )
        digest.update(repr(settings).encode())
        digest.update(np.ascontiguousarray(self.users.keys).tobytes())
        digest.update(np.ascontiguousarray(self.users.user_offsets).tobytes())
        return digest.digest()

    # --------------------------------------------------------- sampling --

    def rng(self, stream, round_index, key=0):
        """The generator of one (stream, round, key): no two share a stream."""
        # Fixed-width words after a 128-bit root.
        words = (stream, *words64(round_index), *words64(key))
        return np.random.default_rng(
            np.random.SeedSequence(self.root_seed, spawn_key=words)
        )

    def plan_round(self, round_index):
        """The clients of one round: `{client_key: ClientPlan}`.

        The key is the user's key (`assignment.user_keys`) for k = 1 and
        the client slot for k > 1. Clients without users are left out.
        """
        round_index = validation.check_steps(round_index, "round_index", minimum=0)
        if self.settings.sampling == "epochs":
            members = self._epoch_members(round_index)
        else:
            members = self._sampled_members(round_index)
        return {
            key: self._plan_client(users, self.rng(CLIENT_STREAM, round_index, key))
            for key, users in members.items()
            if users.size
        }

    def _sampled_members(self, round_index):
        """`{client key: user indices}` of a Poisson or fixed-size round."""
        s = self.settings
        salts = self.rng(ROUND_STREAM, round_index).integers(
            0, 2**64, size=3, dtype=np.uint64, endpoint=False
        )
        assign_salt, sample_salt, _ = (int(salt) for salt in salts)
        if s.users_per_client == 1:
            client_keys = self.users.keys
            members = None
        else:
            client_keys = np.arange(s.num_clients, dtype=np.uint64)
            slots = assignment.assign_virtual_clients(
                self.users.keys, s.num_clients, assign_salt
            )
        if s.sampling == "poisson":
            chosen = np.flatnonzero(
                assignment.hash_uniform(client_keys, sample_salt) < s.sampling_rate
            )
        else:
            order = np.argsort(assignment.keyed_hash(client_keys, sample_salt))
            chosen = np.sort(order[: s.clients_per_round])
        self._check_round_size(round_index, chosen.size, "sampled")
        if s.users_per_client == 1:
            members = {int(client_keys[u]): np.array([u]) for u in chosen}
        elif chosen.size == 0:
            members = {}
        else:
            in_round = np.flatnonzero(np.isin(slots, chosen))
            by_slot = in_round[np.argsort(slots[in_round], kind="stable")]
            bounds = np.searchsorted(slots[by_slot], chosen)
            groups = np.split(by_slot, bounds[1:])
            members = {
                int(slot): users for slot, users in zip(chosen, groups, strict=True)
            }
        return members

    def _check_round_size(self, round_index, count, verb):
        s = self.settings
        if count > s.max_clients_per_round:
            raise RoundTruncationError(
                f"Round {round_index} {verb} {count} virtual clients, "
                f"more than max_clients_per_round={s.max_clients_per_round} "
                f"(probability {s.truncation_probability:.2g} per round). "
                "No update was computed from it. Raise max_clients_per_round "
                "(or leave it None) and resume."
            )

    def _epoch_members(self, round_index):
        """`{client key: user indices}` of a round of sampling='epochs'."""
        s = self.settings
        epoch, position = divmod(round_index, s.rounds_per_epoch)
        layout = self.epoch_layout(epoch)
        if s.users_per_client == 1:
            chosen = layout[position]
            self._check_round_size(round_index, chosen.size, "holds")
            return {int(self.users.keys[u]): np.array([u]) for u in chosen}
        slots, users_by_slot, slot_bounds = layout
        start, stop = epoch_positions(position, s.num_clients, s.rounds_per_epoch)
        return {
            int(slot): users_by_slot[slot_bounds[slot] : slot_bounds[slot + 1]]
            for slot in np.sort(slots[start:stop])
        }

    def epoch_id(self, epoch):
        """A 31-bit identity of an epoch's layout (who is in which round),
        drawn from the sampling seed: the same for the same layout (with
        `client_order="fixed"`, every epoch's), and with probability
        1 - 2^-31 different for another epoch or another planner (a
        restarted job draws a new seed, and a new layout)."""
        key = 0 if self.settings.client_order == "fixed" else epoch
        return int(self.rng(LAYOUT_ID_STREAM, key).integers(0, 2**31 - 1))

    def epoch_layout(self, epoch):
        """Who is where in one epoch of sampling='epochs' (cached).

        k = 1: a list of R arrays, the users of each round; a user's round
        is floor(hash_uniform(user key, salt) * R), which looks at no other
        user. k > 1: `(slot order, users sorted by slot, slot bounds)`;
        every user keeps one slot (a keyed hash with the epoch's salt) for
        the whole epoch, and round r takes the slots at positions j of the
        order with floor(j * R / P) = r. With `client_order="fixed"` the
        salts (and for k > 1 the slot order 0..P-1) are those of epoch 0.
        """
        s = self.settings
        key = 0 if s.client_order == "fixed" else epoch
        with self._layout_lock:
            layout = self._layouts.get(key)
        if layout is not None:
            return layout
        salts = self.rng(EPOCH_STREAM, key).integers(
            0, 2**64, size=2, dtype=np.uint64, endpoint=False
        )
        assign_salt, order_salt = (int(salt) for salt in salts)
        rounds = s.rounds_per_epoch
        keys = self.users.keys
        if s.users_per_client == 1:
            place = assignment.hash_uniform(keys, assign_salt) * rounds
            place = np.minimum(np.floor(place).astype(np.int64), rounds - 1)
            by_round = np.argsort(place, kind="stable")
            bounds = np.searchsorted(place[by_round], np.arange(rounds + 1))
            layout = [by_round[bounds[r] : bounds[r + 1]] for r in range(rounds)]
        else:
            pool = s.num_clients
            slots = assignment.assign_virtual_clients(keys, pool, assign_salt)
            if s.client_order == "fixed":
                order = np.arange(pool)
            else:
                order = np.argsort(
                    assignment.keyed_hash(np.arange(pool, dtype=np.uint64), order_salt)
                )
            users_by_slot = np.argsort(slots, kind="stable")
            slot_bounds = np.searchsorted(slots[users_by_slot], np.arange(pool + 1))
            layout = (order, users_by_slot, slot_bounds)
        with self._layout_lock:
            # Keep two epochs: prefetching threads may straddle a boundary.
            if len(self._layouts) >= 2:
                self._layouts.pop(next(iter(self._layouts)))
            self._layouts[key] = layout
        return layout

    def _plan_client(self, users, rng):
        s = self.settings
        offsets = self.users.user_offsets
        starts = offsets[users]
        counts = offsets[users + 1] - starts
        quotas = even_quotas(counts, min(s.max_examples_per_client, counts.sum()), rng)
        chosen = np.concatenate(
            [
                self.users.examples_by_user[
                    start + rng.choice(count, quota, replace=False)
                ]
                for start, count, quota in zip(starts, counts, quotas, strict=True)
            ]
        )
        grid = batch_layout(chosen, s.local_steps, s.batch_size, rng)
        return ClientPlan(users=users, example_index=grid)


def even_quotas(counts, total, rng):
    """Splits `total` examples between users as evenly as their counts allow.

    Example:

    >>> even_quotas(np.array([1, 5, 5]), 7, np.random.default_rng(0)).tolist()
    [1, 3, 3]
    """
    quotas = np.zeros_like(counts)
    remaining = int(total)
    order = np.argsort(counts, kind="stable")
    for position, user in enumerate(order):
        share = min(int(counts[user]), remaining // (len(order) - position))
        quotas[user] = share
        remaining -= share
    while remaining > 0:
        spare = np.flatnonzero(quotas < counts)
        extra = rng.choice(spare, min(remaining, spare.size), replace=False)
        quotas[extra] += 1
        remaining -= extra.size
    return quotas


def batch_layout(examples, steps, batch_size, rng):
    """`[steps, batch_size]` example indices: shuffled passes, -1 = empty.

    Example:

    >>> grid = batch_layout(np.arange(3), 2, 2, np.random.default_rng(0))
    >>> sorted(grid.ravel().tolist())  # every example once, one slot empty
    [-1, 0, 1, 2]
    """
    grid = np.full((steps, batch_size), -1, dtype=np.int64)
    n = examples.size
    per_step = min(batch_size, n)
    order, position = rng.permutation(examples), 0
    for step in range(steps):
        if position >= n:
            order, position = rng.permutation(examples), 0
        take = min(per_step, n - position)
        grid[step, :take] = order[position : position + take]
        position += take
    return grid


def epoch_positions(position, num_clients, rounds):
    """`[start, stop)`: the positions j with floor(j * R / P) = position.

    Example:

    >>> [epoch_positions(r, 5, 2) for r in range(2)]
    [(0, 3), (3, 5)]
    """
    return (
        -(-position * num_clients // rounds),
        -(-(position + 1) * num_clients // rounds),
    )


def words64(value):
    """`value` as two 32-bit words, low first."""
    value = int(value)
    return value & 0xFFFFFFFF, value >> 32
