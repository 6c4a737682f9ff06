"""VirtualClients(sampling="epochs"): rounds without sampling for DP-FTRL.

The accounting (`kdpemb.privacy.TreeAggregation`) needs every user in at
most one round per epoch, and a user's round independent of who else is in
the data. These tests check both on the plans, by brute force.
"""

import math

import keras
import numpy as np
import pytest
from scipy import stats

from kdpemb import privacy
from kdpemb.data import VirtualClients, round_plan, round_size
from kdpemb.data import virtual_clients as vc
from kdpemb.data.virtual_clients import participation_counts
from kdpemb.datasets.user_hash import user_keys
from kdpemb.errors import RoundTruncationError
from kdpemb.testing import RoundConsumer
from tests.data import elements
from tests.data.elements import without_user

pytestmark = pytest.mark.filterwarnings(
    "ignore::kdpemb.errors.ReproducibleSamplingWarning"
)


def population(num_users, seed, *, max_examples=4, num_classes=5):
    """`elements.population` with this file's smaller users."""
    return elements.population(
        num_users, seed, max_examples=max_examples, num_classes=num_classes
    )


def epochs_clients(data, **kwargs):
    defaults = dict(sampling="epochs", local_steps=2, batch_size=3, seed=0)
    return VirtualClients(*data, **{**defaults, **kwargs})


def assert_each_user_once(counts, num_users):
    assert sorted(counts) == list(range(num_users))
    repeated = {user: c for user, c in counts.items() if c != 1}
    assert not repeated, f"users not in exactly one round: {repeated}"


def rounds_of_epoch(clients, epoch):
    """[{client key: user names}] for each round of `epoch`."""
    rounds = len(clients)
    return [
        {
            key: tuple(clients.user_names[plan.users])
            for key, plan in clients.plan_round(epoch * rounds + r).items()
        }
        for r in range(rounds)
    ]


def contents(clients, round_index, example_ids):
    """{client key: (user names, example ids per local slot)}."""
    out = {}
    for key, plan in clients.plan_round(round_index).items():
        grid = plan.example_index
        ids = np.where(grid >= 0, example_ids[np.maximum(grid, 0)], -1)
        out[key] = (tuple(clients.user_names[plan.users]), ids.tobytes())
    return out


def changed(a, b):
    return {key for key in a.keys() | b.keys() if a.get(key) != b.get(key)}


ORDERS = ["shuffled", "fixed"]


# ----------------------------------------------- at most once per epoch --


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("users_per_client", [1, 3])
def test_every_user_is_in_exactly_one_round_of_each_epoch(users_per_client, order):
    data = population(30, seed=1)
    clients = epochs_clients(
        data, users_per_client=users_per_client, clients_per_round=3,
        client_order=order,
    )  # fmt: skip
    rounds = math.ceil(clients.num_clients / 3)
    assert len(clients) == clients.rounds_per_epoch == rounds
    if users_per_client > 1:
        assert clients.max_clients_per_round == math.ceil(clients.num_clients / rounds)
    for epoch in range(3):
        assert_each_user_once(participation_counts(clients, epoch), 30)
        slots_seen = []
        for r in range(rounds):
            plans = clients.plan_round(epoch * rounds + r)
            slots_seen += list(plans)
            element = clients.round(epoch * rounds + r)
            for key, (shape, dtype) in clients.element_spec.items():
                assert element[key].shape == shape and element[key].dtype == dtype
            assert element["client_mask"].sum() == len(plans)
            assert len(plans) <= clients.max_clients_per_round
        # No client (user, or slot) is in two rounds of an epoch.
        assert len(slots_seen) == len(set(slots_seen))


def test_the_once_per_epoch_check_fails_on_sampled_rounds():
    # The same users with Poisson sampling at q = 1/2 over 4 rounds: a user
    # is in 2+ rounds with probability 11/16, so some of 30 users is, except
    # with probability (5/16)^30 < 1e-15 (and the seed is fixed).
    data = population(30, seed=1)
    for users_per_client in (1, 3):
        clients = VirtualClients(
            *data, clients_per_round=15 / users_per_client, rounds_per_epoch=4,
            users_per_client=users_per_client, seed=0,
        )  # fmt: skip
        counts = participation_counts(clients, 0)
        assert max(counts.values()) >= 2
        with pytest.raises(AssertionError, match="not in exactly one round"):
            assert_each_user_once(counts, 30)


