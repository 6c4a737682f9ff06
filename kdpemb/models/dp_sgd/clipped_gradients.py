"""The clipped sum of per-example gradients of any Keras model.

`clipped_gradient_sum` returns a `kdpemb.privacy.gaussian_sum.ClippedSum`
of the model's per-example gradients (each clipped to C as one vector
over all trainable variables, or layer by layer), computed one of two
ways, chosen once by `plan_gradients`:

- "layers" (ghost clipping): one forward pass taps every layer that owns
  weights (`layer_taps`); one backward pass gives the gradient with
  respect to each tapped output; each layer's per-example squared norms
  come from its input and that gradient (`ghost_norms`, or a vectorised
  per-example gradient of that layer alone); and the clipped sum is one
  vector-Jacobian product per layer, weighted by the clip factors. No
  per-example gradient of the model is ever formed.
- "whole_model": each example's gradient of the whole model
  (`vmap` / `tf.vectorized_map`), clipped and summed. Used when the model
  cannot be split into layer calls: a layer with weights called more than
  once (shared weights), or with more than one input tensor.

Every layer must treat the examples of a batch independently (no
BatchNormalization in training, which `check_backbone` refuses).

With `examples_per_user=k` (user-level DP) a batch is S user slots of k
rows each, a user's real rows first, then padding (`mask` false); each
contribution is one user's gradient, the mean over its n_u <= k real rows
of their per-example gradients, clipped to C. In "layers" mode the loss
weights each real row by 1 / n_u, and each layer's rows regroup into one
contribution per slot (`ghost_norms.ghost_squared_norms(group_size=k)`);
in "whole_model" mode a per-user map takes each slot's gradient.

Example:

>>> import keras, numpy as np
>>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
>>> plan = plan_gradients(model, np.ones((3, 3), "float32"))
>>> plan.mode, plan.methods
('layers', ('ghost',))
"""

import dataclasses
import logging
from typing import NamedTuple

import keras
import numpy as np
from keras import ops

from kdpemb.models._shared import backends, layer_taps
from kdpemb.models.dp_sgd import ghost_norms
from kdpemb.privacy import gaussian_sum

MODES = ("auto", "ghost", "vectorized")
logger = logging.getLogger("kdpemb")


@dataclasses.dataclass(frozen=True)
class GradientPlan:
    """How per-example gradient norms are computed for one model.

    Attributes:
        mode: "layers" (per layer, from taps) or "whole_model".
        owners: the layers with weights, in call order ("layers" mode).
        methods: "ghost" or "vectorized" for each owner.
        groups: for each trainable variable of the model, the index of the
            layer that owns it (per-layer clipping groups).
        reason: why "whole_model" was chosen, or "".
    """

    mode: str
    owners: tuple
    methods: tuple
    groups: tuple
    reason: str = ""

    @property
    def num_groups(self):
        return max(self.groups) + 1 if self.groups else 0

    def describe(self):
        """One line: which layers use which method."""
        if self.mode == "whole_model":
            return (
                f"per-example gradients of the whole model, vectorised ({self.reason})"
            )
        counts = {}
        for layer, method in zip(self.owners, self.methods, strict=True):
            key = (method, type(layer).__name__)
            counts[key] = counts.get(key, 0) + 1
        parts = []
        for method in ("ghost", "vectorized"):
            kinds = [f"{n}× {k}" for (m, k), n in counts.items() if m == method]
            if kinds:
                parts.append(f"{method}: {', '.join(kinds)}")
        return "per-example gradient norms by layer; " + "; ".join(parts)


def _variable_groups(model, owners):
    owner_of = {}
    for index, layer in enumerate(owners):
        for variable in layer_taps.own_trainable_variables(layer):
            owner_of[id(variable)] = index
    return tuple(owner_of.get(id(v)) for v in model.trainable_variables)


def _training(model):
    """`training=True` for a model whose `call` takes it."""
    return {"training": True} if model._call_has_training_arg else {}


def _tapped_pass(model, owners, inputs):
    """The tapped calls of one training-mode forward pass on `inputs`, and
    the losses the layers added (`add_loss`)."""
    trainable = [v.value for v in model.trainable_variables]
    fixed = [v.value for v in model.non_trainable_variables]
    with layer_taps.tap(owners) as calls:
        _, _, losses = model.stateless_call(
            trainable, fixed, inputs, return_losses=True, **_training(model)
        )
    return calls, losses


