"""Tree-aggregation noise (`kdpemb.privacy.tree_noise`) against a reference.

The reference builds the whole tree offline: every completed node of a
tree over T rounds gets one noise vector, the noisy prefix sum S_j sums
the nodes of j's binary decomposition (or, with Honaker's estimator, the
nodes' efficient estimates, computed bottom-up), and the covariance of
the prefix sums follows from which node noises each one contains. The
implementation is incremental (it keeps only the open nodes); the tests
run it over many coordinates at once and compare the empirical
covariance of its prefix sums with the reference's. A node drawn twice,
reused, or dropped changes some entry by at least σ².
"""

import keras
import numpy as np
import pytest

from kdpemb.privacy import gaussian_sum, tree_noise

SIGMA = 1.5  # z · C with z = 1.5, C = 1.
COORDINATES = 40_000


def completed_nodes(rounds):
    """`(level, index)` of every node of a tree over `rounds` leaves that
    completes: it covers rounds index·2^level + 1 .. (index + 1)·2^level."""
    return [
        (level, index)
        for level in range(rounds.bit_length())
        for index in range(rounds >> level)
    ]


def decomposition(j):
    """The nodes whose sum is S_j: one per set bit of j, from the left."""
    nodes, start = [], 0
    for level in reversed(range(j.bit_length())):
        if j >> level & 1:
            nodes.append((level, start >> level))
            start += 1 << level
    return nodes


def reference_coefficients(rounds, efficient):
    """`A [rounds, nodes]`: prefix sum j's noise is Σ_nodes A[j-1, n]·noise_n."""
    nodes = completed_nodes(rounds)
    column = {node: i for i, node in enumerate(nodes)}

    def own(node):
        row = np.zeros(len(nodes))
        row[column[node]] = 1.0
        return row

    estimate = {}
    for level, index in nodes:  # Bottom-up: children come first.
        if level == 0 or not efficient:
            estimate[level, index] = own((level, index))
            continue
        children = estimate[level - 1, 2 * index] + estimate[level - 1, 2 * index + 1]
        # Inverse-variance weights of the node's value and its children's sum.
        own_variance = 1.0
        children_variance = np.sum(children**2)
        weight = children_variance / (own_variance + children_variance)
        estimate[level, index] = weight * own((level, index)) + (1 - weight) * children
    return np.stack(
        [sum(estimate[node] for node in decomposition(j)) for j in range(1, rounds + 1)]
    )


def run_tree(round_positions, efficient, seed=0, levels=None):
    """The per-round noise of `tree_noise` for rounds at these positions
    in their tree, over `COORDINATES` coordinates: `[rounds, COORDINATES]`."""
    clipped = gaussian_sum.clip_and_sum([np.zeros((1, COORDINATES), "float32")], 1.0)
    levels = levels or tree_noise.tree_levels(max(round_positions))
    state = tree_noise.initial_open_noise(clipped, levels)
    generator = keras.random.SeedGenerator(seed)
    noises = []
    for j in round_positions:
        noise, state = tree_noise.tree_noise(
            clipped, SIGMA, generator, state, j, efficient=efficient
        )
        noises.append(keras.ops.convert_to_numpy(noise[0]))
    return np.stack(noises).astype(np.float64)


def covariance_mismatch(noises, expected_covariance):
    """Largest |empirical − expected| covariance of the prefix sums, in
    standard errors of the empirical entries."""
    prefix = np.cumsum(noises, axis=0)
    empirical = prefix @ prefix.T / prefix.shape[1]
    diagonal = np.diag(expected_covariance)
    standard_error = np.sqrt(
        (np.outer(diagonal, diagonal) + expected_covariance**2) / prefix.shape[1]
    )
    return np.max(np.abs(empirical - expected_covariance) / standard_error)


def expected_covariance(rounds, efficient):
    coefficients = reference_coefficients(rounds, efficient)
    return SIGMA**2 * coefficients @ coefficients.T


