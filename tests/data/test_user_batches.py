"""UserIndices / UserBatches: user sampling, the cap k, slot layout, errors."""

import numpy as np
import pytest
from scipy import stats

from kdpemb.data import PoissonIndices, user_batches
from kdpemb.data.round_size import max_clients_per_round
from kdpemb.data.user_batches import UserBatches, UserIndices


def draws(batches, steps=None):
    """Every batch of `batches` as `(indices, mask)` of shape [S, k]."""
    k = batches.examples_per_user
    for step in range(len(batches) if steps is None else steps):
        indices, mask = batches.sample(step)
        yield indices.reshape(-1, k), mask.reshape(-1, k) == 1


def included(batches, users):
    """[steps, U] bool: which users each step sampled."""
    rows = np.zeros((len(batches), batches.num_users), dtype=bool)
    position = {name: u for u, name in enumerate(batches.user_ids)}
    for step, (indices, mask) in enumerate(draws(batches)):
        real = mask.any(axis=1)
        names = users[indices[real, 0]]
        rows[step, [position[name] for name in names]] = True
    return rows


def shuffled_users(counts, seed=0):
    """User ids (id u holds counts[u] examples), in a shuffled order."""
    users = np.repeat(np.arange(len(counts)), counts)
    return np.random.default_rng(seed).permutation(users)


# ------------------------------------------------------------- sampling --


def test_each_user_is_included_with_probability_q_whatever_its_data():
    counts = np.tile([1, 10], 100)  # 200 users: half with 1, half with 10.
    users = shuffled_users(counts)
    batches = UserIndices(users, 20, 3, steps=2_000, seed=1)
    assert batches.sampling_probability == pytest.approx(0.1)
    seen = included(batches, users)
    steps, q = seen.shape[0], 0.1
    band = 6 * np.sqrt(steps * q * (1 - q))
    # Per user (per-example sampling would give 1 - 0.9**10 = 0.65 to the
    # users with 10 examples).
    assert np.all(np.abs(seen.sum(0) - steps * q) < band)
    for group in (counts == 1, counts == 10):
        total = seen[:, group].sum()
        n = steps * group.sum()
        assert abs(total - n * q) < 6 * np.sqrt(n * q * (1 - q))
    # The number of users per step is Binomial(U, q): its mean and variance.
    sizes = seen.sum(1)
    mean, var = 200 * q, 200 * q * (1 - q)
    assert abs(sizes.mean() - mean) < 6 * np.sqrt(var / steps)
    assert abs(sizes.var(ddof=1) - var) < 6 * var * np.sqrt(2 / (steps - 1))


def test_two_users_are_included_independently():
    users = shuffled_users(np.full(40, 3))
    batches = UserIndices(users, 20, 2, steps=4_000, seed=2)
    seen = included(batches, users).astype(float)
    steps, q = seen.shape[0], 0.5
    joint = seen.T @ seen / steps  # [U, U]: both users in a step.
    pairs = joint[np.triu_indices(40, 1)]
    band = 6 * np.sqrt(q * q * (1 - q * q) / steps)
    assert np.all(np.abs(pairs - q * q) < band)


def test_users_are_drawn_from_their_count_only():
    """The users of every step are those of `PoissonIndices(U, ...)` with
    the sampler's seed: the same whatever each user holds."""
    few = shuffled_users(np.full(30, 2))
    many = shuffled_users(np.arange(1, 31) * 3, seed=5)
    for users in (few, many):
        reference = PoissonIndices(30, 6, steps=50, seed=[7, 0])
        batches = UserIndices(users, 6, 4, steps=50, seed=7)
        for step, (indices, mask) in enumerate(draws(batches)):
            expected, expected_mask = reference.sample(step)
            names = users[indices[mask.any(1), 0]]
            np.testing.assert_array_equal(names, expected[expected_mask == 1])


def test_fixed_sampling_takes_exactly_that_many_users():
    users = shuffled_users(np.arange(1, 21))
    batches = UserIndices(users, 7, 3, steps=30, seed=0, sampling="fixed")
    assert batches.max_users == 7 and batches.max_rows == 21
    for indices, mask in draws(batches):
        assert indices.shape == (7, 3) and mask.any(1).sum() == 7