def _batched(value, rows):
    shape = getattr(value, "shape", None)
    return shape is not None and len(shape) > 0 and shape[0] == rows


def _structure_problem(model, owners, sample_inputs):
    """Why the model cannot be split by layer calls ("" if it can), from
    passes on 3 and on 2 rows, and the calls of the first."""
    passes = []
    # Weight regularizers read no data (DPModel adds their gradients).
    regularized = sum(v.regularizer is not None for v in model.trainable_weights)
    for rows in (3, 2):
        calls, losses = _tapped_pass(model, owners, sample_inputs[:rows])
        if len(losses) > regularized:
            raise ValueError(
                f"Layers of this model add {len(losses) - regularized} loss "
                "term(s) with "
                "add_loss (or an activity regularizer): DPModel clips each "
                "example's gradient of the compiled loss only, and would leave "
                "them out. Remove them, or make them part of the loss."
            )
        passes.append((rows, calls))
    rows, calls = passes[0]
    called = [c.layer for c in calls]
    repeated = sorted({c.layer.name for c in calls if called.count(c.layer) > 1})
    if repeated:
        return f"layers called more than once: {', '.join(repeated)}", calls
    unbatched = sorted(
        {
            c.layer.name
            for rows, pass_calls in passes
            for c in pass_calls
            if not (_batched(c.inputs, rows) and _batched(c.output, rows))
        }
    )
    if unbatched:
        return (
            "layers called on (or returning) a tensor without the batch axis: "
            f"{', '.join(unbatched)}"
        ), calls
    if any(c.other_args for c in calls):
        names = sorted({c.layer.name for c in calls if c.other_args})
        return f"layers called with several tensors: {', '.join(names)}", calls
    owned = [
        id(v) for layer in owners for v in layer_taps.own_trainable_variables(layer)
    ]
    if len(owned) != len(set(owned)):
        return "a variable is tracked by two layers (tied weights)", calls
    return "", calls


def _self_check_problem(model, plan, loss_fn, sample_inputs, sample_targets):
    """Why the by-layer plan cannot be trusted on this model ("" if it can):
    its norms differ from per-example gradients of the whole model, the
    sample gives nothing to compare (every reference norm 0 or not finite),
    or one row's input changes another row's output.

    Both are taken at the current weights plus a fixed perturbation (a
    zero-initialised layer would otherwise hide the layers before it), on
    the same batch and random-seed state, so that dropout and random
    augmentation draw the same masks in both.
    """
    backend = backends.current()
    rng = np.random.default_rng(0)
    params = [
        v.value + ops.cast(0.05 * rng.normal(size=v.shape), v.dtype)
        for v in model.trainable_variables
    ]
    fixed = [v.value for v in model.non_trainable_variables]
    x = ops.convert_to_tensor(sample_inputs)
    y = ops.convert_to_tensor(sample_targets)
    rows = int(ops.shape(x)[0])
    engine = ClippedGradients(model, plan, loss_fn, [1.0])

    def reference_norm(params, fixed, x, y, row):
        # Example `row`'s gradient by plain autodiff of its own loss in the
        # batch: an independent reference (and no vectorised map, which
        # TensorFlow can crash on for some models).
        def loss(values):
            y_pred, _ = model.stateless_call(values, fixed, x, **_training(model))
            losses = per_example_losses(loss_fn, y, y_pred)
            return ops.sum(ops.where(ops.arange(rows) == row, losses, 0.0))

        grads = backend.value_and_grad(loss)(params)[1]
        return gaussian_sum.global_norms([ops.expand_dims(g, 0) for g in grads])[0]

    reference_norm = backend.compiled(reference_norm)
    whole = np.array(
        [
            ops.convert_to_numpy(reference_norm(params, fixed, x, y, row))
            for row in range(rows)
        ]
    )
    if not np.all(np.isfinite(whole)) or not np.any(whole > 0):
        # Nothing to compare (a loss that vanishes or overflows on these
        # targets): a plan that cannot be tested is not trusted.
        return (
            "the self-check's synthetic batch gives no finite, non-zero "
            "gradient to compare the per-layer norms with"
        )
    by_layer = backend.compiled(engine.per_example_norms)(params, fixed, x, y)
    by_layer = ops.convert_to_numpy(by_layer)
    if not np.allclose(by_layer, whole, rtol=1e-3, atol=1e-6 * (1 + whole.max())):
        return (
            "its per-layer norms differ from per-example gradients of the "
            "whole model (weights read outside the layer that owns them, or "
            "examples that interact?)"
        )
    other = np.asarray(ops.convert_to_numpy(x)).copy()
    if np.issubdtype(other.dtype, np.floating):
        other[0] = 2 * other[-1] + 1
    else:  # Indices stay valid.
        other[0] = (other[0] + 1) % 2
    outputs = [
        ops.convert_to_numpy(
            model.stateless_call(params, fixed, inputs, **_training(model))[0]
        )
        for inputs in (x, ops.convert_to_tensor(other))
    ]
    if not np.allclose(outputs[0][1:], outputs[1][1:], rtol=1e-5, atol=1e-6):
        return "one example's input changes another example's output"
    return ""


