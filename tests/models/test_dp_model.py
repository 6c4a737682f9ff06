"""DPModel: DP-SGD for any Keras model. Its DP claims, each by a test that can fail."""

import keras
import numpy as np
import pytest
from keras import layers

from kdpemb import privacy
from kdpemb.errors import PrivacyBudgetExhaustedError, UnsupportedLayerError
from kdpemb.models import DPModel
from kdpemb.models.dp_sgd.clipped_gradients import ClippedGradients, plan_gradients
from kdpemb.privacy import protocol

pytestmark = pytest.mark.filterwarnings(
    "ignore::kdpemb.errors.ReproducibleNoiseWarning"
)
RNG = np.random.default_rng(0)


def mlp(seed=0, regularizer=None):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((3,)),
            layers.Dense(4, activation="tanh", kernel_regularizer=regularizer),
            layers.Dense(2),
        ]
    )


def data(n=12, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)).astype("float32")
    y = rng.normal(size=(n, 2)).astype("float32")
    return x, y


def weights(model):
    return [keras.ops.convert_to_numpy(w).copy() for w in model.trainable_weights]


def dp(network, **settings):
    settings.setdefault("noise_multiplier", 0.0)
    model = DPModel(network, seed=0, **settings)
    model.compile(keras.optimizers.SGD(0.5), "mse")
    return model


