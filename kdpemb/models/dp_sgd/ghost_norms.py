"""Per-example gradient norms of one layer, from its input and output gradient.

For a layer whose output is linear in its weights, example i's weight
gradient is a function of the layer's input `a_i` and of the gradient
`g_i` of the loss with respect to the layer's output (before its
activation). Its squared L2 norm follows without forming the gradient
(ghost clipping):

- Dense, Conv1D/2D (after unfolding the input into patches): with T
  positions (tokens, pixels), `‖Σ_t a_t g_tᵀ‖²` is `Σ_{t,s} (a_t·a_s)(g_t·g_s)`
  (cost T² per example) or the squared norm of the `[d_in, d_out]`
  per-example gradient (cost T · d_in · d_out); the cheaper is used. The
  bias adds `‖Σ_t g_t‖²`.
- EinsumDense: the per-example kernel gradient, one `einsum`.
- Embedding: `Σ_{t,s} [row_t = row_s] (g_t·g_s)` (tokens that read the
  same row add up; the row of id −k is V − k, as Keras reads it).
- LayerNormalization, GroupNormalization: `γ` and `β` scale and shift the
  normalised input x̂ element-wise, so their per-example gradients are
  `Σ x̂ ⊙ g` and `Σ g` over the positions they are shared by.

With `group_size=k`, `ghost_squared_norms` gives the squared norm of each
group of k consecutive rows' summed gradient (one user's examples, at user
level): the group's rows are regrouped as positions of one contribution.

Any other layer with weights goes through `vectorized_gradients`: the
per-example gradient of that layer alone (`vmap` on JAX,
`tf.vectorized_map` on TensorFlow). `method_of(call)` says which applies.

Example:

>>> import keras, numpy as np
>>> layer = keras.layers.Dense(2)
>>> layer.build((None, 3))
>>> a = np.array([[1.0, 2.0, 2.0]], "float32")  # ‖a‖² = 9
>>> g = np.array([[3.0, 4.0]], "float32")       # ‖g‖² = 25
>>> call = layer_taps.TappedCall(layer, a, None, False, {})
>>> round(float(ghost_squared_norms(call, g)[0]), 3)  # 9 · 25 + 25 (bias)
250.0
"""

import string

import keras
from keras import ops

from kdpemb.models._shared import layer_taps

_NORMALIZATIONS = (keras.layers.LayerNormalization, keras.layers.GroupNormalization)


def method_of(call):
    """ "ghost" if `ghost_squared_norms` covers the layer of `call` (a
    `layer_taps.TappedCall`), else "vectorized"."""
    layer = call.layer
    if getattr(layer, "quantization_mode", None) is not None or getattr(
        layer, "lora_enabled", False
    ):
        return "vectorized"
    # The formulas cover all of a layer's weights: with some frozen (e.g.
    # biases trained alone), they would count the frozen ones too.
    if len(layer_taps.own_trainable_variables(layer)) != len(
        layer._trainable_variables
    ):
        return "vectorized"
    kind = type(layer)
    if kind in (keras.layers.Dense, keras.layers.EinsumDense, keras.layers.Embedding):
        return "ghost"
    if kind in (keras.layers.Conv1D, keras.layers.Conv2D):
        plain = layer.groups == 1 and layer.data_format == "channels_last"
        return "ghost" if plain else "vectorized"
    if kind in _NORMALIZATIONS:
        rank = len(call.inputs.shape)
        return "ghost" if _trailing_axes(layer.axis, rank) else "vectorized"
    return "vectorized"


def _trailing_axes(axis, rank):
    """Whether the normalisation axes are the last ones (where γ and β
    broadcast without a reshape)."""
    axes = sorted(
        a % rank for a in (axis if isinstance(axis, (list, tuple)) else [axis])
    )
    return axes == list(range(rank - len(axes), rank))


def _f32(x):
    return ops.cast(x, "float32")


def _positions(x):
    """`[B, ..., d]` as `[B, T, d]`."""
    shape = ops.shape(x)
    return ops.reshape(x, (shape[0], -1, shape[-1]))


