"""Per-example gradient norms and clipped sums against brute force.

The brute force takes each example's gradient by autodiff on that example
alone, then clips and sums in NumPy. Every layer type with a ghost norm is
checked, on both backends.
"""

import keras
import numpy as np
import pytest
from keras import layers

from kdpemb.models._shared import backends
from kdpemb.models.dp_sgd.clipped_gradients import (
    ClippedGradients,
    per_example_losses,
    plan_gradients,
)


def squared_error(y_true, y_pred):
    return keras.ops.mean(
        keras.ops.square(
            keras.ops.reshape(y_pred, (keras.ops.shape(y_pred)[0], -1)) - y_true
        ),
        axis=-1,
    )


def compiled(fn):
    return backends.current().compiled(fn)


def brute_force_gradients(model, x, y, loss_fn=squared_error):
    """Example i's gradient (a list over trainable variables), one at a time."""
    backend = backends.current()
    params = [v.value for v in model.trainable_variables]
    fixed = [v.value for v in model.non_trainable_variables]

    def gradient(params, x_i, y_i):
        def loss(values):
            out, _ = model.stateless_call(values, fixed, x_i, training=True)
            return keras.ops.sum(per_example_losses(loss_fn, y_i, out))

        return backend.value_and_grad(loss)(params)[1]

    gradient = compiled(gradient)
    rows = []
    for i in range(len(x)):
        grads = gradient(params, x[i : i + 1], y[i : i + 1])
        rows.append([keras.ops.convert_to_numpy(g).astype("float64") for g in grads])
    return rows


def flat_norm(grads):
    return np.sqrt(sum(np.sum(g**2) for g in grads))


def engine_for(model, x, mode="auto", loss_fn=squared_error, clip_norms=(1.0,)):
    plan = plan_gradients(model, x[:3], mode)
    return plan, ClippedGradients(model, plan, loss_fn, list(clip_norms))


def state(model):
    return (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
    )


def targets(model, x, seed=1):
    out = keras.ops.convert_to_numpy(model(x))
    rng = np.random.default_rng(seed)
    return rng.normal(size=(len(x), int(np.prod(out.shape[1:])))).astype("float32")


def check_norms_and_sum(model, x, expect_methods=None, mode="auto", atol=1e-5):
    y = targets(model, x)
    plan, engine = engine_for(model, x, mode)
    if expect_methods is not None:
        assert plan.methods == tuple(expect_methods), plan.describe()
    params, fixed = state(model)
    norms = compiled(engine.per_example_norms)(params, fixed, x, y)
    norms = keras.ops.convert_to_numpy(norms)
    brute = brute_force_gradients(model, x, y)
    expected = np.array([flat_norm(g) for g in brute])
    # Gram-form norms add a bound on their float32 round-off: never below
    # the true norm (a clip factor never too large), and close to it.
    assert np.all(norms >= expected * (1 - 1e-5) - 1e-7), (norms, expected)
    np.testing.assert_allclose(norms, expected, rtol=2e-3, atol=atol)
    # A clip norm below every norm: the sum of normalised gradients.
    clip = float(expected.min()) / 2
    _, engine = engine_for(model, x, mode, clip_norms=(clip,))
    mask = np.array([True] * (len(x) - 1) + [False])
    clipped, _ = compiled(engine)(params, fixed, x, y, mask)
    for k in range(len(params)):
        terms = [
            clip * g[k] / n for g, n, m in zip(brute, expected, mask, strict=True) if m
        ]
        want = sum(terms)
        got = keras.ops.convert_to_numpy(clipped.total[k])
        # Each term is off by at most the norms' relative error (2e-3), so
        # their sum by that much of the sum of their magnitudes: terms that
        # cancel leave a small entry with a larger relative error.
        bound = 2e-3 * sum(np.abs(term) for term in terms) + 1e-6
        assert np.all(np.abs(got - want) <= bound), (got, want, bound)
    assert int(clipped.count) == len(x) - 1
    return plan


def sequential(input_shape, *stack):
    return keras.Sequential([keras.Input(input_shape), *stack])


RNG = np.random.default_rng(0)


def images(shape, n=4):
    return RNG.normal(size=(n, *shape)).astype("float32")