@pytest.mark.parametrize("efficient", [False, True], ids=["standard", "efficient"])
def test_prefix_sums_have_the_trees_variances_and_correlations(efficient):
    rounds = 11
    noises = run_tree(range(1, rounds + 1), efficient)
    covariance = expected_covariance(rounds, efficient)
    assert covariance_mismatch(noises, covariance) < 5.0
    if not efficient:
        # Var S_j = popcount(j) σ²: e.g. S_7 sums the nodes [1-4], [5-6], [7].
        assert np.diag(covariance)[6] == pytest.approx(3 * SIGMA**2)


def test_the_efficient_estimator_lowers_every_prefix_variance():
    standard = np.diag(expected_covariance(15, efficient=False))
    efficient = np.diag(expected_covariance(15, efficient=True))
    assert np.all(efficient <= standard + 1e-12)
    assert efficient[14] < 0.8 * standard[14]  # S_15: four nodes.
    # The reference's weights are the closed form the module uses.
    assert tree_noise.efficient_variances(4)[3] == pytest.approx(
        expected_covariance(8, True)[7, 7] / SIGMA**2
    )


@pytest.mark.parametrize("efficient", [False, True], ids=["standard", "efficient"])
def test_the_check_catches_a_reused_node(monkeypatch, efficient):
    # A closed node that is not subtracted stays in every later prefix sum
    # beside its parent: the same noise counted twice.
    def off_by_one(levels, new_level):
        return keras.ops.cast(keras.ops.arange(levels) < new_level - 1, "float32")

    monkeypatch.setattr(tree_noise, "_closing_levels", off_by_one)
    noises = run_tree(range(1, 12), efficient=efficient)
    assert covariance_mismatch(noises, expected_covariance(11, efficient)) > 20.0


@pytest.mark.parametrize("efficient", [False, True], ids=["standard", "efficient"])
def test_the_check_catches_a_dropped_node(monkeypatch, efficient):
    draws = []
    normal = keras.random.normal

    def drops_the_third(shape, **kwargs):
        draws.append(shape)
        value = normal(shape, **kwargs)
        return value * 0.0 if len(draws) == 3 else value

    monkeypatch.setattr(tree_noise.keras.random, "normal", drops_the_third)
    noises = run_tree(range(1, 12), efficient=efficient)
    assert covariance_mismatch(noises, expected_covariance(11, efficient)) > 20.0


def test_a_restart_starts_a_new_tree_independent_of_the_last():
    # Two trees of 4 rounds: positions 1..4, 1..4. The second tree's prefix
    # sums (counted from its start) have the first tree's covariance and
    # are uncorrelated with it, although the state still holds its nodes.
    noises = run_tree([1, 2, 3, 4, 1, 2, 3, 4], efficient=False)
    first, second = noises[:4], noises[4:]
    covariance = expected_covariance(4, efficient=False)
    assert covariance_mismatch(first, covariance) < 5.0
    assert covariance_mismatch(second, covariance) < 5.0
    cross = np.cumsum(first, 0) @ np.cumsum(second, 0).T / COORDINATES
    assert np.max(np.abs(cross)) < 5 * 2 * SIGMA**2 / np.sqrt(COORDINATES)


def test_zero_noise_adds_nothing_and_leaves_no_node_open():
    clipped = gaussian_sum.clip_and_sum([np.ones((2, 3), "float32")], 1.0)
    state = tree_noise.initial_open_noise(clipped, 2)
    noise, state = tree_noise.tree_noise(
        clipped, 0.0, keras.random.SeedGenerator(0), state, 1
    )
    assert not np.any(keras.ops.convert_to_numpy(noise[0]))
    assert not np.any(keras.ops.convert_to_numpy(state[0]))


def test_bad_arguments_are_refused():
    clipped = gaussian_sum.clip_and_sum([np.ones((2, 3), "float32")], 1.0)
    state = tree_noise.initial_open_noise(clipped, 2)
    with pytest.raises(TypeError, match="SeedGenerator"):
        tree_noise.tree_noise(clipped, 1.0, 0, state, 1)
    with pytest.raises(TypeError, match="ClippedSum"):
        tree_noise.tree_noise(
            [np.ones(3)], 1.0, keras.random.SeedGenerator(0), state, 1
        )
