"""One DP-SGD step of `DPModel` (its `train_step`), on every device.

Each device clips the examples (or users) of its share of the logical
batch, physical batch by physical batch (`gradient_accumulation`); the
counts are summed over every device (`backends.replica_sum`); the noise
N(0, (zC)²) is added once to the global sum (TensorFlow: all-reduced,
the same noise drawn on every replica; JAX: the one global program); it
is divided by the expected batch B, and the optimizer takes it once
(`backends.optimizer_share`: on TensorFlow, whose optimizer sums the
replicas' gradients, the first replica passes it, the others zeros). A step past
a target-ε plan, or whose hosts served rows of different samples,
releases nothing and is not counted.

Example:

>>> import keras, numpy as np
>>> from kdpemb.models import DPModel
>>> network = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
>>> model = DPModel(network, noise_multiplier=0.0)
>>> model.compile("sgd", "mse")
>>> _ = model.fit(np.ones((8, 2), "float32"), np.zeros((8, 1), "float32"),
...               batch_size=4, verbose=0)
>>> int(keras.ops.convert_to_numpy(model.private_steps))
2
"""

from keras import ops

from kdpemb.models._shared import backends, hosts_agreement
from kdpemb.models.dp_sgd import gradient_accumulation, step_releases
from kdpemb.privacy import gaussian_sum


def train_step(model, data):
    """The step on `data` = `(x, y, mask)`, with a fourth array (each row's
    batch digest) on several hosts; returns the logs."""
    # On several hosts a fourth array carries each row's batch digest.
    x, y, mask, *batch_id = data
    plumbing = backends.current()
    network = model.network
    params = [v.value for v in network.trainable_variables]
    fixed = [v.value for v in network.non_trainable_variables]
    clipped, losses, fixed = clipped_sums(model, x, y, mask, params, fixed)
    noise = gaussian_sum.gaussian_noise(
        clipped, model.noise_multiplier, model.noise_seed
    )
    # The global sum (TensorFlow: over the replicas), and the noise drawn
    # once: every replica draws the same from the same seed state.
    total = [plumbing.replica_sum(t) for t in clipped.total]
    grads = [(t + n) / model._denominator for t, n in zip(total, noise, strict=True)]
    grads = add_weight_penalties(network, params, grads)
    within_plan = model._within_plan()
    aligned = hosts_agreement.aligned(batch_id[0]) if batch_id else None
    if aligned is not None:
        # Rows of different samples on different hosts: not the sampled
        # batch the accounting assumes (an example could count twice).
        within_plan = (
            aligned if within_plan is None else ops.logical_and(within_plan, aligned)
        )
    if within_plan is not None:
        # Past the plan (a callback changed the step count mid-fit, which
        # fit's checks cannot see): release nothing computed from the data
        # and count nothing. A zero gradient; momentum still moves.
        grads = [ops.where(within_plan, g, ops.zeros_like(g)) for g in grads]
    # Anything the optimizer does before summing the replicas' gradients
    # sees the noised gradient only (`backends.optimizer_share`).
    grads = plumbing.optimizer_share(grads)
    model.optimizer.apply(grads, network.trainable_variables)
    for variable, value in zip(network.non_trainable_variables, fixed, strict=True):
        variable.assign(value)
    model.private_steps.assign_add(
        1 if within_plan is None else ops.cast(within_plan, "int32")
    )
    logs = {"private_steps": model.private_steps.value}
    logs = {**logs, **step_releases.release(model, clipped, losses, within_plan)}
    if aligned is not None:
        logs["misaligned_hosts"] = 1 - ops.cast(aligned, "int32")
    return plumbing.replica_logs(logs)


def clipped_sums(model, x, y, mask, params, fixed):
    """`(gradient ClippedSum, loss ClippedSum or None, new non-trainable
    values)` of the batch: each device clips its rows, physical batch by
    physical batch. The counts are summed over every device; the
    gradient sum is this replica's on TensorFlow (`train_step` adds the
    replicas'), the global one on JAX."""
    plumbing = backends.current()
    engine = step_releases.step_engine(model, model._engine_for())
    physical = model.physical_batch_size

    def local(rows, shared):
        x, y, mask = rows
        params, fixed = shared
        values = step_releases.carry(model, fixed)
        clipped, values = gradient_accumulation.accumulate(
            engine, params, values, x, y, mask, physical
        )
        fixed, losses = step_releases.uncarry(model, values)
        sums = (clipped.total, clipped.count, clipped.num_nonfinite,
                clipped.num_within_clip)  # fmt: skip
        if losses is not None:
            sums += (losses.total[0], losses.count, losses.num_nonfinite)
        return sums, fixed

    sums, fixed = plumbing.split_over_devices(local, (x, y, mask), (params, fixed))
    total, *counts = sums
    count, nonfinite, within, *loss_sums = [plumbing.replica_sum(c) for c in counts]
    clipped = gaussian_sum.ClippedSum(total, engine.clip_norm, count, nonfinite, within)
    losses = None
    if loss_sums:
        loss_total, loss_count, loss_nonfinite = loss_sums
        losses = gaussian_sum.ClippedSum(
            [loss_total], model.noised_loss.bound, loss_count, loss_nonfinite
        )
    return clipped, losses, fixed


def add_weight_penalties(network, params, grads):
    """Adds the gradients of weight regularizers: they do not read data, so
    they need neither clipping nor noise."""
    regularized = [
        (i, v.regularizer)
        for i, v in enumerate(network.trainable_variables)
        if getattr(v, "regularizer", None) is not None
    ]
    if not regularized:
        return grads
    backend = backends.current()
    indices = [i for i, _ in regularized]

    def penalty(values):
        return sum(
            ops.cast(reg(value), "float32")
            for (_, reg), value in zip(regularized, values, strict=True)
        )

    _, extra = backend.value_and_grad(penalty)([params[i] for i in indices])
    grads = list(grads)
    for i, g in zip(indices, extra, strict=True):
        grads[i] = grads[i] + ops.cast(g, grads[i].dtype)
    return grads
