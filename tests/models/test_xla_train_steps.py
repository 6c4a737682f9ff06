"""Every trainer's train step, compiled by XLA (`compile(jit_compile=True)`),
takes the step it takes without XLA.

Two identical models, one compiled with `jit_compile=True` and one with
`jit_compile=False` (a `tf.function` graph on TensorFlow, op-by-op
execution on JAX), fit on the same data with the same seeds: the same
weights, and the first one's step was compiled by XLA. One seed draws
other noise under XLA on TensorFlow (its stateless kernels and XLA's
differ), so the comparisons draw a smooth function of the seed
generators' states instead (`same_draws`: every release's noise on, its
seeds moving as they do), and one test checks XLA's own draws.

A Poisson batch has a random size, and XLA compiles a program per batch
shape: an XLA step gets batches padded to a few sizes. XLA refuses the
vectorised gradient of a recurrent layer: TensorFlow loops instead.
"""

import math
import warnings

import keras
import numpy as np
import pytest
from keras import layers, ops

from kdpemb.data.poisson_batches import PoissonIndices
from kdpemb.models import (
    CentralizedBaseline,
    DPModel,
    FedEmbModel,
    LastLayerDPClassifier,
)
from kdpemb.privacy import AdaptiveClipping, LossRelease
from tests.models import fedemb_reference as ref
from tests.models.test_fedemb import tiny_clients
from tests.models.test_fedemb_tree import epochs_clients

TENSORFLOW = keras.backend.backend() == "tensorflow"
DELTA = 1e-3
pytestmark = [
    pytest.mark.filterwarnings("ignore::kdpemb.errors.ReproducibleNoiseWarning"),
    pytest.mark.filterwarnings("ignore::kdpemb.errors.ReproducibleSamplingWarning"),
]


@pytest.fixture
def same_draws(monkeypatch):
    """`keras.random.normal` as a smooth function of the seed generator's
    state (advanced as by a draw), the same in XLA and out of it."""

    def normal(shape, mean=0.0, stddev=1.0, dtype=None, seed=None):
        state = ops.cast(seed.next() % 1000, "float32")
        phase = 0.013 * state[0] + 0.007 * state[1]
        shape = tuple(int(d) for d in shape)
        angles = ops.arange(math.prod(shape), dtype="float32") * 0.37 + phase
        values = ops.reshape(math.sqrt(2.0) * ops.sin(angles), shape)
        return ops.cast(mean + stddev * values, dtype or "float32")

    monkeypatch.setattr(keras.random, "normal", normal)


@pytest.fixture
def batch_sizes(monkeypatch):
    """`(real, padded)` sizes of every Poisson sample drawn."""
    drawn = []
    sample = PoissonIndices.sample

    def recorded(self, index):
        indices, mask = sample(self, index)
        drawn.append((int(mask.sum()), len(mask)))
        return indices, mask

    monkeypatch.setattr(PoissonIndices, "sample", recorded)
    return drawn


def values(variables):
    return [np.array(keras.ops.convert_to_numpy(v), np.float64) for v in variables]


def _reachable(fn, seen):
    """`fn` and the functions its closures (and wrapped functions) hold."""
    if id(fn) in seen:
        return
    seen.add(id(fn))
    yield fn
    inner = getattr(fn, "python_function", None)  # A `tf.function`'s own.
    if inner is not None:
        yield from _reachable(inner, seen)
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            held = cell.cell_contents
        except ValueError:  # An empty cell.
            continue
        if callable(held) and not isinstance(held, (keras.layers.Layer, type)):
            yield from _reachable(held, seen)


def xla_steps(model):
    """The functions of `model.train_function` that XLA compiled and ran:
    `tf.function(jit_compile=True)`s traced at least once, `jax.jit`s with
    a compiled program."""
    found = []
    for fn in _reachable(model.train_function, set()):
        if TENSORFLOW:
            import tensorflow as tf

            if (
                isinstance(fn, tf.types.experimental.PolymorphicFunction)
                and getattr(fn, "_jit_compile", None) is True
                and fn.experimental_get_tracing_count() > 0
            ):
                found.append(fn)
        elif hasattr(fn, "lower") and fn._cache_size() > 0:  # jax.jit
            found.append(fn)
    return found