def plan_gradients(
    model, sample_inputs, mode="auto", loss_fn=None, sample_targets=None
):
    """Decides how to compute per-example gradient norms of `model`, from
    forward passes on `sample_inputs`; see the module docstring.

    With `loss_fn` and `sample_targets`, a by-layer plan is also checked
    against whole-model per-example gradients on the sample, and against
    a model whose examples interact; if either check fails the plan falls
    back to whole-model gradients. Pass synthetic (or public) samples of
    the training data's shape: the plan should not depend on private
    values.

    Args:
        model: a built `keras.Model`.
        sample_inputs: a batch of at least three inputs.
        mode: "auto" (default: by layer where the model allows it),
            "ghost" (by layer, and refuse a layer without a ghost norm) or
            "vectorized" (whole-model per-example gradients).
        loss_fn, sample_targets: optional; see above.

    Returns:
        `GradientPlan`.
    """
    if mode not in MODES:
        raise ValueError(f"gradient_method must be one of {MODES}, got {mode!r}.")
    if int(ops.shape(sample_inputs)[0]) < 3:
        raise ValueError("plan_gradients needs a sample of at least three inputs.")
    owners = layer_taps.weight_owners(model)
    reason, calls = _structure_problem(model, owners, sample_inputs)
    if mode == "vectorized":
        reason = "gradient_method='vectorized'"
    plan = None
    if not reason:
        called = tuple(c.layer for c in calls)
        methods = tuple(ghost_norms.method_of(c) for c in calls)
        if mode == "ghost" and "vectorized" in methods:
            names = [c.layer.name for c, m in zip(calls, methods, strict=True)
                     if m == "vectorized"]  # fmt: skip
            raise ValueError(
                f"gradient_method='ghost': no ghost norm for the layers {names}; "
                "use gradient_method='auto' (a vectorised per-example gradient "
                "of those layers alone)."
            )
        # Layers never called (no gradient) keep a group of their own.
        unused = [layer for layer in owners if layer not in called]
        plan = GradientPlan(
            "layers", called, methods, _variable_groups(model, (*called, *unused))
        )
        if loss_fn is not None:
            reason = _self_check_problem(
                model, plan, loss_fn, sample_inputs[:3], sample_targets[:3]
            )
    if reason and mode == "ghost":
        raise ValueError(
            f"gradient_method='ghost' cannot split this model by layer "
            f"({reason}); use gradient_method='auto' or 'vectorized'."
        )
    if reason:
        return GradientPlan(
            "whole_model", (), (), _variable_groups(model, owners), reason
        )
    return plan


def per_example_losses(loss_fn, y_true, y_pred):
    """`loss_fn(y_true, y_pred)` unreduced, then averaged over all axes but
    the first: one loss per example, `[B]` float32."""
    losses = ops.cast(loss_fn(y_true, y_pred), "float32")
    if len(losses.shape) == 0:
        raise ValueError(
            "The loss returned a scalar: DP-SGD needs one loss per example. "
            "Compile with a Keras loss (a name, a keras.losses.Loss, or a "
            "function returning per-example values)."
        )
    if len(losses.shape) > 1:
        losses = ops.mean(ops.reshape(losses, (ops.shape(losses)[0], -1)), axis=1)
    return losses


