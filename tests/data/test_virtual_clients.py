"""VirtualClients: assignment, sampling, round layout, inputs and errors."""

import warnings

import keras
import numpy as np
import pytest
from scipy import stats

from kdpemb import privacy
from kdpemb.data import VirtualClients
from kdpemb.data.assignment import assign_virtual_clients
from kdpemb.data.round_size import max_clients_per_round, overflow_probability
from kdpemb.datasets import UserImages
from kdpemb.datasets.user_hash import user_keys
from kdpemb.errors import ReproducibleSamplingWarning, RoundTruncationError
from kdpemb.testing import RoundConsumer
from tests.data.elements import population, without_user

pytestmark = pytest.mark.filterwarnings(
    "ignore::kdpemb.errors.ReproducibleSamplingWarning"
)


def client_contents(clients, round_index, example_ids):
    """{client key: (user names, example ids per local slot)}."""
    contents = {}
    for key, plan in clients.plan_round(round_index).items():
        grid = plan.example_index
        ids = np.where(grid >= 0, example_ids[np.maximum(grid, 0)], -1)
        contents[key] = (tuple(clients.user_names[plan.users]), ids.tobytes())
    return contents


def changed_clients(a, b):
    return {key for key in a.keys() | b.keys() if a.get(key) != b.get(key)}


# ----------------------------------------------------------- assignment --


