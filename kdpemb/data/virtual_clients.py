"""`VirtualClients`: user data as fixed-shape DP-FedEmb training rounds.

A `keras.utils.PyDataset` shell: a `RoundPlanner` (`kdpemb.data.round_plan`)
says which examples each round holds; `VirtualClients` gathers them into
the arrays of a round, serves them to `model.fit` (or as `to_tf_dataset()`)
and, on several hosts, serves this host's rows (`kdpemb.data.host_rounds`).
"""

import math
import weakref

import keras
import numpy as np

from kdpemb import _finite_inputs as finite_inputs
from kdpemb import _validation as validation
from kdpemb.data import host_rounds
from kdpemb.data.round_arrays import POSITION_KEYS, element_spec, round_arrays

# ClientPlan and the two bounds were defined here before the planner moved
# out: they stay importable from this module.
from kdpemb.data.round_plan import ClientPlan as ClientPlan
from kdpemb.data.round_plan import RoundPlanner
from kdpemb.data.round_settings import MAX_ROUNDS_PER_EPOCH as MAX_ROUNDS_PER_EPOCH
from kdpemb.data.round_settings import TRUNCATION_TOLERANCE as TRUNCATION_TOLERANCE
from kdpemb.data.round_settings import RoundSettings
from kdpemb.data.user_index import index_users
from kdpemb.datasets import sources as user_sources
from kdpemb.datasets.user_shards_reader import UserShards


