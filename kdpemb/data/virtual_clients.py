"""`VirtualClients`: user data as fixed-shape DP-FedEmb training rounds."""

import hashlib
import math
import numbers
import secrets
import threading
import warnings
import weakref
from typing import NamedTuple

import keras
import numpy as np

from kdpemb import _validation as validation
from kdpemb.data import assignment, round_size, sources
from kdpemb.datasets.user_shards_reader import UserShards
from kdpemb.errors import (
    DataDependentScheduleWarning,
    ReproducibleSamplingWarning,
    RoundTruncationError,
)
from kdpemb.privacy import Schedule, mechanisms
from kdpemb.privacy.schedule import rounds_per_epoch_for

_SAMPLINGS = ("poisson", "fixed", "epochs")
_CLIENT_ORDERS = ("shuffled", "fixed")
# Largest overflow probability of a Poisson round's default bound M_max. For
# k > 1 the count of sampled slots depends on no one's data (P is public),
# so 1e-9 only makes a failed run rare. For k = 1 the count is the number of
# sampled users, so whether a round overflows depends on who is present and
# adds up to e^ε · rounds · p to δ: 1e-30 keeps that below 1e-10 for any
# ε <= 25 and up to 10^9 rounds.
TRUNCATION_TOLERANCE = {"independent of data": 1e-9, "data dependent": 1e-30}
_ROUND_STREAM, _CLIENT_STREAM, _EPOCH_STREAM, _LAYOUT_ID_STREAM = 1, 2, 3, 4
# With sampling="epochs", each round also says which epoch layout (who is
# in which round) it is from, and its position in that epoch.
_POSITION_KEYS = ("epoch_id", "round_in_epoch")
_MAX_SEED = 2**128
# On several hosts each row says its round, modulo this: small enough that
# the replicas' int32 sum of it cannot overflow.
_ROUND_INDEX_MODULUS = 2**20
# An epoch's length is a Python (and tf.data) integer: at most 2**53 rounds.
MAX_ROUNDS_PER_EPOCH = 2**53


class _GroupedExamples:
    """`_examples_by_user` of data stored grouped by user: the identity."""

    def __getitem__(self, index):
        return np.asarray(index)


_GROUPED = _GroupedExamples()


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


