"""Recall@FAR and the ROC against slow references and scikit-learn."""

import itertools

import numpy as np
import pytest
from sklearn.metrics import roc_curve

from kdpemb.metrics import recall_at_far, verification, verification_roc


def unit_rows(embeddings):
    embeddings = np.asarray(embeddings, dtype=np.float32)
    norms = np.linalg.norm(embeddings, axis=1, keepdims=True)
    return embeddings / np.maximum(norms, 1e-12)


def reference_recall(embeddings, labels, far):
    """A loop over every pair and every candidate threshold."""
    unit = unit_rows(embeddings)
    genuine, impostor = [], []
    for i, j in itertools.combinations(range(len(labels)), 2):
        score = float(np.float32(unit[i] @ unit[j]))
        (genuine if labels[i] == labels[j] else impostor).append(score)
    best = 0.0
    for t in [np.inf, *genuine, *impostor]:
        accepted_impostors = sum(s >= t for s in impostor)
        if accepted_impostors / len(impostor) <= far:
            best = max(best, sum(s >= t for s in genuine) / len(genuine))
    return best


def clustered(seed, identities=12, per_identity=5, dim=6, noise=0.9):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(identities, dim))
    labels = np.repeat(np.arange(identities), per_identity)
    rng.shuffle(labels)
    return centres[labels] + noise * rng.normal(size=(labels.size, dim)), labels


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("far", [0.003, 0.01, 0.1, 0.5])
def test_recall_at_far_equals_a_loop_over_all_pairs(seed, far):
    embeddings, labels = clustered(seed)
    expected = reference_recall(embeddings, labels, far)
    assert recall_at_far(embeddings, labels, far) == pytest.approx(expected, abs=1e-12)


def tied_data(seed):
    """Embeddings on a few axes: every score is exactly -1, 0 or 1."""
    rng = np.random.default_rng(seed)
    axes = np.concatenate([np.eye(3), -np.eye(3)])
    labels = rng.integers(0, 4, size=24)
    # An identity mostly sits on its own axis, sometimes on another one.
    choice = np.where(rng.random(24) < 0.7, labels, rng.integers(0, 6, size=24))
    return axes[choice] * rng.uniform(0.5, 2, size=(24, 1)), labels


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("far", [0.02, 0.1, 0.3, 0.6, 1.0])
def test_ties_are_accepted_or_rejected_together(seed, far):
    embeddings, labels = tied_data(seed)
    expected = reference_recall(embeddings, labels, far)
    assert recall_at_far(embeddings, labels, far) == pytest.approx(expected, abs=1e-12)


def all_pair_scores(embeddings, labels):
    """float64 cosines of every pair i < j, rounded to float32, one by one."""
    unit = np.asarray(embeddings, dtype=np.float64)
    unit = unit / np.maximum(np.linalg.norm(unit, axis=1, keepdims=True), 1e-12)
    i, j = np.triu_indices(len(labels), k=1)
    scores = np.einsum("kd,kd->k", unit[i], unit[j]).astype(np.float32)
    return scores, (labels[i] == labels[j]).astype(int)


def sklearn_recall(embeddings, labels, far):
    scores, same = all_pair_scores(embeddings, labels)
    fpr, tpr, _ = roc_curve(same, scores, drop_intermediate=False)
    return tpr[fpr <= far].max()


def quantised(seed, distinct=24, n=400, dim=32):
    """Many exact duplicates: identities share a few quantised vectors."""
    rng = np.random.default_rng(seed)
    codebook = np.round(rng.normal(size=(distinct, dim)) * 4) / 4
    labels = rng.integers(0, 40, size=n)
    pick = np.where(
        rng.random(n) < 0.6, labels % distinct, rng.integers(0, distinct, n)
    )
    return codebook[pick], labels


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("block_elements", [None, 500])
def test_duplicated_embeddings_tie_exactly_whatever_the_blocks(
    seed, block_elements, monkeypatch
):
    embeddings, labels = quantised(seed)
    if block_elements:
        monkeypatch.setattr(verification, "_BLOCK_ELEMENTS", block_elements)
    for far in (1e-3, 1e-2, 0.1):
        assert recall_at_far(embeddings, labels, far) == pytest.approx(
            sklearn_recall(embeddings, labels, far), abs=1e-12
        )


