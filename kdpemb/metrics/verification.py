"""Verification quality of embeddings: ROC and Recall@FAR over pairs.

Every pair (i, j), i < j, of an evaluation set is a *genuine* pair (same
identity) or an *impostor* pair (different identities). Its score is the
cosine similarity of the two L2-normalised embeddings, and a threshold t
accepts the pairs with score >= t. Then

    FAR(t) = #impostor pairs accepted / #impostor pairs
    TAR(t) = #genuine pairs accepted / #genuine pairs

and Recall@FAR=f is the largest TAR(t) with FAR(t) <= f.

**Exactness.** With a the most false accepts that f allows (about
f · #impostors, see below) and v the (a+1)-th largest
impostor score, FAR(t) <= f exactly when t > v, so Recall@FAR=f is the
share of genuine scores strictly above v. Only the a+1 largest impostor
scores are needed, so the all-pairs computation streams blocks of rows of
the similarity matrix and keeps a running top-(a+1): memory is one block
plus the genuine scores, never the N × N matrix.

**Ties.** Scores are cosine similarities computed in float64 and rounded
to float32. A float64 matrix product can differ in the last bits for the
same pair of vectors depending on where they sit in a block; rounding to
float32 makes identical (duplicated or quantised) embeddings score exactly
equal. Pairs with equal scores are accepted or rejected together (a
threshold cannot split them), so a genuine pair tied with the (a+1)-th
impostor is rejected. That is what `sklearn.metrics.roc_curve` does too.

**FAR arithmetic.** FAR(t) is the float64 quotient accepted / #impostors,
as scikit-learn computes it, and "FAR <= f" is compared in float64 (so
far=0.29 with 100 impostors allows 29 false accepts although 0.29 · 100
is 28.999... in binary).
"""

import math
import numbers

import numpy as np

_BLOCK_ELEMENTS = 2**24  # Scores per block: 128 MiB of float64.
PAIRS = ("all", "in_batch")


def _check_embeddings(embeddings, labels):
    try:
        embeddings = np.asarray(embeddings)
    except ValueError as error:  # A ragged list.
        raise ValueError(
            f"embeddings must be a (num_examples, dim) array ({error})."
        ) from error
    if embeddings.ndim != 2:
        raise ValueError(
            f"embeddings must have shape (num_examples, dim), got {embeddings.shape}."
        )
    if embeddings.dtype.kind not in "fiu":
        raise ValueError(f"embeddings must be numbers, got dtype {embeddings.dtype}.")
    if embeddings.shape[0] == 0:
        raise ValueError("embeddings and labels are empty: nothing to verify.")
    if embeddings.shape[1] == 0:
        raise ValueError(
            f"embeddings have no dimensions (shape {embeddings.shape}); pass "
            "(num_examples, dim) embeddings with dim >= 1."
        )
    embeddings = embeddings.astype(np.float64)
    finite = np.isfinite(embeddings).all(axis=1)
    if not finite.all():
        bad = np.flatnonzero(~finite)
        raise ValueError(
            f"embeddings[{bad[0]}] holds NaN or infinite values ({bad.size} "
            "such row(s)). The model diverged or its input was bad; Recall@FAR "
            "of non-finite embeddings is undefined."
        )
    labels = _identities(labels, len(embeddings))
    # Scaled by the largest entry first, so that huge values do not overflow.
    peak = np.abs(embeddings).max(axis=1, keepdims=True)
    embeddings = embeddings / np.where(peak > 0, peak, 1.0)
    norms = np.linalg.norm(embeddings, axis=1, keepdims=True)
    # A zero embedding has similarity 0 with everything.
    return embeddings / np.maximum(norms, 1e-12), labels


def _identities(labels, num_embeddings=None):
    """`labels` as identity indices 0..I-1 (int64), or a ValueError."""
    labels = np.asarray(labels)
    if labels.ndim == 2 and labels.shape[1] == 1:
        labels = labels[:, 0]
    if num_embeddings is not None and labels.shape != (num_embeddings,):
        raise ValueError(
            f"labels must have shape ({num_embeddings},), one identity per "
            f"embedding, got {labels.shape}."
        )
    if labels.ndim != 1:
        raise ValueError(
            f"labels must be 1-D, one identity per image, got shape {labels.shape}."
        )
    if labels.dtype.kind == "f" and not (
        np.isfinite(labels).all() and (labels == np.round(labels)).all()
    ):
        raise ValueError(
            "labels must be integer identities, got fractions (or NaN); pass "
            "one integer (or string) identity per image."
        )
    if labels.dtype.kind not in "biufUSO":
        raise ValueError(
            f"labels must be integer (or string) identities, got dtype {labels.dtype}."
        )
    _, labels = np.unique(labels, return_inverse=True)
    return labels.reshape(-1).astype(np.int64)


