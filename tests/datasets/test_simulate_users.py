import warnings

import numpy as np
import pytest

from kdpemb.datasets.simulate_users import simulate_users


def classes_of_each_user(labels, users):
    return [set(labels[users == u].tolist()) for u in range(users.max() + 1)]


def shuffled_labels(num_classes, per_class, seed=0):
    labels = np.repeat(np.arange(num_classes), per_class)
    return np.random.default_rng(seed).permutation(labels)


@pytest.mark.parametrize("classes_per_user", [None, 1, 3])
def test_every_example_gets_exactly_one_dense_user_id(classes_per_user):
    labels = shuffled_labels(10, 37)
    users = simulate_users(labels, num_users=20, classes_per_user=classes_per_user)
    assert users.shape == labels.shape
    assert users.dtype == np.int64
    assert np.unique(users).tolist() == list(range(20))


def test_iid_parts_differ_in_size_by_at_most_one():
    users = simulate_users(np.zeros(103, np.int64), num_users=10)
    sizes = np.bincount(users)
    assert sizes.size == 10
    assert sizes.sum() == 103
    assert sizes.max() - sizes.min() == 1


def test_iid_split_mixes_classes_instead_of_cutting_sorted_data():
    labels = np.repeat(np.arange(10), 100)  # Sorted: contiguous cuts give 1 class.
    users = simulate_users(labels, num_users=10)
    assert all(len(c) >= 5 for c in classes_of_each_user(labels, users))


@pytest.mark.parametrize("c", [1, 2, 3, 7])
def test_skewed_users_hold_exactly_c_classes(c):
    labels = shuffled_labels(10, 200)
    users = simulate_users(labels, num_users=50, classes_per_user=c, seed=3)
    assert [len(s) for s in classes_of_each_user(labels, users)] == [c] * 50


def test_skewed_users_hold_every_class_when_c_is_at_least_the_class_count():
    labels = shuffled_labels(5, 40)
    users = simulate_users(labels, num_users=8, classes_per_user=12)
    assert [len(s) for s in classes_of_each_user(labels, users)] == [5] * 8


@pytest.mark.parametrize(
    "num_users, c, num_classes", [(100, 3, 10), (7, 2, 5), (13, 4, 6), (3, 4, 10)]
)
def test_skewed_class_holders_are_balanced(num_users, c, num_classes):
    labels = shuffled_labels(num_classes, 100)
    users = simulate_users(labels, num_users=num_users, classes_per_user=c, seed=1)
    holders = [len(np.unique(users[labels == k])) for k in range(num_classes)]
    assert sum(holders) == num_users * c
    assert max(holders) - min(holders) <= 1


def test_skewed_class_examples_are_split_evenly_among_holders():
    labels = shuffled_labels(10, 103)
    users = simulate_users(labels, num_users=30, classes_per_user=2)
    for k in range(10):
        counts = np.bincount(users[labels == k])
        counts = counts[counts > 0]
        assert counts.max() - counts.min() <= 1


def test_same_seed_gives_the_same_ids_and_another_seed_differs():
    labels = shuffled_labels(10, 50)
    for c in (None, 2):
        a = simulate_users(labels, 25, classes_per_user=c, seed=7)
        b = simulate_users(labels, 25, classes_per_user=c, seed=7)
        other = simulate_users(labels, 25, classes_per_user=c, seed=8)
        np.testing.assert_array_equal(a, b)
        assert (a != other).any()


def test_users_without_examples_are_dropped_with_one_counting_warning():
    with pytest.warns(UserWarning) as record:
        users = simulate_users(np.arange(88) % 3, num_users=100)
    assert len(record) == 1
    assert str(record[0].message) == (
        "12 of 100 simulated users received no examples and were dropped; "
        "88 users remain."
    )
    assert np.unique(users).tolist() == list(range(88))


def test_class_with_fewer_examples_than_holders_drops_the_empty_users():
    labels = np.array([0] + [1] * 10)  # Class 0 has 1 example for 2 holders.
    with pytest.warns(UserWarning, match="1 of 4 simulated users") as record:
        users = simulate_users(labels, num_users=4, classes_per_user=1)
    assert len(record) == 1
    assert np.unique(users).tolist() == [0, 1, 2]


def test_no_warning_when_every_user_gets_examples():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        simulate_users(shuffled_labels(4, 10), num_users=40)


def test_whole_float_labels_are_accepted_like_ints():
    labels = shuffled_labels(4, 10)
    np.testing.assert_array_equal(
        simulate_users(labels.astype(float), 5, classes_per_user=2),
        simulate_users(labels, 5, classes_per_user=2),
    )


@pytest.mark.parametrize(
    "labels, match",
    [
        (np.zeros((4, 2), int), r"1-D.*\(4, 2\)"),
        (np.array([0.0, 1.5]), r"whole numbers.*labels\[1\] = 1\.5"),
        (np.array([0.0, np.nan]), r"labels\[1\] = nan"),
        (np.array([0, -3]), r"non-negative.*labels\[1\] = -3"),
        (np.array(["cat", "dog"]), r"non-negative integers.*return_inverse"),
        (np.array([], int), "empty"),
    ],
    ids=["2d", "fraction", "nan", "negative", "strings", "empty"],
)
def test_invalid_labels_raise_naming_the_problem(labels, match):
    with pytest.raises(ValueError, match=match):
        simulate_users(labels, num_users=2)


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "3"])
def test_num_users_must_be_a_positive_int(value):
    with pytest.raises(
        ValueError, match=rf"num_users must be a positive int.*{value!r}"
    ):
        simulate_users(np.arange(4), num_users=value)


@pytest.mark.parametrize("value", [0, 1.5, False])
def test_classes_per_user_must_be_a_positive_int(value):
    with pytest.raises(ValueError, match=rf"classes_per_user.*{value!r}"):
        simulate_users(np.arange(4), num_users=2, classes_per_user=value)


def test_too_few_users_to_cover_every_class_is_an_error():
    with pytest.raises(ValueError, match=r"cover only 4 of the 10 classes.*>= 5"):
        simulate_users(np.arange(10), num_users=2, classes_per_user=2)