@pytest.mark.parametrize("far", [0.29, 0.07, 0.57, 1 / 49 * 3])
def test_far_is_compared_as_scikit_learn_does(far):
    # 0.29 * 100 is 28.999... in binary: a floor() would allow 28 accepts.
    embeddings, labels = clustered(11, identities=12, per_identity=3)
    assert recall_at_far(embeddings, labels, far) == pytest.approx(
        sklearn_recall(embeddings, labels, far), abs=1e-12
    )


@pytest.mark.parametrize("seed", range(3))
def test_scikit_learn_roc_gives_the_same_tar_at_the_same_far(seed):
    embeddings, labels = clustered(seed, identities=30, per_identity=6, dim=8)
    scores, same = all_pair_scores(embeddings, labels)
    fpr, tpr, _ = roc_curve(same, scores, drop_intermediate=False)
    for far in (1e-3, 1e-2, 0.1, 0.5):
        assert recall_at_far(embeddings, labels, far) == pytest.approx(
            tpr[fpr <= far].max(), abs=1e-12
        )
    ours_far, ours_tar, ours_thresholds = verification_roc(
        embeddings, labels, max_far=1.0
    )
    np.testing.assert_allclose(ours_far, fpr, atol=1e-12)
    np.testing.assert_allclose(ours_tar, tpr, atol=1e-12)
    assert np.all(np.diff(ours_thresholds[1:]) < 0)


def test_a_partial_roc_is_the_exact_prefix_of_the_full_one():
    embeddings, labels = clustered(5, identities=20, per_identity=5)
    full = verification_roc(embeddings, labels, max_far=1.0)
    part = verification_roc(embeddings, labels, max_far=0.05)
    n = part[0].size
    assert 1 < n < full[0].size and part[0][-1] <= 0.05
    for a, b in zip(part, full, strict=True):
        np.testing.assert_array_equal(a, b[:n])
    assert full[0][n] > 0.05  # The next point of the full curve is past 0.05.


def test_blocked_computation_equals_one_block(monkeypatch):
    embeddings, labels = clustered(6, identities=25, per_identity=4)
    fars = [0.004, 0.02, 0.2]
    whole = recall_at_far(embeddings, labels, fars)
    monkeypatch.setattr(verification, "_BLOCK_ELEMENTS", 150)  # 1 row per block.
    np.testing.assert_array_equal(recall_at_far(embeddings, labels, fars), whole)
    monkeypatch.undo()
    far, tar, thresholds = verification_roc(embeddings, labels, max_far=0.3)
    monkeypatch.setattr(verification, "_BLOCK_ELEMENTS", 150)
    blocked = verification_roc(embeddings, labels, max_far=0.3)
    np.testing.assert_array_equal(blocked[0], far)
    np.testing.assert_array_equal(blocked[1], tar)
    # A float32 matrix product may round the last bit differently per block.
    np.testing.assert_allclose(blocked[2], thresholds, rtol=0, atol=2e-7)


def test_in_batch_pairs_are_the_pairs_inside_each_batch():
    embeddings, labels = clustered(7, identities=10, per_identity=8)
    # One batch holding everything is the exact all-pairs value.
    assert recall_at_far(
        embeddings, labels, 0.05, pairs="in_batch", batch_size=80
    ) == recall_at_far(embeddings, labels, 0.05)
    # Batches of 20: the reference over pairs inside each batch only.
    unit = unit_rows(embeddings)
    genuine, impostor = [], []
    for start in range(0, 80, 20):
        for i, j in itertools.combinations(range(start, start + 20), 2):
            score = float(np.float32(unit[i] @ unit[j]))
            (genuine if labels[i] == labels[j] else impostor).append(score)
    allowed = int(0.05 * len(impostor))
    cut = sorted(impostor, reverse=True)[allowed]
    expected = sum(g > cut for g in genuine) / len(genuine)
    got = recall_at_far(embeddings, labels, 0.05, pairs="in_batch", batch_size=20)
    assert got == pytest.approx(expected, abs=1e-12)


