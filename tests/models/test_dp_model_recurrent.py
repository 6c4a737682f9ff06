"""DPModel on recurrent models: exact per-example clipping, on both backends.

A recurrent layer calls its cell once per time step, so these models take
whole-model per-example gradients. On TensorFlow `tf.vectorized_map`
cannot convert the gradient of a recurrent layer whose input depends on
trainable weights (a TimeDistributed Dense or an Embedding before it);
the TensorFlow backend then loops over the examples. Each test compares
with each example's gradient by plain autodiff on that example alone.
"""

import logging

import keras
import numpy as np
import pytest
from keras import layers

from kdpemb.models import DPModel
from kdpemb.models.dp_sgd.clipped_gradients import _self_check_problem, plan_gradients

pytestmark = pytest.mark.filterwarnings(
    "ignore::kdpemb.errors.ReproducibleNoiseWarning"
)
ROWS, STEPS = 6, 4


def time_distributed_bidirectional_rnn():
    return keras.Sequential(
        [
            keras.Input((STEPS, 3)),
            layers.TimeDistributed(layers.Dense(4, activation="tanh")),
            layers.Bidirectional(layers.SimpleRNN(3)),
            layers.Dense(2),
        ]
    )


def embedding_lstm():
    return keras.Sequential(
        [
            keras.Input((STEPS,), dtype="int32"),
            layers.Embedding(5, 3),
            layers.LSTM(2),
            layers.Dense(2),
        ]
    )


def gru():
    return keras.Sequential([keras.Input((STEPS, 3)), layers.GRU(2), layers.Dense(2)])


MODELS = {
    "time_distributed_bidirectional_simple_rnn": time_distributed_bidirectional_rnn,
    "embedding_lstm": embedding_lstm,
    "gru": gru,
}


def network_and_data(name):
    keras.utils.set_random_seed(0)
    network = MODELS[name]()
    rng = np.random.default_rng(1)
    if name == "embedding_lstm":
        x = rng.integers(0, 5, size=(ROWS, STEPS)).astype("int32")
    else:
        x = rng.normal(size=(ROWS, STEPS, 3)).astype("float32")
    y = rng.normal(size=(ROWS, 2)).astype("float32")
    return network, x, y


def reference_gradients(network, x, y):
    """Each example's gradient (a list over trainable variables) by autodiff
    of its own loss, the example alone in its batch, one at a time."""
    fixed = [v.value for v in network.non_trainable_variables]

    def loss(values, x_i, y_i):
        y_pred, _ = network.stateless_call(values, fixed, x_i, training=True)
        return keras.losses.MeanSquaredError()(y_i, y_pred)

    if keras.backend.backend() == "jax":
        import jax

        gradient = jax.jit(jax.grad(loss))
    else:
        import tensorflow as tf

        def gradient(values, x_i, y_i):
            with tf.GradientTape() as tape:
                tape.watch(values)
                value = loss(values, x_i, y_i)
            return [tf.convert_to_tensor(g) for g in tape.gradient(value, values)]

    params = [v.value for v in network.trainable_variables]
    return [
        [
            keras.ops.convert_to_numpy(g).astype("float64")
            for g in gradient(params, x[i : i + 1], y[i : i + 1])
        ]
        for i in range(len(x))
    ]


def flat_norm(grads):
    return np.sqrt(sum(np.sum(g**2) for g in grads))


@pytest.mark.parametrize("name", ["time_distributed_bidirectional_simple_rnn",
                                  "embedding_lstm"])  # fmt: skip
def test_a_recurrent_model_steps_by_the_mean_of_per_example_clipped_gradients(
    name, caplog, capfd
):
    network, x, y = network_and_data(name)
    before = [keras.ops.convert_to_numpy(w).copy() for w in network.trainable_weights]
    reference = reference_gradients(network, x, y)
    norms = np.array([flat_norm(g) for g in reference])
    clip = float(np.median(norms))  # Some examples clipped, some not.
    assert (norms > clip * 1.01).any() and (norms < clip * 0.99).any()
    model = DPModel(network, noise_multiplier=0.0, clip_norm=clip, seed=0)
    model.compile(keras.optimizers.SGD(0.5), "mse")
    with caplog.at_level(logging.INFO, logger="kdpemb"):
        model.fit(x, y, batch_size=None, epochs=1, verbose=0)
    assert model.gradient_plan.mode == "whole_model"
    assert int(model.private_steps.numpy()) == 1
    after = [keras.ops.convert_to_numpy(w) for w in network.trainable_weights]
    factors = np.minimum(1.0, clip / norms)
    for k, (w0, w1) in enumerate(zip(before, after, strict=True)):
        clipped_mean = np.mean(
            [f * grads[k] for f, grads in zip(factors, reference, strict=True)],
            axis=0,
        )
        np.testing.assert_allclose(w0 - w1, 0.5 * clipped_mean, rtol=1e-4, atol=1e-6)
    # The TensorFlow fallback says which path it took, and TensorFlow's own
    # logs of the failed conversion stay off the console.
    looped = any("tf.map_fn" in r.getMessage() for r in caplog.records)
    assert looped == (keras.backend.backend() == "tensorflow")
    err = capfd.readouterr().err
    for noise in ("pfor", "ZerosLike", "while_loop for converting"):
        assert noise not in err, err[-2000:]


@pytest.mark.parametrize("name", ["time_distributed_bidirectional_simple_rnn", "gru"])
def test_recurrent_models_are_planned_whole_and_their_norms_pass_the_self_check(
    name,
):
    network, x, y = network_and_data(name)
    loss = keras.losses.get("mse")
    plan = plan_gradients(network, x[:3], loss_fn=loss, sample_targets=y[:3])
    # A cell called once per step (or, for the GRU on JAX, never through its
    # own `__call__`, where only the self-check sees its weights) cannot be
    # split by layer.
    assert plan.mode == "whole_model", plan.describe()
    # The whole-model norms (vectorised, or looped on TensorFlow) against
    # the self-check's own autodiff reference, one example at a time.
    assert _self_check_problem(network, plan, loss, x[:3], y[:3]) == ""
