"""User-level clipped sums (`ClippedGradients(examples_per_user=k)`) against
brute force.

A batch is S slots of k rows: a user's real rows first, then padding
(mask false, holding a copy of example 0). The brute force takes each real
example's gradient by autodiff on that example alone, averages each
user's, clips the mean in NumPy (as one vector, or layer by layer) and
sums over users. Every gradient path is covered: each ghost norm (Dense,
Conv2D, Embedding, LayerNormalization, EinsumDense), a layer without one
(its own per-example gradients, summed per user), and whole-model
per-user gradients; on both backends.
"""

import functools

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
from tests.models.test_clipped_gradients import DropoutScale

K = 3
# Examples of each slot's user (0: a slot of padding only). User 0 holds
# three copies of one example: its mean gradient is that example's, which
# a norm that left out the cross-example terms would under-count by √3.
COUNTS = (3, 1, 0, 2, 3)


def squared_error(y_true, y_pred):
    flat = keras.ops.reshape(y_pred, (keras.ops.shape(y_pred)[0], -1))
    return keras.ops.mean(keras.ops.square(flat - y_true), axis=-1)


def compiled(fn):
    return backends.current().compiled(fn)


def sequential(input_shape, *stack):
    return keras.Sequential([keras.Input(input_shape), *stack])


class Scale(layers.Layer):
    """A layer without a ghost norm: elementwise weights. Its weight
    gradient at a zero input is NaN (√|x·w|), as the zeroed padding rows
    it is replayed on give: each user's sum must leave them out."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=input_shape[1:], initializer="ones")

    def call(self, x):
        scaled = x * self.w
        return keras.ops.sin(scaled) + keras.ops.sqrt(keras.ops.abs(scaled))


def embedding_ids(rng, rows):
    ids = rng.integers(0, 5, size=(rows, 3)).astype("int32")
    # User 3's two examples (rows 9 and 10) read row 1 of the table each.
    ids[9], ids[10] = [1, 2, 3], [4, 1, 0]
    return ids


# name: (model, inputs of one row, gradient_method, methods of the plan).
MODELS = {
    "dense": (lambda: sequential((4,), layers.Dense(3, "tanh"), layers.Dense(2)),
              (4,), "auto", ("ghost", "ghost")),
    "conv": (lambda: sequential(
                 (6, 6, 2), layers.Conv2D(2, 3, strides=2, padding="same",
                                          activation="relu"),
                 layers.Flatten(), layers.Dense(2)),
             (6, 6, 2), "auto", ("ghost", "ghost")),
    "embedding": (lambda: sequential((3,), layers.Embedding(5, 3), layers.Flatten(),
                                     layers.Dense(2)),
                  "ids", "auto", ("ghost", "ghost")),
    "norm_einsum": (lambda: sequential(
                        (3, 4), layers.LayerNormalization(),
                        layers.EinsumDense("abc,cd->abd", output_shape=(None, 2),
                                           bias_axes="d"),
                        layers.Flatten()),
                    (3, 4), "auto", ("ghost", "ghost")),
    "fallback": (lambda: sequential((3, 2), Scale(), layers.Dense(2),
                                    layers.Flatten()),
                 (3, 2), "auto", ("vectorized", "ghost")),
    "whole_model": (lambda: sequential((4,), layers.Dense(3, "tanh"),
                                       layers.Dense(2)),
                    (4,), "vectorized", ()),
}  # fmt: skip
FLOAT_MODELS = [name for name in MODELS if MODELS[name][1] != "ids"]


def slot_mask():
    return np.array(
        [j < n for n in COUNTS for j in range(K)], bool
    )  # Real rows first in each slot.


@functools.cache
def case(name):
    """`(model, plan, x, y, mask, brute)` of one model, built once: `brute`
    holds each real row's gradient (a list over trainable variables)."""
    build, shape, mode, methods = MODELS[name]
    keras.utils.set_random_seed(0)
    model = build()
    rng = np.random.default_rng(1)
    rows = K * len(COUNTS)
    if shape == "ids":
        x = embedding_ids(rng, rows)
    else:
        x = rng.normal(size=(rows, *shape)).astype("float32")
    x[1] = x[2] = x[0]  # User 0: three copies of one example.
    mask = slot_mask()
    x[~mask] = x[0]  # Padding rows: copies of example 0.
    out = keras.ops.convert_to_numpy(model(x))
    y = rng.normal(size=(rows, int(np.prod(out.shape[1:])))).astype("float32")
    y[1] = y[2] = y[0]
    y[~mask] = y[0]
    plan = plan_gradients(model, x[:3], mode)
    assert plan.methods == methods, plan.describe()
    return model, plan, x, y, mask, brute_force_gradients(model, x, y, mask)


def state(model):
    return (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
    )


