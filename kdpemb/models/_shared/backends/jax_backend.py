"""JAX plumbing: `jax.value_and_grad` and the stateless train step."""

import jax
import keras


def value_and_grad(fn):
    """`fn(params, *args)` -> `(value, grads)`, differentiating `params`."""
    return jax.value_and_grad(fn)


def vjp(fn, params, cotangent):
    """Gradients of `Σ cotangent · fn(params)` with respect to `params`."""
    output, pullback = jax.vjp(fn, list(params))
    (grads,) = pullback(cotangent.astype(output.dtype))
    return grads


def output_gradients(run, params):
    """`(loss, aux, grads)`: `run(params, probes) -> (loss, (outputs, aux))`
    adds `probes[i]` (zeros) to its i-th tapped layer output; the gradient
    of the loss with respect to each probe is that output's gradient.

    The probes' shapes come from an abstract pass (`jax.eval_shape`),
    which costs no computation.
    """
    _, (outputs, _) = jax.eval_shape(lambda p: run(p, None), params)
    probes = [jax.numpy.zeros(o.shape, o.dtype) for o in outputs]

    def loss_of(probes):
        loss, (_, aux) = run(params, probes)
        return loss, aux

    (loss, aux), grads = jax.value_and_grad(loss_of, has_aux=True)(probes)
    return loss, aux, grads


def compiled(fn):
    """`fn` compiled (`jax.jit`): run eagerly, JAX compiles every op alone."""
    return jax.jit(fn)


def per_example_map(fn, *tensors):
    """`fn` applied to each row of `tensors` (their leading axis), vectorised."""
    return jax.vmap(fn)(*tensors)


def replica_sum(value):
    """Identity: a `keras.distribution` program is global (SPMD), so a sum
    over the client axis already spans every device."""
    return value


def sum_over_devices(fn, rows, shared):
    """`fn(rows, shared)` run by each device on its own share of `rows`
    (their leading axis, split over the `keras.distribution` mesh's batch
    axis), and its outputs summed over the devices (`psum`); `shared` is
    the same on every device. Without a distribution of several devices,
    `fn(rows, shared)`.

    XLA's partitioner, given the whole vectorised round, computes every
    client's convolutions on every device; `shard_map` makes each device
    train only its rows, as a TensorFlow replica does."""
    summed, _ = split_over_devices(lambda r, s: (fn(r, s), ()), rows, shared)
    return summed


def split_over_devices(fn, rows, shared):
    """`(summed, kept)` of `fn(rows, shared) -> (summed, kept)` run by each
    device on its share of `rows` (as `sum_over_devices`): `summed` added
    over the devices, `kept` the value every device computes alike (the
    network's seed states), taken as is."""
    distribution = keras.distribution.distribution()
    if distribution is None or distribution.device_mesh.devices.size == 1:
        return fn(rows, shared)
    axis = distribution.batch_dim_name
    spec = jax.sharding.PartitionSpec

    def local(rows, shared):
        summed, kept = fn(rows, shared)
        return jax.tree.map(lambda x: jax.lax.psum(x, axis), summed), kept

    mapped = _shard_map(
        local,
        mesh=distribution.device_mesh.backend_mesh,
        in_specs=(spec(axis), spec()),
        out_specs=spec(),
    )
    return mapped(rows, shared)


def _shard_map(fn, **kwargs):
    if hasattr(jax, "shard_map"):
        return jax.shard_map(fn, check_vma=False, **kwargs)
    from jax.experimental.shard_map import shard_map

    return shard_map(fn, check_rep=False, **kwargs)


def noise_share():
    """1.0: the global program draws the noise once."""
    return 1.0


def optimizer_share(grads):
    """`grads` unchanged: the global program's optimizer takes them once."""
    return list(grads)


def replica_logs(logs):
    """`logs` unchanged: the global program's logs are already global."""
    return logs


def train_step(model, args, step):
    """Runs `step(data)` with the state Keras passes in, and returns it updated.

    JAX calls `train_step(state, data)` with `state` = (trainable,
    non-trainable, optimizer, metrics variable values); inside a
    `StatelessScope` the model's variables read and write those values.
    """
    state, data = args
    groups = (
        model.trainable_variables,
        model.non_trainable_variables,
        model.optimizer.variables,
        model.metrics_variables,
    )
    return _stateless(groups, state, step, data)


def test_step(model, args, step):
    """Runs `step(data)` with the evaluation state Keras passes in.

    JAX calls `test_step(state, data)` with `state` = (trainable,
    non-trainable, metrics variable values); only the metrics change.
    """
    state, data = args
    groups = (
        model.trainable_variables,
        model.non_trainable_variables,
        model.metrics_variables,
    )
    return _stateless(groups, state, step, data)


def _stateless(groups, state, step, data):
    """`step(data)` inside a `StatelessScope` mapping `groups` to `state`;
    returns its logs and the groups' new values."""
    mapping = [
        pair
        for variables, values in zip(groups, state, strict=True)
        for pair in zip(variables, values, strict=True)
    ]
    with keras.StatelessScope(state_mapping=mapping) as scope:
        logs = step(data)
    new_state = tuple(
        [scope.get_current_value(v) for v in variables] for variables in groups
    )
    return logs, new_state


# Each batch shape is a compilation: pad to a few shapes, with little waste.
BATCH_PADDING = "multiple"


def batch_padding(model):
    """The padding of `model`'s Poisson batches: a few shapes ("multiple"),
    each one compilation of the step."""
    del model
    return BATCH_PADDING


def hold_rows(arrays, held):
    """Device copies of `arrays`, and whether the train step must be retraced.

    The copies travel with every batch (`rows_batches`) as arguments of the
    jitted step: an array the step closed over would be compiled into the
    program as a constant. Passing a device array costs no copy, and `jit`
    retraces by itself when the shapes change, so the answer is False.
    """
    del held  # New device buffers each fit; the old ones are freed.
    rows = tuple(jax.device_put(array) for array in arrays)
    for row in rows:
        row.block_until_ready()  # Out of memory shows here, not mid-fit.
    return rows, False


def rows_batches(sampler, rows, epochs):
    """`sampler`'s batches `(indices, mask)` as `((indices, *rows), mask)`;
    Keras iterates the `PyDataset` anew each epoch, so `epochs` is not needed."""
    del epochs
    return _RowsAlong(sampler, rows)


def gather_inputs(data, rows):
    """`(indices, rows, mask)` of a batch from `rows_batches`."""
    del rows  # They came with the batch.
    (indices, *rows), mask = data
    return indices, rows, mask


class _RowsAlong(keras.utils.PyDataset):
    def __init__(self, sampler, rows):
        super().__init__()
        self.sampler, self.rows = sampler, rows

    def __len__(self):
        return len(self.sampler)

    def __getitem__(self, index):
        indices, mask = self.sampler[index]
        return (indices, *self.rows), mask
