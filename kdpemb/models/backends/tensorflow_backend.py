"""TensorFlow plumbing: `tf.GradientTape` and `tf.distribute` replicas."""

import tensorflow as tf


def value_and_grad(fn):
    """`fn(params, *args)` -> `(value, grads)`, with a tape on `params`."""

    def wrapped(params, *args):
        params = list(params)
        with tf.GradientTape() as tape:
            tape.watch(params)
            value = fn(params, *args)
        grads = tape.gradient(value, params)
        grads = [
            tf.zeros_like(p) if g is None else g
            for p, g in zip(params, grads, strict=True)
        ]
        return value, grads

    return wrapped


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


def noise_share():
    """1.0 on the first replica, 0.0 on the others.

    Keras' optimizer sums the replicas' gradients, so the noise that only
    the first replica contributes is added to the round exactly once.
    """
    context = _replica_context()
    if context is None:
        return tf.constant(1.0)
    return tf.cast(tf.equal(context.replica_id_in_sync_group, 0), tf.float32)


def train_step(model, args, step):
    """TensorFlow calls `train_step(data)` with live variables."""
    (data,) = args
    return step(data)


def test_step(model, args, step):
    """TensorFlow calls `test_step(data)` with live variables."""
    return train_step(model, args, step)