class _Taps(NamedTuple):
    calls: list
    grads: list
    squared: list
    per_example: list  # Per-example gradients of "vectorized" layers, or None.
    value_of: object
    new_fixed: list


def _along_rows(factors, tensor):
    return ops.reshape(factors, (-1,) + (1,) * (len(tensor.shape) - 1))


def _weighted_rows(rows, factors):
    """Σᵢ factorsᵢ · rowsᵢ, where a row with factor 0 adds exactly 0."""
    f = _along_rows(factors, rows)
    return ops.sum(ops.where(f > 0, ops.cast(rows, "float32"), 0.0) * f, axis=0)


def _weighted_layer_gradient(call, g, factors, value_of, backend):
    """Σᵢ factorsᵢ · (example i's gradient of the layer's weights), by one
    VJP of the layer replayed on its inputs. Rows with factor 0 get zero
    inputs and a zero cotangent, so that a NaN in them adds exactly 0."""
    f = _along_rows(factors, g)
    cotangent = ops.where(f > 0, ops.cast(g, "float32"), 0.0) * f
    inputs = call.inputs
    keep = _along_rows(factors, inputs) > 0
    inputs = ops.where(keep, inputs, ops.zeros_like(inputs))
    replayed = call._replace(inputs=inputs)
    return ghost_norms.layer_gradient(replayed, cotangent, value_of, backend)


def _is_seed_state(variable):
    return variable.path.endswith("seed_generator_state")


# -- the slot layout of user-level batches (S slots of k rows) -------------


def _slots(tensor, k):
    """`[S·k, ...]` as `[S, k, ...]`."""
    shape = ops.shape(tensor)
    return ops.reshape(tensor, (-1, k, *shape[1:]))


def _user_mask(mask, k):
    """`[S]`: a slot is a user iff any of its rows is real."""
    return ops.any(_slots(ops.cast(mask, "bool"), k), axis=1)


def _row_weights(mask, k):
    """`[S·k]`: 1 / n_u on each real row of a slot with n_u real rows, 0 on
    padding rows: the loss weights that make a slot's gradient its user's
    mean gradient."""
    mask = ops.cast(mask, "bool")
    counts = ops.sum(ops.cast(_slots(mask, k), "float32"), axis=1)
    weights = ops.repeat(1.0 / ops.maximum(counts, 1.0), k, axis=0)
    return ops.where(mask, weights, 0.0)


def _real_rows(tensor, mask):
    """`tensor` with its padding rows (mask false) zeroed, NaN included."""
    keep = _along_rows(ops.cast(mask, "bool"), tensor)
    return ops.where(keep, tensor, ops.zeros_like(tensor))


def _slot_sums(rows, mask, k):
    """Per-slot sums `[S, ...]` of per-row `[S·k, ...]` values; padding
    rows add exactly 0."""
    return ops.sum(_slots(_real_rows(ops.cast(rows, "float32"), mask), k), axis=1)


def _own_rows(tensor, mask, k):
    """`[S, k, ...]`, each padding row replaced by its slot's first real row
    (wherever it stands in the slot): whatever a padding row held, it then
    computes only on its own user's data, and finite where that user's
    rows are. A slot of padding only keeps its first row (masked out)."""
    slots = _slots(tensor, k)
    real = ops.reshape(ops.cast(mask, "bool"), (-1, k))
    first = ops.cast(ops.argmax(ops.cast(real, "int32"), axis=1), "int32")
    rows = ops.arange(ops.shape(real)[0], dtype="int32") * k + first
    first_rows = ops.expand_dims(ops.take(tensor, rows, axis=0), 1)
    keep = ops.reshape(real, (-1, k) + (1,) * (len(slots.shape) - 2))
    return ops.where(keep, slots, first_rows)