def test_dense_on_vectors_and_on_tokens_both_ghost_branches():
    # Tokens [B, 5, 4] into Dense(3): T² = 25 > 12 per-example matrices;
    # [B, 2, 4] into Dense(8): T² = 4 <= 32, the Gram form.
    model = sequential(
        (5, 4), layers.Dense(3, activation="tanh"), layers.Reshape((3, 5)),
        layers.Dense(2, use_bias=False), layers.Flatten(), layers.Dense(4),
    )  # fmt: skip
    check_norms_and_sum(model, images((5, 4)), ["ghost"] * 3)
    gram = sequential((2, 4), layers.Dense(8, activation="relu"), layers.Flatten())
    check_norms_and_sum(gram, images((2, 4)), ["ghost"])


@pytest.mark.parametrize(
    "conv",
    [
        dict(filters=3, kernel_size=3, strides=2, padding="same"),
        dict(filters=3, kernel_size=(3, 2), strides=(1, 2), padding="valid"),
        dict(filters=2, kernel_size=3, dilation_rate=2, padding="same"),
        dict(
            filters=2, kernel_size=2, dilation_rate=2, padding="valid", use_bias=False
        ),
    ],
    ids=["stride2-same", "rect-valid", "dilated-same", "dilated-valid-nobias"],
)
def test_conv2d_with_strides_padding_and_dilation(conv):
    model = sequential(
        (7, 6, 2), layers.Conv2D(activation="relu", **conv), layers.Flatten()
    )
    check_norms_and_sum(model, images((7, 6, 2)), ["ghost"])


def test_conv2d_gram_branch_few_positions_many_channels():
    # (3, 2, 6) into a 3x3 Conv2D(8): T² = 36 <= 54 · 8, the Gram form (the
    # windows' Gram matrices summed); then stride 2 and dilation-free valid.
    model = sequential(
        (3, 2, 6), layers.Conv2D(8, 3, padding="same", activation="relu"),
        layers.Conv2D(5, (2, 1), strides=(2, 1), padding="valid"), layers.Flatten(),
    )  # fmt: skip
    check_norms_and_sum(model, images((3, 2, 6)), ["ghost", "ghost"])


@pytest.mark.parametrize("padding", ["same", "valid", "causal"])
def test_conv1d_with_dilation_and_causal_padding(padding):
    model = sequential(
        (9, 3), layers.Conv1D(4, 3, dilation_rate=2, padding=padding),
        layers.Conv1D(2, 2, strides=2, padding="valid"), layers.Flatten(),
    )  # fmt: skip
    check_norms_and_sum(model, images((9, 3)), ["ghost", "ghost"])


def test_embedding_with_repeated_tokens():
    model = sequential((6,), layers.Embedding(5, 3), layers.Dense(2), layers.Flatten())
    # Repeated ids within an example add up in one row of the gradient.
    ids = np.array(
        [
            [1, 1, 1, 2, 0, 1],
            [4, 3, 2, 1, 0, 0],
            [2, 2, 2, 2, 2, 2],
            [0, 1, 2, 3, 4, 4],
        ],
        "int32",
    )
    check_norms_and_sum(model, ids, ["ghost", "ghost"])


def test_layer_and_group_normalization_and_einsum_dense():
    model = sequential(
        (5, 4), layers.LayerNormalization(), layers.EinsumDense(
            "abc,cd->abd", output_shape=(None, 6), bias_axes="d"),
        layers.EinsumDense("...b,bc->...c", output_shape=3),
        layers.Reshape((5, 3, 1)), layers.Conv2D(4, 1),
        layers.GroupNormalization(groups=2), layers.Flatten(),
    )  # fmt: skip
    check_norms_and_sum(model, images((5, 4)), ["ghost"] * 5)