def fit_twice(build, fit, capfd):
    """`(weights under XLA, weights without, the XLA model, the two fits'
    results)`: `build(jit_compile)` makes a compiled model, `fit(model)`
    trains it. The XLA fit warns of nothing and retraces nothing."""
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # Keras' own variables and NumPy 2 (as in pyproject's filters).
        warnings.filterwarnings("ignore", "__array__ implementation")
        xla = build(True)
        result = fit(xla)
    caught = [w for w in caught if "Reproducible" not in w.category.__name__]
    assert not caught, [str(w.message) for w in caught]
    out, err = capfd.readouterr()
    assert "retracing" not in out + err, (out + err)[-2000:]
    plain = build(False)
    results = (result, fit(plain))
    assert xla.jit_compile is True and plain.jit_compile is False
    assert xla_steps(xla) and not xla_steps(plain)
    weights = [values(m.trainable_variables) for m in (xla, plain)]
    return *weights, xla, results


def assert_same_moved_weights(got, want, start, atol=1e-5):
    assert len(got) == len(want) == len(start) > 0
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=atol)
    assert all(not np.allclose(g, s) for g, s in zip(got, start, strict=True))


def assert_few_shapes(drawn, multiple):
    """Samples of many sizes, padded to a few multiples of `multiple`."""
    sizes = {real for real, _ in drawn}
    widths = {padded for _, padded in drawn}
    assert len(sizes) > 3, drawn  # Unpadded, as many shapes.
    assert len(widths) <= 3, drawn
    assert all(width % multiple == 0 for width in widths), drawn


# ------------------------------------------------------------ DPModel --


def conv_network():
    """Conv2D and Dense (ghost norms) around a PReLU (none: vectorised)."""
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((5, 5, 1)),
            layers.Conv2D(2, 3),
            layers.PReLU(),
            layers.Flatten(),
            layers.Dense(3),
        ]
    )


def embedding_network():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((3,), dtype="int32"),
            layers.Embedding(6, 2),
            layers.Flatten(),
            layers.Dense(3),
        ]
    )


def dense_network():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), layers.Dense(3)])


def dp_model(network, jit_compile, **settings):
    settings = {"clip_norm": 0.5, "noise_multiplier": 0.7, "seed": 0, **settings}
    model = DPModel(network, delta=DELTA, **settings)
    model.compile(
        keras.optimizers.SGD(0.5, momentum=0.5),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
    )
    return model


def images(n=48, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 5, 5, 1)).astype("float32"), rng.integers(0, 3, n)


def test_dp_model_physical_batches_per_layer_clipping_and_a_vectorised_layer(
    same_draws, batch_sizes, capfd
):
    x, y = images()

    def build(jit_compile):
        return dp_model(
            conv_network(), jit_compile, physical_batch_size=4,
            per_layer_clipping=True,
        )  # fmt: skip

    def fit(model):
        batch_sizes.clear()
        model.fit(x, y, batch_size=12, epochs=1, verbose=0)
        return list(batch_sizes)

    start = values(conv_network().trainable_variables)
    got, want, model, (drawn, _) = fit_twice(build, fit, capfd)
    assert set(model.gradient_plan.methods) == {"ghost", "vectorized"}
    assert int(model.private_steps.value) == 4
    assert_same_moved_weights(got, want, start)
    # The XLA step's batches: 2σ = 6 rows, padded to multiples of 8 (not
    # only of the physical batch).
    assert all(padded % 8 == 0 for _, padded in drawn), drawn


def test_dp_model_users_of_an_embedding(same_draws, capfd):
    rng = np.random.default_rng(1)
    x = rng.integers(0, 6, size=(40, 3)).astype("int32")
    y = rng.integers(0, 3, 40)
    users = np.arange(40) % 10

    def build(jit_compile):
        return dp_model(
            embedding_network(), jit_compile, unit="user", examples_per_user=2,
            physical_batch_size=4,
        )  # fmt: skip

    def fit(model):
        return model.fit(x, y, users=users, batch_size=4, epochs=1, verbose=0)

    start = values(embedding_network().trainable_variables)
    got, want, model, _ = fit_twice(build, fit, capfd)
    assert int(model.private_steps.value) == 2  # round(10 users / 4)
    assert_same_moved_weights(got, want, start)