def test_full_batch_has_every_user_in_every_step():
    users = np.array(["b", "a", "c", "a", "b", "a"])
    batches = UserIndices(users, None, 2, steps=3, seed=0)
    assert batches.sampling_probability == 1.0 and batches.max_users == 3
    np.testing.assert_array_equal(batches.user_ids, ["a", "b", "c"])
    np.testing.assert_array_equal(batches.examples_of_user, [3, 2, 1])
    for indices, mask in draws(batches):
        # Slots follow the sorted ids; the rows of a slot are in order.
        np.testing.assert_array_equal(users[indices[:, 0]], ["a", "b", "c"])
        np.testing.assert_array_equal(mask.sum(1), [2, 2, 1])


def test_seed_none_draws_fresh_randomness():
    users = shuffled_users(np.full(200, 5))
    a, b = (UserIndices(users, 20, 2, steps=1) for _ in range(2))
    first, second = a.sample(0), b.sample(0)
    assert not np.array_equal(first[0], second[0])
    same = UserIndices(users, 20, 2, steps=1, seed=3).sample(0)
    np.testing.assert_array_equal(
        same[0], UserIndices(users, 20, 2, steps=1, seed=3).sample(0)[0]
    )


# -------------------------------------------------------------- the cap --


def test_each_user_gives_at_most_k_distinct_rows_of_its_own():
    counts = np.array([50, 2, 4, 7, 1, 12])
    users = shuffled_users(counts)
    batches = UserIndices(users, None, 4, steps=200, seed=4)
    for indices, mask in draws(batches):
        for slot, name in enumerate(batches.user_ids):
            rows = indices[slot][mask[slot]]
            assert len(rows) == min(counts[name], 4) == len(set(rows))
            assert np.all(users[rows] == name)  # No other user's example.
            # Real rows first, then padding rows of index 0.
            assert mask[slot][: len(rows)].all()
            assert np.all(indices[slot][~mask[slot]] == 0)


def test_rows_of_a_large_user_are_a_uniform_subset():
    users = shuffled_users(np.array([50, 3]))
    batches = UserIndices(users, None, 4, steps=2_000, seed=5)
    own = np.flatnonzero(users == 0)
    hits = np.zeros(len(users))
    adjacent = 0
    for indices, mask in draws(batches):
        rows = indices[0][mask[0]]
        hits[rows] += 1
        ranks = np.sort(np.searchsorted(own, rows))
        adjacent += int(np.sum(np.diff(ranks) == 1))
    steps = len(batches)
    # Each of the 50 examples with frequency 4/50.
    assert stats.chisquare(hits[own]).pvalue > 1e-6
    assert np.all(np.abs(hits[own] / steps - 4 / 50) < 6 * np.sqrt(0.08 / steps))
    # Pairs too: 49 adjacent pairs, each chosen with prob. 4*3 / (50*49).
    expected = steps * 49 * 12 / (50 * 49)
    assert abs(adjacent - expected) < 6 * np.sqrt(expected)


# -------------------------------------------------------------- padding --


@pytest.mark.parametrize("padding", ["bound", "multiple", "none"])
def test_slots_are_padded_as_poisson_batches_are(padding):
    users = shuffled_users(np.full(300, 2))
    batches = UserIndices(users, 30, 3, steps=20, seed=6, padding=padding)
    reference = PoissonIndices(300, 30, steps=20, seed=[6, 0], padding=padding)
    assert batches.max_users == reference.max_batch_size
    assert batches.max_users == max_clients_per_round(300, 0.1, tolerance=1e-9)
    for step, (indices, _) in enumerate(draws(batches)):
        assert indices.shape == (reference.sample(step)[0].size, 3)
    raw_indices, raw_mask = batches.sample(0)
    assert raw_indices.dtype == np.int32 and raw_mask.dtype == np.float32
    if padding == "bound":
        assert indices.shape[0] * 3 == batches.max_rows


