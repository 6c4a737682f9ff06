"""Many-run white-box audits: releases with and without a canary, scored.

`audit_scores` turns membership scores of releases made with the canary
and without it into an `AuditResult`: the threshold is chosen on one half
of the trials and the test is counted on the other half, so the
Clopper–Pearson bound of `kdpemb.audit.bounds` holds for the chosen test.
`audit_gaussian_sum` audits kdpemb's Gaussian sum query itself.

Example:

>>> result = audit_gaussian_sum(noise_multiplier=2.0, delta=1e-5,
...                             trials=400, seed=0)
>>> result.epsilon_lower_bound < result.claimed_epsilon
True
"""

import dataclasses

import keras
import numpy as np

from kdpemb import _validation as validation
from kdpemb import privacy
from kdpemb.audit import bounds
from kdpemb.audit.canaries import direction_canary
from kdpemb.privacy import gaussian_sum

__all__ = [
    "AuditResult",
    "audit_gaussian_sum",
    "audit_releases",
    "audit_scores",
]


@dataclasses.dataclass(frozen=True)
class AuditResult:
    """What an audit found.

    Attributes:
        epsilon_lower_bound: float. ε that the counts prove at `confidence`.
        claimed_epsilon: float. The mechanism's own ε at `delta`.
        delta: float. δ of the claim.
        trials: int. Releases made (with and without the canary together).
        confidence: float. Chance that `epsilon_lower_bound` is valid.
        true_positives, positives: ints. Held-out releases with the
            canary: called "in", and all.
        false_positives, negatives: ints. Held-out releases without it.
        threshold: float. Scores >= threshold are called "in".

    Example:

    >>> import numpy as np
    >>> from kdpemb import audit
    >>> rng = np.random.default_rng(0)
    >>> result = audit.audit_scores(rng.normal(3, 1, 400), rng.normal(0, 1, 400),
    ...                             claimed_epsilon=1.0, delta=1e-5)
    >>> isinstance(result, audit.AuditResult), result.trials
    (True, 800)
    >>> result.violated  # these scores separate more than ε = 1 allows
    True
    """

    epsilon_lower_bound: float
    claimed_epsilon: float
    delta: float
    trials: int
    confidence: float
    true_positives: int
    positives: int
    false_positives: int
    negatives: int
    threshold: float

    @property
    def violated(self):
        """True when the audit proves more ε than claimed: a bug."""
        return self.epsilon_lower_bound > self.claimed_epsilon