@pytest.mark.slow
def test_dp_model_whole_model_gradients_of_a_recurrent_network(same_draws, capfd):
    # TensorFlow cannot vectorise the RNN's gradient: a `tf.map_fn` loop.
    rng = np.random.default_rng(5)
    x = rng.normal(size=(6, 3, 2)).astype("float32")
    y = rng.integers(0, 3, 6)

    def network():
        keras.utils.set_random_seed(0)
        return keras.Sequential(
            [keras.Input((3, 2)), layers.SimpleRNN(2), layers.Dense(3)]
        )  # fmt: skip

    def fit(model):
        return model.fit(x, y, batch_size=None, epochs=1, verbose=0)

    start = values(network().trainable_variables)
    got, want, model, _ = fit_twice(
        lambda jit_compile: dp_model(network(), jit_compile), fit, capfd
    )
    assert model.gradient_plan.mode == "whole_model"
    assert_same_moved_weights(got, want, start)


def test_dp_model_noised_loss_adaptive_clipping_and_a_target_epsilon(same_draws, capfd):
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(40, 4)).astype("float32"), rng.integers(0, 3, 40)

    class PastThePlan(keras.callbacks.Callback):
        """Moves the step count to the plan's end before the last step, and
        records each step's logged releases."""

        def on_train_begin(self, logs=None):
            self.released = []

        def on_train_batch_begin(self, batch, logs=None):
            if batch == 3:
                self.model.private_steps.assign(self.model.planned_steps)

        def on_train_batch_end(self, batch, logs=None):
            self.released.append([float(logs[k]) for k in ("noised_loss", "clip_norm")])

    def build(jit_compile):
        return dp_model(
            dense_network(), jit_compile, noise_multiplier=None, target_epsilon=40.0,
            noised_loss=LossRelease(2.0, 4.0), adaptive_clipping=AdaptiveClipping(),
        )  # fmt: skip

    def fit(model):
        logged = PastThePlan()
        model.fit(x, y, batch_size=10, epochs=1, verbose=0, callbacks=[logged])
        return logged.released

    start = values(dense_network().trainable_variables)
    got, want, model, (released, plain) = fit_twice(build, fit, capfd)
    assert model.noise_multiplier > 0
    # The step past the plan trained nothing and counted nothing.
    assert int(model.private_steps.value) == model.planned_steps == 4
    assert_same_moved_weights(got, want, start)
    released = np.array(released)
    assert np.isfinite(released[:3]).all() and np.isnan(released[3, 0]), released
    assert len(set(released[:3, 1])) == 3  # C moved every step.
    np.testing.assert_allclose(released, plain, rtol=1e-5)  # NaN alike.


def test_the_xla_step_draws_fresh_noise_of_std_z_c_over_b():
    # Steps on all B = 16 examples: a clipped sum at most B · C = 16 in
    # norm, and noise of std z · C = 100 on each of its 1,056 coordinates
    # (norm about 3,250): the update is the noise over B.
    z, clip, b = 100.0, 1.0, 16
    keras.utils.set_random_seed(0)
    network = keras.Sequential([keras.Input((32,)), layers.Dense(32)])
    model = DPModel(network, clip_norm=clip, noise_multiplier=z, seed=0, delta=DELTA)
    model.compile(keras.optimizers.SGD(1.0), "mse", jit_compile=True)
    x = np.random.default_rng(0).normal(size=(16, 32)).astype("float32")
    steps = []
    for _ in range(2):
        before = np.concatenate([w.ravel() for w in values(network.weights)])
        model.fit(x, x, batch_size=None, epochs=1, verbose=0)  # One step.
        after = np.concatenate([w.ravel() for w in values(network.weights)])
        steps.append((before - after) * b / (z * clip))
    assert xla_steps(model)
    for step in steps:  # N(0, 1) per coordinate.
        assert abs(np.std(step) - 1.0) < 0.1
        assert abs(np.mean(step)) < 0.2
    assert abs(np.corrcoef(steps[0], steps[1])[0, 1]) < 0.2  # Fresh draws.


# -------------------------------------------------------- FedEmbModel --


def fedemb_model(jit_compile, **settings):
    model = FedEmbModel(
        ref.linear_backbone(seed=1), client_optimizer=0.2, clip_norm=0.5,
        noise_multiplier=0.8, seed=0, delta=DELTA, **settings,
    )  # fmt: skip
    model.compile(
        optimizer=keras.optimizers.SGD(1.0, momentum=0.5), jit_compile=jit_compile
    )
    return model


