"""Taps on the layers that own trainable weights: their inputs and outputs.

Per-example gradient norms without per-example gradients (ghost
clipping) need, for each layer with weights, its input `a` and the
gradient `g` of the loss with respect to its output. Keras 3 has no
forward hooks, so `tap` swaps each such layer's `call` for one that
records the call (and adds a zero probe to the output, whose gradient is
`g` on JAX) while a forward pass runs, and restores it afterwards.

- `weight_owners(model)`: the layers (the model itself included) that
  own trainable variables directly, not through a sublayer, depth first.
- `tap(layers, probes)`: a context manager that yields the list of
  `TappedCall`s the forward pass appends to, in call order. The built-in
  `activation` of Dense, EinsumDense, Conv1D and Conv2D is applied after
  the tap, so the recorded output is the one the weights act on linearly.

Example:

>>> import keras, numpy as np
>>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2),
...                           keras.layers.ReLU(), keras.layers.Dense(1)])
>>> owners = weight_owners(model)
>>> [type(layer).__name__ for layer in owners]
['Dense', 'Dense']
>>> with tap(owners) as calls:
...     _ = model(np.ones((4, 3), "float32"))
>>> [tuple(call.inputs.shape) for call in calls]
[(4, 3), (4, 2)]
"""

import contextlib
from typing import Any, NamedTuple

import keras


class TappedCall(NamedTuple):
    """One call of a tapped layer during a forward pass.

    Attributes:
        layer: the layer.
        inputs: its first positional argument (None if there was none).
        output: what its `call` returned before its built-in activation
            (and before any probe).
        other_args: True if the call had more positional arguments, or a
            tensor among its keyword arguments (then it cannot be replayed
            on `inputs` alone).
        kwargs: the keyword arguments (`training`, …).
    """

    layer: Any
    inputs: Any
    output: Any
    other_args: bool
    kwargs: dict


def own_trainable_variables(layer):
    """The trainable variables `layer` created itself (not its sublayers')."""
    if not layer.trainable:
        return []
    return [v for v in layer._trainable_variables if v.trainable]


def _sublayers(layer):
    for child in getattr(layer, "_layers", []):
        yield child
        yield from _sublayers(child)


def all_layers(model):
    """`model` and every layer inside it, depth first, each once."""
    layers, seen = [], set()
    for layer in [model, *_sublayers(model)]:
        if id(layer) not in seen:
            seen.add(id(layer))
            layers.append(layer)
    return layers


def weight_owners(model):
    """Layers of `model` (itself included) owning trainable variables, depth
    first, each once."""
    return [layer for layer in all_layers(model) if own_trainable_variables(layer)]


# Layers whose output before their built-in activation is linear in their
# weights (exact types: a subclass may use `activation` otherwise).
LINEAR_BEFORE_ACTIVATION = (
    keras.layers.Dense,
    keras.layers.EinsumDense,
    keras.layers.Conv1D,
    keras.layers.Conv2D,
)


@contextlib.contextmanager
def linear(layer):
    """Runs `layer` without its built-in `activation` if it is one of
    `LINEAR_BEFORE_ACTIVATION`; yields that activation (None otherwise), so
    the caller can apply it: ghost norms need the gradient before it."""
    activation = getattr(layer, "activation", None)
    if type(layer) not in LINEAR_BEFORE_ACTIVATION or not callable(activation):
        yield None
        return
    object.__setattr__(layer, "activation", None)
    try:
        yield activation
    finally:
        object.__setattr__(layer, "activation", activation)


def _is_tensor(value):
    return keras.ops.is_tensor(value) or hasattr(value, "shape")


@contextlib.contextmanager
def tap(layers, probes=None):
    """Records every call of `layers` while the block runs.

    Args:
        layers: the layers to tap (from `weight_owners`).
        probes: list of tensors or None. Added to the outputs of the
            tapped calls, in call order (zeros whose gradient is the
            output's gradient).

    Yields:
        the list of `TappedCall`s, filled as the layers are called.
    """
    calls = []
    originals = {}

    def make_tapped(layer, original):
        def tapped(*args, **kwargs):
            with linear(layer) as activation:
                output = original(*args, **kwargs)
            other = len(args) != 1 or any(_is_tensor(v) for v in kwargs.values())
            inputs = args[0] if args else None
            calls.append(TappedCall(layer, inputs, output, other, dict(kwargs)))
            if probes is not None and len(calls) <= len(probes):
                output = output + probes[len(calls) - 1]
            return output if activation is None else activation(output)

        return tapped

    try:
        for layer in layers:
            if id(layer) in originals:
                continue
            originals[id(layer)] = (layer, layer.__dict__.get("call"))
            object.__setattr__(layer, "call", make_tapped(layer, layer.call))
        yield calls
    finally:
        for layer, previous in originals.values():
            if previous is None:
                del layer.__dict__["call"]
            else:
                object.__setattr__(layer, "call", previous)