class Scale(layers.Layer):
    """A layer without a ghost norm: elementwise weights."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=input_shape[1:], initializer="ones")

    def call(self, x):
        return keras.ops.sin(x * self.w)


def test_a_layer_without_a_ghost_norm_uses_its_own_per_example_gradient():
    model = sequential((3, 2), Scale(), layers.Dense(2), layers.Flatten())
    plan = check_norms_and_sum(model, images((3, 2)), ["vectorized", "ghost"])
    assert plan.mode == "layers"


def test_shared_weights_fall_back_to_whole_model_gradients():
    inputs = keras.Input((4,))
    shared = layers.Dense(4, activation="tanh")
    outputs = layers.Dense(2)(shared(shared(inputs)))
    model = keras.Model(inputs, outputs)
    plan = check_norms_and_sum(model, images((4,)))
    assert plan.mode == "whole_model" and "more than once" in plan.reason
    with pytest.raises(ValueError, match="cannot split this model"):
        plan_gradients(model, images((4,))[:3], "ghost")


def test_whole_model_path_equals_the_ghost_path():
    model = sequential(
        (6, 5, 2), layers.Conv2D(3, 3, strides=2, padding="same"),
        layers.GroupNormalization(groups=3), layers.Flatten(), layers.Dense(3),
    )  # fmt: skip
    x = images((6, 5, 2), n=5)
    y = targets(model, x)
    params, fixed = state(model)
    mask = np.array([1, 1, 0, 1, 1], bool)
    results = []
    for mode in ("ghost", "vectorized"):
        _, engine = engine_for(model, x, mode, clip_norms=(0.05,))
        clipped, _ = compiled(engine)(params, fixed, x, y, mask)
        results.append([keras.ops.convert_to_numpy(t) for t in clipped.total])
    for ghost, whole in zip(*results, strict=True):
        np.testing.assert_allclose(ghost, whole, rtol=2e-4, atol=1e-6)


def test_per_layer_clipping_clips_each_layer_to_its_share():
    model = sequential((4,), layers.Dense(3), layers.Dense(2))
    x = images((4,))
    y = targets(model, x)
    params, fixed = state(model)
    brute = brute_force_gradients(model, x, y)
    c = 1e-3  # Below every layer's norm: each part becomes c · g / ‖g‖.
    for mode in ("auto", "vectorized"):
        _, engine = engine_for(model, x, mode, clip_norms=(c, c))
        assert engine.clip_norm == pytest.approx(c * np.sqrt(2))
        clipped, _ = compiled(engine)(params, fixed, x, y, np.ones(4, bool))
        for k, (first, last) in enumerate([(0, 2), (0, 2), (2, 4), (2, 4)]):
            want = sum(c * g[k] / flat_norm(g[first:last]) for g in brute)
            got = keras.ops.convert_to_numpy(clipped.total[k])
            np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-7)


class DropoutScale(layers.Layer):
    """A layer with a weight and its own randomness inside."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=input_shape[1:], initializer="ones")
        self.dropout = layers.Dropout(0.5)

    def call(self, x, training=None):
        return self.dropout(x * self.w, training=training)


def tied_embedding_model():
    class Tied(keras.Model):
        def __init__(self):
            super().__init__()
            self.embed = layers.Embedding(6, 3)
            self.mix = layers.Dense(3)

        def call(self, ids):
            h = self.mix(self.embed(ids))
            # The embedding matrix is read again outside its layer's call.
            return keras.ops.matmul(h, keras.ops.transpose(self.embed.embeddings))

    model = Tied()
    model(np.zeros((2, 4), "int32"))
    return model


MODELS = {
    "dense": (lambda: sequential((4,), layers.Dense(3, "tanh"), layers.Dense(2)),
              lambda: images((4,), n=6)),
    "conv": (lambda: sequential((6, 6, 2), layers.Conv2D(3, 3, strides=2),
                                layers.GroupNormalization(groups=3), layers.Flatten(),
                                layers.Dense(2)),
             lambda: images((6, 6, 2), n=6)),
    "dropout_in_owner": (lambda: sequential((3, 4), DropoutScale(), layers.Dense(2),
                                            layers.Flatten()),
                         lambda: images((3, 4), n=6)),
    "tied_embedding": (tied_embedding_model,
                       lambda: RNG.integers(0, 6, size=(6, 4)).astype("int32")),
}  # fmt: skip


def removal_distances(model, plan, x, y, per_layer, c=1e-3):
    """How far removing each example moves the clipped sum, in units of C
    (C below every norm: every contribution has norm exactly C)."""
    groups = plan.num_groups if per_layer else 1
    engine = ClippedGradients(
        model, plan, squared_error, [c / np.sqrt(groups)] * groups
    )
    params, fixed = state(model)
    step = compiled(engine)

    def total(mask):
        clipped, _ = step(params, fixed, x, y, mask)
        return np.concatenate(
            [keras.ops.convert_to_numpy(t).ravel() for t in clipped.total]
        )

    full = total(np.ones(len(x), bool))
    distances = []
    for i in range(len(x)):
        mask = np.ones(len(x), bool)
        mask[i] = False
        distances.append(np.linalg.norm(full - total(mask)) / c)
    return np.array(distances)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per_layer"])