def _grouped(x, size):
    """`[S·size, ...]` as `[S, size, ...]`: the rows of one group (one
    user's examples) become positions of one contribution. `x` itself for
    size 1."""
    if size == 1:
        return x
    shape = ops.shape(x)
    return ops.reshape(x, (-1, size, *shape[1:]))


def _group_sums(t, size):
    """`[S·size, n]` summed over each group of `size` rows: `[S, n]`."""
    if size == 1:
        return t
    return ops.sum(ops.reshape(t, (-1, size, ops.shape(t)[-1])), axis=1)


def _static_positions(x):
    count = 1
    for size in x.shape[1:-1]:
        if size is None:
            return None
        count *= int(size)
    return count


_EPS32 = 2.0**-24  # float32's unit round-off.


def _gram_rounding_bound(a_norms, g_norms, length):
    """An upper bound on the float32 round-off of a Gram-form squared norm.

    Σ_{t,s} (a_t·a_s)(g_t·g_s) adds T² products of dot products of length
    p and q; each computed term is off by at most about (p + q + T²) · u
    times |a_t||a_s||g_t||g_s|, and those sum to (Σ_t |a_t||g_t|)². Adding
    the bound makes the computed norm an upper bound: cancellation in the
    sum can then never make an example's clip factor too large (its
    contribution above C). For T² ≤ p·q it costs at most about T(p + q + T²)u
    of the squared norm (under 1% for 64 tokens of width 128).

    Args:
        a_norms, g_norms: `[B, T]` norms of each position's input and output
            gradient.
        length: p + q + T², the number of rounded operations per term.
    """
    return length * _EPS32 * ops.square(ops.sum(a_norms * g_norms, axis=1))


def _row_norms(x):
    return ops.sqrt(ops.sum(ops.square(x), axis=-1))


def outer_sum_squared_norms(a, g):
    """`‖Σ_t a_t g_tᵀ‖²_F` per example, for `a` `[B, ..., p]`, `g` `[B, ..., q]`."""
    positions = _static_positions(a)
    a, g = _positions(_f32(a)), _positions(_f32(g))
    p, q = a.shape[-1], g.shape[-1]
    if positions is not None and positions * positions <= p * q:
        gram_a = ops.einsum("btp,bsp->bts", a, a)
        gram_g = ops.einsum("btq,bsq->bts", g, g)
        squared = ops.maximum(ops.sum(gram_a * gram_g, axis=(1, 2)), 0.0)
        length = p + q + positions * positions
        return squared + _gram_rounding_bound(_row_norms(a), _row_norms(g), length)
    per_example = ops.einsum("btp,btq->bpq", a, g)
    return ops.sum(ops.square(per_example), axis=(1, 2))


def _position_sum_squared_norms(g):
    """`‖Σ_t g_t‖²` per example, for `g` `[B, ..., q]`."""
    return ops.sum(ops.square(ops.sum(_positions(_f32(g)), axis=1)), axis=-1)


def _reduce_to(t, shape):
    """Example i's gradient of a parameter of `shape` broadcast over `t[i]`
    (aligned to the trailing axes), flattened: `[B, prod(shape)]`."""
    rank = len(t.shape)
    keep = len(shape)
    axes = list(range(1, rank - keep))
    axes += [rank - keep + k for k, size in enumerate(shape) if size == 1]
    if axes:
        t = ops.sum(t, axis=axes, keepdims=True)
    return ops.reshape(t, (ops.shape(t)[0], -1))


def _squared(t):
    return ops.sum(ops.square(t), axis=-1)


def _dense(layer, a, g, size=1):
    a, g = _grouped(a, size), _grouped(g, size)
    norms = outer_sum_squared_norms(a, g)
    if layer.use_bias:
        norms = norms + _position_sum_squared_norms(g)
    return norms