def brute_force_gradients(model, x, y, mask):
    backend = backends.current()
    params, fixed = state(model)

    def gradient(params, x_i, y_i):
        def loss(values):
            out, _ = model.stateless_call(values, fixed, x_i, training=True)
            return keras.ops.sum(per_example_losses(squared_error, y_i, out))

        return backend.value_and_grad(loss)(params)[1]

    gradient = compiled(gradient)
    grads = {}
    for i in np.flatnonzero(mask):
        rows = gradient(params, x[i : i + 1], y[i : i + 1])
        grads[i] = [keras.ops.convert_to_numpy(g).astype("float64") for g in rows]
    return grads


def user_gradients(brute, mask):
    """Each real slot's mean gradient: `{slot: list over variables}`."""
    users = {}
    for slot in range(len(mask) // K):
        rows = [i for i in range(slot * K, slot * K + K) if mask[i]]
        if rows:
            users[slot] = [
                np.mean([brute[i][v] for i in rows], axis=0)
                for v in range(len(brute[rows[0]]))
            ]
    return users


def norm(tensors):
    return np.sqrt(sum(np.sum(t**2) for t in tensors))


def clipped_terms(users, plan, clip_norms):
    """Each user's clipped mean gradient (flat, or per group of the plan)."""
    terms = {}
    for slot, grads in users.items():
        if len(clip_norms) == 1:
            factor = min(1.0, clip_norms[0] / max(norm(grads), 1e-30))
            terms[slot] = [factor * g for g in grads]
            continue
        factors = []
        for group, c in enumerate(clip_norms):
            members = [g for g, j in zip(grads, plan.groups, strict=True) if j == group]
            factors.append(min(1.0, c / max(norm(members), 1e-30)) if members else 1)
        terms[slot] = [factors[j] * g for g, j in zip(grads, plan.groups, strict=True)]
    return terms


def clip_norms_for(plan, c, per_layer):
    return [c / np.sqrt(plan.num_groups)] * plan.num_groups if per_layer else [c]


def engine_for(model, plan, clip_norms):
    return ClippedGradients(model, plan, squared_error, clip_norms, examples_per_user=K)


def numpy_total(clipped):
    return [keras.ops.convert_to_numpy(t).astype("float64") for t in clipped.total]


def assert_total(got, terms, rtol=2e-4):
    for v, value in enumerate(got):
        parts = [term[v] for term in terms.values()]
        want = sum(parts)
        # Each term is off by at most the norms' relative error: their sum
        # by that much of the sum of their magnitudes.
        bound = rtol * sum(np.abs(p) for p in parts) + 1e-6
        assert np.all(np.abs(value - want) <= bound), (v, value, want, bound)


@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per_layer"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_user_norms_and_clipped_sum_equal_brute_force(name, per_layer):
    model, plan, x, y, mask, brute = case(name)
    users = user_gradients(brute, mask)
    expected = np.array([norm(users[s]) if s in users else 0.0 for s in range(5)])
    # A clip norm between the users' norms: some clipped, some not.
    c = float(np.median([norm(g) for g in users.values()]))
    clip_norms = clip_norms_for(plan, c, per_layer)
    engine = engine_for(model, plan, clip_norms)
    params, fixed = state(model)

    def both(params, fixed, x, y, mask):
        return engine(params, fixed, x, y, mask)[0], engine.per_user_norms(
            params, fixed, x, y, mask
        )

    clipped, norms = compiled(both)(params, fixed, x, y, mask)
    norms = keras.ops.convert_to_numpy(norms)
    # Gram-form norms carry a bound on their round-off: never below.
    assert np.all(norms >= expected * (1 - 1e-5) - 1e-7), (norms, expected)
    np.testing.assert_allclose(norms, expected, rtol=2e-4, atol=1e-6)
    assert_total(numpy_total(clipped), clipped_terms(users, plan, clip_norms))
    assert int(clipped.count) == len(users) == 4
    assert int(clipped.num_nonfinite) == 0
    if not per_layer:  # Two of the four users' norms are below the median.
        assert int(clipped.num_within_clip) == 2


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_huge_clip_norm_gives_the_sum_of_the_users_mean_gradients(name):
    model, plan, x, y, mask, brute = case(name)
    users = user_gradients(brute, mask)
    engine = engine_for(model, plan, [1e6])
    params, fixed = state(model)
    clipped, _ = compiled(engine)(params, fixed, x, y, mask)
    assert int(clipped.num_within_clip) == int(clipped.count) == 4
    assert_total(numpy_total(clipped), users, rtol=1e-5)


def removal_distances(model, plan, x, y, mask, clip_norms):
    """How far turning each real user's slot into padding moves the clipped
    sum, in units of C."""
    engine = engine_for(model, plan, clip_norms)
    params, fixed = state(model)
    step = compiled(engine)

    def total(mask):
        clipped, _ = step(params, fixed, x, y, mask)
        return np.concatenate([t.ravel() for t in numpy_total(clipped)])

    full = total(mask)
    moved = []
    for slot, n in enumerate(COUNTS):
        if n:
            without = mask.copy()
            without[slot * K : slot * K + K] = False
            moved.append(np.linalg.norm(full - total(without)) / engine.clip_norm)
    return np.array(moved)


def dropout_case():
    keras.utils.set_random_seed(0)
    model = sequential((3, 4), DropoutScale(), layers.Dense(2), layers.Flatten())
    _, _, x, _, mask, _ = case("norm_einsum")
    y = np.random.default_rng(2).normal(size=(len(x), 6)).astype("float32")
    plan = plan_gradients(model, x[:3])
    assert plan.methods == ("vectorized", "ghost"), plan.describe()
    return model, plan, x, y, mask


@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per_layer"])
@pytest.mark.parametrize("name", [*sorted(MODELS), "dropout_in_owner"])
def test_removing_one_user_moves_the_clipped_sum_by_at_most_c(name, per_layer):
    if name == "dropout_in_owner":  # The same masks for norms and sums.
        model, plan, x, y, mask = dropout_case()
    else:
        model, plan, x, y, mask, _ = case(name)
    # C below every user's norm (every group's): each user's clipped
    # gradient has norm C exactly, and its removal moves the sum by C.
    moved = removal_distances(
        model, plan, x, y, mask, clip_norms_for(plan, 1e-4, per_layer)
    )
    assert np.all(moved <= 1 + 1e-4), moved
    assert np.all(moved >= 0.99), moved


@pytest.mark.parametrize("name", FLOAT_MODELS)
def test_a_nan_in_a_padding_row_changes_nothing_and_in_a_real_row_its_user(name):
    model, plan, x, y, mask, _ = case(name)
    engine = engine_for(model, plan, clip_norms_for(plan, 0.05, False))
    params, fixed = state(model)
    step = compiled(engine)
    reference, _ = step(params, fixed, x, y, mask)
    poisoned = x.copy()
    poisoned[~mask] = np.nan  # Padding rows (and a slot of padding only).
    clipped, _ = step(params, fixed, poisoned, y, mask)
    assert int(clipped.num_nonfinite) == 0 and int(clipped.count) == 4
    for got, want in zip(numpy_total(clipped), numpy_total(reference), strict=True):
        np.testing.assert_array_equal(got, want)
    # A NaN in user 3's second example leaves that user out, whole.
    poisoned = x.copy()
    poisoned[10] = np.nan
    clipped, _ = step(params, fixed, poisoned, y, mask)
    assert int(clipped.num_nonfinite) == 1 and int(clipped.count) == 4
    without = mask.copy()
    without[9:12] = False
    expected, _ = step(params, fixed, x, y, without)
    for got, want in zip(numpy_total(clipped), numpy_total(expected), strict=True):
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("name", ["dense", "whole_model"])
def test_padding_rows_before_a_users_real_rows_change_nothing(name):
    # The sampler puts a user's real rows first; the engine must not rely
    # on it: padding rows that come first and hold NaN add nothing.
    model, plan, x, y, mask, _ = case(name)
    engine = engine_for(model, plan, clip_norms_for(plan, 0.05, False))
    params, fixed = state(model)
    step = compiled(engine)
    reference, _ = step(params, fixed, x, y, mask)
    reverse = (np.arange(len(COUNTS))[:, None] * K + np.arange(K)[::-1]).ravel()
    x, y, mask = x[reverse].copy(), y[reverse], mask[reverse]
    assert not mask[3] and mask[5]  # Slot 1: padding rows before its real row.
    x[~mask] = np.nan
    clipped, _ = step(params, fixed, x, y, mask)
    assert int(clipped.num_nonfinite) == 0 and int(clipped.count) == 4
    for got, want in zip(numpy_total(clipped), numpy_total(reference), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-8)


def test_a_huge_input_in_a_padding_row_changes_nothing():
    model, plan, x, y, mask, _ = case("dense")
    engine = engine_for(model, plan, [0.05])
    params, fixed = state(model)
    step = compiled(engine)
    reference, _ = step(params, fixed, x, y, mask)
    huge = x.copy()
    huge[~mask] = 3e38  # Overflows to inf in the first layer.
    clipped, _ = step(params, fixed, huge, y, mask)
    assert int(clipped.num_nonfinite) == 0
    for got, want in zip(numpy_total(clipped), numpy_total(reference), strict=True):
        np.testing.assert_array_equal(got, want)


def test_bad_examples_per_user_and_batches_that_are_not_whole_slots_are_refused():
    model, plan, x, y, mask, _ = case("dense")
    for bad in (0, -2, 2.5, True, "3"):
        with pytest.raises(ValueError, match="examples_per_user must be"):
            ClippedGradients(model, plan, squared_error, [1.0], bad)
    engine = engine_for(model, plan, [1.0])
    params, fixed = state(model)
    with pytest.raises(ValueError, match=r"got 14 rows.*multiple of 3"):
        engine(params, fixed, x[:14], y[:14], mask[:14])
    with pytest.raises(ValueError, match="per_user_norms needs"):
        ClippedGradients(model, plan, squared_error, [1.0]).per_user_norms(
            params, fixed, x, y, mask
        )