def _best_threshold(with_canary, without_canary, delta, confidence):
    """The threshold whose counts on these scores give the largest bound."""
    candidates = np.quantile(
        np.concatenate([with_canary, without_canary]), np.linspace(0.01, 0.99, 99)
    )
    best, best_bound = candidates[len(candidates) // 2], -1.0
    for threshold in candidates:
        found = bounds.epsilon_lower_bound(
            int(np.sum(with_canary >= threshold)),
            with_canary.size,
            int(np.sum(without_canary >= threshold)),
            without_canary.size,
            delta,
            confidence,
        )
        if found > best_bound:
            best, best_bound = threshold, found
    return float(best)


def audit_scores(
    with_canary,
    without_canary,
    claimed_epsilon,
    delta,
    confidence=0.95,
    threshold=None,
):
    """An `AuditResult` from membership scores (higher means "canary in").

    Args:
        with_canary: 1-D array. Scores of releases made with the canary.
        without_canary: 1-D array. Scores of releases made without it.
        claimed_epsilon: float. The ε claimed at `delta`.
        delta: float in [0, 1). δ of the claim.
        confidence: float in (0, 1).
        threshold: float or None. A threshold fixed before seeing the
            scores: all trials are counted. None: it is chosen on the
            first half of each set and the second halves are counted.

    Example:

    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> result = audit_scores(rng.normal(5, 1, 500), rng.normal(0, 1, 500),
    ...                       claimed_epsilon=1.0, delta=1e-5)
    >>> result.violated
    True
    """
    with_canary = np.asarray(with_canary, np.float64).ravel()
    without_canary = np.asarray(without_canary, np.float64).ravel()
    minimum = 1 if threshold is not None else 2
    if with_canary.size < minimum or without_canary.size < minimum:
        raise ValueError(
            f"An audit needs at least {minimum} scores with and without the "
            f"canary, got {with_canary.size} and {without_canary.size}."
        )
    if not (np.all(np.isfinite(with_canary)) and np.all(np.isfinite(without_canary))):
        raise ValueError("Every score must be finite: a release was NaN or inf.")
    trials = with_canary.size + without_canary.size
    if threshold is None:
        half_in, half_out = with_canary.size // 2, without_canary.size // 2
        threshold = _best_threshold(
            with_canary[:half_in], without_canary[:half_out], delta, confidence
        )
        with_canary, without_canary = with_canary[half_in:], without_canary[half_out:]
    threshold = validation.check_finite_real(threshold, "threshold")
    counts = {
        "true_positives": int(np.sum(with_canary >= threshold)),
        "positives": with_canary.size,
        "false_positives": int(np.sum(without_canary >= threshold)),
        "negatives": without_canary.size,
    }
    return AuditResult(
        epsilon_lower_bound=bounds.epsilon_lower_bound(
            **counts, delta=delta, confidence=confidence
        ),
        claimed_epsilon=float(claimed_epsilon),
        delta=float(delta),
        trials=trials,
        confidence=float(confidence),
        threshold=threshold,
        **counts,
    )


def audit_releases(
    with_canary, without_canary, claimed_epsilon, delta, confidence=0.95
):
    """An `AuditResult` from released vectors (`[trials, dim]` each).

    The test direction is learned on the first half of each set: the
    difference of their means, normalised. Every release is scored by its
    projection on it, and `audit_scores` then chooses the threshold on the
    same first halves and counts the second halves, which took no part in
    either choice.

    Example:

    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> shift = np.array([3.0, -3.0])
    >>> result = audit_releases(rng.normal(size=(800, 2)) + shift,
    ...                         rng.normal(size=(800, 2)), 1.0, 1e-5)
    >>> result.violated
    True
    """
    with_canary = np.asarray(with_canary, np.float64)
    without_canary = np.asarray(without_canary, np.float64)
    if with_canary.ndim != 2 or without_canary.shape[1:] != with_canary.shape[1:]:
        raise ValueError(
            "with_canary and without_canary must be [trials, dim] arrays of one "
            f"dim, got shapes {with_canary.shape} and {without_canary.shape}."
        )
    if len(with_canary) < 2 or len(without_canary) < 2:
        raise ValueError(
            "An audit needs at least 2 releases with and without the canary, got "
            f"{len(with_canary)} and {len(without_canary)}."
        )
    half_in, half_out = len(with_canary) // 2, len(without_canary) // 2
    direction = with_canary[:half_in].mean(0) - without_canary[:half_out].mean(0)
    norm = np.linalg.norm(direction)
    if not np.isfinite(norm):
        raise ValueError("Every release must be finite: a release was NaN or inf.")
    if norm > 0:
        direction = direction / norm
    return audit_scores(
        with_canary @ direction,
        without_canary @ direction,
        claimed_epsilon,
        delta,
        confidence,
    )


def _releases(clipped, noise_multiplier, trials, seed_generator):
    """`trials` independent noisy releases `[trials, dim]` of one clipped sum."""
    total = keras.ops.convert_to_tensor(clipped.total[0])
    stacked = clipped._replace(
        total=[keras.ops.broadcast_to(total, (trials, *keras.ops.shape(total)))]
    )
    noisy = gaussian_sum.add_gaussian_noise(stacked, noise_multiplier, seed_generator)
    return keras.ops.convert_to_numpy(noisy[0])


def audit_gaussian_sum(
    noise_multiplier,
    delta,
    *,
    clip_norm=1.0,
    trials=2000,
    confidence=0.95,
    dim=8,
    num_others=15,
    canary_norm=None,
    seed=None,
):
    """White-box audit of `clip_and_sum` + `add_gaussian_noise`.

    A dataset of `num_others` random contributions (norm about
    `clip_norm`, orthogonal to the canary) is summed with and without a
    direction canary of norm `canary_norm` (default 10 · clip_norm, so
    that a sum without clipping would show it), through kdpemb's own
    `clip_and_sum` and `add_gaussian_noise`; `trials / 2` noisy releases
    are drawn for each (independent noise, one stacked draw) and scored by
    their projection on the canary. The claimed ε is that of one Gaussian
    release of noise multiplier z under add/remove-one at `delta`.

    Args:
        noise_multiplier: float > 0. z.
        delta: float in (0, 1). δ of the claim.
        clip_norm: float > 0. C.
        trials: int >= 4. Releases in all.
        confidence: float in (0, 1).
        dim: int. Size of one contribution.
        num_others: int >= 0. Contributions besides the canary.
        canary_norm: float or None.
        seed: int or None. Seeds the data and the noise (None: the noise
            from OS entropy).

    Returns:
        `AuditResult`.

    Example:

    >>> from kdpemb import audit
    >>> result = audit.audit_gaussian_sum(
    ...     noise_multiplier=2.0, delta=1e-5, trials=200, seed=0)
    >>> result.trials, result.epsilon_lower_bound < result.claimed_epsilon
    (200, True)
    """
    noise_multiplier = validation.check_positive(noise_multiplier, "noise_multiplier")
    delta = validation.check_delta(delta)
    clip_norm = validation.check_positive(clip_norm, "clip_norm")
    trials = validation.check_positive_int(trials, "trials")
    if trials < 4:
        raise ValueError(f"trials must be >= 4, got {trials}.")
    canary_norm = 10.0 * clip_norm if canary_norm is None else canary_norm
    canary = direction_canary(dim, canary_norm, seed)
    seed_data = None if seed is None else seed + 1
    others = canary.orthogonal_contributions(
        num_others, scale=clip_norm / np.sqrt(dim), seed=seed_data
    )
    datasets = (np.vstack([others, canary.vector[None]]), others)
    if seed is None:
        generator = gaussian_sum.reseed_from_entropy(keras.random.SeedGenerator(0))
    else:
        generator = keras.random.SeedGenerator(seed)
    scores = []
    for data in datasets:
        if len(data) == 0:
            data = np.zeros((1, dim))
        clipped = gaussian_sum.clip_and_sum([data.astype("float32")], clip_norm)
        releases = _releases(clipped, noise_multiplier, trials // 2, generator)
        scores.append(canary.score(releases))
    claimed = privacy.epsilon(
        privacy.gaussian_releases(
            [
                privacy.GaussianRelease.from_noise_multiplier(
                    noise_multiplier, clip_norm
                )
            ],
            num_examples=num_others + 1,
        ),
        steps=1,
        delta=delta,
    )
    return audit_scores(scores[0], scores[1], claimed, delta, confidence)
