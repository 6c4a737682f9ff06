"""Gradient and replica plumbing, one small module per Keras backend.

The DP algorithms are written once in `keras.ops`; the few things that
differ between backends live here, the way Keras splits its own trainers:

- `value_and_grad(fn)`: `fn(params, *args) -> scalar` becomes
  `(params, *args) -> (value, grads)`, with `params` a list of tensors.
- `vjp(fn, params, cotangent)`: the gradient of `Σ cotangent · fn(params)`
  with respect to `params`, as one vector-Jacobian product.
- `output_gradients(run, params)`: the loss and its gradients with respect
  to the outputs of tapped layers (`kdpemb.models._shared.layer_taps`).
- `compiled(fn)`: `fn`, compiled where eager execution is slow (JAX).
- `per_example_map(fn, *tensors)`: `fn` over the rows of `tensors`,
  vectorised (`vmap`, `vectorized_map`; on TensorFlow a `map_fn` loop
  where `vectorized_map` cannot convert `fn`).
- `replica_sum(x)`: the sum of `x` over the replicas of a
  `tf.distribute` strategy (identity where the program is already global,
  as a JAX `keras.distribution` program is).
- `sum_over_devices(fn, rows, shared)`: `fn` on each device's share of
  a round's rows, summed over the devices (`shard_map` on JAX; the
  strategy's replicas already hold their own rows on TensorFlow).
- `split_over_devices(fn, rows, shared)`: the same for `fn` returning
  `(summed, kept)`: `kept` (alike on every device) is not summed.
- `noise_share()`: 1 on the first replica, 0 on the others, so that a
  value only it contributes to a `replica_sum` is added exactly once.
- `optimizer_share(grads)`: the step's global gradient as this replica
  passes it to the optimizer (TensorFlow's sums the replicas'): all of
  it on the first replica, zeros elsewhere.
- `replica_logs(logs)`: the train step's logs in the form Keras reduces
  over the replicas (TensorFlow's multi-worker strategy needs an axis).
- `train_step(model, args, step)`: calls `step(data)` with the model's
  variables live: directly on TensorFlow, inside a `StatelessScope` on JAX.
- `test_step(model, args, step)`: the same for evaluation.
- `batch_padding(model)`: how `model`'s Poisson batches are padded: to a
  few shapes where each shape is a compilation (JAX, or TensorFlow with
  `jit_compile`), not at all for a TensorFlow graph.
- `hold_rows(arrays, held)`, `rows_batches(sampler, rows, epochs)`,
  `gather_inputs(data, rows)`: training rows kept on the device, and how
  a step that receives only indices reaches them (`models.device_rows`).
"""

import importlib

import keras


def current():
    """The plumbing module of the active Keras backend."""
    backend = keras.backend.backend()
    if backend not in ("tensorflow", "jax"):
        raise NotImplementedError(
            "kdpemb's trainers support the tensorflow and jax backends, "
            f"not {backend!r}."
        )
    return importlib.import_module(f"kdpemb.models._shared.backends.{backend}_backend")
