"""Checks that a backbone can be trained privately without leaking state.

A released model includes its non-trainable variables. BatchNormalization
updates its moving mean and variance from every training batch, without
clipping or noise, so a backbone that trains BatchNormalization on private
data releases statistics of that data with no guarantee at all. kdpemb
refuses such a backbone before training, as Opacus' validators do.
`input_shape` and `output_dim` read a built backbone's shapes.
"""

import keras

from kdpemb.errors import UnsupportedLayerError
from kdpemb.models._shared.layer_taps import all_layers


def check_backbone(backbone):
    """Raises `UnsupportedLayerError` if training `backbone` would leak.

    Refused: a trainable `keras.layers.BatchNormalization` anywhere in the
    backbone (nested models included). Allowed: `GroupNormalization`,
    `LayerNormalization`, and BatchNormalization that is frozen
    (`layer.trainable = False`: Keras then normalises with the stored
    statistics and never updates them), which is sound only if those
    statistics came from public data.

    Args:
        backbone: `keras.Model` or `keras.layers.Layer`.

    Returns:
        The backbone, unchanged.

    Example:

    >>> import keras
    >>> ok = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3),
    ...                        keras.layers.GroupNormalization(groups=2)])
    >>> check_backbone(ok) is ok
    True
    >>> bad = keras.Sequential([keras.Input((8, 8, 3)),
    ...                         keras.layers.BatchNormalization(name="bn1")])
    >>> try:
    ...     check_backbone(bad)
    ... except UnsupportedLayerError as error:
    ...     print(str(error)[:56])
    The backbone has 1 trainable BatchNormalization layer(s)
    """
    if not isinstance(backbone, keras.layers.Layer):
        raise TypeError(
            "backbone must be a keras.Model (or layer) mapping images to "
            f"embeddings, got {type(backbone).__name__}."
        )
    offending = [
        layer.name
        for layer in all_layers(backbone)
        if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable
    ]
    if offending:
        names = ", ".join(repr(name) for name in offending[:5])
        more = f" and {len(offending) - 5} more" if len(offending) > 5 else ""
        raise UnsupportedLayerError(
            f"The backbone has {len(offending)} trainable BatchNormalization "
            f"layer(s) ({names}{more}). Their moving statistics would be "
            "updated from private batches without clipping or noise and "
            "released with the model. Replace them with "
            "keras.layers.GroupNormalization (e.g. groups=8 or 32), or, if "
            "their statistics come from public data, freeze them with "
            "layer.trainable = False. kdpemb.models.replace_batchnorm(model) "
            "does the replacement for you (with mode='freeze', the freezing)."
        )
    return backbone


def input_shape(backbone):
    """The built `backbone`'s input shape, or a clear error."""
    shape = getattr(backbone, "input_shape", None)
    if shape is None:
        raise ValueError(
            "The backbone must be built with a known input shape: create it "
            "with keras.Input(shape=...) or call backbone.build(...)."
        )
    return shape


def output_dim(backbone):
    """D, the width of the built `backbone`'s embeddings `[batch, D]`."""
    if not backbone.built:
        raise ValueError(
            f"The backbone {backbone.name!r} is not built: create it with "
            "keras.Input(shape=...) or call backbone.build(input_shape) first."
        )
    try:
        shape = backbone.output_shape
    except (AttributeError, ValueError):
        spec = backbone.compute_output_spec(
            keras.KerasTensor(input_shape(backbone), dtype="float32")
        )
        shape = spec.shape
    if len(shape) != 2 or shape[-1] is None:
        raise ValueError(
            f"The backbone must map images to embeddings [batch, D]; its output "
            f"shape is {shape}. End it with pooling or Flatten and a Dense layer."
        )
    return int(shape[-1])
