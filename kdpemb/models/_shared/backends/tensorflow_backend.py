"""TensorFlow plumbing: `tf.GradientTape` and `tf.distribute` replicas."""

import logging

import numpy as np
import tensorflow as tf

from kdpemb import _console as console

logger = logging.getLogger("kdpemb")


def value_and_grad(fn):
    """`fn(params, *args)` -> `(value, grads)`, with a tape on `params`."""

    def wrapped(params, *args):
        params = list(params)
        with tf.GradientTape() as tape:
            tape.watch(params)
            value = fn(params, *args)
        grads = tape.gradient(value, params)
        # An Embedding's gradient comes as tf.IndexedSlices; the round's
        # arithmetic (and the other backend) takes dense arrays.
        grads = [
            tf.zeros_like(p) if g is None else tf.convert_to_tensor(g)
            for p, g in zip(params, grads, strict=True)
        ]
        return value, grads

    return wrapped


def vjp(fn, params, cotangent):
    """Gradients of `Σ cotangent · fn(params)` with respect to `params`: the
    tape's `output_gradients` (a sum of products would cost an extra pass
    over the output when the batch dimension is unknown)."""
    params = list(params)
    with tf.GradientTape() as tape:
        tape.watch(params)
        output = fn(params)
    grads = tape.gradient(
        output, params, output_gradients=tf.cast(cotangent, output.dtype)
    )
    return [
        tf.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)
    ]


def output_gradients(run, params):
    """`(loss, aux, grads)`: `run(params, None) -> (loss, (outputs, aux))`;
    `grads[i]` is the gradient of the loss with respect to the i-th tapped
    layer output, which a tape gives for intermediate tensors directly."""
    params = list(params)
    with tf.GradientTape() as tape:
        tape.watch(params)
        loss, (outputs, aux) = run(params, None)
    grads = tape.gradient(loss, list(outputs))
    grads = [
        tf.zeros_like(o) if g is None else g
        for o, g in zip(outputs, grads, strict=True)
    ]
    return loss, aux, grads


def compiled(fn):
    """`fn` itself: TensorFlow runs eager ops fast, and a `tf.function`
    would cost a trace for a computation done once."""
    return fn


def per_example_map(fn, *tensors):
    """`fn` applied to each row of `tensors` (their leading axis): vectorised
    by `tf.vectorized_map` (which loops over the rows of an op that has no
    vectorised form), or, where `tf.vectorized_map` fails to convert `fn`
    at all, a `tf.map_fn` loop over the rows: the same values, slower.

    `tf.vectorized_map` fails, for instance, on the gradient of a
    recurrent layer (a `while` loop) whose input depends on trainable
    weights: TensorFlow's converter of the `ZerosLike` of the loop's
    `variant` accumulators raises a `TypeError`. The attempt is traced in
    a function of its own, so that a failed one leaves no ops behind in
    the caller's graph.

    In a step that XLA compiles (`jit_compile`), a `fn` with a `while`
    loop (a recurrent layer) is looped over with `tf.map_fn` at once: the
    vectorised form of such a loop is a loop of conditionals on resource
    handles, which XLA refuses to compile.
    """
    signature = []

    def one(rows):
        outputs = fn(*rows)
        if not signature:  # The structure, dtypes and shapes of one row's.
            signature.append(
                tf.nest.map_structure(
                    lambda t: tf.TensorSpec(t.shape, t.dtype), outputs
                )
            )
        return outputs

    def vectorized(*tensors):
        return tf.vectorized_map(one, tensors)

    if _xla_tracing() and _has_loop(one, tensors):
        logger.info(
            "The per-example function has a while loop, which XLA cannot "
            "compile once vectorised; looping over the rows with tf.map_fn "
            "instead (the same gradients, slower)."
        )
        return tf.map_fn(one, tensors, fn_output_signature=signature[0])
    try:
        # A failed conversion logs its graph before it raises: handled below.
        with console.vectorizer_logs_quieted(keep_errors=False):
            if tf.executing_eagerly():  # `vectorized_map` traces a function.
                return vectorized(*tensors)
            return tf.function(vectorized, autograph=False)(*tensors)
    except tf.errors.OpError:  # Raised running ops (eager), not converting.
        raise
    except Exception as error:  # Any failure to convert `fn`.
        if not signature:  # `fn` itself failed: a loop would too.
            raise
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        reason = lines[-1][:200] if lines else type(error).__name__
    logger.info(
        "tf.vectorized_map cannot vectorise the per-example function (%s); "
        "looping over the rows with tf.map_fn instead (the same "
        "gradients, slower).",
        reason,
    )
    return tf.map_fn(one, tensors, fn_output_signature=signature[0])