@pytest.mark.parametrize("noise", ["independent", "tree"])
def test_fedemb_rounds_with_adaptive_clipping_or_tree_noise(noise, same_draws, capfd):
    if noise == "tree":
        settings, clients = {"noise": "tree"}, epochs_clients
    else:
        settings = {"adaptive_clipping": AdaptiveClipping(count_stddev=1.0)}
        clients = tiny_clients

    def build(jit_compile):
        return fedemb_model(jit_compile, **settings)

    def fit(model):
        # Keras would shuffle the rounds with Python's own `random`.
        return model.fit(clients(), epochs=1, verbose=0, shuffle=False)

    start = values(ref.linear_backbone(seed=1).trainable_variables)
    got, want, model, _ = fit_twice(build, fit, capfd)
    assert int(model.private_steps.value) == 4
    assert_same_moved_weights(got, want, start)


# ----------------------------------------------- LastLayerDPClassifier --


def features(n=40, seed=3):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 4)).astype("float32"), rng.integers(0, 3, n)


@pytest.mark.parametrize("unit", ["example", "user"])
def test_last_layer_dp_sgd(unit, same_draws, batch_sizes, capfd):
    x, y = features()
    user_settings = {"unit": "user", "examples_per_user": 2} if unit == "user" else {}
    users = {"users": np.arange(40) % 20} if unit == "user" else {}

    def build(jit_compile):
        model = LastLayerDPClassifier(
            3, target_epsilon=20.0, delta=DELTA, seed=0, **user_settings
        )
        model.compile(keras.optimizers.SGD(0.5), jit_compile=jit_compile)
        return model

    def fit(model):
        batch_sizes.clear()
        model.fit(x, y, batch_size=8 if unit == "example" else 4, epochs=3,
                  verbose=0, **users)  # fmt: skip
        return list(batch_sizes)

    got, want, model, (drawn, _) = fit_twice(build, fit, capfd)
    assert int(model.private_steps.value) == model.planned_steps == 15
    assert model.noise_multiplier > 0
    assert_same_moved_weights(got, want, [0 * w for w in want])  # From zeros.
    if unit == "example":
        assert_few_shapes(drawn, 8)


@pytest.mark.parametrize("method", ["dp-ls", "dp-newton", "dp-fc"])
def test_closed_form_methods_step_on_the_host_whatever_jit_compile(method):
    x, y = features()
    fitted = []
    for jit_compile in (True, False):
        model = LastLayerDPClassifier(
            3, method=method, feature_clip_norm=2.0, noise_multiplier=2.0,
            delta=DELTA, seed=0,
        )  # fmt: skip
        model.compile(jit_compile=jit_compile)
        model.fit(x, y, epochs=1 if method == "dp-ls" else 2, verbose=0)
        assert model.train_function is None  # No compiled step at all.
        fitted.append(values(model.trainable_variables))
    assert_same_moved_weights(*fitted, [0 * w for w in fitted[0]], atol=1e-7)


# ---------------------------------------------- CentralizedBaseline --


def test_centralized_baseline_with_pretrainings_cosine_head_and_margin(capfd):
    # `pretrain` fits this model (its default head: cosine).
    rng = np.random.default_rng(4)
    x = rng.normal(size=(24, *ref.IMAGE_SHAPE)).astype("float32")
    y = rng.integers(0, 3, 24)

    def build(jit_compile):
        keras.utils.set_random_seed(0)
        model = CentralizedBaseline(
            ref.linear_backbone(embedding_dim=4), 3, head="cosine", head_margin=0.2
        )
        model.compile(
            keras.optimizers.Adam(0.05),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=jit_compile,
        )
        return model

    def fit(model):
        return model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)

    start = values(build(False).trainable_variables)
    got, want, _, _ = fit_twice(build, fit, capfd)
    assert_same_moved_weights(got, want, start)


class TPUStrategy:  # Only its name is read: no TPU here.
    pass


def test_batches_are_padded_to_a_few_shapes_wherever_xla_compiles_the_step():
    from types import SimpleNamespace

    from kdpemb.models._shared import backends

    def padding(jit_compile, strategy=None):
        model = SimpleNamespace(jit_compile=jit_compile, _distribute_strategy=strategy)
        return backends.current().batch_padding(model)

    assert padding(True) == "multiple"
    # A TPU compiles every step with XLA, whatever jit_compile says.
    assert padding(False, TPUStrategy()) == "multiple"
    # Without XLA a TensorFlow graph takes any batch size; JAX always compiles.
    expected = "none" if keras.backend.backend() == "tensorflow" else "multiple"
    assert padding(False) == expected