def test_a_pass_over_the_dataset_holds_each_users_examples_in_one_round():
    images, labels, user_ids = population(20, seed=2)
    clients = epochs_clients(
        (images, labels, user_ids), users_per_client=2, rounds_per_epoch=4
    )

    def users_per_round(elements):
        return [
            set(user_ids[e["images"][e["example_mask"]][:, 0, 0, 0].astype(int)])
            for e in elements
        ]

    passes = [users_per_round([clients[i] for i in range(len(clients))])]
    clients.on_epoch_end()
    passes.append(users_per_round([clients[i] for i in range(len(clients))]))
    passes.append(users_per_round(list(clients)))
    for rounds in passes:
        assert len(rounds) == 4
        assert sum(len(r) for r in rounds) == len(set().union(*rounds)) == 20
    # Each pass is a fresh epoch: the shuffled rounds differ.
    assert passes[0] != passes[1] != passes[2]


@pytest.mark.parametrize(("num_clients", "rounds"), [(10, 4), (7, 7), (12, 5), (1, 1)])
def test_slot_positions_split_an_epoch_into_rounds_as_floor_j_r_over_p(
    num_clients, rounds
):
    parts = [round_plan.epoch_positions(r, num_clients, rounds) for r in range(rounds)]
    for r, (start, stop) in enumerate(parts):
        brute = [j for j in range(num_clients) if j * rounds // num_clients == r]
        assert list(range(start, stop)) == brute
    sizes = [stop - start for start, stop in parts]
    assert max(sizes) == math.ceil(num_clients / rounds)
    assert max(sizes) - min(sizes) <= 1


# -------------------------------------------------- neighbouring datasets --


def round_of_user(clients, epoch):
    return {
        name: r
        for r, members in enumerate(rounds_of_epoch(clients, epoch))
        for names in members.values()
        for name in names
    }


@pytest.mark.parametrize("order", ORDERS)
def test_removing_one_user_changes_only_that_users_leaf_with_one_user_per_client(
    order,
):
    images, labels, user_ids = population(30, seed=3)
    removed = np.unique(user_ids)[7]
    smaller = without_user(images, labels, user_ids, removed)
    # R is public, so equal for both datasets.
    kwargs = dict(rounds_per_epoch=5, client_order=order)
    full = epochs_clients((images, labels, user_ids), **kwargs)
    small = epochs_clients(smaller, **kwargs)
    for epoch in range(3):
        a, b = round_of_user(full, epoch), round_of_user(small, epoch)
        assert removed in a and removed not in b
        assert {u: r for u, r in a.items() if u != removed} == b
        changed_rounds = []
        for r in range(5):
            ca = contents(full, epoch * 5 + r, images[:, 0, 0, 0])
            cb = contents(small, epoch * 5 + r, smaller[0][:, 0, 0, 0])
            difference = changed(ca, cb)
            if difference:
                changed_rounds.append(r)
                # Only the removed user's own client (their leaf).
                assert difference == {int(user_keys(np.array([removed]))[0])}
                assert ca[next(iter(difference))][0] == (removed,)
        assert changed_rounds == [a[removed]]


@pytest.mark.parametrize("order", ORDERS)
def test_removing_one_user_changes_one_slot_per_epoch_with_a_public_pool(order):
    # 31 users of k = 3: ceil(N / k) drops from 11 to 10 without the user;
    # the public num_clients=11 keeps P (and R) equal for both datasets.
    images, labels, user_ids = population(31, seed=4)
    removed = np.unique(user_ids)[12]
    smaller = without_user(images, labels, user_ids, removed)
    kwargs = dict(
        users_per_client=3, num_clients=11, rounds_per_epoch=4, client_order=order
    )
    full = epochs_clients((images, labels, user_ids), **kwargs)
    small = epochs_clients(smaller, **kwargs)
    for clients in (full, small):
        assert clients.schedule.pool_size == 11 and clients.schedule.pool_is_public
        assert clients.schedule.steps_per_epoch == 4
    for epoch in range(3):
        differences = []
        for r in range(4):
            ca = contents(full, epoch * 4 + r, images[:, 0, 0, 0])
            cb = contents(small, epoch * 4 + r, smaller[0][:, 0, 0, 0])
            differences += [(r, slot) for slot in changed(ca, cb)]
            holders = [slot for slot, (names, _) in ca.items() if removed in names]
            assert {slot for _, slot in differences if _ == r} <= set(holders)
        assert len(differences) == 1


# --------------------------------------------------------- client order --


@pytest.mark.parametrize("users_per_client", [1, 3])
def test_shuffled_orders_change_every_epoch_and_fixed_orders_repeat(
    users_per_client,
):
    data = population(30, seed=5)
    kwargs = dict(users_per_client=users_per_client, rounds_per_epoch=5)
    shuffled = epochs_clients(data, client_order="shuffled", **kwargs)
    fixed = epochs_clients(data, client_order="fixed", **kwargs)
    layouts = [rounds_of_epoch(shuffled, e) for e in range(3)]
    assert layouts[0] != layouts[1] and layouts[1] != layouts[2]
    assert layouts[0] != layouts[2]
    repeated = [rounds_of_epoch(fixed, e) for e in range(3)]
    assert repeated[0] == repeated[1] == repeated[2]
    if users_per_client > 1:
        # Fixed order: round r holds the slots at positions floor(j R / P) = r.
        for r, members in enumerate(repeated[0]):
            start, stop = round_plan.epoch_positions(r, fixed.num_clients, 5)
            assert set(members) <= set(range(start, stop))
    # The same users in the same rounds, but fresh examples each epoch.
    plans = fixed.plan_round(0)
    key = max(plans, key=lambda k: (plans[k].example_index >= 0).sum())
    grids = [fixed.plan_round(5 * e)[key].example_index for e in range(3)]
    assert any(not np.array_equal(grids[0], g) for g in grids[1:])


def test_single_user_rounds_are_binomial_and_each_users_round_is_uniform():
    data = population(40, seed=6, max_examples=1)
    clients = epochs_clients(data, rounds_per_epoch=4, local_steps=1, batch_size=1)
    epochs = 150
    sizes, where = [], np.zeros((40, 4), int)
    for epoch in range(epochs):
        layout = rounds_of_epoch(clients, epoch)
        sizes += [len(members) for members in layout]
        for r, members in enumerate(layout):
            for names in members.values():
                where[np.searchsorted(clients.user_names, names[0]), r] += 1
    sizes = np.array(sizes)
    values = np.arange(41)
    expected = stats.binom.pmf(values, 40, 1 / 4) * sizes.size
    observed = np.bincount(sizes, minlength=41)
    keep = expected > 5
    chi2 = (((observed - expected)[keep]) ** 2 / expected[keep]).sum()
    assert stats.chi2.sf(chi2, keep.sum() - 1) > 1e-3
    # Each user's round is uniform over the 4 rounds.
    assert stats.chisquare(where.ravel(), np.full(160, epochs / 4)).pvalue > 1e-3
    # The bound is the Binomial(N, 1 / R) tail bound with the k = 1 tolerance.
    assert clients.max_clients_per_round == round_size.max_clients_per_round(
        40, 1 / 4, vc.TRUNCATION_TOLERANCE["data dependent"]
    )
    assert clients.truncation_probability <= 1e-30
    assert stats.binom.sf(clients.max_clients_per_round, 40, 1 / 4) <= 1e-30


def test_a_single_user_round_over_its_bound_raises():
    data = population(10, seed=7)
    with pytest.warns(UserWarning, match="RoundTruncationError"):
        clients = epochs_clients(data, rounds_per_epoch=5, max_clients_per_round=1)
    # 10 users in 5 rounds: some round holds two (pigeonhole).
    with pytest.raises(RoundTruncationError, match="max_clients_per_round=1"):
        for r in range(5):
            clients.plan_round(r)


# ------------------------------------------------------ schedule & errors --


@pytest.mark.parametrize(
    ("users_per_client", "num_clients", "given"),
    [(1, None, "m"), (1, None, "r"), (3, None, "m"), (3, 12, "r"), (3, 12, "both")],
)
def test_the_schedule_is_the_one_a_model_computes(users_per_client, num_clients, given):
    data = population(33, seed=8)
    pool = num_clients or math.ceil(33 / users_per_client)
    m, rounds = 4, math.ceil(pool / 4)
    kwargs = {
        "m": dict(clients_per_round=m),
        "r": dict(rounds_per_epoch=rounds),
        "both": dict(clients_per_round=m, rounds_per_epoch=rounds),
    }[given]
    clients = epochs_clients(
        data, users_per_client=users_per_client, num_clients=num_clients, **kwargs
    )
    assert len(clients) == clients.rounds_per_epoch == rounds
    schedule = privacy.Schedule.virtual_clients(
        33, kwargs.get("clients_per_round"), users_per_client=users_per_client,
        num_clients=num_clients, sampling="epochs", local_steps=2,
        rounds_per_epoch=rounds,
    )  # fmt: skip
    assert clients.schedule == schedule
    assert schedule.steps_per_epoch == rounds and schedule.pool_size == pool
    assert clients.clients_per_round == schedule.sample_size == pool / rounds
    mechanism = clients.schedule.privacy_mechanism(1.0, noise="tree")
    assert mechanism.steps_per_epoch == rounds
    assert "no sampling" in clients.describe()
    assert "client_order='shuffled'" in repr(clients)


def small_data():
    return population(10, seed=9)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(sampling="epochs", rounds_per_epoch=11), "at most rounds_per_epoch=10"),
        (dict(sampling="epochs", clients_per_round=0.5), r"R = 20 rounds.*at most"),
        (dict(sampling="epochs"), "needs clients_per_round"),
        (dict(), "needs clients_per_round"),
        (dict(clients_per_round=2, client_order="fixed"), "for sampling='epochs'"),
        (dict(sampling="fixed", clients_per_round=2, client_order="shuffled"),
         "client_order='shuffled' is for"),
        (dict(sampling="epochs", rounds_per_epoch=2, client_order="random"),
         "client_order must be one of"),
        (dict(sampling="epochs", clients_per_round=3, rounds_per_epoch=3),
         "disagree"),
        (dict(sampling="epochs", clients_per_round=11), "more than the 10"),
        (dict(sampling="epochs", rounds_per_epoch=0), "rounds_per_epoch must be"),
        (dict(sampling="epochs", users_per_client=2, rounds_per_epoch=2,
              max_clients_per_round=4), r"ceil\(5 / 2\) = 3"),
        (dict(sampling="epochs", users_per_client=2, rounds_per_epoch=2,
              max_clients_per_round=3), None),
        (dict(sampling="epochs", clients_per_round=3, rounds_per_epoch=4), None),
        (dict(sampling="epochs", rounds_per_epoch=2, workers=2), "workers=2"),
        (dict(sampling="epochs", rounds_per_epoch=2, workers=1), None),
        (dict(clients_per_round=2, workers=3), None),
    ],
)  # fmt: skip
def test_bad_epoch_settings_are_refused_with_a_message(kwargs, message):
    if message is None:  # A control: this setting is valid.
        VirtualClients(*small_data(), **kwargs)
        return
    with pytest.raises(ValueError, match=message):
        VirtualClients(*small_data(), **kwargs)