class ClippedGradients:
    """Computes `ClippedSum`s of a model's per-example gradients.

    Args:
        model: the `keras.Model` to train.
        plan: its `GradientPlan`.
        loss_fn: `(y_true, y_pred) -> per-example losses`.
        clip_norms: list of floats: one (flat clipping) or one per group of
            the plan (per-layer clipping).
        examples_per_user: None (default: one contribution per example)
            or int k >= 1: batches in the slot layout of the module
            docstring, one contribution per user (its mean gradient).
    """

    def __init__(self, model, plan, loss_fn, clip_norms, examples_per_user=None):
        self.model, self.plan, self.loss_fn = model, plan, loss_fn
        if examples_per_user is not None and (
            isinstance(examples_per_user, bool)
            or not isinstance(examples_per_user, (int, np.integer))
            or examples_per_user < 1
        ):
            raise ValueError(
                f"examples_per_user must be None or an int >= 1, got "
                f"{examples_per_user!r}: the most examples of one user in a "
                "step (each user's slot of rows in a batch)."
            )
        self.examples_per_user = (
            None if examples_per_user is None else int(examples_per_user)
        )
        self.clip_norms = list(clip_norms)
        if len(self.clip_norms) not in (1, plan.num_groups):
            raise ValueError(
                f"Give one clip norm, or one per layer with weights "
                f"({plan.num_groups}); got {len(self.clip_norms)}."
            )
        self.seed_states = [
            i for i, v in enumerate(model.non_trainable_variables) if _is_seed_state(v)
        ]

    @property
    def clip_norm(self):
        """The bound C of one example's whole gradient: (Σ_j C_j²)^½; the
        one clip norm itself where there is one (a float tensor where C is
        model state: adaptive clipping)."""
        if len(self.clip_norms) == 1:
            return self.clip_norms[0]
        return float(np.sqrt(sum(c * c for c in self.clip_norms)))

    def example_losses(self, params, non_trainable, x, y):
        """Each example's loss, `[B]` float32, from a training-mode forward
        pass at these values (the non-trainable ones are not advanced):
        what `DPModel(noised_loss=...)` clips, sums and noises."""
        y_pred, _ = self.model.stateless_call(
            params, non_trainable, x, **_training(self.model)
        )
        return per_example_losses(self.loss_fn, y, y_pred)

    def __call__(self, params, non_trainable, x, y, mask):
        """`(ClippedSum, new non-trainable values)` for one batch.

        Only the random-seed states of the new non-trainable values are
        kept (dropout draws new masks); any other state a training call
        would update from the batch is dropped.
        """
        backend = backends.current()
        self._check_slots(x)
        if self.plan.mode == "layers":
            clipped, new_fixed = self._by_layer(
                backend, params, non_trainable, x, y, mask
            )
        else:
            clipped, new_fixed = self._whole_model(
                backend, params, non_trainable, x, y, mask
            )
        kept = list(non_trainable)
        for index in self.seed_states:
            kept[index] = new_fixed[index]
        return clipped, kept

    def _check_slots(self, x):
        """A user-level batch must be whole slots of k rows."""
        k = self.examples_per_user
        if k is None:
            return
        rows = keras.tree.flatten(x)[0].shape[0]
        if rows is not None and int(rows) % k:
            raise ValueError(
                f"A user-level batch holds whole slots of examples_per_user={k} "
                f"rows, got {rows} rows: build batches with the user sampler "
                f"(DPModel.fit(..., users=...)), or pass a multiple of {k} rows."
            )

    def per_user_norms(self, params, non_trainable, x, y, mask):
        """Each slot's user gradient norm (the mean over its real rows of
        their gradients), `[S]`, unclipped: 0 for a slot of padding only.
        Needs `examples_per_user`; for tests and diagnostics."""
        k = self.examples_per_user
        if k is None:
            raise ValueError(
                "per_user_norms needs ClippedGradients(..., examples_per_user=k); "
                "use per_example_norms at example level."
            )
        self._check_slots(x)
        backend = backends.current()
        if self.plan.mode == "layers":
            taps = self._taps(backend, params, non_trainable, x, y, mask, k)
            return ops.sqrt(sum(taps.squared[1:], taps.squared[0]))
        grads = self._per_user_gradients(backend, params, non_trainable, x, y, mask)
        return ops.where(_user_mask(mask, k), gaussian_sum.global_norms(grads), 0.0)

    # -- by layer --------------------------------------------------------

    def per_example_norms(self, params, non_trainable, x, y):
        """Each example's gradient norm over all trainable variables, `[B]`
        (unclipped; for tests and diagnostics on public data)."""
        backend = backends.current()
        mask = ops.ones((ops.shape(x)[0],), "bool")
        if self.plan.mode == "layers":
            taps = self._taps(backend, params, non_trainable, x, y, mask)
            return ops.sqrt(sum(taps.squared[1:], taps.squared[0]))
        grads = self._per_example_gradients(backend, params, non_trainable, x, y)
        return gaussian_sum.global_norms(grads)

    def _taps(self, backend, params, non_trainable, x, y, mask, group_size=None):
        """One forward and backward pass (`_Taps`): the tapped calls, the
        gradients of their outputs, each layer's per-example squared norms
        (and, for "vectorized" layers, the per-example gradients they come
        from), `value_of` and the new non-trainable values.

        With `group_size` k (user level) each real row's loss is weighted
        by 1 / n_u, padding rows' inputs and output gradients are zeroed,
        and the norms (and "vectorized" gradients) are per slot, `[S]`."""
        model, owners = self.model, self.plan.owners
        mask = ops.cast(mask, "bool")
        weights = None if group_size is None else _row_weights(mask, group_size)
        records = {}

        def run(values, probes):
            with layer_taps.tap(owners, probes) as calls:
                y_pred, new_fixed = model.stateless_call(
                    values, non_trainable, x, **_training(model)
                )
            losses = per_example_losses(self.loss_fn, y, y_pred)
            if weights is not None:
                losses = losses * weights
            records["calls"] = calls
            outputs = [c.output for c in calls]
            inputs = [c.inputs for c in calls]
            # where(), not a product: a NaN loss of a left-out row adds 0.
            total = ops.sum(ops.where(mask, losses, 0.0))
            return total, (outputs, (inputs, new_fixed))

        _, (inputs, new_fixed), grads = backend.output_gradients(run, params)
        calls = [
            layer_taps.TappedCall(c.layer, a, None, False, c.kwargs)
            for c, a in zip(records["calls"], inputs, strict=True)
        ]
        values = {
            id(v): p for v, p in zip(model.trainable_variables, params, strict=True)
        }
        values.update(
            {
                id(v): p
                for v, p in zip(
                    model.non_trainable_variables, non_trainable, strict=True
                )
            }
        )

        def value_of(variable):
            return values.get(id(variable), variable.value)

        if group_size is not None:  # A NaN in a padding row then adds 0.
            calls = [c._replace(inputs=_real_rows(c.inputs, mask)) for c in calls]
            grads = [_real_rows(g, mask) for g in grads]
        squared, per_example = [], []
        for call, g, method in zip(calls, grads, self.plan.methods, strict=True):
            if method == "ghost":
                squared.append(
                    ghost_norms.ghost_squared_norms(call, g, value_of, group_size or 1)
                )
                per_example.append(None)
            else:
                rows = ghost_norms.vectorized_gradients(call, g, value_of, backend)
                if group_size is not None:  # Each user's gradient.
                    rows = [_slot_sums(r, mask, group_size) for r in rows]
                squared.append(ops.square(gaussian_sum.global_norms(rows)))
                per_example.append(rows)
        return _Taps(calls, grads, squared, per_example, value_of, new_fixed)

    def _by_layer(self, backend, params, non_trainable, x, y, mask):
        model, k = self.model, self.examples_per_user
        taps = self._taps(backend, params, non_trainable, x, y, mask, k)
        calls, grads, squared = taps.calls, taps.grads, taps.squared

        real = None if k is None else ops.cast(mask, "bool")

        def to_rows(factors):
            """A contribution's factor on each of its rows (a user's on
            its real rows; its output gradients already carry 1 / n_u)."""
            if k is None:
                return factors
            return ops.where(real, ops.repeat(factors, k, axis=0), 0.0)

        if k is not None:
            mask = _user_mask(mask, k)

        def layer_sums(factors_of_call):
            total = [None] * len(params)
            position = {id(v): i for i, v in enumerate(model.trainable_variables)}
            for call, g, rows, factors in zip(
                calls, grads, taps.per_example, factors_of_call, strict=True
            ):
                if rows is None:
                    sums = _weighted_layer_gradient(
                        call, g, to_rows(factors), taps.value_of, backend
                    )
                else:  # The very gradients whose norms gave the factors.
                    sums = [_weighted_rows(r, factors) for r in rows]
                own = layer_taps.own_trainable_variables(call.layer)
                for variable, value in zip(own, sums, strict=True):
                    total[position[id(variable)]] = ops.cast(value, "float32")
            return [
                ops.zeros(p.shape, "float32") if t is None else t
                for p, t in zip(params, total, strict=True)
            ]

        if len(self.clip_norms) == 1:
            norms = ops.sqrt(sum(squared[1:], squared[0]))
            clipped = gaussian_sum.clipped_sum_from_norms(
                norms, self.clip_norms[0],
                lambda factors: layer_sums([factors] * len(calls)), mask,
            )  # fmt: skip
        else:  # Group i is the i-th call's layer; unused layers add nothing.
            zeros = ops.zeros_like(squared[0])
            group_norms = [ops.sqrt(sq) for sq in squared]
            group_norms += [zeros] * (len(self.clip_norms) - len(calls))
            clipped = gaussian_sum.clipped_sum_from_group_norms(
                group_norms, self.clip_norms,
                lambda factors: layer_sums(factors[: len(calls)]), mask,
            )  # fmt: skip
        return clipped, taps.new_fixed

    # -- whole model -----------------------------------------------------

    def _per_example_gradients(self, backend, params, non_trainable, x, y):
        model = self.model

        def one(x_i, y_i):
            def loss(values):
                y_pred, _ = model.stateless_call(
                    values, non_trainable, ops.expand_dims(x_i, 0), **_training(model)
                )
                losses = per_example_losses(
                    self.loss_fn, ops.expand_dims(y_i, 0), y_pred
                )
                return ops.sum(losses)

            _, grads = backend.value_and_grad(loss)(params)
            return [ops.cast(g, "float32") for g in grads]

        return backend.per_example_map(one, x, y)

    def _per_user_gradients(self, backend, params, non_trainable, x, y, mask):
        """Each slot's gradient of Σ_j w_j loss_j over its k rows (w_j = 1 / n_u
        on real rows, 0 on padding rows, which hold copies of the slot's
        first row): its user's mean gradient, `[S, ...]` per variable."""
        model, k = self.model, self.examples_per_user
        mask = ops.cast(mask, "bool")
        weights = _slots(_row_weights(mask, k), k)
        x = keras.tree.map_structure(lambda t: _own_rows(t, mask, k), x)
        y = keras.tree.map_structure(lambda t: _own_rows(t, mask, k), y)

        def one(x_u, y_u, w_u, m_u):
            def loss(values):
                y_pred, _ = model.stateless_call(
                    values, non_trainable, x_u, **_training(model)
                )
                losses = per_example_losses(self.loss_fn, y_u, y_pred)
                return ops.sum(ops.where(m_u, losses * w_u, 0.0))

            _, grads = backend.value_and_grad(loss)(params)
            return [ops.cast(g, "float32") for g in grads]

        return backend.per_example_map(one, x, y, weights, _slots(mask, k))

    def _whole_model(self, backend, params, non_trainable, x, y, mask):
        model, k = self.model, self.examples_per_user
        if k is None:
            grads = self._per_example_gradients(backend, params, non_trainable, x, y)
        else:
            grads = self._per_user_gradients(backend, params, non_trainable, x, y, mask)
            mask = _user_mask(mask, k)
        if len(self.clip_norms) == 1:
            clipped = gaussian_sum.clip_and_sum(grads, self.clip_norms[0], mask)
        else:
            groups = self.plan.groups

            def group_norm(index):
                members = [g for g, k in zip(grads, groups, strict=True) if k == index]
                if not members:
                    return ops.zeros((ops.shape(grads[0])[0],), "float32")
                return gaussian_sum.global_norms(members)

            def weighted_sum(factors):
                return [
                    _weighted_rows(g, factors[k])
                    for g, k in zip(grads, groups, strict=True)
                ]

            clipped = gaussian_sum.clipped_sum_from_group_norms(
                [group_norm(k) for k in range(len(self.clip_norms))],
                self.clip_norms, weighted_sum, mask,
            )  # fmt: skip
        if not self.seed_states:
            return clipped, non_trainable
        # A plain forward pass advances the random-seed states (dropout).
        _, new_fixed = model.stateless_call(
            params, non_trainable, x, **_training(model)
        )
        return clipped, new_fixed
