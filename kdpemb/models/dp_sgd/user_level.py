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

from kdpemb import _validation as validation
from kdpemb import privacy
from kdpemb.models._shared import privacy_plan, privacy_unit


def check_unit(unit, examples_per_user, physical_batch_size):
    """`(unit, examples_per_user)` checked (`privacy_unit.check_unit`); a
    physical batch holds whole users (a multiple of k)."""
    unit, k = privacy_unit.check_unit(unit, examples_per_user, "DPModel")
    if k is not None and physical_batch_size is not None and physical_batch_size % k:
        raise ValueError(
            f"physical_batch_size={physical_batch_size} must be a multiple of "
            f"examples_per_user={k}: a physical batch holds whole users. Use "
            f"e.g. {max(1, physical_batch_size // k) * k}."
        )
    return unit, k


def check_users(model, users, num_examples):
    """`(users, U)` of `fit` (`privacy_unit.check_users`): the ids checked
    and counted before any plan, or `(None, None)` at example level."""
    return privacy_unit.check_users(model.unit, users, num_examples, "DPModel", "x, y")


def schedule(model, count, batch_size):
    """`(steps per epoch, Schedule.users(...))` of a fit over `count` users
    with `batch_size` expected users per step (None: every user every
    step); an epoch is round(U / B_u) steps."""
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


def batches(model, x, y, users, batch_size, steps, seed, padding, devices=1):
    """The fit's `UserBatches`: slots of k rows per sampled user, as many
    slots as fill whole physical batches on each of `devices`."""
    from kdpemb.data.user_batches import UserBatches

    k = model.examples_per_user
    physical = model.physical_batch_size
    slots = devices * (physical // k if physical else 1)
    return UserBatches(
        x, y, users, batch_size, k, steps, seed=seed, padding=padding,
        sampling=model.sampling, multiple_of=slots,
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