# ------------------------------------------------------------------ fit --


class Recorder(RoundConsumer):
    """Logs the round of every element it trains on (run eagerly)."""

    def __init__(self, round_of_images, log):
        super().__init__()
        # A function, not the containers: Keras would track (copy) them.
        self.record = lambda images: log.append(round_of_images[images.tobytes()])

    def call(self, element):
        try:
            images = keras.ops.convert_to_numpy(element["images"]).astype(np.float32)
        except Exception:  # A symbolic trace (shape inference): no data.
            images = None
        if images is not None:
            self.record(images)
        return super().call(element)


class EpochMarks(keras.callbacks.Callback):
    def __init__(self, log):
        super().__init__()
        self.log = log

    def on_epoch_begin(self, epoch, logs=None):
        self.log.append("epoch")


@pytest.mark.parametrize("source", ["py_dataset", "tf_dataset"])
def test_each_keras_epoch_trains_on_one_whole_epoch_of_rounds(source):
    if source == "tf_dataset":
        pytest.importorskip("tensorflow")
    images, labels, user_ids = population(24, seed=10)
    clients = epochs_clients(
        (images / images.max(), labels, user_ids), users_per_client=2,
        rounds_per_epoch=3,
    )  # fmt: skip
    data = clients.to_tf_dataset() if source == "tf_dataset" else clients
    round_of_images = {
        clients.round(r)["images"].astype(np.float32).tobytes(): r for r in range(45)
    }
    log = []
    for epochs in (2, 3):  # Two fits on the same rounds.
        model = Recorder(round_of_images, log)
        model.compile(optimizer=keras.optimizers.SGD(0.5), run_eagerly=True)
        model.fit(
            data, epochs=epochs, verbose=0, shuffle=source == "py_dataset",
            callbacks=[EpochMarks(log)],
        )  # fmt: skip
    blocks = [[]]
    for entry in log:
        if entry == "epoch":
            blocks.append([])
        else:
            blocks[-1].append(entry)
    assert blocks[0] == []  # Nothing trained before the first epoch.
    blocks = blocks[1:]
    assert len(blocks) == 5
    # Keras epoch e trained on the R = 3 rounds of one epoch of the rounds
    # (its model's tree then holds each user at most once), a fresh one
    # each time.
    for block in blocks:
        assert sorted(r % 3 for r in block) == [0, 1, 2], blocks
        assert len({r // 3 for r in block}) == 1, blocks
    assert len({block[0] // 3 for block in blocks}) == 5


@pytest.mark.parametrize(("num_users", "rounds"), [(15, 13), (17, 7), (30, 26)])
def test_clients_per_round_of_p_over_r_gives_r_rounds(num_users, rounds):
    # ceil(15 / (15 / 13)) is 14 in floating point; the data keeps R = 13.
    data = population(num_users, seed=11)
    clients = epochs_clients(data, clients_per_round=num_users / rounds)
    assert len(clients) == rounds
    assert clients.clients_per_round == num_users / rounds
    assert clients.schedule == privacy.Schedule.virtual_clients(
        num_users, num_users / rounds, sampling="epochs", local_steps=2,
        rounds_per_epoch=rounds,
    )  # fmt: skip