def _planned(name, doc):
    """A read-only attribute of the rounds' `RoundSettings`."""
    return property(lambda self: getattr(self.planner.settings, name), doc=doc)


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
        images, labels, user_ids, num_classes = read_source(
            images, labels, user_ids, num_classes=num_classes
        )
        self._images = images
        self._labels = labels
        self.num_classes = num_classes
        self.image_shape = tuple(int(d) for d in images.shape[1:])
        user_index = index_users(user_ids, users)
        settings = RoundSettings(
            user_index.num_users,
            clients_per_round=clients_per_round,
            users_per_client=users_per_client,
            sampling=sampling,
            client_order=client_order,
            local_steps=local_steps,
            batch_size=batch_size,
            max_examples_per_client=max_examples_per_client,
            max_clients_per_round=max_clients_per_round,
            rounds_per_epoch=rounds_per_epoch,
            num_clients=num_clients,
            workers=self.workers,
        )
        # Which users, clients and examples each round holds.
        self.planner = RoundPlanner(settings, user_index, seed)
        # Which slice of every round's client rows this process serves
        # (`join_hosts`); one host serves them all.
        self.hosts = host_rounds.HostSlice()

    # ------------------------------------------------------- attributes --

    users_per_client = _planned("users_per_client", "k, users per virtual client.")
    sampling = _planned("sampling", '"poisson", "fixed" or "epochs".')
    client_order = _planned("client_order", 'With sampling="epochs": the order.')
    num_clients = _planned("num_clients", "P, the number of virtual clients.")
    clients_per_round = _planned("clients_per_round", "M, clients per round.")
    sampling_rate = _planned("sampling_rate", "q = M / P.")
    local_steps = _planned("local_steps", "Local batches per client per round.")
    batch_size = _planned("batch_size", "Examples per local batch.")
    max_examples_per_client = _planned(
        "max_examples_per_client", "Cap on a client's examples per round."
    )
    max_clients_per_round = _planned(
        "max_clients_per_round", "M_max, the client rows of a round."
    )
    truncation_probability = _planned(
        "truncation_probability", "Probability that a round exceeds M_max."
    )
    rounds_per_epoch = _planned("rounds_per_epoch", "Rounds per pass (`len`).")

    user_names = property(
        lambda self: self.planner.users.user_names,
        doc="User ids, sorted; `ClientPlan.users` index them.",
    )
    num_users = property(
        lambda self: self.planner.users.num_users, doc="N, users with examples."
    )
    num_examples = property(
        lambda self: self.planner.users.num_examples, doc="Examples of all users."
    )
    host_index = property(
        lambda self: self.hosts.index, doc="This host's index (0 on one host)."
    )
    host_count = property(
        lambda self: self.hosts.count, doc="Hosts sharing the rounds (`join_hosts`)."
    )

    # The user index and seed under their former names (tests read them).
    _keys = property(lambda self: self.planner.users.keys)
    _user_offsets = property(lambda self: self.planner.users.user_offsets)
    _examples_by_user = property(lambda self: self.planner.users.examples_by_user)
    _root_seed = property(lambda self: self.planner.root_seed)

    def _rng(self, stream, round_index, key=0):
        return self.planner.rng(stream, round_index, key)

    @property
    def max_local_classes(self):
        """Most identities one client can hold in a round (head columns)."""
        return min(self.max_examples_per_client, self.num_classes)

    @property
    def max_identities_per_user(self):
        """Most identities any one user holds."""
        return self.planner.users.max_identities_per_user(
            self._labels, self.num_classes
        )

    @property
    def element_spec(self):
        """`{key: (shape, dtype)}` of one round as this host serves it
        (`rows_per_host` rows; all `max_clients_per_round` on one host)."""
        keys = POSITION_KEYS if self.sampling == "epochs" else ()
        if self.host_count > 1:
            keys = (*keys, "round_index")
        return element_spec(
            self.rows_per_host,
            self.local_steps,
            self.batch_size,
            self.image_shape,
            self._images.dtype,
            keys=keys,
        )

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
        return self.planner.settings.schedule

    def describe(self):
        """A few lines on the population, the sampling and one round."""
        spec = self.element_spec
        lines = [
            f"{self.num_examples} examples of {self.num_classes} identities "
            f"from {self.num_users} users",
            *self.planner.settings.describe(),
            f"{self.rounds_per_epoch} rounds per epoch, "
            f"{self.round_nbytes / 2**20:.1f} MiB per round",
        ]
        lines += [
            f"  {key}: {list(shape)} {dtype}" for key, (shape, dtype) in spec.items()
        ]
        return "\n".join(lines)

    def __repr__(self):
        return f"VirtualClients({self.planner.settings.arguments()})"

    # ----------------------------------------------------------- rounds --

    def plan_round(self, round_index):
        """The clients of one round: `{client_key: ClientPlan}`.

        The key is the user's key (`assignment.user_keys`) for k = 1 and
        the client slot for k > 1. Clients without users are left out. The
        arrays of `round()` are built from this plan.
        """
        return self.planner.plan_round(round_index)

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
        rows = self.hosts.rows(plans)
        element = self._round_arrays(round_index, rows, self.rows_per_host)
        if self.host_count > 1:
            # On every row: the model checks that all hosts serve one round.
            element["round_index"] = np.full(
                self.rows_per_host,
                round_index % host_rounds.ROUND_INDEX_MODULUS,
                np.int32,
            )
        return element

    @property
    def rows_per_host(self):
        """Client rows of a round that each host builds."""
        return self.hosts.rows_of(self.max_clients_per_round)

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
        self.hosts = host_rounds.join_hosts(
            self.planner, hosts, self._fingerprint_extra()
        )

    def check_hosts(self, hosts):
        """Refuses hosts the rounds' rows do not split over (no collective:
        `FedEmbModel.fit` runs it on each host before `join_hosts`)."""
        host_rounds.check_split(self.planner.settings, hosts)

    def plan_fingerprint(self):
        """Bytes that differ between two `VirtualClients` whose rounds may
        differ: the seed, the next epoch, the settings and the user index
        (for `join_hosts`; the seed is in it, so keep it private)."""
        return self.planner.fingerprint(self._fingerprint_extra())

    def _fingerprint_extra(self):
        return (self.num_classes, self.image_shape, str(np.dtype(self._images.dtype)))

    def _round_arrays(self, round_index, plans, m):
        """The round's arrays over `m` rows, the first `len(plans)` from
        `plans` (in order) and the rest masked."""
        grid = (m, self.local_steps, self.batch_size)
        element = round_arrays(
            plans, grid, self._images, self._labels, self.image_shape
        )
        if self.sampling == "epochs":
            # Where the round sits, on every row (rows may be split over
            # devices): the model checks that each of its epochs takes
            # distinct rounds of one epoch layout.
            epoch, position = divmod(round_index, self.rounds_per_epoch)
            element["epoch_id"] = np.full(m, self.planner.epoch_id(epoch), np.int32)
            element["round_in_epoch"] = np.full(m, position, np.int32)
        return element

    # ------------------------------------------------ keras.utils.PyDataset --

    def __len__(self):
        return self.rounds_per_epoch

    def _epoch_round(self, epoch, index):
        if not 0 <= index < self.rounds_per_epoch:
            raise IndexError(
                f"round {index} is out of range for an epoch of "
                f"{self.rounds_per_epoch} rounds."
            )
        return self.host_round(epoch * self.rounds_per_epoch + index)

    def __getitem__(self, index):
        """Round `index` of the current Keras epoch (same index, same round)."""
        return self._epoch_round(self.planner.epoch, index)

    def __iter__(self):
        """One epoch of rounds that no earlier pass has served."""
        epoch = self.planner.claim_epoch()
        for index in range(self.rounds_per_epoch):
            yield self._epoch_round(epoch, index)

    def on_epoch_end(self):
        self.planner.start_epoch()

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