def _einsum_dense(layer, a, g, size=1):
    inputs, rest = layer.equation.split(",")
    kernel, outputs = rest.split("->")
    if "..." in inputs or "..." in outputs:
        free = [c for c in string.ascii_letters if c not in layer.equation]
        extra = len(a.shape) - (len(inputs) - 3)
        fill = "".join(free[:extra])
        inputs, outputs = inputs.replace("...", fill), outputs.replace("...", fill)
    batch = inputs[0]
    per_example = ops.einsum(f"{inputs},{outputs}->{batch}{kernel}", _f32(a), _f32(g))
    per_example = ops.reshape(per_example, (ops.shape(per_example)[0], -1))
    norms = ops.sum(ops.square(_group_sums(per_example, size)), axis=1)
    if layer.bias is not None:
        bias = _reduce_to(_f32(g), tuple(layer.bias.shape))
        norms = norms + _squared(_group_sums(bias, size))
    return norms


def _windows(a, size, strides, dilation, padding):
    """The kh·kw shifted views `[B, H', W', C]` of `a` `[B, H, W, C]` that a
    Conv2D's kernel rows and columns multiply, in the kernel's order:
    together (concatenated along channels) the input unfolded into
    patches. Strided slices of the padded input: `ops.image.extract_patches`
    convolves with a `[kh·kw·C]²` identity kernel, kh·kw·C times the work
    of the layer itself (left only for a dynamic spatial shape)."""
    spatial = tuple(a.shape[1:3])
    if None in spatial:
        return [
            ops.image.extract_patches(
                a, size, strides=strides, dilation_rate=dilation,
                padding=padding, data_format="channels_last",
            )
        ]  # fmt: skip
    if padding == "same":  # As TensorFlow and XLA pad: the extra one after.
        pads = []
        for n, k, s, d in zip(spatial, size, strides, dilation, strict=True):
            total = max((-(-n // s) - 1) * s + (k - 1) * d + 1 - n, 0)
            pads.append([total // 2, total - total // 2])
        a = ops.pad(a, [[0, 0], *pads, [0, 0]])
        spatial = tuple(a.shape[1:3])
    (kh, kw), (sh, sw), (dh, dw) = size, strides, dilation
    out_h = (spatial[0] - (kh - 1) * dh - 1) // sh + 1
    out_w = (spatial[1] - (kw - 1) * dw - 1) // sw + 1
    return [
        a[:, i * dh : i * dh + (out_h - 1) * sh + 1 : sh,
          j * dw : j * dw + (out_w - 1) * sw + 1 : sw, :]
        for i in range(kh)
        for j in range(kw)
    ]  # fmt: skip


def _windowed_squared_norms(windows, g):
    """`outer_sum_squared_norms` of the windows concatenated along their
    last axis, without concatenating them: the per-example gradient is one
    block per window (its squared norm the sum of theirs), and the Gram
    matrix of the concatenation the sum of the windows' Gram matrices."""
    positions = _static_positions(g)
    g = _positions(_f32(g))
    windows = [_positions(_f32(w)) for w in windows]
    p, q = sum(w.shape[-1] for w in windows), g.shape[-1]
    if positions is not None and positions * positions <= p * q:
        gram_a = sum(ops.einsum("btp,bsp->bts", w, w) for w in windows)
        gram_g = ops.einsum("btq,bsq->bts", g, g)
        squared = ops.maximum(ops.sum(gram_a * gram_g, axis=(1, 2)), 0.0)
        a_norms = ops.sqrt(sum(ops.sum(ops.square(w), axis=-1) for w in windows))
        length = p + q + positions * positions + len(windows)
        return squared + _gram_rounding_bound(a_norms, _row_norms(g), length)
    return sum(
        ops.sum(ops.square(ops.einsum("btp,btq->bpq", w, g)), axis=(1, 2))
        for w in windows
    )


def _conv(layer, a, g, group_size=1):
    # Windows per example (shifted views of its own image), then grouped.
    a, g = _f32(a), _f32(g)
    if layer.data_format == "channels_first":
        order = [0, *range(2, layer.rank + 2), 1]
        a, g = ops.transpose(a, order), ops.transpose(g, order)
    size, strides = tuple(layer.kernel_size), tuple(layer.strides)
    dilation, padding = tuple(layer.dilation_rate), layer.padding
    if layer.rank == 1:
        if padding == "causal":
            a = ops.pad(a, [[0, 0], [dilation[0] * (size[0] - 1), 0], [0, 0]])
            padding = "valid"
        a, g = ops.expand_dims(a, 1), ops.expand_dims(g, 1)
        size, strides, dilation = (1, *size), (1, *strides), (1, *dilation)
    windows = _windows(a, size, strides, dilation, padding)
    windows = [_grouped(w, group_size) for w in windows]
    g = _grouped(g, group_size)
    norms = _windowed_squared_norms(windows, g)
    if layer.use_bias:
        norms = norms + _position_sum_squared_norms(g)
    return norms


def embedding_rows(layer, ids):
    """The rows of `layer`'s table that `ids` read, as Keras' Embedding reads
    them: ids of a dtype other than int32/int64 cast to int32 (truncated
    towards zero), then id −k (1 ≤ k ≤ V) read row V − k (`ops.take` wraps
    negative indices on both backends). Ids outside [−V, V) read no row
    (TensorFlow refuses them on the CPU; JAX gives NaN, which leaves the
    example out); mapped here they stay outside [0, V), apart from every
    row, so they can only add to an example's norm, never hide a repeat.

    Comparing raw ids would count −1 and V − 1 as two rows: the norm of
    their summed gradient would be under-counted, and one example could
    move the clipped sum by up to √2 · C.
    """
    ids = ops.convert_to_tensor(ids)
    if keras.backend.standardize_dtype(ids.dtype) not in ("int32", "int64"):
        ids = ops.cast(ids, "int32")
    rows = int(layer.embeddings.shape[0])
    return ops.where(ids < 0, ids + ops.cast(rows, ids.dtype), ids)


def _embedding(layer, ids, g, size=1):
    rows = _grouped(embedding_rows(layer, ids), size)
    ids = ops.reshape(rows, (ops.shape(rows)[0], -1))
    g = _positions(_f32(_grouped(g, size)))
    same = ops.cast(ops.expand_dims(ids, 2) == ops.expand_dims(ids, 1), "float32")
    squared = ops.sum(same * ops.einsum("btd,bsd->bts", g, g), axis=(1, 2))
    squared = ops.maximum(squared, 0.0)
    positions = ops.shape(g)[1]
    length = ops.cast(g.shape[-1] + positions * positions, "float32")
    return squared + _gram_rounding_bound(1.0, _row_norms(g), length)


def _normalization(layer, a, g, kwargs, value_of, size=1):
    # x̂: the layer with γ = 1 and β = 0.
    unit = [
        ops.ones(v.shape, v.dtype) if v is layer.gamma else ops.zeros(v.shape, v.dtype)
        for v in layer.trainable_variables
    ]
    fixed = [value_of(v) for v in layer.non_trainable_variables]
    normalized, _ = layer.stateless_call(unit, fixed, a, **kwargs)
    g = _f32(g)
    norms = 0.0
    if layer.gamma is not None and layer.gamma.trainable:
        scaled = _grouped(_f32(normalized) * g, size)
        norms += _squared(_reduce_to(scaled, tuple(layer.gamma.shape)))
    if layer.beta is not None and layer.beta.trainable:
        norms += _squared(_reduce_to(_grouped(g, size), tuple(layer.beta.shape)))
    return norms


def ghost_squared_norms(call, g, value_of=None, group_size=1):
    """Per-example squared gradient norms `[B]` of `call.layer`'s trainable
    weights, for a layer `method_of` calls "ghost"; with `group_size` k,
    those of each group of k consecutive rows' summed gradient, `[B / k]`
    (one user's examples: the k rows' positions are positions of one
    contribution, and the Gram form's round-off bound counts all k·T).

    Args:
        call: `layer_taps.TappedCall` of the layer's one call.
        g: the gradient of the loss with respect to its output (before
            its activation), `[B, ...]`.
        value_of: `variable -> current value` (for the normalisations'
            other variables); defaults to `variable.value`.
        group_size: int k >= 1 dividing B (default 1: per example). Rows
            left out of a group's sum must hold zeros in `call.inputs` and
            `g` (zero them with `ops.where`: NaN · 0 is NaN).

    Example (two examples of one user: their gradients add up first):

    >>> import keras, numpy as np
    >>> layer = keras.layers.Dense(1, use_bias=False)
    >>> layer.build((None, 1))
    >>> call = layer_taps.TappedCall(layer, np.ones((2, 1), "float32"), None,
    ...                              False, {})
    >>> g = np.array([[1.0], [2.0]], "float32")
    >>> [round(float(v), 3) for v in ghost_squared_norms(call, g)]
    [1.0, 4.0]
    >>> [round(float(v), 3) for v in ghost_squared_norms(call, g, group_size=2)]
    [9.0]
    """
    layer, a = call.layer, call.inputs
    value_of = value_of or (lambda v: v.value)
    kind = type(layer)
    size = int(group_size)
    if size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}.")
    if kind is keras.layers.Dense:
        return _dense(layer, a, g, size)
    if kind is keras.layers.EinsumDense:
        return _einsum_dense(layer, a, g, size)
    if kind in (keras.layers.Conv1D, keras.layers.Conv2D):
        return _conv(layer, a, g, size)
    if kind is keras.layers.Embedding:
        return _embedding(layer, a, g, size)
    if kind in _NORMALIZATIONS:
        return _normalization(layer, a, g, call.kwargs, value_of, size)
    raise TypeError(f"No ghost norm for {kind.__name__}; use vectorized_gradients.")


def replay(layer, own_values, inputs, kwargs, value_of):
    """`layer`'s output (before its activation) on `inputs`, with its own
    trainable variables set to `own_values` and every other variable to
    `value_of(variable)`."""
    own = layer_taps.own_trainable_variables(layer)
    substitute = {id(v): value for v, value in zip(own, own_values, strict=True)}
    trainable = [substitute.get(id(v)) for v in layer.trainable_variables]
    trainable = [
        value_of(v) if value is None else value
        for v, value in zip(layer.trainable_variables, trainable, strict=True)
    ]
    fixed = [value_of(v) for v in layer.non_trainable_variables]
    with layer_taps.linear(layer):
        output, _ = layer.stateless_call(trainable, fixed, inputs, **kwargs)
    return output


def layer_gradient(call, cotangent, value_of, backend):
    """Σᵢ of the per-example gradients of `call.layer`'s own trainable
    variables, each weighted by the rows of `cotangent` (`factorᵢ · gᵢ`):
    one vector-Jacobian product of the layer alone."""
    own = layer_taps.own_trainable_variables(call.layer)

    def output_of(values):
        return replay(call.layer, values, call.inputs, call.kwargs, value_of)

    return backend.vjp(output_of, [value_of(v) for v in own], cotangent)


def vectorized_gradients(call, g, value_of, backend):
    """Each example's gradient of `call.layer`'s own trainable weights (a
    list, one `[B, ...]` tensor per variable): the layer replayed on one
    example at a time, vectorised. For layers without a ghost norm; the
    caller clips and sums these very tensors, so the norm that sets an
    example's clip factor is that of the gradient it contributes."""
    own = layer_taps.own_trainable_variables(call.layer)
    own_values = [value_of(v) for v in own]

    def one(inputs, grad):
        def weighted(values):
            output = replay(
                call.layer, values, ops.expand_dims(inputs, 0), call.kwargs, value_of
            )
            return ops.sum(_f32(output) * ops.expand_dims(_f32(grad), 0))

        _, grads = backend.value_and_grad(weighted)(own_values)
        return [_f32(gr) for gr in grads]

    return backend.per_example_map(one, call.inputs, g)
