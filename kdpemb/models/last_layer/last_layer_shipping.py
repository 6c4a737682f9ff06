"""The model to ship: a backbone and a private head, in plain Keras.

`LastLayerDPClassifier.stack_on(backbone)` builds it here: the backbone,
the feature clipping written with Keras ops (no kdpemb layer) and a copy
of the head's `Dense` layer. Its `.keras` file names built-in Keras
classes and ops only, so `keras.saving.load_model` loads it (safe mode
on) in a process without kdpemb.

Example:

>>> import keras
>>> import numpy as np
>>> backbone = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
>>> head = keras.layers.Dense(4)
>>> head.build((None, 2))
>>> model = stack(backbone, head, feature_clip_norm=1.0)
>>> model.predict(np.ones((5, 3)), verbose=0).shape
(5, 4)
"""

import keras
from keras import ops


def clip_to_norm(features, clip_norm):
    """`features` (cast to float32) scaled to L2 norm at most `clip_norm`
    along the last axis; on tensors, or on a functional model's symbolic
    ones (the ops then become part of the model).

    Example:

    >>> import numpy as np
    >>> clipped = clip_to_norm(np.array([[3.0, 4.0], [0.3, 0.4]]), 1.0)
    >>> ops.convert_to_numpy(clipped).astype("float64").round(3).tolist()
    [[0.6, 0.8], [0.3, 0.4]]
    """
    features = ops.cast(features, "float32")
    norms = ops.sqrt(ops.sum(ops.square(features), axis=-1, keepdims=True))
    return features * ops.minimum(1.0, clip_norm / ops.maximum(norms, 1e-30))


def _single_shape(model, which):
    """`model.input_shape` or `output_shape`, refused unless one tensor's."""
    try:
        shape = getattr(model, f"{which}_shape")
    except (AttributeError, ValueError):
        shape = None
    if not isinstance(shape, tuple) or not all(
        dim is None or isinstance(dim, int) for dim in shape
    ):
        raise ValueError(
            f"stack_on needs a backbone with one {which} tensor, built "
            "(a keras.Model or Sequential that starts with keras.Input); "
            f"got {getattr(model, 'name', model)!r} with {which} shape {shape!r}."
        )
    return shape


def stack(backbone, head, feature_clip_norm, name=None):
    """`backbone`, features clipped to `feature_clip_norm` (None: not
    clipped) and a copy of the built `Dense` layer `head`: a functional
    `keras.Model` of built-in Keras layers and ops only.

    Raises:
        ValueError: if the backbone has several inputs or outputs, or its
            features are not as wide as the head's input.
    """
    input_shape = _single_shape(backbone, "input")
    output_shape = _single_shape(backbone, "output")
    width = int(head.kernel.shape[0])
    if len(output_shape) != 2 or output_shape[-1] != width:
        raise ValueError(
            f"The backbone {backbone.name!r} gives features of shape "
            f"{output_shape}, but this head was fitted on {width}-dimensional "
            f"features (shape (None, {width})): stack it on the backbone whose "
            "features it was fitted on, or fit a new head on this backbone's "
            "features."
        )
    given = getattr(backbone, "inputs", None) or [None]
    inputs = keras.Input(input_shape[1:], dtype=getattr(given[0], "dtype", None))
    features = backbone(inputs)
    if feature_clip_norm is not None:
        features = clip_to_norm(features, float(feature_clip_norm))
    copy = keras.layers.Dense.from_config(head.get_config())
    outputs = copy(features)
    copy.set_weights(head.get_weights())
    return keras.Model(inputs, outputs, name=name or f"{backbone.name}_dp_head")