def _pair_counts(labels):
    n = labels.size
    sizes = np.bincount(labels)
    genuine = int((sizes * (sizes - 1) // 2).sum())
    return genuine, n * (n - 1) // 2 - genuine


def check_in_batch_size(batch_size, name="batch_size"):
    """`batch_size` as an int >= 2 (pairs need two rows), or a ValueError
    naming `name`."""
    if (
        not isinstance(batch_size, numbers.Integral)
        or isinstance(batch_size, bool)
        or batch_size < 2
    ):
        raise ValueError(f"{name} must be an int >= 2, got {batch_size!r}.")
    return int(batch_size)


def _counts(labels, pairs, batch_size):
    """`(genuine, impostor)` pair counts of identity indices `labels`, or a
    ValueError when either is zero: what the pairs of `pairs` need."""
    identities = int(labels.max()) + 1 if labels.size else 0
    if identities < 2:
        raise ValueError(
            f"Verification needs at least two identities; got {identities} "
            f"identity among {labels.size} embeddings, so there is no "
            "impostor pair."
        )
    if pairs == "in_batch":
        genuine = impostor = 0
        for start in range(0, labels.size, batch_size):
            g, i = _pair_counts(labels[start : start + batch_size])
            genuine, impostor = genuine + g, impostor + i
    else:
        genuine, impostor = _pair_counts(labels)
    if genuine == 0:
        raise ValueError(
            "No genuine pair: every identity has a single embedding (or, with "
            "pairs='in_batch', no batch holds two of one identity). Use at "
            "least two images per identity."
        )
    if impostor == 0:
        raise ValueError(
            "No impostor pair: every pair has the same identity (or, with "
            "pairs='in_batch', every batch holds one identity). Use images "
            "of at least two identities (in each batch)."
        )
    return genuine, impostor


def check_labels(labels, far=1e-3, pairs="all", batch_size=256):
    """Checks, before any embedding, that `labels` can give Recall@FAR.

    The checks of `recall_at_far` that need only the labels: their shape
    and dtype, at least one genuine and one impostor pair (for `pairs`),
    and that every `far` is measurable on that many impostor pairs. What
    `kdpemb.callbacks.RecallAtFAR` runs before training.

    Args:
        labels: array `(N,)` of integer (or string) identities.
        far, pairs, batch_size: as for `recall_at_far`.

    Returns:
        `(genuine, impostor)`: the numbers of pairs of each kind.

    Raises:
        ValueError: naming what is missing and the fix.

    Example:

    >>> check_labels([0, 0, 1, 1, 2], far=0.2)
    (2, 8)
    >>> try:
    ...     check_labels([0, 1, 2, 3], far=0.2)
    ... except ValueError as error:
    ...     print(str(error)[:54])
    No genuine pair: every identity has a single embedding
    """
    fars = check_far(far)
    if not isinstance(pairs, str) or pairs not in PAIRS:
        raise ValueError(f"pairs must be one of {PAIRS}, got {pairs!r}.")
    if pairs == "in_batch":
        batch_size = check_in_batch_size(batch_size)
    labels = _identities(labels)
    if labels.size == 0:
        raise ValueError("labels is empty: there are no images to pair.")
    genuine, impostor = _counts(labels, pairs, batch_size)
    _check_measurable(fars, impostor)
    return genuine, impostor


def check_far(far):
    """`far` (one rate or several) as a 1-D float array of rates in (0, 1],
    or a ValueError that names the bad value."""
    try:
        values = np.atleast_1d(np.asarray(far, dtype=float))
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"far must be a float or a list of floats, got {far!r}."
        ) from error
    if values.ndim != 1 or values.size == 0:
        raise ValueError(f"far must be a float or a list of floats, got {far!r}.")
    for value in values:
        if not (math.isfinite(value) and 0.0 < value <= 1.0):
            raise ValueError(f"far must be in (0, 1], got {value!r}.")
    return values


def allowed_false_accepts(far, num_impostors):
    """The largest a with a / num_impostors <= far, in float64.

    >>> allowed_false_accepts(0.29, 100), allowed_false_accepts(1e-3, 999)
    (29, 0)
    """
    allowed = min(num_impostors, math.floor(far * num_impostors))
    while allowed < num_impostors and (allowed + 1) / num_impostors <= far:
        allowed += 1
    while allowed > 0 and allowed / num_impostors > far:
        allowed -= 1
    return allowed


def _check_measurable(values, num_impostors):
    for value in values:
        if allowed_false_accepts(value, num_impostors) == 0:
            scale = 10.0 ** (math.floor(math.log10(1.0 / num_impostors)) - 2)
            smallest = math.ceil(1.0 / num_impostors / scale) * scale
            raise ValueError(
                f"far={value:g} is below 1 / {num_impostors} impostor pairs: "
                "this evaluation set cannot measure a false-accept rate that "
                f"small. Use far >= {smallest:.3g}, or more identities and "
                "images."
            )
    return values


class _TopScores:
    """The k largest values seen so far (k may be 0), in amortised O(n).

    Candidates below the current k-th largest are discarded on arrival;
    the rest wait in a list that is partitioned down to k only when it
    holds more than 2k values.
    """

    def __init__(self, k):
        self.k = k
        self.floor = -np.inf
        self.pending = []
        self.size = 0

    def add(self, scores):
        if self.k == 0:
            return
        scores = scores[scores >= self.floor]
        if scores.size:
            self.pending.append(scores)
            self.size += scores.size
        if self.size > 2 * self.k:
            self._shrink()

    def _shrink(self):
        merged = np.concatenate(self.pending) if self.pending else np.empty(0)
        if merged.size > self.k:
            merged = np.partition(merged, merged.size - self.k)[-self.k :]
            self.floor = merged.min()
        self.pending, self.size = [merged], merged.size

    @property
    def values(self):
        self._shrink()
        return self.pending[0].astype(np.float32)


def _all_pair_scores(unit, labels, keep):
    """Genuine scores and the `keep` largest impostor scores over i < j.

    Rows are sorted by identity, so in row i the columns j > i hold first
    the rest of i's identity (genuine pairs) and then only impostors.
    """
    order = np.argsort(labels, kind="stable")
    unit, labels = unit[order], labels[order]
    identity_end = np.searchsorted(labels, labels, side="right")
    n = unit.shape[0]
    genuine = []
    top = _TopScores(keep)
    rows = max(1, min(n, _BLOCK_ELEMENTS // max(n, 1)))
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        # Columns start..n-1; float64 products rounded to float32 (ties).
        scores = (unit[start:stop] @ unit[start:].T).astype(np.float32)
        for row, i in enumerate(range(start, stop)):
            impostors_from = identity_end[i] - start
            genuine.append(scores[row, row + 1 : impostors_from].copy())
            scores[row, :impostors_from] = -np.inf  # Not an impostor pair.
        flat = scores.reshape(-1)
        top.add(flat[flat > -np.inf] if top.floor == -np.inf else flat)
    return np.concatenate(genuine), top.values


def _in_batch_scores(unit, labels, batch_size):
    genuine, impostor = [], []
    for start in range(0, unit.shape[0], batch_size):
        block = unit[start : start + batch_size]
        block_labels = labels[start : start + batch_size]
        scores = (block @ block.T).astype(np.float32)
        upper = np.triu(np.ones(scores.shape, dtype=bool), k=1)
        same = block_labels[:, None] == block_labels[None, :]
        genuine.append(scores[upper & same])
        impostor.append(scores[upper & ~same])
    return np.concatenate(genuine), np.concatenate(impostor)


def _scores(embeddings, labels, pairs, batch_size, keep_far):
    if not isinstance(pairs, str) or pairs not in PAIRS:
        raise ValueError(f"pairs must be one of {PAIRS}, got {pairs!r}.")
    if pairs == "in_batch":
        batch_size = check_in_batch_size(batch_size)
    unit, labels = _check_embeddings(embeddings, labels)
    _, num_impostors = _counts(labels, pairs, batch_size)
    if pairs == "in_batch":
        genuine, impostor = _in_batch_scores(unit, labels, batch_size)
    else:
        keep = min(num_impostors, allowed_false_accepts(keep_far, num_impostors) + 1)
        genuine, impostor = _all_pair_scores(unit, labels, keep)
    return genuine, np.sort(impostor)[::-1], num_impostors


def _recall(genuine_sorted, impostor_desc, num_impostors, far):
    allowed = allowed_false_accepts(far, num_impostors)
    if allowed >= num_impostors:
        return 1.0
    cut = impostor_desc[allowed]
    above = genuine_sorted.size - np.searchsorted(genuine_sorted, cut, side="right")
    return above / genuine_sorted.size


def recall_at_far(embeddings, labels, far=1e-3, pairs="all", batch_size=256):
    """True-accept rate at a fixed false-accept rate, over all pairs.

    Args:
        embeddings: float array `(N, dim)`. Need not be normalised.
        labels: int array `(N,)`. Identity of each embedding.
        far: float or sequence of floats in (0, 1]. The false-accept
            rate(s). Defaults to `1e-3`.
        pairs: str. `"all"` (exact, every pair i < j) or `"in_batch"`
            (only pairs inside consecutive batches of `batch_size`, the
            cheaper approximation of the DP-FedEmb reference code).
            Defaults to `"all"`.
        batch_size: int. Batch size for `pairs="in_batch"`. Defaults to
            `256`.

    Returns:
        float, or a NumPy array with one value per `far` when `far` is a
        sequence.

    Raises:
        ValueError: for NaN or infinite embeddings, a single identity, no
            genuine pair, or a `far` below 1 / (number of impostor pairs).

    Example:

    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> centres = rng.normal(size=(50, 16))
    >>> labels = np.repeat(np.arange(50), 4)
    >>> embeddings = centres[labels] + 0.3 * rng.normal(size=(200, 16))
    >>> float(recall_at_far(embeddings, labels, far=1e-2)) > 0.9
    True
    >>> recall_at_far(embeddings, labels, far=[1e-3, 1e-1]).shape
    (2,)
    """
    *_, result = _scores_and_recalls(embeddings, labels, far, pairs, batch_size)
    return float(result[0]) if np.ndim(far) == 0 else result


def verification_roc(embeddings, labels, max_far=0.1, pairs="all", batch_size=256):
    """The ROC of pair verification: `(far, tar, thresholds)`.

    One point per distinct score at which the acceptance changes, from the
    strictest threshold down, starting at `(0, 0, inf)` as
    `sklearn.metrics.roc_curve` does. The curve is exact for FAR <=
    `max_far` and stops there, so that only the top `max_far` share of
    impostor scores is kept in memory (N = 50,000 embeddings make 1.25e9
    pairs: `max_far=0.1` keeps 500 MB of them, `1e-2` 50 MB). Pass
    `max_far=1` for the whole curve on small sets.

    Args:
        embeddings: float array `(N, dim)`.
        labels: int array `(N,)`.
        max_far: float in (0, 1]. Largest FAR on the curve. Defaults to
            `0.1`.
        pairs: str. `"all"` or `"in_batch"` (see `recall_at_far`).
        batch_size: int. For `pairs="in_batch"`. Defaults to `256`.

    Returns:
        `(far, tar, thresholds)`: float64, float64 and float32 arrays of the
        same length; far and tar never decrease, thresholds decrease.

    Example:

    >>> import numpy as np
    >>> embeddings = np.array([[1, 0], [1, 0.1], [0, 1], [0.1, 1]])
    >>> far, tar, thresholds = verification_roc(embeddings, [0, 0, 1, 1],
    ...                                         max_far=1.0)
    >>> far[:2].tolist(), tar[:2].tolist()
    ([0.0, 0.0], [0.0, 1.0])
    """
    if not (isinstance(max_far, numbers.Real) and 0.0 < max_far <= 1.0):
        raise ValueError(f"max_far must be in (0, 1], got {max_far!r}.")
    roc, _ = roc_and_recall(embeddings, labels, [max_far], pairs, batch_size)
    return roc


def _scores_and_recalls(embeddings, labels, fars, pairs, batch_size):
    """Sorted genuine scores, kept impostor scores (descending), the number
    of impostor pairs, and Recall@FAR at each of `fars`."""
    fars = check_far(fars)
    genuine, impostor, num_impostors = _scores(
        embeddings, labels, pairs, batch_size, keep_far=float(fars.max())
    )
    _check_measurable(fars, num_impostors)
    genuine_sorted = np.sort(genuine)
    recalls = np.array(
        [_recall(genuine_sorted, impostor, num_impostors, f) for f in fars]
    )
    return genuine_sorted, impostor, num_impostors, recalls


def roc_and_recall(embeddings, labels, fars, pairs="all", batch_size=256):
    """`(verification_roc(max_far=max(fars)), recall_at_far(fars))` from
    one pass over the pairs (what the `RecallAtFAR` callback needs)."""
    genuine_sorted, impostor, num_impostors, recalls = _scores_and_recalls(
        embeddings, labels, fars, pairs, batch_size
    )
    complete = impostor.size == num_impostors
    thresholds = np.unique(np.concatenate([genuine_sorted, impostor]))[::-1]
    if not complete:  # Exact only above the smallest kept impostor score.
        thresholds = thresholds[thresholds > impostor[-1]]
    accepted_genuine = genuine_sorted.size - np.searchsorted(
        genuine_sorted, thresholds, side="left"
    )
    accepted_impostor = impostor.size - np.searchsorted(
        impostor[::-1], thresholds, side="left"
    )
    far = np.concatenate([[0.0], accepted_impostor / num_impostors])
    tar = np.concatenate([[0.0], accepted_genuine / genuine_sorted.size])
    thresholds = np.concatenate([[np.inf], thresholds]).astype(np.float32)
    keep = far <= float(np.max(fars))
    return (far[keep], tar[keep], thresholds[keep]), recalls
