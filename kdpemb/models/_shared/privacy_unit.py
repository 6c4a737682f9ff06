"""The privacy unit of a model: "example", or "user" with a cap of k
examples per user and step; and the `users` of a fit at user level.

One set of checks for `DPModel` and `LastLayerDPClassifier`: the unit and
its cap when the model is built, and the user ids when it is fit (checked
and counted before any plan is made, so a refused `users` leaves nothing
fixed).

Example:

>>> import numpy as np
>>> check_unit("user", 4, "DPModel")
('user', 4)
>>> users, count = check_users("user", np.array([7, 3, 7]), 3, "DPModel", "x, y")
>>> count
2
"""

import numpy as np

from kdpemb import _validation as validation

UNITS = ("example", "user")


def check_unit(unit, examples_per_user, owner):
    """`(unit, examples_per_user)`: "user" needs the public cap k (a
    positive int), "example" refuses it. `owner` names the model."""
    if not isinstance(unit, str) or unit not in UNITS:
        raise ValueError(
            f"unit must be one of {UNITS}, got {unit!r}: 'user' protects all of "
            "a person's examples, 'example' one example."
        )
    if unit == "example":
        if examples_per_user is not None:
            raise ValueError(
                f"examples_per_user={examples_per_user!r} caps each user's "
                f"examples per step, for user-level privacy: build the {owner} "
                "with unit='user' (and fit(..., users=ids)), or leave "
                "examples_per_user out."
            )
        return unit, None
    if examples_per_user is None:
        raise ValueError(
            "unit='user' needs examples_per_user=k: the most examples of one "
            "user a step averages into that user's contribution (a public "
            "cap, e.g. 8; a user's other examples sit that step out)."
        )
    k = validation.check_positive_int(
        examples_per_user,
        "examples_per_user",
        "It is k, the most examples of one user per step (e.g. 8).",
    )
    return unit, k


def check_users(unit, users, num_examples, owner, data):
    """`(users, U)`: the `users` of `fit` at user level, one id per example,
    checked (ints or strings) and counted; `(None, None)` at example level,
    where `users` is refused. `data` names fit's data arguments."""
    if unit == "example":
        if users is not None:
            raise ValueError(
                f"{owner}.fit got users=, but this {owner} protects examples. "
                f"Build it with {owner}(..., unit='user', examples_per_user=k) "
                "for a guarantee per user, or leave users out."
            )
        return None, None
    if users is None:
        raise ValueError(
            f"A {owner} with unit='user' needs fit({data}, users=ids): one "
            "user id per example, so that each step samples users and the "
            "guarantee is per user."
        )
    if hasattr(users, "__len__") and len(users) != num_examples:
        raise ValueError(
            f"users has {len(users)} ids for {num_examples} examples: give one "
            "id per example (one user id per example, in the order of the rows)."
        )
    from kdpemb.data.user_batches import index_user_ids

    user_ids, _ = index_user_ids(users)
    return np.asarray(users), int(user_ids.size)