# Fixed-size sampling of single users is a replace-one scheme: see the next
# test for its property.
@pytest.mark.parametrize(
    ("users_per_client", "sampling"), [(1, "poisson"), (3, "poisson"), (3, "fixed")]
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_removing_one_user_changes_at_most_one_client_per_round(
    users_per_client, sampling, seed
):
    rng = np.random.default_rng(100 + seed)
    num_clients = int(rng.integers(8, 30))
    # The sampling rate q is a public hyperparameter, equal for neighbouring
    # datasets; for k > 1 so is the number of virtual clients P: N and N - 1
    # users make the same P = ceil(N / k) here. (For k = 1 a client is a
    # user, so P = N, and M is scaled to keep q.)
    num_users = num_clients * users_per_client
    images, labels, user_ids = population(num_users, seed)
    removed = rng.choice(np.unique(user_ids))
    smaller = without_user(images, labels, user_ids, removed)
    m = 4 if sampling == "fixed" else 4.5
    m_smaller = m if users_per_client > 1 else m * (num_users - 1) / num_users
    full = VirtualClients(
        images, labels, user_ids, clients_per_round=m, sampling=sampling,
        users_per_client=users_per_client, local_steps=2, batch_size=3, seed=seed,
    )  # fmt: skip
    small = VirtualClients(
        *smaller, clients_per_round=m_smaller, sampling=sampling,
        users_per_client=users_per_client, local_steps=2, batch_size=3, seed=seed,
    )  # fmt: skip
    if users_per_client > 1:
        assert small.num_clients == full.num_clients
    assert small.sampling_rate == pytest.approx(full.sampling_rate, rel=1e-12)
    rounds_with_removed_user = 0
    for round_index in range(40):
        a = client_contents(full, round_index, images[:, 0, 0, 0])
        b = client_contents(small, round_index, smaller[0][:, 0, 0, 0])
        changed = changed_clients(a, b)
        assert len(changed) <= 1
        holders = [key for key, (names, _) in a.items() if removed in names]
        assert changed <= set(holders)
        rounds_with_removed_user += bool(holders)
    assert rounds_with_removed_user > 0  # The check above was not vacuous.


@pytest.mark.parametrize("seed", [0, 1])
def test_a_public_num_clients_keeps_the_property_when_ceil_n_over_k_moves(seed):
    # N = 3P + 1 users: removing one makes ceil(N / 3) drop from P + 1 to P,
    # which would re-hash everyone. A public num_clients fixes P.
    users_per_client, num_clients = 3, 9
    images, labels, user_ids = population(3 * num_clients + 1, seed)
    removed = np.unique(user_ids)[seed]
    smaller = without_user(images, labels, user_ids, removed)
    kwargs = dict(
        clients_per_round=3.5, users_per_client=users_per_client, batch_size=3,
        seed=seed,
    )  # fmt: skip
    default_full = VirtualClients(images, labels, user_ids, **kwargs)
    default_small = VirtualClients(*smaller, **kwargs)
    assert default_full.num_clients != default_small.num_clients  # The hazard.
    full = VirtualClients(images, labels, user_ids, num_clients=10, **kwargs)
    small = VirtualClients(*smaller, num_clients=10, **kwargs)
    assert full.schedule.pool_size == 10 and full.schedule.pool_is_public
    assert not default_full.schedule.pool_is_public
    for round_index in range(40):
        a = client_contents(full, round_index, images[:, 0, 0, 0])
        b = client_contents(small, round_index, smaller[0][:, 0, 0, 0])
        assert len(changed_clients(a, b)) <= 1


def test_replacing_one_users_data_changes_one_client_with_fixed_sampling():
    images, labels, user_ids = population(30, seed=4)
    target = user_ids[0]
    replaced = images.copy()
    replaced[user_ids == target] += 10_000  # Same user, different data.
    kwargs = dict(clients_per_round=6, sampling="fixed", batch_size=4, seed=3)
    a = VirtualClients(images, labels, user_ids, **kwargs)
    b = VirtualClients(replaced, labels, user_ids, **kwargs)
    for round_index in range(30):
        ca = client_contents(a, round_index, images[:, 0, 0, 0])
        cb = client_contents(b, round_index, replaced[:, 0, 0, 0])
        assert len(ca) == len(cb) == 6
        assert len(changed_clients(ca, cb)) <= 1


def shuffle_and_chunk(keys, num_clients, salt):
    """The naive grouping: shuffle all users, cut into groups. Not private."""
    order = np.random.default_rng(salt).permutation(keys.size)
    clients = np.empty(keys.size, dtype=np.int64)
    clients[order] = np.arange(keys.size) * num_clients // keys.size
    return clients


@pytest.mark.parametrize(
    ("assign", "holds"),
    [(assign_virtual_clients, True), (shuffle_and_chunk, False)],
    ids=["keyed_hash", "shuffle_and_chunk"],
)
def test_assignment_property_check_catches_a_grouping_that_depends_on_others(
    assign, holds
):
    rng = np.random.default_rng(7)
    violations = 0
    for trial in range(20):
        names = rng.choice(10**6, size=int(rng.integers(20, 60)), replace=False)
        keys = user_keys(names)
        leaving = int(rng.integers(names.size))
        num_clients = max(2, names.size // 4)
        before = assign(keys, num_clients, salt=trial)
        after = assign(np.delete(keys, leaving), num_clients, salt=trial)
        groups_before = {
            c: frozenset(names[before == c]) - {names[leaving]}
            for c in range(num_clients)
        }
        groups_after = {
            c: frozenset(np.delete(names, leaving)[after == c])
            for c in range(num_clients)
        }
        changed = sum(groups_before[c] != groups_after[c] for c in groups_before)
        violations += changed > 0
    assert (violations == 0) == holds


def test_client_sizes_average_users_per_client():
    keys = user_keys(np.arange(40_000))
    sizes = np.bincount(assign_virtual_clients(keys, 10_000, salt=5), minlength=10_000)
    assert sizes.mean() == 4.0
    # Independent slots: about Poisson(4) users per client.
    assert sizes.var() == pytest.approx(4.0, rel=0.1)


# ------------------------------------------------------------- sampling --


def test_poisson_rounds_have_mean_m_clients():
    images, labels, user_ids = population(200, seed=1, max_examples=1)
    clients = VirtualClients(
        images, labels, user_ids, clients_per_round=10, batch_size=1, seed=11
    )
    counts = np.array([len(clients.plan_round(r)) for r in range(1500)])
    q = 10 / 200
    standard_error = np.sqrt(200 * q * (1 - q) / counts.size)
    assert abs(counts.mean() - 10) < 4 * standard_error
    assert counts.var() == pytest.approx(200 * q * (1 - q), rel=0.15)
    # The count is Binomial(P, q): a goodness-of-fit test of its histogram.
    values = np.arange(counts.max() + 1)
    expected = stats.binom.pmf(values, 200, q) * counts.size
    observed = np.bincount(counts, minlength=values.size)
    keep = expected > 5
    chi2 = (((observed - expected)[keep]) ** 2 / expected[keep]).sum()
    assert stats.chi2.sf(chi2, keep.sum() - 1) > 1e-3


def test_each_user_is_sampled_independently_with_rate_q():
    images, labels, user_ids = population(40, seed=1, max_examples=1)
    clients = VirtualClients(
        images, labels, user_ids, clients_per_round=8, batch_size=1, seed=12
    )
    names = list(clients.user_names)
    taken = np.zeros((2000, 40), dtype=bool)
    for r in range(taken.shape[0]):
        for plan in clients.plan_round(r).values():
            taken[r, names.index(clients.user_names[plan.users[0]])] = True
    q = 0.2
    # Each user's rate is q: a chi-square test over users.
    counts = taken.sum(axis=0)
    chi2 = ((counts - q * 2000) ** 2 / (q * (1 - q) * 2000)).sum()
    assert stats.chi2.sf(chi2, 40) > 1e-3
    # No two users move together: every pairwise correlation is small.
    corr = np.corrcoef(taken.T.astype(float))
    off_diagonal = np.abs(corr[~np.eye(40, dtype=bool)])
    assert off_diagonal.max() < 5 / np.sqrt(2000)


@pytest.mark.parametrize("users_per_client", [1, 3])
def test_a_round_without_clients_is_all_masked(users_per_client):
    images, labels, user_ids = population(30, seed=4)
    clients = VirtualClients(
        images, labels, user_ids, clients_per_round=0.05,
        users_per_client=users_per_client, batch_size=2, seed=0,
    )  # fmt: skip
    empty = [r for r in range(40) if not clients.plan_round(r)]
    assert empty  # Most rounds sample nobody at q = 0.05 / P.
    element = clients.round(empty[0])
    assert not element["client_mask"].any() and not element["example_mask"].any()


def test_fixed_sampling_takes_exactly_m_clients():
    images, labels, user_ids = population(50, seed=2)
    clients = VirtualClients(
        images, labels, user_ids, clients_per_round=7, sampling="fixed", seed=1
    )
    assert clients.max_clients_per_round == 7
    assert {len(clients.plan_round(r)) for r in range(50)} == {7}


@pytest.mark.parametrize(
    ("num_clients", "rate"),
    [(2_500, 64 / 2_500), (100, 0.5), (10**6, 1e-4), (37, 0.03), (5, 0.9)],
)
def test_round_bound_is_the_smallest_with_overflow_below_1e_9(num_clients, rate):
    bound = max_clients_per_round(num_clients, rate)
    assert stats.binom.sf(bound, num_clients, rate) <= 1e-9
    assert stats.binom.sf(bound - 1, num_clients, rate) > 1e-9
    assert overflow_probability(num_clients, rate, bound) == pytest.approx(
        stats.binom.sf(bound, num_clients, rate), rel=1e-6, abs=1e-300
    )


def test_a_data_dependent_round_count_gets_a_far_smaller_overflow_bound():
    images, labels, user_ids = population(600, seed=3)
    single = VirtualClients(images, labels, user_ids, clients_per_round=16)
    grouped = VirtualClients(
        images, labels, user_ids, clients_per_round=16, users_per_client=2
    )
    # k = 1: the count is the number of sampled users (depends on who is
    # present), so its overflow must be negligible next to δ.
    assert single.truncation_probability <= 1e-30
    assert 1e-30 < grouped.truncation_probability <= 1e-9
    assert single.max_clients_per_round > grouped.max_clients_per_round


def test_full_participation_needs_no_bound():
    assert max_clients_per_round(40, 1.0) == 40
    assert overflow_probability(40, 1.0, 40) == 0.0


def test_a_round_over_its_bound_raises_instead_of_dropping_clients():
    images, labels, user_ids = population(40, seed=3)
    with pytest.warns(UserWarning, match="RoundTruncationError"):
        clients = VirtualClients(
            images, labels, user_ids, clients_per_round=8,
            max_clients_per_round=8, seed=0,
        )  # fmt: skip
    assert clients.truncation_probability == pytest.approx(
        stats.binom.sf(8, 40, 0.2), rel=1e-6
    )
    outcomes = []
    for r in range(60):
        try:
            outcomes.append(len(clients.plan_round(r)))
        except RoundTruncationError as error:
            assert "max_clients_per_round=8" in str(error)
            outcomes.append(None)
    assert None in outcomes and all(o is None or o <= 8 for o in outcomes)


# ------------------------------------------------------- round contents --


def make_clients(**kwargs):
    images, labels, user_ids = population(60, seed=5, max_examples=9)
    defaults = dict(
        clients_per_round=12, users_per_client=2, local_steps=3, batch_size=4, seed=2
    )
    return VirtualClients(images, labels, user_ids, **{**defaults, **kwargs}), images


def test_round_arrays_match_the_element_spec():
    clients, _ = make_clients()
    element = clients.round(0)
    assert set(element) == set(clients.element_spec)
    for key, (shape, dtype) in clients.element_spec.items():
        assert element[key].shape == shape, key
        assert element[key].dtype == dtype, key
    assert clients.round_nbytes == sum(a.nbytes for a in element.values())


def test_masks_mark_exactly_the_filled_slots():
    clients, images = make_clients()
    for r in range(5):
        element = clients.round(r)
        plans = list(clients.plan_round(r).values())
        used = element["example_mask"]
        assert element["client_mask"].sum() == len(plans)
        assert not used[~element["client_mask"]].any()
        assert (element["images"][~used] == 0).all()
        assert (element["labels"][~used] == 0).all()
        for row, plan in enumerate(plans):
            grid = plan.example_index
            np.testing.assert_array_equal(used[row], grid >= 0)
            np.testing.assert_array_equal(
                element["images"][row][used[row]], images[grid[grid >= 0]]
            )


def test_local_labels_are_reindexed_inside_each_client():
    clients, _ = make_clients(users_per_client=3, clients_per_round=8)
    seen_multiclass = False
    for r in range(10):
        element = clients.round(r)
        for row in np.flatnonzero(element["client_mask"]):
            used = element["example_mask"][row]
            local = element["labels"][row][used]
            global_ = element["global_labels"][row][used]
            classes = np.unique(global_)
            assert element["num_local_classes"][row] == classes.size
            # Local label = rank of the global label among the client's.
            np.testing.assert_array_equal(local, np.searchsorted(classes, global_))
            seen_multiclass |= classes.size > 1
    assert seen_multiclass


def test_batches_are_full_and_free_of_repeats_and_passes_cover_every_example():
    clients, _ = make_clients(users_per_client=1, clients_per_round=20)
    for r in range(5):
        for plan in clients.plan_round(r).values():
            grid = plan.example_index
            chosen = np.unique(grid[grid >= 0])
            n = chosen.size
            per_step = min(clients.batch_size, n)
            for row in grid:
                filled = row[row >= 0]
                assert filled.size == np.unique(filled).size  # No repeats.
                assert 1 <= filled.size <= per_step
            # The first pass uses every chosen example before any repeats.
            first_pass = grid.reshape(-1)[grid.reshape(-1) >= 0][:n]
            assert np.unique(first_pass).size == n


def test_a_clients_examples_are_capped_and_shared_evenly_between_users():
    images = np.zeros((113, 2, 2, 1), np.uint8)
    labels = np.arange(113) % 5
    user_ids = np.array([0] * 100 + [1] * 3 + [2] * 10)
    clients = VirtualClients(
        images, labels, user_ids, clients_per_round=1, users_per_client=3,
        local_steps=5, batch_size=4, max_examples_per_client=15, seed=0,
    )  # fmt: skip
    plan = next(iter(clients.plan_round(0).values()))
    grid = plan.example_index
    chosen = np.unique(grid[grid >= 0])
    per_user = np.bincount(user_ids[chosen], minlength=3)
    # 15 examples: user 1 gives all 3, users 0 and 2 six each.
    np.testing.assert_array_equal(per_user, [6, 3, 6])


def test_sampling_inside_a_client_is_without_replacement_and_varies():
    images = np.zeros((50, 2, 2, 1), np.uint8)
    clients = VirtualClients(
        images, np.zeros(50, int), np.zeros(50, int), clients_per_round=1,
        local_steps=2, batch_size=5, seed=0,
    )  # fmt: skip
    picks = []
    for r in range(30):
        grid = clients.plan_round(r)[int(user_keys(np.array([0]))[0])].example_index
        assert np.unique(grid).size == 10
        picks.append(frozenset(grid.ravel().tolist()))
    assert len(set(picks)) > 20
    # Every example is about equally likely: 30 rounds * 10 / 50 = 6 each.
    counts = np.bincount(np.concatenate([list(p) for p in picks]), minlength=50)
    assert stats.chisquare(counts).pvalue > 1e-3


# ---------------------------------------------------------- determinism --


def test_rounds_are_a_function_of_the_seed():
    a, _ = make_clients(seed=9)
    b, _ = make_clients(seed=9)
    c, _ = make_clients(seed=10)
    for r in range(3):
        ra, rb, rc = a.round(r), b.round(r), c.round(r)
        for key in ra:
            np.testing.assert_array_equal(ra[key], rb[key])
        assert not np.array_equal(ra["images"], rc["images"])


def test_without_a_seed_each_instance_samples_differently_and_quietly():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a, _ = make_clients(seed=None)
        b, _ = make_clients(seed=None)
    assert not np.array_equal(a.round(0)["images"], b.round(0)["images"])


def test_a_fixed_seed_warns_that_it_is_for_tests():
    with pytest.warns(ReproducibleSamplingWarning, match="seed=None"):
        make_clients(seed=1)


def test_each_epoch_gets_fresh_rounds():
    clients, _ = make_clients(rounds_per_epoch=2)
    first = clients[0]["images"]
    assert np.array_equal(first, clients[0]["images"])  # Same epoch, same round.
    clients.on_epoch_end()
    assert not np.array_equal(first, clients[0]["images"])
    np.testing.assert_array_equal(clients[1]["images"], clients.round(3)["images"])
    with pytest.raises(IndexError):
        clients[2]


# --------------------------------------------------------------- inputs --


def test_user_images_and_string_user_ids_are_accepted():
    images, labels, user_ids = population(12, seed=6)
    names = np.array([f"user-{u}" for u in user_ids])
    clients = VirtualClients(
        UserImages(images, labels, names), clients_per_round=3, seed=0
    )
    assert clients.num_users == 12 and clients.user_names[0].startswith("user-")
    assert clients.round(0)["client_mask"].any()


def test_tf_data_and_py_dataset_inputs_give_the_same_clients():
    tf = pytest.importorskip("tensorflow")
    images, labels, user_ids = population(15, seed=7)

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 3

        def __getitem__(self, i):
            part = slice(i * 10, (i + 1) * 10) if i < 2 else slice(20, None)
            return images[part], labels[part], user_ids[part]

    from_arrays = VirtualClients(images, labels, user_ids, clients_per_round=4, seed=1)
    batched = tf.data.Dataset.from_tensor_slices((images, labels, user_ids)).batch(7)
    dict_elements = tf.data.Dataset.from_tensor_slices(
        {"images": images, "labels": labels, "user_ids": user_ids}
    )
    for source in (batched, dict_elements, Batches()):
        other = VirtualClients(source, clients_per_round=4, seed=1)
        np.testing.assert_array_equal(
            other.round(0)["images"], from_arrays.round(0)["images"]
        )


def test_images_of_inconsistent_shapes_are_refused():
    tf = pytest.importorskip("tensorflow")

    def mixed():
        yield np.zeros((4, 4, 1)), 0, 0
        yield np.zeros((5, 5, 1)), 1, 1

    dataset = tf.data.Dataset.from_generator(
        mixed,
        output_signature=(
            tf.TensorSpec((None, None, 1)),
            tf.TensorSpec((), tf.int64),
            tf.TensorSpec((), tf.int64),
        ),
    )
    with pytest.raises(ValueError, match=r"inconsistent shapes.*element 1"):
        VirtualClients(dataset, clients_per_round=1)
    with pytest.raises(ValueError, match="inconsistent shapes"):
        VirtualClients(
            [np.zeros((4, 4, 1)), np.zeros((5, 5, 1))], [0, 1], [0, 1],
            clients_per_round=1,
        )  # fmt: skip


# ------------------------------------------------------------ validation --


def good_arrays():
    images, labels, user_ids = population(10, seed=8)
    return images.copy(), labels.copy(), user_ids.copy()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_pixels_are_refused_naming_the_image(bad):
    images, labels, user_ids = good_arrays()
    images[5, 0, 0, 0] = bad
    with pytest.raises(ValueError, match=r"images\[5\] holds NaN or infinite"):
        VirtualClients(images, labels, user_ids, clients_per_round=2)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a[1].__setitem__(0, -1), "labels must be >= 0"),
        (lambda a: a[1].__setitem__(0, 7), r"labels must be < num_classes=7"),
        (lambda a: a.__setitem__(1, a[1] + 0.5), "integer identity indices"),
        (lambda a: a.__setitem__(1, a[1][:-1]), r"labels must have shape"),
        (lambda a: a.__setitem__(2, a[2][:-1]), r"user_ids must have shape"),
        (lambda a: a.__setitem__(0, a[0][..., 0]), r"images\[\.\.\., None\]"),
        (lambda a: a.__setitem__(0, a[0][:0]), "no examples"),
    ],
)
def test_bad_arrays_are_refused_with_a_message(change, message):
    arrays = list(good_arrays())
    change(arrays)
    with pytest.raises(ValueError, match=message):
        VirtualClients(*arrays, clients_per_round=2, num_classes=7)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(clients_per_round=0), "clients_per_round must be > 0"),
        (dict(clients_per_round=11), r"more than the 10 virtual clients"),
        (dict(clients_per_round=2, users_per_client=11), r"more than the 10 users"),
        (dict(clients_per_round=2, sampling="fixed", users_per_client=3), None),
        (dict(clients_per_round=2.5, sampling="fixed"), "whole number"),
        (dict(clients_per_round=2, sampling="stratified"), "sampling must be"),
        (dict(clients_per_round=2, max_examples_per_client=33), "at most 32"),
        (dict(clients_per_round=2, local_steps=0), "local_steps"),
        (dict(clients_per_round=2, seed=-1), "seed must be None"),
        (dict(clients_per_round=2, seed=True), "seed must be None"),
        (dict(clients_per_round=2, seed=2**128), "seed must be None"),
        (dict(clients_per_round=2, sampling="fixed", max_clients_per_round=3), "fixed"),
        (dict(clients_per_round=2, num_clients=9), "every user is their own"),
        (dict(clients_per_round=2, users_per_client=2, num_clients=4), "between"),
    ],
)
def test_bad_settings_are_refused_with_a_message(kwargs, message):
    if message is None:  # A control: this setting is valid.
        VirtualClients(*good_arrays(), **kwargs)
        return
    with pytest.raises(ValueError, match=message):
        VirtualClients(*good_arrays(), **kwargs)