def test_slots_are_a_multiple_of_multiple_of_and_never_zero():
    users = shuffled_users(np.full(50, 2))
    batches = UserIndices(
        users, 0.5, 2, steps=40, seed=7, padding="none", multiple_of=3
    )
    sizes = {indices.shape[0] for indices, _ in draws(batches)}
    assert all(size % 3 == 0 and size >= 3 for size in sizes)
    features, labels = np.arange(100.0), np.arange(100)
    empty = UserBatches(features, labels, shuffled_users(np.full(50, 2)),
                        1e-9, 2, steps=1, seed=0, padding="none")  # fmt: skip
    x, _, mask = empty[0]
    assert x.shape == (2,) and not mask.any()


def test_indices_are_int64_past_the_int32_limit(monkeypatch):
    monkeypatch.setattr(user_batches, "INDEX_INT32_LIMIT", 5)
    batches = UserIndices(np.arange(8) // 2, None, 2, steps=1, seed=0)
    indices, _ = batches.sample(0)
    assert indices.dtype == np.int64
    np.testing.assert_array_equal(indices, np.arange(8))


def test_user_batches_gather_the_rows():
    features = np.arange(24.0).reshape(12, 2)  # Row i is (2i, 2i + 1).
    labels, users = np.arange(12) % 3, shuffled_users(np.full(4, 3))
    batches = UserBatches(features, labels, users, None, 2, steps=2, seed=0)
    x, y, m = batches[1]
    rows = (x[:, 0] // 2).astype(int)
    np.testing.assert_array_equal(x, features[rows])
    np.testing.assert_array_equal(y, labels[rows])
    assert x.shape == (8, 2) and m.dtype == np.float32 and m.sum() == 8
    slots = users[rows].reshape(4, 2)  # Every user's slot holds its own rows.
    np.testing.assert_array_equal(slots, np.repeat(np.arange(4), 2).reshape(4, 2))
    with pytest.raises(IndexError):
        batches[2]


# --------------------------------------------------------------- errors --


@pytest.mark.parametrize(
    "users, kwargs, message",
    [
        (np.zeros((4, 1)), {}, r"users must be 1-D.*shape \(4, 1\)"),
        ([0.0, 1.0, np.nan], {}, r"got the float nan \(at example 2\)"),
        ([0.5, 1.0], {}, "got the float 0.5"),
        ([True, False], {}, "got dtype bool"),
        ([], {}, "users is empty"),
        (np.array([1, "a"], dtype=object), {}, "cannot be ordered"),
        ([0, 1, 1], {"examples_per_user": 0}, "examples_per_user must be a pos"),
        ([0, 1, 1], {"examples_per_user": 2.0}, "examples_per_user must be a pos"),
        ([0, 1, 1], {"users_per_step": 3}, "users_per_step=3 is more than the 2"),
        ([0, 1, 1], {"users_per_step": 0}, "users_per_step must be > 0"),
        (
            [0, 1, 2],
            {"users_per_step": 1.5, "sampling": "fixed"},
            "users_per_step must be a whole number",
        ),
        ([0, 1], {"seed": -1}, "seed must be None"),
        ([0, 1], {"seed": True}, "seed must be None"),
        ([0, 1], {"seed": [1, -2]}, "seed must be None"),
        ([0, 1], {"padding": "pad"}, "padding"),
        ([0, 1], {"sampling": "shuffle"}, "sampling"),
        ([0, 1], {"steps": 0}, "steps must be a positive integer"),
    ],
)
def test_bad_inputs_are_refused_with_a_clear_error(users, kwargs, message):
    arguments = {"users_per_step": 1, "examples_per_user": 2, "steps": 1} | kwargs
    with pytest.raises(ValueError, match=message):
        UserIndices(users, **arguments)


def test_one_user_is_allowed():
    batches = UserIndices([4, 4, 4], 1, 2, steps=1, seed=0, sampling="fixed")
    indices, mask = batches.sample(0)
    assert mask.tolist() == [1.0, 1.0] and len(set(indices)) == 2


def test_user_batches_refuse_users_of_the_wrong_length():
    features, labels = np.zeros((4, 2)), np.zeros(4)
    with pytest.raises(ValueError, match="users has 3 ids but features has 4"):
        UserBatches(features, labels, [0, 1, 1], 1, 2, steps=1)
    with pytest.raises(ValueError, match="features has 4 rows but labels has 3"):
        UserBatches(features, labels[:3], [0, 1, 1, 0], 1, 2, steps=1)