def _xla_tracing():
    """Whether the graph being traced is one that XLA compiles (a
    `tf.function(jit_compile=True)`, as Keras' step under `jit_compile`,
    or a function called from one)."""
    if tf.executing_eagerly():
        return False
    # TensorFlow has no public test; its tracer marks such graphs so.
    from tensorflow.python.ops import control_flow_util

    graph = tf.compat.v1.get_default_graph()
    return control_flow_util.GraphOrParentsInXlaContext(graph)


def _has_loop(one, tensors):
    """Whether `one` (of a tuple of rows of `tensors`) runs a `while` loop,
    in its own graph or in a function it calls: traced once, on specs."""
    specs = [tf.TensorSpec(t.shape[1:], t.dtype) for t in tensors]
    traced = tf.function(lambda *rows: one(rows), autograph=False)
    graph = traced.get_concrete_function(*specs).graph
    library = graph.as_graph_def().library.function
    kinds = {op.type for op in graph.get_operations()}
    kinds.update(node.op for function in library for node in function.node_def)
    return bool(kinds & {"While", "StatelessWhile"})


def _replica_context():
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return None
    return context


def replica_sum(value):
    """Sum over the replicas in sync (identity without a strategy)."""
    context = _replica_context()
    if context is None:
        return value
    return context.all_reduce(tf.distribute.ReduceOp.SUM, value)


def sum_over_devices(fn, rows, shared):
    """`fn(rows, shared)`: a replica's program already holds only its rows
    (the strategy splits them); `replica_sum` sums over the replicas.
    Clients trained at once (`tf.vectorized_map`) leave out the
    vectoriser's while-loop notes."""
    with console.vectorizer_logs_quieted():
        return fn(rows, shared)


def split_over_devices(fn, rows, shared):
    """`fn(rows, shared) -> (summed, kept)`: a replica's program already
    holds only its rows; its `summed` are its own (`replica_sum` adds
    them up)."""
    with console.vectorizer_logs_quieted():
        return fn(rows, shared)


def noise_share():
    """1.0 on the first replica, 0.0 on the others: a value that only the
    first replica contributes to a `replica_sum` is added exactly once."""
    context = _replica_context()
    if context is None:
        return tf.constant(1.0)
    return tf.cast(tf.equal(context.replica_id_in_sync_group, 0), tf.float32)


def optimizer_share(grads):
    """The step's gradient (the same global, noised value on every replica)
    as this replica hands it to the optimizer, which sums the replicas':
    the whole on the first replica, zeros on the others. Whatever the
    optimizer does to one replica's gradient before that sum (`clipnorm`,
    `clipvalue`, gradient accumulation) then sees the noised gradient
    only, as on one device."""
    context = _replica_context()
    if context is None:
        return list(grads)
    first = tf.equal(context.replica_id_in_sync_group, 0)
    return [tf.where(first, g, tf.zeros_like(g)) for g in grads]