def read_source(images, labels=None, user_ids=None, *, num_classes=None):
    """Returns checked `(images, labels, user_ids, num_classes)`.

    `images` keeps its type when it is a NumPy array or a lazy array-like,
    so a large synthetic dataset is never materialised here. For a
    `UserShards` the images and labels are its lazy arrays and `user_ids`
    is the `UserShards` itself: its examples are already grouped by user
    and were checked when written, so nothing is scanned here.

    Example:

    >>> import numpy as np
    >>> images, labels, user_ids, num_classes = read_source(
    ...     np.zeros((4, 2, 2, 1), np.uint8), [0, 1, 1, 0], [7, 7, 8, 8])
    >>> images.shape, labels.tolist(), user_ids.tolist(), num_classes
    ((4, 2, 2, 1), [0, 1, 1, 0], [7, 7, 8, 8], 2)
    """
    if isinstance(images, UserShards):
        return _read_shards(images, labels, user_ids, num_classes)
    source = user_sources.open_source(images, labels, user_ids)
    images, labels, user_ids, _ = source.arrays()
    user_sources.check_image_shape(images.shape)
    # As the float32 FedEmbModel casts them to (1e39 would turn infinite).
    finite_inputs.check_array(images, "images", what="pixels", as_dtype="float32")
    labels, num_classes = user_sources.check_labels(labels, len(images), num_classes)
    user_ids = user_sources.check_user_ids(user_ids, len(images))
    return images, labels, user_ids, num_classes


def _read_shards(shards, labels, user_ids, num_classes):
    if labels is not None or user_ids is not None:
        raise ValueError(
            "Pass either a UserShards or (images, labels, user_ids), not both: "
            "a UserShards already carries labels and user ids."
        )
    if num_classes is None:
        num_classes = shards.num_classes
    else:
        num_classes = validation.check_positive_int(num_classes, "num_classes")
        if num_classes <= shards.max_label:
            raise ValueError(
                f"num_classes={num_classes}, but the labels of {shards.directory} "
                f"go up to {shards.max_label}. Use num_classes >= "
                f"{shards.max_label + 1}, or leave it None "
                f"({shards.num_classes}, as written)."
            )
    return shards.images, shards.labels, shards, num_classes