def test_removing_one_example_moves_the_clipped_sum_by_at_most_c(name, per_layer):
    build, inputs = MODELS[name]
    keras.utils.set_random_seed(0)
    model, x = build(), inputs()
    y = targets(model, x)
    plan = plan_gradients(model, x[:3], "auto", squared_error, y[:3])
    if name == "tied_embedding":
        assert plan.mode == "whole_model", plan.describe()
    moved = removal_distances(model, plan, x, y, per_layer)
    assert np.all(moved <= 1 + 1e-4), moved
    if not per_layer:
        np.testing.assert_allclose(moved, 1.0, rtol=1e-3)


def test_a_nan_example_adds_nothing_even_on_the_ghost_path():
    model = sequential((4,), layers.Dense(3, "relu"), layers.Dense(2))
    x = images((4,), n=5)
    y = targets(model, x)
    x[0, 1] = np.nan  # A masked-out row (as padding copies of example 0)...
    x[3, 0] = np.inf  # ... and a sampled one.
    mask = np.array([False, True, True, True, True])
    _, engine = engine_for(model, x[1:], clip_norms=(0.1,))
    params, fixed = state(model)
    step = compiled(engine)
    clipped, _ = step(params, fixed, x, y, mask)
    for total in clipped.total:
        assert np.all(np.isfinite(keras.ops.convert_to_numpy(total)))
    assert int(clipped.num_nonfinite) == 1 and int(clipped.count) == 4
    clean = mask.copy()
    clean[3] = False
    expected, _ = step(params, fixed, x, y, clean)
    for got, want in zip(clipped.total, expected.total, strict=True):
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(got), keras.ops.convert_to_numpy(want), rtol=1e-6
        )


def test_partly_frozen_layers_count_only_their_trainable_weights():
    model = sequential((4,), layers.Dense(3, "tanh"), layers.Dense(2))
    for layer in model.layers:
        layer.kernel.trainable = False  # Biases alone (BitFit).
    plan = check_norms_and_sum(model, images((4,)))
    assert plan.methods == ("vectorized", "vectorized")


def test_ids_that_keras_wraps_count_as_the_row_they_read():
    # Embedding reads id −k from row V − k (and casts float ids to int32):
    # −1 and 4, −5 and 0, 2.7 and 2 each read one row of a 5-row table.
    model = sequential((6,), layers.Embedding(5, 3), layers.Dense(2), layers.Flatten())
    ids = np.array(
        [
            [-1, 4, -1, 4, 0, -5],
            [4, 3, 2, 1, 0, 0],
            [-2, 3, -3, 2, -4, 1],
            [-1, -1, 4, 4, 4, -1],
        ],
        "int32",
    )
    check_norms_and_sum(model, ids, ["ghost", "ghost"])
    floats = np.array([[-1.0, 4.0, 2.7, 2.0, -0.5, 0.0]] * 3 + [[1, 2, 3, 4, 0, 1]])
    check_norms_and_sum(model, floats.astype("float32"), ["ghost", "ghost"])


@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per_layer"])
def test_an_example_with_an_id_and_its_negative_alias_moves_the_sum_by_at_most_c(
    per_layer,
):
    keras.utils.set_random_seed(0)
    model = sequential(
        (8,), layers.Embedding(50, 4), layers.GlobalAveragePooling1D(), layers.Dense(2)
    )
    x = RNG.integers(0, 50, size=(5, 8)).astype("int32")
    x[0] = [-1, 49] * 4  # One row of the table, read eight times.
    x[1] = [-50, 0, -7, 43, 5, 5, -45, 5]
    y = targets(model, x)
    # Planned without the self-check: the ghost norms alone are under test.
    plan = plan_gradients(model, x[2:], "auto")
    assert plan.methods == ("ghost", "ghost"), plan.describe()
    moved = removal_distances(model, plan, x, y, per_layer)
    assert np.all(moved <= 1 + 1e-4), moved
