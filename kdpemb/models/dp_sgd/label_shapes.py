"""Labels of the shape the compiled loss reads, checked before `DPModel.fit`.

A cross-entropy given the other label form (one-hot rows to a sparse
loss, class indices to a categorical one) fails deep inside Keras, on the
few synthetic rows the model is built with, naming their shape instead of
the data's. `check` names the data's shape and the two fixes.

Example:

>>> import keras
>>> check((40,), (None, 3), keras.losses.SparseCategoricalCrossentropy())
>>> check((40, 3), (None, 3), keras.losses.SparseCategoricalCrossentropy())
Traceback (most recent call last):
    ...
ValueError: The labels y have shape (40, 3): one-hot rows, ...
"""

import keras

SPARSE = (keras.losses.sparse_categorical_crossentropy,)
CATEGORICAL = (
    keras.losses.categorical_crossentropy,
    keras.losses.categorical_focal_crossentropy,
)


def _kind(loss):
    """ "sparse", "categorical" or None (a loss whose labels are not checked),
    for a loss function or a `keras.losses.Loss` that wraps one."""
    if isinstance(loss, keras.losses.Loss):  # Keras' losses wrap a function.
        loss = getattr(loss, "fn", loss)
    if any(loss is fn for fn in SPARSE):
        return "sparse"
    if any(loss is fn for fn in CATEGORICAL):
        return "categorical"
    return None


def output_shape(network):
    """The shape of the network's (first) output, or None if unknown."""
    try:
        return tuple(network.outputs[0].shape)
    except (AttributeError, IndexError, TypeError, ValueError):
        return None


def _fits(shape, expected):
    """Whether `shape` is `expected`, where None in `expected` is any size."""
    return len(shape) == len(expected) and all(
        want is None or have == want for have, want in zip(shape, expected, strict=True)
    )


def check(label_shape, output_shape, loss):
    """Refuses labels of a shape the cross-entropy `loss` cannot read.

    Args:
        label_shape: tuple. The shape of the labels y (rows first).
        output_shape: tuple. The network's output shape, e.g. (None, K).
        loss: the compiled loss (`keras.losses.get` of it).

    Raises:
        ValueError: naming the labels' shape, the shape the loss takes and
            the two ways out.
    """
    kind = _kind(loss)
    if kind is None or output_shape is None or len(output_shape) < 2:
        return
    rows, per_example = tuple(label_shape[:1]), tuple(label_shape[1:])
    classes = tuple(output_shape[1:-1])
    one_hot = (*classes, output_shape[-1])
    name = type(loss).__name__ if isinstance(loss, keras.losses.Loss) else loss.__name__
    width = output_shape[-1]
    if kind == "sparse":
        if _fits(per_example, classes) or _fits(per_example, (*classes, 1)):
            return
        if _fits(per_example, one_hot):
            raise ValueError(
                f"The labels y have shape {tuple(label_shape)}: one-hot rows, as "
                f"wide as the network's output {tuple(output_shape)}, but the "
                f"loss {name} takes class indices, one per example: shape "
                f"{rows + classes}. Pass integer labels (y.argmax(axis=-1)), or "
                "compile with keras.losses.CategoricalCrossentropy."
            )
        raise ValueError(
            f"The labels y have shape {tuple(label_shape)}, but the loss {name} "
            f"on the network's output {tuple(output_shape)} takes class indices "
            f"of shape {rows + classes}: one integer in [0, {width}) per example."
        )
    if _fits(per_example, one_hot):
        return
    if _fits(per_example, classes) or _fits(per_example, (*classes, 1)):
        raise ValueError(
            f"The labels y have shape {tuple(label_shape)}: class indices, but "
            f"the loss {name} takes one-hot rows as wide as the network's output "
            f"{tuple(output_shape)}: shape {rows + one_hot}. Pass one-hot labels "
            f"(keras.utils.to_categorical(y, {width})), or compile with "
            "keras.losses.SparseCategoricalCrossentropy."
        )
    raise ValueError(
        f"The labels y have shape {tuple(label_shape)}, but the loss {name} on "
        f"the network's output {tuple(output_shape)} takes one-hot rows of shape "
        f"{rows + one_hot}."
    )