def test_scale_and_label_values_do_not_matter():
    embeddings, labels = clustered(8)
    value = recall_at_far(embeddings, labels, 0.01)
    scaled = embeddings * np.linspace(0.1, 10, len(labels))[:, None]
    assert recall_at_far(scaled, labels * 7 + 3, 0.01) == value
    assert recall_at_far(embeddings, labels.astype(str), 0.01) == value


def test_better_embeddings_score_higher():
    noisy, labels = clustered(9, noise=2.0)
    clean, _ = clustered(9, noise=0.2)
    assert recall_at_far(clean, labels, 0.01) > recall_at_far(noisy, labels, 0.01)


# ------------------------------------------------------------ edge cases --


def test_a_far_below_one_impostor_pair_is_refused_with_the_smallest_usable():
    embeddings, labels = clustered(1, identities=4, per_identity=2)
    impostors = 28 - 4
    with pytest.raises(ValueError, match=f"below 1 / {impostors} impostor") as error:
        recall_at_far(embeddings, labels, far=0.01)
    # The suggested FAR is itself accepted.
    suggested = float(str(error.value).split("far >= ")[1].split(",")[0])
    assert 0 <= recall_at_far(embeddings, labels, far=suggested) <= 1
    assert 0 <= recall_at_far(embeddings, labels, far=1 / impostors) <= 1


def test_a_single_identity_is_refused():
    with pytest.raises(ValueError, match="at least two identities"):
        recall_at_far(np.ones((5, 3)), np.zeros(5))


def test_identities_with_one_image_each_have_no_genuine_pair():
    with pytest.raises(ValueError, match="No genuine pair"):
        recall_at_far(np.eye(4), np.arange(4), far=0.5)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_embeddings_are_refused_naming_the_row(bad):
    embeddings, labels = clustered(2)
    embeddings[7, 1] = bad
    with pytest.raises(ValueError, match=r"embeddings\[7\] holds NaN"):
        recall_at_far(embeddings, labels)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(far=0.0), r"far must be in \(0, 1\]"),
        (dict(far=1.5), r"far must be in \(0, 1\]"),
        (dict(far=np.nan), r"far must be in \(0, 1\]"),
        (dict(pairs="some"), "pairs must be one of"),
        (dict(pairs="in_batch", batch_size=1), "batch_size must be"),
    ],
)
def test_bad_arguments_are_refused(kwargs, message):
    embeddings, labels = clustered(3)
    with pytest.raises(ValueError, match=message):
        recall_at_far(embeddings, labels, **kwargs)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="shape"):
        recall_at_far(np.ones(5), np.zeros(5))
    with pytest.raises(ValueError, match="labels must have shape"):
        recall_at_far(np.ones((5, 2)), np.zeros(4))


def test_a_zero_embedding_scores_zero_with_everything():
    embeddings = np.array([[1.0, 0], [1.0, 0.01], [0, 0], [0, 1.0], [0.01, 1.0]])
    labels = np.array([0, 0, 1, 1, 1])
    assert recall_at_far(embeddings, labels, far=1.0) == 1.0
    assert reference_recall(embeddings, labels, 0.5) == recall_at_far(
        embeddings, labels, 0.5
    )


@pytest.mark.parametrize(("pairs", "batch_size"), [("all", 256), ("in_batch", 7)])
def test_check_labels_counts_the_pairs_by_brute_force(pairs, batch_size):
    labels = np.random.default_rng(5).integers(0, 6, 40)
    counts = [0, 0]  # genuine, impostor
    for start in range(0, 40, batch_size if pairs == "in_batch" else 40):
        block = labels[start : start + (batch_size if pairs == "in_batch" else 40)]
        for i in range(len(block)):
            for j in range(i + 1, len(block)):
                counts[int(block[i] != block[j])] += 1
    assert verification.check_labels(labels, 0.1, pairs, batch_size) == tuple(counts)
    # A FAR below one impostor pair is refused by the labels alone.
    with pytest.raises(ValueError, match="cannot measure"):
        verification.check_labels(labels, 0.5 / counts[1], pairs, batch_size)