class VirtualClients(keras.utils.PyDataset):
    """Users grouped into virtual clients and sampled into training rounds.

    Each round (one element, one `train_step` of a DP-FedEmb model):

    1. Every user joins one of P = ceil(N / k) virtual clients (or
       `num_clients`) through a keyed hash of the user's own id and a fresh
       per-round salt (`users_per_client=k`; with k = 1 a virtual client
       is one user). No user's client depends on which other users exist,
       so, with P fixed, removing one user changes one client's content in
       every round.
    2. Virtual clients are sampled: Poisson with rate q = M / P (default,
       what the accountant assumes), or exactly M without replacement
       (`sampling="fixed"`, which needs the RDP accountant; slots that
       hold no user then leave their rows empty).
    3. Each sampled client takes up to `max_examples_per_client` of its
       users' examples without replacement, shared as evenly as possible
       between its users (a user with more data gets no more weight), and
       lays them out as `local_steps` batches of `batch_size` (several
       passes when a client has fewer examples; one batch is never larger
       than the client's example count, so it holds no repeats).
    4. Labels are re-indexed to 0..c-1 inside each client (c identities
       present), so the local head needs c columns, not the global count.

    `sampling="epochs"` replaces steps 1 and 2 by rounds without sampling,
    for DP-FTRL (`FedEmbModel(noise="tree")`): an epoch is R =
    `rounds_per_epoch` rounds, a public number, and every virtual client
    is in exactly one of them, so every user takes part in at most one
    round per epoch. With k > 1 each user keeps one of the P slots for
    the whole epoch (the keyed hash of step 1 with a salt per epoch, not
    per round), and round r of the epoch takes the slots at positions j
    with floor(j * R / P) = r of the epoch's slot order (ceil(P / R) or
    floor(P / R) slots); with P fixed, removing a user changes the
    content of one slot, in one round of each epoch. With k = 1 a user's
    round is floor(u * R) for u a keyed hash of the user's own id and the
    epoch's salt, so it does not depend on which other users exist:
    removing a user takes that user's contribution out of one round of
    each epoch and changes nothing else (a round then holds
    Binomial(N, 1 / R) users, bounded as a Poisson round of single users
    is). `client_order="shuffled"` (default) draws a new order every
    epoch; `"fixed"` keeps the same clients in the same rounds every
    epoch. The tree-aggregation accounting assumes no amplification from
    the order, only at most one round per user per epoch, and its epochs
    are the model's blocks of R steps: train on whole passes of R rounds.

    The element is a dict of arrays with static shapes:

    | key | shape | dtype |
    |---|---|---|
    | `images` | `[M_max, local_steps, batch_size, H, W, C]` | as given |
    | `labels` (local) | `[M_max, local_steps, batch_size]` | int32 |
    | `global_labels` | `[M_max, local_steps, batch_size]` | int32 |
    | `example_mask` | `[M_max, local_steps, batch_size]` | bool |
    | `client_mask` | `[M_max]` | bool |
    | `num_local_classes` | `[M_max]` | int32 |
    | `epoch_id`, `round_in_epoch` (`sampling="epochs"` only) | `[M_max]` | int32 |

    With `sampling="epochs"` every row also says which epoch layout the
    round is from (a 31-bit id drawn from the seed) and its position in
    it: `FedEmbModel` checks that each of its epochs of R rounds takes R
    distinct rounds of one layout.

    Sampled clients fill the first rows; masked slots hold zeros. M_max is
    the smallest bound that a Poisson round exceeds with probability at
    most 1e-9 for k > 1 (the count of sampled slots depends on no one's
    data) and 1e-30 for k = 1 (the count of sampled users does, adding at
    most e^ε · rounds · p to δ); see `truncation_probability`. A round
    that would exceed it raises `RoundTruncationError` instead of silently
    dropping clients.

    It is a `keras.utils.PyDataset`, so it is the `x` of `model.fit` on
    both backends, prefetched by `workers` threads; `to_tf_dataset()` gives
    a `tf.data.Dataset` (for `tf.distribute`). Every round is a pure
    function of the seed and the round number, and successive epochs get
    fresh rounds (for `sampling="epochs"`, round `epoch * R + r`).

    `schedule` is the `kdpemb.privacy.Schedule` of the rounds (users,
    P, M, sampling, local steps): a `FedEmbModel` takes it at its first
    `fit` on these rounds, and its `privacy_mechanism(z, clip_norm)` is the
    mechanism of one round. The number of virtual clients P and the rate
    q are public hyperparameters. By default P derives from the number of
    users N, which treats N as public (as DP-SGD's q = B / N does; the
    model warns with `kdpemb.errors.DataDependentScheduleWarning`); pass
    `num_clients` to fix P from a public count.

    Args:
        images: array `(N, H, W, C)`, a lazy array-like, a `UserImages`, a
            `tf.data.Dataset` or a `keras.utils.PyDataset` yielding
            `(images, labels, user_ids)`, or a `kdpemb.datasets.UserShards`
            (data on disk, read lazily: no per-example array in memory).
        labels: int array `(N,)`. Identity of each image. Omit for a
            `UserImages`, a dataset or a `UserShards`.
        user_ids: int or str array `(N,)`. User of each image.
        clients_per_round: float or None. M, the expected number of
            virtual clients per round (exactly M for `sampling="fixed"`).
            For `sampling="epochs"` it sets R = ceil(P / M) and may be
            omitted when `rounds_per_epoch` is given; the rounds then hold
            P / R clients on average.
        users_per_client: int. k, users per virtual client (on average).
            Defaults to `1`.
        sampling: str. `"poisson"`, `"fixed"` or `"epochs"` (no
            sampling, see above). Defaults to `"poisson"`.
        client_order: str or None. For `sampling="epochs"` only:
            `"shuffled"` (default, a new order every epoch) or `"fixed"`
            (the same rounds every epoch).
        local_steps: int. Local batches per client per round. Defaults to
            `1`.
        batch_size: int. Examples per local batch. Defaults to `32`.
        max_examples_per_client: int or None. Cap on a client's examples
            per round, at most `local_steps * batch_size`. Defaults to
            `local_steps * batch_size`.
        max_clients_per_round: int or None. M_max; defaults to the bound
            with overflow probability <= 1e-9 per round (1e-30 for k = 1).
            With `sampling="epochs"` and k > 1 it is ceil(P / R).
        rounds_per_epoch: int or None. Rounds per pass (`len(self)`).
            Defaults to floor(P / M) (about one expected pass over the
            clients; never more rounds per epoch than
            `schedule.steps_for_epochs` counts). For `sampling="epochs"`
            it is R, the public number of rounds in which every client
            takes part once, at most P; defaults to ceil(P / M). Pass it
            (and for k > 1 `num_clients`) from public numbers so that R
            does not depend on the user count.
        num_clients: int or None. P, the number of virtual clients, for
            k > 1. Defaults to ceil(N / k) for the N users in the data. P
            must not depend on the data for the one-client-changes
            argument to hold exactly: pass a public count (e.g. from the
            number of enrolled users) to fix it; the default treats N as
            public, as DP-SGD's q = B / N does.
        num_classes: int or None. Number of global identities; labels must
            be below it. Defaults to `max(labels) + 1`.
        users: sequence or None. Every enrolled user id; users without
            examples are dropped with a warning. Defaults to the users in
            `user_ids`.
        seed: int or None. `None` (default) draws the sampling seed from OS
            entropy. A fixed seed makes the sampling predictable, which the
            privacy guarantee does not allow: use it for tests only.
        workers: int or None. Threads that prepare rounds ahead of
            training. Defaults to `2`; with `sampling="epochs"` it must be
            `1` (the default there): Keras' multi-worker loader serves
            prefetched rounds in the next Keras epoch, which would mix two
            epochs. `to_tf_dataset()` prefetches whole epochs instead.
        max_queue_size: int. Rounds prepared ahead. Defaults to `2`.

    Example:

    >>> import numpy as np
    >>> from kdpemb.datasets import synthetic_identities
    >>> data = synthetic_identities(40, 6, image_size=16, seed=0)
    >>> clients = VirtualClients(data, clients_per_round=4, users_per_client=2,
    ...                          local_steps=2, batch_size=4)
    >>> clients.num_clients, clients.sampling_rate
    (20, 0.2)
    >>> element = clients.round(0)
    >>> element["images"].shape[1:], element["images"].dtype
    ((2, 4, 16, 16, 3), dtype('uint8'))
    >>> bool(element["client_mask"].sum() <= clients.max_clients_per_round)
    True
    >>> epochs = VirtualClients(data, users_per_client=2, num_clients=20,
    ...                         sampling="epochs", rounds_per_epoch=6)
    >>> len(epochs), epochs.max_clients_per_round  # ceil(20 / 6) slots
    (6, 4)
    """

    def __init__(
        self,
        images,
        labels=None,
        user_ids=None,
        *,
        clients_per_round=None,
        users_per_client=1,
        sampling="poisson",
        client_order=None,
        local_steps=1,
        batch_size=32,
        max_examples_per_client=None,
        max_clients_per_round=None,
        rounds_per_epoch=None,
        num_clients=None,
        num_classes=None,
        users=None,
        seed=None,
        workers=None,
        max_queue_size=2,
    ):
        if workers is None:
            workers = 1 if sampling == "epochs" else 2
        workers = validation.check_positive_int(workers, "workers")
        max_queue_size = validation.check_positive_int(max_queue_size, "max_queue_size")
        super().__init__(workers=workers, max_queue_size=max_queue_size)
        images, labels, user_ids, num_classes = sources.read_source(
            images, labels, user_ids, num_classes=num_classes
        )
        self._images = images
        self._labels = labels
        self.num_classes = num_classes
        self.image_shape = tuple(int(d) for d in images.shape[1:])
        self._index_users(user_ids, users)

        self.users_per_client = validation.check_positive_int(
            users_per_client, "users_per_client"
        )
        if self.users_per_client > self.num_users:
            raise ValueError(
                f"users_per_client={users_per_client} is more than the "
                f"{self.num_users} users in the data. Use at most "
                f"{self.num_users}, or add users."
            )
        if not isinstance(sampling, str) or sampling not in _SAMPLINGS:
            raise ValueError(f"sampling must be one of {_SAMPLINGS}, got {sampling!r}.")
        self.sampling = sampling
        self.client_order = self._check_client_order(client_order)
        if sampling == "epochs" and self.workers > 1:
            raise ValueError(
                f"workers={self.workers}: with sampling='epochs' Keras must read "
                "the rounds in order, one whole epoch per Keras epoch. Keras' "
                "multi-worker loader carries rounds it prefetched over into the "
                "next Keras epoch, which would then mix two epochs of rounds (a "
                "user could take part twice in one DP-FTRL tree). Use workers=1 "
                "(the default), or `to_tf_dataset()` for rounds prepared ahead."
            )
        self.num_clients = self._check_num_clients(num_clients)
        if self.sampling == "epochs":
            self.local_steps = validation.check_positive_int(local_steps, "local_steps")
            self.rounds_per_epoch = self._check_epoch_rounds(
                clients_per_round, rounds_per_epoch
            )
            # P enters the schedule only when given: a P derived from the
            # user count is not public (`Schedule.pool_is_public`).
            self._schedule = Schedule.virtual_clients(
                self.num_users,
                clients_per_round,
                users_per_client=self.users_per_client,
                num_clients=None if num_clients is None else self.num_clients,
                sampling=self.sampling,
                local_steps=self.local_steps,
                rounds_per_epoch=self.rounds_per_epoch,
            )
            self.clients_per_round = self._schedule.sample_size
            self.sampling_rate = self._schedule.sampling_probability
        else:
            self.clients_per_round = self._check_clients_per_round(clients_per_round)
            self.sampling_rate = self.clients_per_round / self.num_clients
            self.local_steps = validation.check_positive_int(local_steps, "local_steps")
            self._schedule = Schedule.virtual_clients(
                self.num_users,
                self.clients_per_round,
                users_per_client=self.users_per_client,
                num_clients=None if num_clients is None else self.num_clients,
                sampling=self.sampling,
                local_steps=self.local_steps,
            )
        self.batch_size = validation.check_positive_int(batch_size, "batch_size")
        self.max_examples_per_client = self._check_cap(max_examples_per_client)
        self.max_clients_per_round, self.truncation_probability = self._round_bound(
            max_clients_per_round
        )
        if self.sampling != "epochs":
            given = rounds_per_epoch is not None
            if not given:
                rounds_per_epoch = max(
                    1, math.floor(self.num_clients / self.clients_per_round)
                )
            self.rounds_per_epoch = validation.check_positive_int(
                rounds_per_epoch, "rounds_per_epoch"
            )
            if self.rounds_per_epoch > MAX_ROUNDS_PER_EPOCH:
                what = (
                    f"rounds_per_epoch={self.rounds_per_epoch}"
                    if given
                    else f"clients_per_round={self.clients_per_round:g} makes "
                    f"an epoch of floor(P / M) = {self.rounds_per_epoch:.3g} "
                    "rounds, which"
                )
                raise ValueError(
                    f"{what} is more than the {MAX_ROUNDS_PER_EPOCH} rounds an "
                    "epoch (len() of this dataset) can hold. Pass a smaller "
                    "rounds_per_epoch (and fit with epochs)."
                )
        # The last epochs' layouts (`_epoch_layout`), shared by the threads
        # that prepare rounds.
        self._layout_lock = threading.Lock()
        self._layouts = {}
        # Which slice of every round's client rows this process serves
        # (`join_hosts`); one host serves them all.
        self.host_index, self.host_count = 0, 1
        self._seed_is_fixed = seed is not None
        if seed is None:
            self._root_seed = secrets.randbits(128)
        else:
            if (
                not isinstance(seed, numbers.Integral)
                or isinstance(seed, bool)
                or not 0 <= seed < _MAX_SEED
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
                stacklevel=2,
            )
            self._root_seed = int(seed)
        # Every pass over the rounds (a Keras epoch, an iteration of the
        # PyDataset or of `to_tf_dataset()`) claims an epoch number never
        # used before, so no round is ever served for training twice.
        self._epoch_lock = threading.Lock()
        self._epochs_claimed = 0
        self._epoch = self._claim_epoch()

    # ----------------------------------------------------------- set-up --

    def _index_users(self, user_ids, roster):
        if isinstance(user_ids, UserShards):
            self._index_shards(user_ids, roster)
            return
        self._shards = None
        try:
            names, user_of_example = np.unique(user_ids, return_inverse=True)
        except TypeError:
            raise ValueError(
                "user_ids mix types that cannot be ordered (e.g. ints and "
                "strings); use one type, e.g. str(user) for every id."
            ) from None
        if roster is not None:
            _check_roster(names, roster, "user_ids", stacklevel=4)
        self.user_names = names
        self.num_users = int(names.size)
        self.num_examples = int(user_of_example.size)
        self._keys = assignment.user_keys(names)
        if np.unique(self._keys).size != self._keys.size:
            raise ValueError(
                "Two user ids share a 64-bit key (a BLAKE2b collision of "
                "string ids); they would share a virtual client. Rename one "
                "user or use integer ids."
            )
        self._examples_by_user = np.argsort(user_of_example, kind="stable")
        counts = np.bincount(user_of_example, minlength=self.num_users)
        self._user_offsets = np.concatenate([[0], np.cumsum(counts)])

    def _index_shards(self, shards, roster):
        """The per-user index of a `UserShards`, memory-mapped as written.

        Its users are sorted as `np.unique` sorts them and each user's
        examples are contiguous, in input order, so the rounds are those of
        the same data in memory; nothing per example is built.
        """
        names = shards.user_names
        if roster is not None:
            _check_roster(names, roster, shards.directory, stacklevel=5)
        self._shards = shards
        self.user_names = names
        self.num_users = shards.num_users
        self.num_examples = shards.num_images
        self._keys = shards.user_keys
        self._examples_by_user = _GROUPED
        self._user_offsets = shards.user_offsets

    def _check_num_clients(self, value):
        k = self.users_per_client
        if value is None:
            return mechanisms.num_virtual_clients(self.num_users, k)
        value = validation.check_positive_int(value, "num_clients")
        if k == 1 and value != self.num_users:
            raise ValueError(
                f"num_clients={value}: with users_per_client=1 every user is "
                f"their own virtual client, so num_clients is the number of "
                f"users ({self.num_users}). Leave it None."
            )
        low = mechanisms.num_virtual_clients(self.num_users, k)
        if not low <= value <= self.num_users:
            raise ValueError(
                f"num_clients={value} must be between ceil(N / k) = {low} and "
                f"N = {self.num_users} for {self.num_users} users with "
                f"users_per_client={k}."
            )
        return value

    def _check_client_order(self, order):
        if self.sampling != "epochs":
            if order is not None:
                raise ValueError(
                    f"client_order={order!r} is for sampling='epochs' only (rounds "
                    f"without sampling); sampling={self.sampling!r} draws new "
                    "clients every round. Leave client_order None, or use "
                    "sampling='epochs'."
                )
            return None
        if order is None:
            return "shuffled"
        if not isinstance(order, str) or order not in _CLIENT_ORDERS:
            raise ValueError(
                f"client_order must be one of {_CLIENT_ORDERS}, got {order!r}."
            )
        return order

    def _check_epoch_rounds(self, clients_per_round, rounds_per_epoch):
        """R, the public number of rounds per epoch, for sampling='epochs'."""
        pool = self.num_clients
        if clients_per_round is not None:
            clients_per_round = self._check_clients_per_round(clients_per_round)
        if rounds_per_epoch is None:
            if clients_per_round is None:
                raise ValueError(
                    "sampling='epochs' needs clients_per_round (M: an epoch is "
                    "then R = ceil(P / M) rounds) or rounds_per_epoch (R, a "
                    "public number). Pass one of them."
                )
            rounds = rounds_per_epoch_for(pool, clients_per_round)
            if self.users_per_client == 1:
                warnings.warn(
                    f"sampling='epochs' with one user per virtual client: the "
                    f"epoch's R = ceil(N / M) = {rounds} rounds derives from "
                    f"the private user count N = {pool}, and every user's round "
                    "depends on R, so one user more or less can move everyone. "
                    "Pass rounds_per_epoch from a public count.",
                    DataDependentScheduleWarning,
                    stacklevel=4,
                )
        else:
            rounds = validation.check_positive_int(rounds_per_epoch, "rounds_per_epoch")
            if clients_per_round is not None:
                implied = rounds_per_epoch_for(pool, clients_per_round)
                if implied != rounds:
                    raise ValueError(
                        f"clients_per_round={clients_per_round:g} and "
                        f"rounds_per_epoch={rounds} disagree: {pool} virtual "
                        f"clients in {rounds} rounds make {pool / rounds:.4g} "
                        f"per round, and clients_per_round={clients_per_round:g} "
                        f"makes ceil(P / M) = {implied} rounds. Pass only one "
                        "of them."
                    )
        if rounds > pool:
            given = (
                f"rounds_per_epoch={rounds}"
                if rounds_per_epoch is not None
                else f"clients_per_round={clients_per_round:g} (R = {rounds} rounds)"
            )
            raise ValueError(
                f"{given}: an epoch of {rounds} rounds over {pool} virtual "
                f"clients would leave some rounds always empty. Use at most "
                f"rounds_per_epoch={pool} (clients_per_round >= 1)."
            )
        return rounds

    def _check_clients_per_round(self, value):
        if value is None:
            raise ValueError(
                f"sampling={self.sampling!r} needs clients_per_round, M: the "
                "expected number of virtual clients per round."
            )
        value = validation.check_positive(value, "clients_per_round")
        if value > self.num_clients:
            raise ValueError(
                f"clients_per_round={value:g} is more than the "
                f"{self.num_clients} virtual clients that {self.num_users} "
                f"users make with users_per_client={self.users_per_client}. "
                f"Use at most {self.num_clients} (q = M / P must be <= 1)."
            )
        if self.sampling == "fixed":
            if value != int(value):
                raise ValueError(
                    f"sampling='fixed' takes exactly clients_per_round clients, "
                    f"which must be a whole number; got {value:g}."
                )
            value = int(value)
        return value

    def _check_cap(self, cap):
        slots = self.local_steps * self.batch_size
        if cap is None:
            return slots
        cap = validation.check_positive_int(cap, "max_examples_per_client")
        if cap > slots:
            raise ValueError(
                f"max_examples_per_client={cap} is more than the "
                f"local_steps * batch_size = {slots} examples a client can "
                f"use in a round. Use at most {slots}, or more local steps."
            )
        return cap

    @property
    def _truncation_tolerance(self):
        if self.users_per_client == 1:
            return TRUNCATION_TOLERANCE["data dependent"]
        return TRUNCATION_TOLERANCE["independent of data"]

    def _round_bound(self, bound):
        if self.sampling == "fixed":
            if bound is not None and bound != self.clients_per_round:
                raise ValueError(
                    f"max_clients_per_round={bound}: sampling='fixed' takes "
                    f"exactly clients_per_round={self.clients_per_round} slots. "
                    "Leave it None."
                )
            return self.clients_per_round, 0.0
        rate = self.sampling_rate
        if self.sampling == "epochs":
            # k > 1: a round holds a public number of slots. k = 1: each
            # user's round is uniform over R, so a round holds
            # Binomial(N, 1 / R) users.
            if self.users_per_client > 1:
                return self._epoch_slots_bound(bound), 0.0
            rate = 1.0 / self.rounds_per_epoch
        tolerance = self._truncation_tolerance
        if bound is None:
            bound = round_size.max_clients_per_round(self.num_clients, rate, tolerance)
        bound = validation.check_positive_int(bound, "max_clients_per_round")
        probability = round_size.overflow_probability(self.num_clients, rate, bound)
        if probability > tolerance:
            extra = (
                " With users_per_client=1 whether a round overflows depends on "
                "who is present: it adds up to e^ε · rounds · "
                f"{probability:.2g} to δ."
                if self.users_per_client == 1
                else ""
            )
            warnings.warn(
                f"max_clients_per_round={bound}: a round draws more clients "
                f"with probability {probability:.2g}, and then training stops "
                "with RoundTruncationError. Leave it as None for a bound "
                f"with probability <= {tolerance:g}." + extra,
                UserWarning,
                stacklevel=3,
            )
        return min(bound, self.num_clients), probability

    def _epoch_slots_bound(self, bound):
        slots = math.ceil(self.num_clients / self.rounds_per_epoch)
        if bound is not None:
            bound = validation.check_positive_int(bound, "max_clients_per_round")
            if bound != slots:
                raise ValueError(
                    f"max_clients_per_round={bound}: with sampling='epochs' and "
                    f"users_per_client={self.users_per_client} every round "
                    f"holds ceil(P / R) = ceil({self.num_clients} / "
                    f"{self.rounds_per_epoch}) = {slots} client slots (or one "
                    "fewer). Leave it None."
                )
        return slots

    # ------------------------------------------------------- properties --

    @property
    def max_local_classes(self):
        """Most identities one client can hold in a round (head columns)."""
        return min(self.max_examples_per_client, self.num_classes)

    @property
    def max_identities_per_user(self):
        """Most identities any one user holds."""
        if self._shards is not None:
            return self._shards.max_identities_per_user
        counts = np.diff(self._user_offsets)
        users = np.repeat(np.arange(self.num_users), counts)
        labels = self._labels[self._examples_by_user].astype(np.int64)
        pairs = np.unique(users * self.num_classes + labels)
        return int(np.bincount(pairs // self.num_classes).max())

    @property
    def element_spec(self):
        """`{key: (shape, dtype)}` of one round as this host serves it
        (`rows_per_host` rows; all `max_clients_per_round` on one host)."""
        m, s, b = self.rows_per_host, self.local_steps, self.batch_size
        grid = (m, s, b)
        return {
            "images": ((*grid, *self.image_shape), np.dtype(self._images.dtype)),
            "labels": (grid, np.dtype(np.int32)),
            "global_labels": (grid, np.dtype(np.int32)),
            "example_mask": (grid, np.dtype(bool)),
            "client_mask": ((m,), np.dtype(bool)),
            "num_local_classes": ((m,), np.dtype(np.int32)),
            **(
                {key: ((m,), np.dtype(np.int32)) for key in _POSITION_KEYS}
                if self.sampling == "epochs"
                else {}
            ),
            **(
                {"round_index": ((m,), np.dtype(np.int32))}
                if self.host_count > 1
                else {}
            ),
        }

    @property
    def round_nbytes(self):
        """Bytes of one round (the prefetch queue holds `max_queue_size`)."""
        return sum(
            math.prod(shape) * dtype.itemsize
            for shape, dtype in self.element_spec.values()
        )

    @property
    def schedule(self):
        """The `kdpemb.privacy.Schedule` these rounds are sampled with.

        The one description of the sampling that the model (it takes it at
        its first `fit`) and the accountant use; its
        `privacy_mechanism(noise_multiplier, clip_norm)` is the mechanism
        of one round. `num_clients` is in it only when you gave it (a
        public count); otherwise `schedule.pool_is_public` is False for
        k > 1.

        Example:

        >>> import numpy as np
        >>> clients = VirtualClients(np.zeros((8, 4, 4, 1)), labels=np.arange(8),
        ...                          user_ids=np.arange(8) // 2,
        ...                          clients_per_round=2, seed=None)
        >>> mechanism = clients.schedule.privacy_mechanism(1.0, clip_norm=0.1)
        >>> mechanism.pool_size, mechanism.sample_size, mechanism.unit
        (4, 2.0, 'user')
        """
        return self._schedule

    def describe(self):
        """A few lines on the population, the sampling and one round."""
        spec = self.element_spec
        if self.sampling == "epochs":
            how = (
                f"no sampling: each in one of {self.rounds_per_epoch} rounds "
                f"per epoch ({self.client_order} order), "
                f"{self.clients_per_round:.4g} per round"
            )
        else:
            how = (
                f"{self.sampling} sampling, M = {self.clients_per_round:g} "
                f"per round (q = {self.sampling_rate:.4g})"
            )
        lines = [
            f"{self.num_examples} examples of {self.num_classes} identities "
            f"from {self.num_users} users",
            f"{self.num_clients} virtual clients of ~{self.users_per_client} "
            f"user(s); {how}",
            f"M_max = {self.max_clients_per_round} client slots "
            f"(overflow probability {self.truncation_probability:.2g} per round)",
            f"{self.rounds_per_epoch} rounds per epoch, "
            f"{self.round_nbytes / 2**20:.1f} MiB per round",
        ]
        lines += [
            f"  {key}: {list(shape)} {dtype}" for key, (shape, dtype) in spec.items()
        ]
        return "\n".join(lines)

    def __repr__(self):
        return (
            f"VirtualClients(num_users={self.num_users}, "
            f"num_clients={self.num_clients}, "
            f"clients_per_round={self.clients_per_round:g}, "
            f"sampling={self.sampling!r}"
            + (
                f", rounds_per_epoch={self.rounds_per_epoch}, "
                f"client_order={self.client_order!r})"
                if self.sampling == "epochs"
                else ")"
            )
        )

    # --------------------------------------------------------- sampling --

    def _rng(self, stream, round_index, key=0):
        # Fixed-width words after a 128-bit root: no two (stream, round,
        # key) triples share a random stream.
        words = (stream, *_words64(round_index), *_words64(key))
        return np.random.default_rng(
            np.random.SeedSequence(self._root_seed, spawn_key=words)
        )

    def plan_round(self, round_index):
        """The clients of one round: `{client_key: ClientPlan}`.

        The key is the user's key (`assignment.user_keys`) for k = 1 and
        the client slot for k > 1. Clients without users are left out. The
        arrays of `round()` are built from this plan.
        """
        round_index = validation.check_steps(round_index, "round_index", minimum=0)
        if self.sampling == "epochs":
            members = self._epoch_members(round_index)
        else:
            members = self._sampled_members(round_index)
        return {
            key: self._plan_client(users, self._rng(_CLIENT_STREAM, round_index, key))
            for key, users in members.items()
            if users.size
        }

    def _sampled_members(self, round_index):
        """`{client key: user indices}` of a Poisson or fixed-size round."""
        salts = self._rng(_ROUND_STREAM, round_index).integers(
            0, 2**64, size=3, dtype=np.uint64, endpoint=False
        )
        assign_salt, sample_salt, _ = (int(s) for s in salts)
        if self.users_per_client == 1:
            client_keys = self._keys
            members = None
        else:
            client_keys = np.arange(self.num_clients, dtype=np.uint64)
            slots = assignment.assign_virtual_clients(
                self._keys, self.num_clients, assign_salt
            )
        if self.sampling == "poisson":
            chosen = np.flatnonzero(
                assignment.hash_uniform(client_keys, sample_salt) < self.sampling_rate
            )
        else:
            order = np.argsort(assignment.keyed_hash(client_keys, sample_salt))
            chosen = np.sort(order[: self.clients_per_round])
        self._check_round_size(round_index, chosen.size, "sampled")
        if self.users_per_client == 1:
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
        if count > self.max_clients_per_round:
            raise RoundTruncationError(
                f"Round {round_index} {verb} {count} virtual clients, "
                f"more than max_clients_per_round={self.max_clients_per_round} "
                f"(probability {self.truncation_probability:.2g} per round). "
                "No update was computed from it. Raise max_clients_per_round "
                "(or leave it None) and resume."
            )

    def _epoch_members(self, round_index):
        """`{client key: user indices}` of a round of sampling='epochs'."""
        epoch, position = divmod(round_index, self.rounds_per_epoch)
        layout = self._epoch_layout(epoch)
        if self.users_per_client == 1:
            chosen = layout[position]
            self._check_round_size(round_index, chosen.size, "holds")
            return {int(self._keys[u]): np.array([u]) for u in chosen}
        slots, users_by_slot, slot_bounds = layout
        start, stop = _epoch_positions(
            position, self.num_clients, self.rounds_per_epoch
        )
        return {
            int(slot): users_by_slot[slot_bounds[slot] : slot_bounds[slot + 1]]
            for slot in np.sort(slots[start:stop])
        }

    def _epoch_id(self, epoch):
        """A 31-bit identity of an epoch's layout (who is in which round),
        drawn from the sampling seed: the same for the same layout (with
        `client_order="fixed"`, every epoch's), and with probability
        1 - 2^-31 different for another epoch or another `VirtualClients`
        (a restarted job draws a new seed, and a new layout)."""
        key = 0 if self.client_order == "fixed" else epoch
        return int(self._rng(_LAYOUT_ID_STREAM, key).integers(0, 2**31 - 1))

    def _epoch_layout(self, epoch):
        """Who is where in one epoch of sampling='epochs' (cached).

        k = 1: a list of R arrays, the users of each round; a user's round
        is floor(hash_uniform(user key, salt) * R), which looks at no other
        user. k > 1: `(slot order, users sorted by slot, slot bounds)`;
        every user keeps one slot (a keyed hash with the epoch's salt) for
        the whole epoch, and round r takes the slots at positions j of the
        order with floor(j * R / P) = r. With `client_order="fixed"` the
        salts (and for k > 1 the slot order 0..P-1) are those of epoch 0.
        """
        key = 0 if self.client_order == "fixed" else epoch
        with self._layout_lock:
            layout = self._layouts.get(key)
        if layout is not None:
            return layout
        salts = self._rng(_EPOCH_STREAM, key).integers(
            0, 2**64, size=2, dtype=np.uint64, endpoint=False
        )
        assign_salt, order_salt = (int(s) for s in salts)
        rounds = self.rounds_per_epoch
        if self.users_per_client == 1:
            place = assignment.hash_uniform(self._keys, assign_salt) * rounds
            place = np.minimum(np.floor(place).astype(np.int64), rounds - 1)
            by_round = np.argsort(place, kind="stable")
            bounds = np.searchsorted(place[by_round], np.arange(rounds + 1))
            layout = [by_round[bounds[r] : bounds[r + 1]] for r in range(rounds)]
        else:
            pool = self.num_clients
            slots = assignment.assign_virtual_clients(self._keys, pool, assign_salt)
            if self.client_order == "fixed":
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
        starts = self._user_offsets[users]
        counts = self._user_offsets[users + 1] - starts
        quotas = _even_quotas(
            counts, min(self.max_examples_per_client, counts.sum()), rng
        )
        chosen = np.concatenate(
            [
                self._examples_by_user[start + rng.choice(count, quota, replace=False)]
                for start, count, quota in zip(starts, counts, quotas, strict=True)
            ]
        )
        grid = _layout(chosen, self.local_steps, self.batch_size, rng)
        return ClientPlan(users=users, example_index=grid)

    def round(self, round_index):
        """The arrays of one round (see the class docstring)."""
        plans = list(self.plan_round(round_index).values())
        return self._round_arrays(round_index, plans, self.max_clients_per_round)

    def host_round(self, round_index):
        """This host's slice of round `round_index`: what training reads.

        On one host, the whole round. After `join_hosts`, host h of H
        builds the `max_clients_per_round // H` rows of the round's
        clients h, h + H, h + 2H, ... of `plan_round` (so every host
        trains about as many clients), reads the examples of those
        clients only, and adds `round_index` (the round's index modulo
        2**20, `[rows_per_host]` int32) so that the model can check that
        every host serves the same round.
        """
        plans = list(self.plan_round(round_index).values())
        rows = plans[self.host_index :: self.host_count]
        element = self._round_arrays(round_index, rows, self.rows_per_host)
        if self.host_count > 1:
            # On every row: the model checks that all hosts serve one round.
            element["round_index"] = np.full(
                self.rows_per_host, round_index % _ROUND_INDEX_MODULUS, np.int32
            )
        return element

    @property
    def rows_per_host(self):
        """Client rows of a round that each host builds."""
        return self.max_clients_per_round // self.host_count

    def join_hosts(self, hosts):
        """Makes this the slice of one round plan shared by every host.

        `FedEmbModel.fit` calls it on every host before the first round,
        under a multi-host engine (`kdpemb.distribute.current_hosts`). The
        sampling seed becomes the chief's (drawn from OS entropy there;
        a fixed `seed` must be the same on every host), every host is at
        the same epoch of rounds (a new one if they were not), and the
        plan (seed, settings, user index; not the pixels) is compared
        across hosts: any difference raises
        `kdpemb.errors.HostsDisagreeError` on every host. From then on
        this host serves only its rows (`host_round`).

        Args:
            hosts: `kdpemb.distribute.Hosts`.

        Example:

        >>> from kdpemb.distribute import Hosts
        >>> clients = VirtualClients(np.zeros((8, 2, 2, 1)), np.zeros(8, int),
        ...                          np.arange(8), clients_per_round=2)
        >>> clients.join_hosts(Hosts.single())
        >>> clients.host_count, clients.rows_per_host == clients.max_clients_per_round
        (1, True)
        """
        self.check_hosts(hosts)
        if hosts.count > 1 and not self._seed_is_fixed:
            self._root_seed = hosts.shared_bits(128)
            with self._layout_lock:
                self._layouts = {}
        # The same current epoch everywhere: unchanged where the hosts agree
        # (fresh clients), else a new one that no host has served.
        epochs = hosts.gather_ints([self._epoch, self._epochs_claimed])
        if any(row != epochs[0] for row in epochs):
            with self._epoch_lock:
                self._epochs_claimed = max(row[1] for row in epochs)
            self._epoch = self._claim_epoch()
        hosts.check_agree({"round plan": self.plan_fingerprint()})
        self.host_index, self.host_count = hosts.index, hosts.count

    def check_hosts(self, hosts):
        """Refuses hosts the rounds' rows do not split over (no collective:
        `FedEmbModel.fit` runs it on each host before `join_hosts`)."""
        if self.max_clients_per_round % hosts.count:
            size = -(-self.max_clients_per_round // hosts.count) * hosts.count
            if self.sampling == "fixed":
                fix = f"clients_per_round a multiple of {hosts.count}"
            elif self.sampling == "epochs" and self.users_per_client > 1:
                fix = (
                    f"num_clients and rounds_per_epoch such that ceil(P / R) "
                    f"is a multiple of {hosts.count}"
                )
            elif size <= self.num_clients:
                fix = f"max_clients_per_round={size}"
            else:  # M_max is at most P.
                fix = (
                    f"more virtual clients (num_clients >= {size}), or a number "
                    f"of hosts that divides {self.max_clients_per_round}"
                )
            raise ValueError(
                f"The rounds hold max_clients_per_round="
                f"{self.max_clients_per_round} client rows, which do not split "
                f"over {hosts.count} hosts; build the VirtualClients with "
                f"{fix}."
            )

    def plan_fingerprint(self):
        """Bytes that differ between two `VirtualClients` whose rounds may
        differ: the seed, the next epoch, the settings and the user index
        (for `join_hosts`; the seed is in it, so keep it private)."""
        digest = hashlib.blake2b(digest_size=32)
        settings = (
            self._root_seed,
            self._epochs_claimed,
            repr(self.schedule),
            self.max_clients_per_round,
            self.max_examples_per_client,
            self.batch_size,
            self.rounds_per_epoch,
            self.client_order,
            self.num_classes,
            self.image_shape,
            str(np.dtype(self._images.dtype)),
        )
        digest.update(repr(settings).encode())
        digest.update(np.ascontiguousarray(self._keys).tobytes())
        digest.update(np.ascontiguousarray(self._user_offsets).tobytes())
        return digest.digest()

    def _round_arrays(self, round_index, plans, m):
        """The round's arrays over `m` rows, the first `len(plans)` from
        `plans` (in order) and the rest masked."""
        s, b = self.local_steps, self.batch_size
        index = np.full((m, s, b), -1, dtype=np.int64)
        local = np.zeros((m, s, b), dtype=np.int32)
        num_local = np.zeros(m, dtype=np.int32)
        for row, plan in enumerate(plans):
            grid = plan.example_index
            index[row] = grid
            used = grid >= 0
            classes, local_labels = np.unique(
                self._labels[grid[used]], return_inverse=True
            )
            local[row][used] = local_labels
            num_local[row] = classes.size
        example_mask = index >= 0
        client_mask = np.zeros(m, dtype=bool)
        client_mask[: len(plans)] = True
        global_labels = np.where(example_mask, self._labels[np.maximum(index, 0)], 0)
        element = {
            "images": self._gather(index, example_mask),
            "labels": local,
            "global_labels": global_labels.astype(np.int32),
            "example_mask": example_mask,
            "client_mask": client_mask,
            "num_local_classes": num_local,
        }
        if self.sampling == "epochs":
            # Where the round sits, on every row (rows may be split over
            # devices): the model checks that each of its epochs takes
            # distinct rounds of one epoch layout.
            epoch, position = divmod(round_index, self.rounds_per_epoch)
            element["epoch_id"] = np.full(m, self._epoch_id(epoch), np.int32)
            element["round_in_epoch"] = np.full(m, position, np.int32)
        return element

    def _gather(self, index, mask):
        flat_index = index.reshape(-1)
        flat_mask = mask.reshape(-1)
        out = np.empty((flat_index.size, *self.image_shape), dtype=self._images.dtype)
        if isinstance(self._images, np.ndarray):
            np.take(self._images, np.maximum(flat_index, 0), axis=0, out=out)
            out[~flat_mask] = 0
        else:
            out[...] = 0
            out[flat_mask] = np.asarray(self._images[flat_index[flat_mask]])
        return out.reshape(*index.shape, *self.image_shape)

    # ------------------------------------------------ keras.utils.PyDataset --

    def __len__(self):
        return self.rounds_per_epoch

    def _claim_epoch(self):
        with self._epoch_lock:
            self._epochs_claimed += 1
            return self._epochs_claimed - 1

    def _epoch_round(self, epoch, index):
        if not 0 <= index < self.rounds_per_epoch:
            raise IndexError(
                f"round {index} is out of range for an epoch of "
                f"{self.rounds_per_epoch} rounds."
            )
        return self.host_round(epoch * self.rounds_per_epoch + index)

    def __getitem__(self, index):
        """Round `index` of the current Keras epoch (same index, same round)."""
        return self._epoch_round(self._epoch, index)

    def __iter__(self):
        """One epoch of rounds that no earlier pass has served."""
        epoch = self._claim_epoch()
        for index in range(self.rounds_per_epoch):
            yield self._epoch_round(epoch, index)

    def on_epoch_end(self):
        self._epoch = self._claim_epoch()

    def to_tf_dataset(self):
        """The rounds as a prefetched `tf.data.Dataset` of dicts.

        Each iteration is one epoch of rounds that no earlier pass (even an
        interrupted one) has served. Its cardinality is `rounds_per_epoch`.
        `clients_of(dataset)` finds these clients again, so a `FedEmbModel`
        fit on this very dataset checks (or takes) their schedule as for
        the `VirtualClients` itself; a dataset derived from it (`.map`,
        `.filter`, ...) needs `FedEmbModel(..., schedule=clients.schedule)`.
        """
        import tensorflow as tf

        signature = {
            key: tf.TensorSpec(shape, tf.as_dtype(dtype))
            for key, (shape, dtype) in self.element_spec.items()
        }

        def epoch():
            yield from iter(self)

        dataset = tf.data.Dataset.from_generator(epoch, output_signature=signature)
        dataset = dataset.apply(
            tf.data.experimental.assert_cardinality(self.rounds_per_epoch)
        )
        dataset = dataset.prefetch(self.max_queue_size)
        _DATASET_SOURCES[dataset] = self
        return dataset


# Datasets made by `to_tf_dataset`, to the clients they came from (weakly:
# an entry goes with its dataset).
_DATASET_SOURCES = weakref.WeakKeyDictionary()


def clients_of(dataset):
    """The `VirtualClients` whose `to_tf_dataset()` made `dataset`, or None."""
    try:
        return _DATASET_SOURCES.get(dataset)
    except TypeError:  # Not weakly referenceable: not one of ours.
        return None


def participation_counts(clients, epoch):
    """How many times each user takes part in one epoch of `clients`' rounds.

    Reads the plans of rounds `epoch * len(clients)` to
    `(epoch + 1) * len(clients) - 1` (`VirtualClients.plan_round`) and counts
    every client a user is in (a user in two clients of one round counts
    twice). With `sampling="epochs"` every count is 1; with Poisson or
    fixed-size sampling a user can take part in several rounds of an epoch.

    Args:
        clients: `VirtualClients`.
        epoch: int >= 0. The epoch (pass over `len(clients)` rounds).

    Returns:
        dict `{user index: count}` over every user (index into
        `clients.user_names`), 0 for a user in no round.

    Example:

    >>> import numpy as np
    >>> clients = VirtualClients(np.zeros((6, 2, 2, 1)), labels=np.zeros(6, int),
    ...                          user_ids=np.arange(6), sampling="epochs",
    ...                          rounds_per_epoch=3)
    >>> participation_counts(clients, epoch=0)
    {0: 1, 1: 1, 2: 1, 3: 1, 4: 1, 5: 1}
    """
    epoch = validation.check_steps(epoch, "epoch", minimum=0)
    rounds = len(clients)
    counts = np.zeros(clients.num_users, dtype=np.int64)
    for position in range(rounds):
        for plan in clients.plan_round(epoch * rounds + position).values():
            np.add.at(counts, plan.users, 1)
    return {user: int(count) for user, count in enumerate(counts)}


def _check_roster(names, roster, source, stacklevel):
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


def _even_quotas(counts, total, rng):
    """Splits `total` examples between users as evenly as their counts allow."""
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


def _layout(examples, steps, batch_size, rng):
    """`[steps, batch_size]` example indices: shuffled passes, -1 = empty."""
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


def _epoch_positions(position, num_clients, rounds):
    """`[start, stop)`: the positions j with floor(j * R / P) = position."""
    return (
        -(-position * num_clients // rounds),
        -(-(position + 1) * num_clients // rounds),
    )


def _words64(value):
    value = int(value)
    return value & 0xFFFFFFFF, value >> 32
