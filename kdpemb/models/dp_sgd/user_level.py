"""User-level DP-SGD for `DPModel(unit="user")`: the checks, the schedule
and the sampler of a fit whose privacy unit is the user.

With `unit="user"`, `DPModel.fit(x, y, users=ids, batch_size=B_u)`
samples users (Poisson over the U distinct ids, q = B_u / U), takes at
most `examples_per_user` (k) of each sampled user's examples, chosen at
random at every step, and clips each user's gradient, the mean over
those examples, to C (`kdpemb.models.dp_sgd.clipped_gradients` with
`examples_per_user`). Removing every example of one user removes one
clipped contribution: sensitivity C, accounted on `Schedule.users`.

Example:

>>> check_unit("user", 4, physical_batch_size=None)
('user', 4)
>>> check_unit("example", None, physical_batch_size=None)
('example', None)
"""

import numpy as np

from kdpemb import _validation as validation
from kdpemb import privacy
from kdpemb.models._shared import privacy_plan

UNITS = ("example", "user")


def check_unit(unit, examples_per_user, physical_batch_size):
    """`(unit, examples_per_user)` checked: a user-level model needs the
    public cap k; a physical batch holds whole users (a multiple of k)."""
    if not isinstance(unit, str) or unit not in UNITS:
        raise ValueError(
            f"unit must be one of {UNITS}, got {unit!r}: 'user' protects all "
            "of a person's examples, 'example' one example."
        )
    if unit == "example":
        if examples_per_user is not None:
            raise ValueError(
                f"examples_per_user={examples_per_user!r} caps each user's "
                "examples per step at user level: give unit='user' (and "
                "fit(..., users=...)), or leave examples_per_user out."
            )
        return unit, None
    if examples_per_user is None:
        raise ValueError(
            "unit='user' needs examples_per_user=k: the most examples of one "
            "user a step averages into that user's gradient (a public cap, "
            "e.g. 8; examples above it are left out of that step)."
        )
    k = validation.check_positive_int(examples_per_user, "examples_per_user")
    if physical_batch_size is not None and physical_batch_size % k:
        raise ValueError(
            f"physical_batch_size={physical_batch_size} must be a multiple of "
            f"examples_per_user={k}: a physical batch holds whole users. Use "
            f"e.g. {max(1, physical_batch_size // k) * k}."
        )
    return unit, k


def check_users(model, users, num_examples):
    """The `users` argument of `fit`: required (one id per example) at user
    level, refused at example level. Returns the ids as an array, or None."""
    if model.unit == "example":
        if users is not None:
            raise ValueError(
                "DPModel.fit got users=, but this DPModel protects examples. "
                "Build it with DPModel(..., unit='user', examples_per_user=k) "
                "for a guarantee per user."
            )
        return None
    if users is None:
        raise ValueError(
            "A DPModel with unit='user' needs fit(x, y, users=ids): one user "
            "id per example, so that each step samples users."
        )
    users = np.asarray(users)
    if users.ndim != 1 or len(users) != num_examples:
        raise ValueError(
            f"users must hold one id per example: got shape {users.shape} "
            f"for {num_examples} examples."
        )
    return users


def num_users(users):
    """U, the number of distinct ids."""
    try:
        return len(np.unique(users))
    except TypeError as error:
        raise ValueError(
            f"users ids must be sortable values of one kind (ints or strings): {error}"
        ) from None


def schedule(model, users, batch_size):
    """`(steps per epoch, Schedule.users(...))` of a fit over `users` with
    `batch_size` expected users per step (None: every user every step);
    an epoch is round(U / B_u) steps."""
    count = num_users(users)
    try:
        batch_size, steps = privacy_plan.example_batches(count, batch_size)
    except ValueError as error:
        raise ValueError(
            f"{error} (with unit='user', batch_size is the expected number of "
            f"users per step, out of the {count} users in the data)"
        ) from None
    if model.delta is not None:
        validation.check_delta(model.delta, count, "user")
    return steps, privacy.Schedule.users(
        count, batch_size, sampling=model.sampling,
        examples_per_user=model.examples_per_user,
    )  # fmt: skip


def batches(model, x, y, users, batch_size, steps, seed, padding):
    """The fit's `UserBatches`: slots of k rows per sampled user."""
    from kdpemb.data.user_batches import UserBatches

    k = model.examples_per_user
    physical = model.physical_batch_size
    return UserBatches(
        x, y, users, batch_size, k, steps, seed=seed, padding=padding,
        sampling=model.sampling, multiple_of=physical // k if physical else 1,
    )  # fmt: skip


def slot_means(values, mask, examples_per_user):
    """Per-user means of per-example `values` `[S*k]` in the slot layout,
    and the users' mask `[S]` (a slot is a user iff any row is real).
    Padding rows add exactly 0, even where their value is not finite."""
    from keras import ops

    k = examples_per_user
    real = ops.reshape(ops.cast(mask, "bool"), (-1, k))
    values = ops.reshape(ops.cast(values, "float32"), (-1, k))
    counts = ops.sum(ops.cast(real, "float32"), axis=1)
    total = ops.sum(ops.where(real, values, 0.0), axis=1)
    return total / ops.maximum(counts, 1.0), counts > 0