def test_user_ids_of_mixed_types_are_refused():
    images, labels, _ = good_arrays()
    mixed = np.array([1, "a"] * (len(labels) // 2) + [1] * (len(labels) % 2), object)
    with pytest.raises(ValueError, match="one type"):
        VirtualClients(images, labels, mixed, clients_per_round=1)


def test_random_streams_of_rounds_and_clients_never_coincide():
    clients, _ = make_clients(seed=0)
    draw = lambda *words: clients._rng(*words).integers(2**63, size=4).tolist()  # noqa: E731
    streams = [draw(1, 0), draw(2, 0, 0), draw(1, 2**32), draw(1, 0, 1), draw(2, 1)]
    assert len({tuple(s) for s in streams}) == len(streams)


def test_an_epoch_never_runs_more_rounds_than_the_accountant_counts():
    for m, users_per_client in [(16, 4), (7, 1), (3.5, 2), (40, 1)]:
        images, labels, user_ids = population(300, seed=2)
        clients = VirtualClients(
            images, labels, user_ids, clients_per_round=m,
            users_per_client=users_per_client,
        )  # fmt: skip
        for epochs in (1, 3, 10):
            assert epochs * len(clients) <= clients.schedule.steps_for_epochs(epochs)


def test_enrolled_users_without_examples_are_dropped_with_a_count():
    images, labels, user_ids = good_arrays()
    roster = [*np.unique(user_ids).tolist(), -1, -2, -3]
    with pytest.warns(UserWarning, match="3 of 13 users have no examples"):
        clients = VirtualClients(
            images, labels, user_ids, users=roster, clients_per_round=2
        )
    assert clients.num_users == 10
    with pytest.raises(ValueError, match="not in `users`"):
        VirtualClients(images, labels, user_ids, users=roster[:5], clients_per_round=2)


# ------------------------------------------------------- accounting & fit --


@pytest.mark.parametrize(
    ("users_per_client", "num_clients"), [(1, None), (4, None), (4, 12)]
)
def test_the_schedule_has_the_pool_and_rate_the_rounds_are_sampled_with(
    users_per_client, num_clients
):
    images, labels, user_ids = population(41, seed=9)
    clients = VirtualClients(
        images, labels, user_ids, clients_per_round=3, local_steps=2,
        users_per_client=users_per_client, num_clients=num_clients,
    )  # fmt: skip
    schedule = clients.schedule
    assert schedule == privacy.Schedule.virtual_clients(
        41, 3, users_per_client=users_per_client, num_clients=num_clients,
        local_steps=2,
    )  # fmt: skip
    assert schedule.pool_size == clients.num_clients
    assert schedule.sampling_probability == clients.sampling_rate
    # P derived from the user count is not public (k > 1 only).
    assert schedule.pool_is_public == (users_per_client == 1 or num_clients is not None)
    mechanism = schedule.privacy_mechanism(1.0, clip_norm=0.5)
    assert mechanism == privacy.virtual_clients(
        1.0, 3, 41, users_per_client=users_per_client, clip_norm=0.5,
        num_clients=num_clients,
    )  # fmt: skip
    assert not hasattr(clients, "privacy_mechanism")  # One owner: the schedule.


def test_rounds_feed_model_fit_on_this_backend():
    images, labels, user_ids = population(40, seed=10)
    clients = VirtualClients(
        images / images.max(), labels, user_ids, clients_per_round=5,
        local_steps=2, batch_size=3, rounds_per_epoch=4,
    )  # fmt: skip
    model = RoundConsumer()
    model.compile(optimizer=keras.optimizers.SGD(0.5))
    history = model.fit(clients, epochs=3, verbose=0)
    assert len(history.history["loss"]) == 3
    assert history.history["loss"][-1] < history.history["loss"][0]


def test_fit_never_trains_on_the_same_round_twice():
    images, labels, user_ids = population(40, seed=10)
    clients = VirtualClients(
        images / images.max(), labels, user_ids, clients_per_round=5,
        batch_size=3, rounds_per_epoch=3,
    )  # fmt: skip
    served = []
    build = clients.host_round
    clients.host_round = lambda r: served.append(r) or build(r)
    model = RoundConsumer()
    model.compile(optimizer=keras.optimizers.SGD(0.5))
    model.fit(clients, epochs=3, verbose=0)
    model.fit(clients, epochs=2, verbose=0)
    # TensorFlow builds two rounds up front to learn the element's shape and
    # then trains on them again; anything else served twice would be reuse.
    repeats = len(served) - len(set(served))
    assert repeats <= 2 * (keras.backend.backend() == "tensorflow") * 2
    assert len(set(served)) >= 5 * 3


def test_no_pass_replays_rounds_of_an_earlier_pass_even_if_interrupted():
    clients, _ = make_clients(rounds_per_epoch=3)
    seen = []
    for element in clients:  # Interrupted after one round.
        seen.append(element["images"])
        break
    seen += [element["images"] for element in clients]
    seen += [element["images"] for element in clients]
    for i in range(len(seen)):
        for j in range(i):
            assert not np.array_equal(seen[i], seen[j])


def test_to_tf_dataset_yields_the_same_rounds_and_fresh_epochs():
    pytest.importorskip("tensorflow")
    clients, _ = make_clients(rounds_per_epoch=2)
    twin, _ = make_clients(rounds_per_epoch=2)
    dataset = clients.to_tf_dataset()
    # A known length: tf.distribute counts steps by it (FedEmbModel.fit).
    assert int(dataset.cardinality()) == 2
    for epoch in range(1, 3):  # Epoch 0 is the Keras epoch of `clients[i]`.
        elements = list(dataset.as_numpy_iterator())
        assert len(elements) == 2
        for index, element in enumerate(elements):
            expected = twin.round(epoch * 2 + index)
            for key in expected:
                np.testing.assert_array_equal(element[key], expected[key])
    # An interrupted pass (take) is not replayed by the next one.
    first = next(dataset.take(1).as_numpy_iterator())["images"]
    again = next(dataset.take(1).as_numpy_iterator())["images"]
    assert not np.array_equal(first, again)
    model = RoundConsumer(scale=1 / 400)
    model.compile(optimizer=keras.optimizers.SGD(0.5))
    history = model.fit(dataset, epochs=2, verbose=0, shuffle=False)
    assert len(history.history["loss"]) == 2
