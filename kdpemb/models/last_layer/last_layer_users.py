"""User-level privacy of `LastLayerDPClassifier(unit="user")`, and the
DP-SGD sampler of both units.

With `unit="user"` the guarantee covers all of one person's examples:
`fit(features, labels, users=ids)` counts the U distinct ids, accounts on
`Schedule.users(U, B_u, examples_per_user=k)` and gives each user one
contribution per step, the mean over at most k of their examples chosen
at random (`kdpemb.data.UserIndices`):

- DP-SGD samples users (q = B_u / U) in the slot layout of `UserIndices`
  and clips each user's mean head gradient to C
  (`last_layer_dp_sgd_head.clipped_user_head_gradient`);
- the closed forms weight each chosen example by 1 / n_u (`user_weights`),
  so a user's share of every statistic is a convex combination of
  per-example terms, bounded as one example's is: the sensitivities of
  `last_layer_stats` hold per user unchanged.

Example:

>>> check_unit("user", 4)
('user', 4)
>>> users, count = check_users("user", np.array([7, 3, 7]), 3)
>>> count
2
"""

import warnings

import numpy as np

from kdpemb.models._shared import backends, privacy_unit


def check_unit(unit, examples_per_user):
    """`(unit, examples_per_user)` checked (`privacy_unit.check_unit`)."""
    return privacy_unit.check_unit(unit, examples_per_user, "LastLayerDPClassifier")


def check_users(unit, users, num_examples):
    """`(users, U)` of `fit` (`privacy_unit.check_users`), or `(None, None)`
    at example level."""
    return privacy_unit.check_users(
        unit, users, num_examples, "LastLayerDPClassifier", "features, labels"
    )


def sampler_batches(
    model, features, labels, users, batch_size, steps, epochs, seed, devices=1
):
    """DP-SGD's batches: indices of rows kept on the device (`PoissonIndices`,
    or `UserIndices` at user level), or rows gathered on the host when the
    device has no room for them (`PoissonBatches`, `UserBatches`).

    On several devices, rows gathered on the host, a multiple of `devices`
    rows (of `devices` slots, whole users, at user level): the engine
    splits each batch over the devices, each holding its share of the rows.
    """
    from kdpemb.data.poisson_batches import PoissonBatches, PoissonIndices
    from kdpemb.data.user_batches import UserBatches, UserIndices

    rows = model._rows
    padding = backends.current().batch_padding(model)
    k = model.examples_per_user
    if devices > 1:
        model.train_function = None  # Traced for the replicas' rows.
        if users is None:
            return PoissonBatches(
                features, labels, batch_size, steps, seed=seed, padding=padding,
                multiple_of=devices,
            )  # fmt: skip
        return UserBatches(
            features, labels, users, batch_size, k, steps, seed=seed,
            padding=padding, multiple_of=devices,
        )  # fmt: skip
    if rows.hold(features, labels):
        if users is None:
            sampler = PoissonIndices(len(features), batch_size, steps, seed, padding)
        else:
            sampler = UserIndices(users, batch_size, k, steps, seed, padding)
        batches = rows.batches(sampler, epochs)
    else:
        warnings.warn(
            f"The {features.nbytes / 2**20:.0f} MiB of features do not fit "
            "in device memory: each DP-SGD step gathers its batch on the "
            "host instead, which is slower.",
            stacklevel=3,
        )
        if users is None:
            batches = PoissonBatches(features, labels, batch_size, steps, seed=seed)
        else:
            batches = UserBatches(
                features, labels, users, batch_size, k, steps, seed=seed
            )
    if rows.retrace:  # The step reads its rows another way now.
        model.train_function = None
    return batches


def user_weights(users, examples_per_user, rng):
    """Each example's weight in a closed-form step at user level: 1 / n_u
    for the n_u ≤ k examples chosen of its user (drawn by `rng`, afresh
    per call and independently per user), 0 for the others; the weights of
    every user sum to 1.

    Example:

    >>> weights = user_weights(np.array([0, 0, 0, 1]), 2, np.random.default_rng(0))
    >>> sorted(weights.tolist())
    [0.0, 0.5, 0.5, 1.0]
    """
    from kdpemb.data.user_batches import UserIndices

    k = examples_per_user
    seed = int(rng.integers(2**63))
    indices, mask = UserIndices(users, None, k, steps=1, seed=seed).sample(0)
    real = mask.reshape(-1, k) > 0
    share = np.where(real, 1.0 / np.maximum(real.sum(axis=1, keepdims=True), 1), 0.0)
    weights = np.zeros(len(users))
    chosen = real.reshape(-1)
    weights[indices[chosen]] = share.reshape(-1)[chosen]
    return weights
