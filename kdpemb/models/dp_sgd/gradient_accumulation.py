"""A logical batch's clipped sum, physical batch by physical batch.

`accumulate(engine, ...)` splits a logical batch of DP-SGD into chunks of
`physical_batch_size` rows, computes each chunk's `ClippedSum` with the
engine (`ClippedGradients`, or an engine that wraps it) and adds them in
one `fori_loop`, before any noise: gradient accumulation with the
sensitivity of one step. At user level a chunk holds whole users (its
size is a multiple of `examples_per_user`).

Example:

>>> import keras, numpy as np
>>> from kdpemb.models.dp_sgd.clipped_gradients import ClippedGradients, plan_gradients
>>> network = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
>>> loss = keras.losses.mean_squared_error
>>> engine = ClippedGradients(network, plan_gradients(network, np.ones((3, 2))),
...                           loss, [1.0])
>>> params = [v.value for v in network.trainable_variables]
>>> x, y = np.ones((4, 2), "float32"), np.zeros((4, 1), "float32")
>>> clipped, _ = accumulate(engine, params, [], x, y, np.ones(4, bool), 2)
>>> int(clipped.count)
4
"""

from keras import ops

from kdpemb.privacy import gaussian_sum


def accumulate(engine, params, fixed, x, y, mask, physical_batch_size):
    """`(ClippedSum, new non-trainable values)` of the logical batch
    `x, y, mask`, chunk by chunk (the whole batch at once when it is no
    larger than `physical_batch_size`, or that is None)."""
    physical = physical_batch_size
    size = x.shape[0]
    if physical is None or (size is not None and size <= physical):
        return engine(params, fixed, x, y, mask)
    if size is not None and size % physical:
        raise ValueError(  # Rows past the last whole chunk would be lost.
            f"A batch of {size} rows does not split into physical batches "
            f"of {physical}: feed DPModel through its own fit."
        )
    chunks = ops.shape(x)[0] // physical

    def chunk(tensor, index):
        start = [index * physical] + [0] * (len(tensor.shape) - 1)
        return ops.slice(tensor, start, (physical, *tensor.shape[1:]))

    def body(index, carry):
        totals, count, nonfinite, within, values = carry
        part, values = engine(
            params, values, chunk(x, index), chunk(y, index), chunk(mask, index)
        )
        return (
            [t + p for t, p in zip(totals, part.total, strict=True)],
            count + part.count,
            nonfinite + part.num_nonfinite,
            within + part.num_within_clip,
            values,
        )

    zero = ops.zeros((), "int32")
    init = ([ops.zeros(p.shape, "float32") for p in params], zero, zero, zero,
            list(fixed))  # fmt: skip
    totals, count, nonfinite, within, fixed = ops.fori_loop(0, chunks, body, init)
    return gaussian_sum.ClippedSum(
        totals, engine.clip_norm, count, nonfinite, within
    ), fixed