@pytest.mark.parametrize("physical_batch_size", [None, 4, 5])
def test_no_noise_and_a_huge_clip_norm_is_the_non_private_step(physical_batch_size):
    x, y = data()
    regularizer = keras.regularizers.L2(0.1)  # Data-independent: no clip, no noise.
    reference = mlp(regularizer=regularizer)
    reference.compile(keras.optimizers.SGD(0.5), "mse")
    model = dp(mlp(regularizer=regularizer), clip_norm=1e6,
               physical_batch_size=physical_batch_size)  # fmt: skip
    for got, want in zip(weights(model.network), weights(reference), strict=True):
        np.testing.assert_array_equal(got, want)
    model.fit(x, y, batch_size=None, epochs=2, verbose=0)  # Full batch.
    reference.fit(x, y, batch_size=len(x), epochs=2, verbose=0, shuffle=False)
    for got, want in zip(weights(model.network), weights(reference), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert model.privacy_statement(delta=1e-3).steps == 2


def per_example_gradients(network, x, y):
    plan = plan_gradients(network, x[:3], "vectorized")
    loss = keras.losses.get("mse")
    engine = ClippedGradients(network, plan, loss, [1.0])
    from kdpemb.models._shared import backends

    params = [v.value for v in network.trainable_variables]
    fixed = [v.value for v in network.non_trainable_variables]
    grads = engine._per_example_gradients(backends.current(), params, fixed, x, y)
    return [keras.ops.convert_to_numpy(g).astype("float64") for g in grads]


def test_a_clip_norm_below_every_gradient_steps_along_the_mean_normalised_gradient():
    x, y = data()
    network = mlp()
    grads = per_example_gradients(network, x, y)
    norms = np.sqrt(sum(np.sum(g.reshape(len(x), -1) ** 2, axis=1) for g in grads))
    clip = norms.min() / 3
    before = weights(network)
    model = dp(network, clip_norm=clip)
    model.fit(x, y, batch_size=None, epochs=1, verbose=0)
    for k, (w0, w1) in enumerate(zip(before, weights(model.network), strict=True)):
        mean = np.mean(
            clip * grads[k] / norms.reshape((-1,) + (1,) * (grads[k].ndim - 1)), axis=0
        )
        np.testing.assert_allclose(w0 - w1, 0.5 * mean, rtol=1e-4, atol=1e-7)


def linear_network():
    network = keras.Sequential([keras.Input((2,)), layers.Dense(1, use_bias=False)])
    network.set_weights([np.zeros((2, 1), "float32")])
    return network


def clipped_sum(network, x, y, mask, clip_norm):
    plan = plan_gradients(network, x[:3])
    engine = ClippedGradients(network, plan, keras.losses.get("mse"), [clip_norm])
    params = [v.value for v in network.trainable_variables]
    clipped, _ = engine(params, [], x, y, mask)
    return np.concatenate(
        [keras.ops.convert_to_numpy(t).ravel() for t in clipped.total]
    )


def test_one_example_moves_the_clipped_sum_by_at_most_c_or_2c_and_can_attain_it():
    c = 0.1
    network = linear_network()
    x = RNG.normal(size=(6, 2)).astype("float32")
    y = RNG.normal(size=(6, 1)).astype("float32") * 5
    full = clipped_sum(network, x, y, np.ones(6, bool), c)
    # Removing an example (the mask leaves it out): moves the sum by exactly C
    # here (its gradient is above C, so clipped to norm C).
    for i in range(6):
        mask = np.ones(6, bool)
        mask[i] = False
        moved = np.linalg.norm(full - clipped_sum(network, x, y, mask, c))
        assert moved <= c * (1 + 1e-5)
        assert moved == pytest.approx(c, rel=1e-4)
    # Replacing one: at most 2C, attained by the example whose residual has
    # the opposite sign (a gradient pointing the other way).
    x_swap, y_swap = x.copy(), y.copy()
    y_swap[0] = -y[0]
    moved = np.linalg.norm(
        full - clipped_sum(network, x_swap, y_swap, np.ones(6, bool), c)
    )
    assert moved <= 2 * c * (1 + 1e-5)
    assert moved == pytest.approx(2 * c, rel=1e-4)


class StepWeights(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = []

    def on_epoch_end(self, epoch, logs=None):
        self.seen.append(np.concatenate([w.ravel() for w in weights(self.model)]))


def test_noise_std_is_z_c_over_the_batch_and_fresh_every_step():
    # Zero weights and zero targets: every gradient is 0, so each step
    # moves the weights by lr · N(0, (zC)²) / B exactly.
    z, c, n = 1.5, 0.2, 16
    network = keras.Sequential(
        [keras.Input((8,)), layers.Dense(64, kernel_initializer="zeros")]
    )
    x = RNG.normal(size=(n, 8)).astype("float32")
    model = DPModel(network, clip_norm=c, noise_multiplier=z, seed=3)
    model.compile(keras.optimizers.SGD(1.0), "mse")
    steps = StepWeights()
    model.fit(x, np.zeros((n, 64), "float32"), batch_size=None, epochs=6,
              callbacks=[steps], verbose=0)  # fmt: skip
    moves = np.diff(np.array([np.zeros_like(steps.seen[0]), *steps.seen]), axis=0)
    std = moves.std() * n  # 6 × 576 draws.
    assert std == pytest.approx(z * c, rel=0.06)  # Rejects 2zC and zC/2.
    correlations = np.corrcoef(moves)[np.triu_indices(len(moves), 1)]
    assert np.max(np.abs(correlations)) < 0.2  # Independent steps.


def test_the_budget_contract_with_a_target_epsilon():
    x, y = data(n=64)
    model = DPModel(mlp(), clip_norm=1.0, target_epsilon=2.0, delta=1e-3)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    statement = model.privacy_statement()
    assert statement.steps == 8 == model.planned_steps
    assert 0.99 * 2.0 <= statement.epsilon <= 2.0
    expected = privacy.epsilon(
        privacy.dp_sgd(model.noise_multiplier, batch_size=16, num_examples=64), 8, 1e-3
    )
    assert statement.epsilon == pytest.approx(expected, rel=1e-6)
    before = weights(model.network)
    with pytest.raises(PrivacyBudgetExhaustedError):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    np.testing.assert_array_equal(weights(model.network)[0], before[0])
    with pytest.raises(ValueError, match="trained with"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)


class RestoresSteps(keras.callbacks.Callback):
    """Restores private steps taken elsewhere at train begin (as
    `BackupAndRestore` restores a crashed run's)."""

    def on_train_begin(self, logs=None):
        self.model.private_steps.assign(3)


def test_a_refused_first_fit_keeps_the_given_plan_and_no_calibration():
    # Steps restored at train begin were taken at a noise this plan does
    # not know: the fit is refused and its calibration undone, back to
    # the planned_steps given to the constructor (as FedEmbModel does).
    x, y = data(n=64)
    model = DPModel(mlp(), target_epsilon=2.0, delta=1e-3, planned_steps=20)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    before = weights(model.network)
    with pytest.raises(ValueError, match="restored 3 private steps"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0,
                  callbacks=[RestoresSteps()])  # fmt: skip
    np.testing.assert_array_equal(weights(model.network)[0], before[0])
    assert model.planned_steps == 20 and model.schedule is None
    assert model.calibrated_noise_multiplier is None is model.noise_multiplier
    model.private_steps.assign(0)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # Plans afresh: 20.
    assert model.planned_steps == 20 and model.calibrated_noise_multiplier > 0


def test_a_given_plan_that_misses_its_target_is_refused_and_keeps_no_schedule():
    x, y = data(n=64)
    model = DPModel(mlp(), target_epsilon=2.0, delta=1e-3, planned_steps=8,
                    calibrated_noise_multiplier=0.2)  # fmt: skip
    model.compile(keras.optimizers.SGD(0.1), "mse")
    with pytest.raises(ValueError, match=r"more than its target_epsilon=2\.0"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert model.schedule is None and protocol.read_private_steps(model) == 0


def test_fixed_size_sampling_is_accounted_as_replace_one_with_rdp():
    from kdpemb.callbacks import PrivacyBudget
    from kdpemb.errors import UnsupportedMechanismError

    x, y = data(n=40)
    model = DPModel(mlp(), target_epsilon=3.0, delta=1e-3, sampling="fixed")
    model.compile(keras.optimizers.SGD(0.1), "mse")
    budget = PrivacyBudget(verbose=0)
    model.fit(x, y, batch_size=10, epochs=2, verbose=0, callbacks=[budget])
    mechanism = model.privacy_mechanism()
    assert (mechanism.relation_name, mechanism.sampling) == ("replace_one", "fixed")
    statement = model.privacy_statement()
    assert statement.accountant == "rdp" and statement.steps == 8
    expected = privacy.Accountant(mechanism, "rdp").epsilon(8, 1e-3)
    assert statement.epsilon == pytest.approx(expected) and expected <= 3.0
    assert budget.epsilon == pytest.approx(expected, rel=1e-6)
    with pytest.raises(UnsupportedMechanismError, match="RDP"):
        model.privacy_statement(accountant="pld")


def test_bad_input_is_refused_before_training():
    bn = keras.Sequential(
        [keras.Input((3,)), layers.BatchNormalization(), layers.Dense(2)]
    )
    with pytest.raises(UnsupportedLayerError, match="replace_batchnorm"):
        DPModel(bn, noise_multiplier=1.0)
    regularized = keras.Sequential(
        [keras.Input((3,)), layers.Dense(2, activity_regularizer="l2")]
    )
    with pytest.raises(ValueError, match="activity_regularizer"):
        DPModel(regularized, noise_multiplier=1.0)
    model = DPModel(mlp(), noise_multiplier=1.0)
    with pytest.raises(ValueError, match="needs a loss"):
        model.compile("sgd")
    with pytest.raises(ValueError, match="one loss"):
        model.compile("sgd", loss=["mse", "mse"])
    model.compile("sgd", "mse")
    x, y = data()
    with pytest.raises(ValueError, match="exceeds"):
        model.fit(x, y, batch_size=100)
    with pytest.raises(ValueError, match="cannot be sampled"):
        model.fit((x,), y, batch_size=4)
    with pytest.raises(ValueError, match="does not take shuffle"):
        model.fit(x, y, batch_size=4, shuffle=True)
    with pytest.raises(ValueError, match="sampling"):
        DPModel(mlp(), noise_multiplier=1.0, sampling="shuffle")
    with pytest.raises(ValueError, match="exactly one"):
        DPModel(mlp(), noise_multiplier=1.0, target_epsilon=1.0, delta=1e-5)
    assert int(keras.ops.convert_to_numpy(model.private_steps)) == 0


@pytest.mark.parametrize(
    "settings",
    [dict(physical_batch_size=4), dict(per_layer_clipping=True)],
    ids=["physical_batches", "per_layer"],
)
def test_noise_std_stays_z_c_with_physical_batches_and_per_layer_clipping(settings):
    z, c, n = 1.0, 0.3, 16
    network = keras.Sequential(
        [keras.Input((8,)), layers.Dense(16, kernel_initializer="zeros"),
         layers.Dense(16, kernel_initializer="zeros")]
    )  # fmt: skip
    x = RNG.normal(size=(n, 8)).astype("float32")
    model = DPModel(network, clip_norm=c, noise_multiplier=z, seed=5, **settings)
    model.compile(keras.optimizers.SGD(1.0), "mse")
    steps = StepWeights()
    model.fit(x, np.zeros((n, 16), "float32"), batch_size=None, epochs=4,
              callbacks=[steps], verbose=0)  # fmt: skip
    # Zero weights: the second layer's gradient is 0 at the first step, the
    # first layer's stays 0; so the first step moves by noise alone.
    moves = steps.seen[0]
    assert moves.std() * n == pytest.approx(z * c, rel=0.1)  # 416 draws.


def test_an_overflowing_example_leaves_the_weights_finite():
    # NaN or infinite inputs are refused before fit (tests/
    # test_nonfinite_inputs.py); a finite one whose gradient overflows
    # float32 is left out of the clipped sum instead.
    x, y = data(n=16)
    x[0, 0] = 3e38  # Also the padding rows' source.
    model = dp(mlp(), clip_norm=0.1, noise_multiplier=0.5)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    for w in weights(model.network):
        assert np.all(np.isfinite(w))


def test_unfrozen_layers_are_planned_again_and_a_trainable_batchnorm_is_refused():
    x, y = data()
    network = mlp()
    network.layers[0].trainable = False
    model = dp(network, clip_norm=1e6)
    model.fit(x, y, batch_size=None, epochs=1, verbose=0)
    frozen = network.layers[0].get_weights()[0]
    network.layers[0].trainable = True
    model.compile(keras.optimizers.SGD(0.5), "mse")
    model.fit(x, y, batch_size=None, epochs=1, verbose=0)
    assert not np.allclose(network.layers[0].get_weights()[0], frozen)
    assert model.gradient_plan.num_groups == 2

    bn = keras.Sequential(
        [keras.Input((3,)), layers.BatchNormalization(), layers.Dense(2)]
    )
    bn.layers[0].trainable = False
    model = dp(bn)
    bn.layers[0].trainable = True  # Unfrozen after construction.
    with pytest.raises(UnsupportedLayerError):
        model.fit(x, y[:, :2], batch_size=4, verbose=0)


def test_mixed_precision_is_refused_with_the_fix():
    network = keras.Sequential(
        [keras.Input((3,)), layers.Dense(2, dtype="mixed_bfloat16")]
    )
    with pytest.raises(ValueError, match="another dtype than float32"):
        DPModel(network, noise_multiplier=1.0)


class Scale(layers.Layer):
    """A layer without a ghost norm."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=input_shape[1:], initializer="ones")

    def call(self, x):
        return keras.ops.tanh(x * self.w)


def test_fallback_and_ghost_paths_train_alike_with_lamb():
    optimizer = "Lamb"  # SGD and Adam are used by the other tests.
    x, y = data(n=16)
    results = []
    for method in ("auto", "vectorized"):
        keras.utils.set_random_seed(1)
        network = keras.Sequential(
            [keras.Input((3,)), Scale(), layers.Dense(4, "relu"), layers.Dense(2)]
        )
        model = DPModel(network, clip_norm=0.05, noise_multiplier=0.0, seed=0,
                        gradient_method=method)  # fmt: skip
        model.compile(getattr(keras.optimizers, optimizer)(0.1), "mse")
        model.fit(x, y, batch_size=8, epochs=2, verbose=0)
        results.append((model.gradient_plan, weights(model.network)))
    (plan, ghost), (whole_plan, whole) = results
    assert plan.methods == ("vectorized", "ghost", "ghost")
    assert whole_plan.mode == "whole_model"
    for a, b in zip(ghost, whole, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    keras.utils.set_random_seed(1)
    untrained = keras.Sequential(
        [keras.Input((3,)), Scale(), layers.Dense(4, "relu"), layers.Dense(2)]
    )
    assert not np.allclose(ghost[1], weights(untrained)[1])  # It trained.


def test_dropout_keeps_the_ghost_path_and_zero_heads_do_not_hide_layers():
    x, y = data(n=16)
    network = keras.Sequential(
        [keras.Input((3,)), layers.Dense(8, "relu"), layers.Dropout(0.5),
         layers.Dense(2, kernel_initializer="zeros")]
    )  # fmt: skip
    model = dp(network, noise_multiplier=1.0)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert model.gradient_plan.mode == "layers", model.gradient_plan.describe()
    assert model.gradient_plan.methods == ("ghost", "ghost")


def test_inputs_the_network_was_not_built_for_are_refused_before_any_step():
    # A convolutional network built for 6x6 images would train on 4x4 ones.
    network = keras.Sequential(
        [
            keras.Input((6, 6, 1)),
            keras.layers.Conv2D(2, 3),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(3),
        ]
    )
    model = DPModel(network, noise_multiplier=1.0, delta=1e-3, seed=0)
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    x = np.zeros((20, 4, 4, 1), "float32")
    pattern = (
        r"network takes inputs of shape \(6, 6, 1\).*x has inputs of shape \(4, 4, 1\)"
    )
    with pytest.raises(ValueError, match=pattern):
        model.fit(x, np.zeros(20, int), batch_size=5, verbose=0)
    assert protocol.read_private_steps(model) == 0 and model.schedule is None


def test_sparse_labels_with_several_output_axes_train_and_are_range_checked():
    # A network with an output per position: one class index per position.
    network = keras.Sequential([keras.Input((5, 3)), keras.layers.Dense(4)])
    model = DPModel(network, noise_multiplier=1.0, delta=1e-3, seed=0)
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 5, 3)).astype("float32")
    y = rng.integers(0, 4, (16, 5))
    bad = y.copy()
    bad[3, 2] = 4
    with pytest.raises(ValueError, match="num_classes=4"):
        model.fit(x, bad, batch_size=8, epochs=1, verbose=0)
    assert protocol.read_private_steps(model) == 0
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert protocol.read_private_steps(model) == 2


@pytest.mark.filterwarnings("ignore::kdpemb.errors.SmallPopulationWarning")
@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per_layer"])
def test_one_example_reading_a_row_through_its_negative_alias_moves_at_most_c(
    per_layer,
):
    # Ids −1 and V − 1 read the same row: one example's gradient there is
    # the sum of both tokens', and its contribution is clipped as one.
    keras.utils.set_random_seed(0)
    readout = layers.Dense(1, kernel_initializer="ones", trainable=False)
    network = keras.Sequential(
        [keras.Input((2,)), layers.Embedding(5, 4), layers.Flatten(), readout]
    )
    c = 0.01
    model = DPModel(network, clip_norm=c, noise_multiplier=0.0, sampling="fixed",
                    per_layer_clipping=per_layer, seed=0)  # fmt: skip
    model.compile(keras.optimizers.SGD(1.0), "mse")
    before = weights(network)
    x = np.array([[-1, 4]], "int32")
    model.fit(x, np.array([[1000.0]], "float32"), batch_size=None, verbose=0)
    # The self-check (on aliased ids) trusts the fixed ghost norm.
    assert model.gradient_plan.mode == "layers", model.gradient_plan.describe()
    moved = np.sqrt(
        sum(np.sum((a - b) ** 2) for a, b in zip(weights(network), before, strict=True))
    )
    assert moved == pytest.approx(c, rel=1e-4)


def tied_output_model(vocabulary=7, width=3):
    """Its output projection reads the input embedding's table outside the
    Embedding's call: a per-layer plan would drop that path's gradient."""

    class TiedOutput(keras.Model):
        def __init__(self):
            super().__init__()
            self.embed = layers.Embedding(vocabulary, width)
            self.mix = layers.Dense(width)

        def call(self, ids):
            h = self.mix(self.embed(ids))
            return keras.ops.matmul(h, keras.ops.transpose(self.embed.embeddings))

    keras.utils.set_random_seed(0)
    model = TiedOutput()
    model(np.zeros((2, 4), "int32"))
    return model


@pytest.mark.parametrize(
    "loss",
    ["categorical_crossentropy",
     keras.losses.CategoricalCrossentropy(from_logits=True)],
    ids=["probabilities", "logits"],
)  # fmt: skip
def test_tied_weights_with_one_hot_targets_fall_back_and_train_exactly(loss):
    rng = np.random.default_rng(3)
    x = rng.integers(0, 7, size=(6, 4)).astype("int32")
    y = keras.ops.convert_to_numpy(keras.ops.one_hot(rng.integers(0, 7, (6, 4)), 7))
    network = tied_output_model()
    reference = tied_output_model()
    model = DPModel(network, clip_norm=1e6, noise_multiplier=0.0, seed=0)
    model.compile(keras.optimizers.SGD(0.5), loss)
    model.fit(x, y, batch_size=None, verbose=0)  # Full batch, no clipping.
    assert model.gradient_plan.mode == "whole_model", model.gradient_plan.describe()
    reference.compile(keras.optimizers.SGD(0.5), loss)
    reference.fit(x, y, batch_size=len(x), epochs=1, verbose=0, shuffle=False)
    for got, want in zip(weights(network), weights(reference), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_a_self_check_with_nothing_to_compare_does_not_trust_the_plan():
    network = tied_output_model()
    x = np.array([[0, 1, 2, 3]] * 3, "int32")
    zeros = np.zeros((3, 4, 7), "float32")  # One-hot cross-entropy is 0 on them.
    plan = plan_gradients(network, x, "auto", keras.losses.categorical_crossentropy,
                          zeros)  # fmt: skip
    assert plan.mode == "whole_model"
    assert "no finite, non-zero gradient" in plan.reason


def test_synthetic_samples_read_ids_through_aliases_and_give_a_non_zero_loss():
    from kdpemb.models.dp_sgd.dp_model import synthetic_inputs, synthetic_targets

    network = keras.Sequential(
        [keras.Input((6,)), layers.Embedding(9, 2), layers.Embedding(5, 2)]
    )
    ids = synthetic_inputs(np.zeros((10, 6), "int64"), network)
    assert ids.dtype == np.int64 and ids.shape == (3, 6)
    assert ids.min() >= -5 and ids.max() < 5  # The smaller table's range.
    rows = ids % 5
    for k in range(3):  # Row 0: each id beside its alias id − 5.
        assert ids[0, 2 * k] >= 0 and ids[0, 2 * k + 1] < 0
        assert rows[0, 2 * k] == rows[0, 2 * k + 1]
    assert set(ids[1]) == {-1, 4}  # One row, read both ways.
    labels = synthetic_targets(np.zeros((10,), "int32"), 4, class_labels=True)
    assert labels.min() == 0 and labels.max() == 3
    one_hot = synthetic_targets(np.zeros((10, 4), "float32"), 4, class_labels=False)
    loss = keras.losses.categorical_crossentropy(one_hot, np.full((3, 4), 0.25))
    assert np.all(keras.ops.convert_to_numpy(loss) > 0)


@pytest.mark.filterwarnings("ignore::kdpemb.errors.SmallPopulationWarning")
def test_the_self_check_catches_a_norm_that_counts_ids_not_rows(monkeypatch):
    # The ghost norm as it was: raw ids compared, −1 and V − 1 two rows.
    from kdpemb.models.dp_sgd import ghost_norms

    monkeypatch.setattr(
        ghost_norms, "embedding_rows", lambda layer, ids: keras.ops.cast(ids, "int32")
    )
    network = keras.Sequential(
        [keras.Input((2,)), layers.Embedding(5, 4), layers.Flatten(), layers.Dense(1)]
    )
    model = DPModel(network, clip_norm=0.01, noise_multiplier=0.0, seed=0)
    model.compile(keras.optimizers.SGD(1.0), "mse")
    before = weights(network)
    model.fit(np.array([[-1, 4]], "int32"), np.array([[1000.0]], "float32"),
              batch_size=None, verbose=0)  # fmt: skip
    assert model.gradient_plan.mode == "whole_model", model.gradient_plan.describe()
    moved = np.sqrt(
        sum(np.sum((a - b) ** 2) for a, b in zip(weights(network), before, strict=True))
    )
    assert moved == pytest.approx(0.01, rel=1e-4)


def test_ids_that_another_layer_refuses_negative_are_planned_on_valid_ids():
    # The self-check's aliased ids are negative; CategoryEncoding refuses
    # them on TensorFlow, so the plan is made on ids in [0, V).
    ids = keras.Input((6,), dtype="int32")
    pooled = layers.GlobalAveragePooling1D()(layers.Embedding(20, 3)(ids))
    counts = layers.CategoryEncoding(20, output_mode="multi_hot")(ids)
    output = layers.Dense(2)(layers.Concatenate()([pooled, counts]))
    network = keras.Model(ids, output)
    x = RNG.integers(0, 20, size=(8, 6)).astype("int32")
    y = RNG.integers(0, 2, size=8).astype("int32")
    model = DPModel(network, noise_multiplier=0.0, seed=0)
    model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
    before = weights(network)
    model.fit(x, y, batch_size=4, verbose=0)
    assert model.gradient_plan.mode == "layers", model.gradient_plan.describe()
    assert any(np.any(a != b) for a, b in zip(weights(network), before, strict=True))


def test_a_loss_scale_optimizer_is_refused_at_compile():
    # It would divide every update by its loss scale (DPModel scales no loss).
    model = dp(mlp(), noise_multiplier=1.0)
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match="LossScaleOptimizer would shrink every"):
        model.compile(optimizer, "mse")