def replica_logs(logs):
    """`logs` as Keras reduces them over the strategy's replicas.

    Under a `MultiWorkerMirroredStrategy` Keras averages each log along
    axis 0 across all workers' replicas, which a scalar lacks: each log
    is given one axis of length 1, and the average is the scalar again
    (every replica holds the same synced value).
    """
    strategy = tf.distribute.get_strategy()
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return logs
    # Keras' own test: one worker's strategy is reduced as a local one.
    if not getattr(strategy.extended, "_in_multi_worker_mode", lambda: True)():
        return logs
    return {name: tf.reshape(value, (1,)) for name, value in logs.items()}


def train_step(model, args, step):
    """TensorFlow calls `train_step(data)` with live variables."""
    (data,) = args
    return step(data)


def test_step(model, args, step):
    """TensorFlow calls `test_step(data)` with live variables."""
    return train_step(model, args, step)


def hold_rows(arrays, held):
    """Device copies of `arrays`, and whether the train step must be retraced.

    The copies are variables that the traced step captures by reference,
    so the batches carry only indices. A later fit with arrays of the
    same shapes overwrites the variables in place (no retrace); other
    shapes need new variables, and a new trace to capture them.
    """
    if held is not None and all(
        v.shape == a.shape and v.dtype == a.dtype
        for v, a in zip(held, arrays, strict=True)
    ):
        for variable, array in zip(held, arrays, strict=True):
            variable.assign(array)
        return held, False
    with tf.init_scope():
        rows = tuple(tf.Variable(array, trainable=False) for array in arrays)
    return rows, True


# A TensorFlow graph takes any batch size without a new trace: no padding.
BATCH_PADDING = "none"


def batch_padding(model):
    """The padding of `model`'s Poisson batches (`PoissonIndices`): none for
    a graph; for a step that XLA compiles (`jit_compile`, and always under
    a `TPUStrategy`), which is a new program for every batch shape, a few
    shapes ("multiple"), as on JAX."""
    strategy = getattr(model, "_distribute_strategy", None)
    on_tpu = type(strategy).__name__.startswith("TPUStrategy")
    return "multiple" if model.jit_compile or on_tpu else BATCH_PADDING


def rows_batches(sampler, rows, epochs):
    """`sampler`'s batches `(indices, mask)` for `epochs` epochs, as one
    `tf.data.Dataset`; fit it with `steps_per_epoch=len(sampler)`.

    - One Python call draws a whole epoch's samples (padded to the
      widest), and `tf.data` hands them out step by step: a Python call
      per step would cost about as much as a step of the head.
    - The next epoch is drawn in the background while this one trains.
    - One stream for all epochs keeps one iterator for the whole fit.
      Keras would otherwise make a new iterator each epoch, and the first
      step of an epoch often waited about 150 ms for it.
    - tf.data's autotuning is off: the pipeline has nothing to tune, and
      deleting an autotuned iterator stalled for up to 0.6 s.

    Every draw comes from `sampler`'s own generator, in order. A fit that
    stops early leaves at most the next epoch's samples drawn and unused.
    """
    del rows  # The step captures them.
    steps = len(sampler)

    def one_epoch(_):
        batches = [sampler[step] for step in range(steps)]
        width = max(len(mask) for _, mask in batches)
        indices = np.zeros((steps, width), sampler.index_dtype)
        masks = np.zeros((steps, width), np.float32)
        for step, (chosen, mask) in enumerate(batches):
            indices[step, : len(chosen)] = chosen
            masks[step, : len(mask)] = mask
        return indices, masks

    def draw_epoch(epoch):
        arrays = tf.numpy_function(
            one_epoch, [epoch], (sampler.index_dtype, tf.float32), stateful=True
        )
        return tuple(tf.ensure_shape(array, (steps, None)) for array in arrays)

    options = tf.data.Options()
    options.autotune.enabled = False
    epochs_of_samples = tf.data.Dataset.range(epochs).map(draw_epoch)
    batches = epochs_of_samples.prefetch(1).unbatch().prefetch(2)
    return batches.with_options(options)


def gather_inputs(data, rows):
    """`(indices, rows, mask)` of a batch from `rows_batches`."""
    indices, mask = data
    return indices, rows, mask
