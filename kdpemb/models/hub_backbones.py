"""Embedding backbones from keras-hub (and keras-cv) vision backbones.

A keras-hub or keras-cv vision backbone maps images to a feature map
`[batch, H, W, C]` (ResNet, EfficientNet, MobileNet, ...) or to tokens
`[batch, T, D]` (ViT); the CNNs among them use BatchNormalization.
`hub_backbone` turns one into a kdpemb backbone, images in 0-255 to
embeddings `[batch, D]`, that `FedEmbModel` and `DPModel` train: it
replaces (or freezes) the BatchNormalization, rescales the pixels, pools
the features and adds a Dense embedding layer, as `resnet_gn` ends.
keras-hub is needed only to load a preset by name (`pip install
"kdpemb[hub]"`); a backbone object is used as it is.
"""

import keras

from kdpemb._validation import (
    check_bool,
    check_choice,
    check_positive,
    check_positive_int,
    is_real,
)
from kdpemb.models.backbone_checks import check_backbone
from kdpemb.models.batchnorm_replacement import MODES, replace_batchnorm

POOLINGS = ("average", "token")


def hub_backbone(
    backbone,
    embedding_dim=64,
    *,
    pooling=None,
    rescale=None,
    batchnorm="group_norm",
    groups=32,
    normalize=False,
    input_shape=None,
    name=None,
):
    """An embedding backbone from a keras-hub or keras-cv vision backbone.

    The result is a functional `keras.Model`: `Rescaling(rescale)`, the
    backbone with its BatchNormalization replaced by GroupNormalization
    (`replace_batchnorm(backbone, batchnorm, groups)`: the backbone given
    is left unchanged with `"group_norm"`, frozen in place with
    `"freeze"`; one without BatchNormalization, such as a ViT, is used as
    is), pooling, and `Dense(embedding_dim, name="embedding")`.
    `FedEmbModel` and `DPModel` take it as is. Rebuilt, a keras-hub or
    keras-cv backbone becomes a plain functional model with the same
    layers and weights (its class and presets are not kept). Backbones
    whose BatchNormalization sits inside layers of their own (keras-hub's
    MobileNet, EfficientNet's `"fused"` and `"unfused"` blocks) cannot be
    rebuilt: pass `batchnorm="freeze"`, sound only when the statistics
    are public (a pretrained preset's).

    Args:
        backbone: a built `keras.Model` from images `[batch, H, W, C]` to
            a feature map `[batch, h, w, c]` or tokens `[batch, T, d]`
            (`keras_hub.models.ResNetBackbone(...)`, `ViTBackbone(...)`,
            a keras-cv backbone, ...), or a keras-hub preset name, loaded
            with `keras_hub.models.Backbone.from_preset` (a download).
        embedding_dim: int. D. Defaults to 64.
        pooling: `"average"` (over positions or tokens), `"token"` (the
            first token: a ViT's class token) or None: `"token"` for a
            backbone with a class token (`use_class_token`), else
            `"average"`.
        rescale: float multiplying the pixels first, or None: 1/255 (0-255
            pixels to 0-1), or 1 (no rescaling) for a backbone that
            rescales its inputs itself (keras-cv's `include_rescaling`).
        batchnorm: `"group_norm"` (the default) or `"freeze"`, as in
            `replace_batchnorm`.
        groups: int. The most groups per GroupNormalization. Defaults to 32.
        normalize: bool. End with `keras.layers.UnitNormalization`
            (unit-length embeddings). Defaults to False, as `resnet_gn`.
        input_shape: tuple `(H, W, C)`, for a backbone built without a
            fixed image size (keras-hub's default `image_shape=(None,
            None, 3)`). Defaults to the backbone's.
        name: str. The model's name. Defaults to the backbone's name with
            `"_embedding"`.

    Returns:
        A `keras.Model` from images to embeddings `[batch, embedding_dim]`.

    Example:

    >>> import keras_hub
    >>> vit = keras_hub.models.ViTBackbone(
    ...     image_shape=(16, 16, 3), patch_size=4, num_layers=1, num_heads=2,
    ...     hidden_dim=8, mlp_dim=16)
    >>> hub_backbone(vit, embedding_dim=4).output_shape
    (None, 4)
    >>> resnet = keras_hub.models.ResNetBackbone(
    ...     input_conv_filters=[64], input_conv_kernel_sizes=[3],
    ...     stackwise_num_filters=[64, 16], stackwise_num_blocks=[1, 1],
    ...     stackwise_num_strides=[1, 2], block_type="basic_block",
    ...     image_shape=(16, 16, 3))
    >>> model = hub_backbone(resnet, embedding_dim=4, groups=8)
    >>> sorted({type(layer).__name__ for layer in model.layers[2].layers
    ...         if "Normalization" in type(layer).__name__})
    ['GroupNormalization']
    """
    if isinstance(backbone, str):
        backbone = _import_keras_hub().models.Backbone.from_preset(backbone)
    if not isinstance(backbone, keras.Model):
        raise TypeError(
            "backbone must be a keras-hub or keras-cv backbone (a keras.Model) "
            f"or a keras-hub preset name, got {type(backbone).__name__}."
        )
    embedding_dim = check_positive_int(
        embedding_dim, "embedding_dim", "It is D, the width of the embeddings."
    )
    if pooling is not None:
        check_choice(pooling, POOLINGS, "pooling")
    check_choice(batchnorm, MODES, "batchnorm")
    normalize = check_bool(normalize, "normalize")
    if rescale is None:
        rescale = 1.0 if getattr(backbone, "include_rescaling", False) else 1 / 255
    elif not is_real(rescale):
        raise ValueError(
            f"rescale must be a number (1 / 255 for 0-255 pixels, 1 for none) "
            f"or None, got {rescale!r}."
        )
    rescale = check_positive(rescale, "rescale")
    shape = _image_shape(backbone, input_shape)
    pooling = _pooling(backbone, shape, pooling)
    body = replace_batchnorm(backbone, mode=batchnorm, groups=groups)

    inputs = keras.Input(shape)
    x = inputs
    if rescale != 1:
        x = keras.layers.Rescaling(rescale, name="rescaling")(x)
    features = body(x)
    x = _pool(features, pooling)
    x = keras.layers.Dense(embedding_dim, name="embedding")(x)
    if normalize:
        x = keras.layers.UnitNormalization(name="unit_normalization")(x)
    model = keras.Model(inputs, x, name=name or f"{backbone.name}_embedding")
    return check_backbone(model)


def _import_keras_hub():
    try:
        import keras_hub
    except ImportError as error:
        raise ImportError(
            "hub_backbone loads a preset by name with keras-hub, which is not "
            'installed: pip install "kdpemb[hub]". Or build the backbone '
            "yourself (e.g. keras_hub.models.ResNetBackbone(...)) and pass it."
        ) from error
    return keras_hub


def _image_shape(backbone, input_shape):
    if not backbone.built:
        raise ValueError(
            f"The backbone {backbone.name!r} is not built: build it with an "
            "image shape (keras-hub: image_shape=(H, W, 3))."
        )
    own = backbone.input_shape
    if not isinstance(own, tuple) or not all(
        dim is None or isinstance(dim, int) for dim in own
    ):
        raise TypeError(
            f"hub_backbone takes a backbone with one image input, but "
            f"{backbone.name!r} takes {own!r}."
        )
    if len(own) != 4:
        raise ValueError(
            f"The backbone {backbone.name!r} takes inputs of shape {own}; "
            "hub_backbone needs images [batch, H, W, C]."
        )
    if input_shape is None:
        return tuple(own[1:])
    input_shape = tuple(input_shape)
    if len(input_shape) != 3 or not all(
        isinstance(dim, int) and dim >= 1 for dim in input_shape
    ):
        raise ValueError(
            f"input_shape must be (H, W, C) positive ints, got {input_shape!r}."
        )
    for dim, wanted in zip(own[1:], input_shape, strict=True):
        if dim is not None and dim != wanted:
            raise ValueError(
                f"input_shape={input_shape!r} does not match the backbone's "
                f"image shape {own[1:]!r}."
            )
    return input_shape


def _pooling(backbone, image_shape, pooling):
    """The pooling for the backbone's output, or an error naming the fix."""
    output = backbone.compute_output_spec(keras.KerasTensor((None, *image_shape)))
    shape = tuple(output.shape) if isinstance(output, keras.KerasTensor) else None
    if shape is None or len(shape) not in (3, 4):
        raise ValueError(
            f"The backbone {backbone.name!r} gives outputs of shape {shape}; "
            "hub_backbone pools a feature map [batch, h, w, c] or tokens "
            "[batch, T, d]. For a keras-hub task (e.g. an ImageClassifier) "
            "pass its .backbone."
        )
    if len(shape) == 4:
        if pooling == "token":
            raise ValueError(
                "pooling='token' takes the first of a ViT's tokens, but the "
                f"backbone {backbone.name!r} gives a feature map {shape}: use "
                "pooling='average'."
            )
        return "average"
    if pooling is None:
        pooling = "token" if getattr(backbone, "use_class_token", False) else "average"
    return pooling


def _pool(features, pooling):
    if len(features.shape) == 4:
        return keras.layers.GlobalAveragePooling2D(name="pool")(features)
    if pooling == "average":
        return keras.layers.GlobalAveragePooling1D(name="pool")(features)
    tokens = features.shape[1]
    if tokens is None:
        raise ValueError(
            "pooling='token' needs a fixed number of tokens: pass input_shape "
            "(H, W, C) or build the backbone with a fixed image_shape."
        )
    # The first token, by layers that save and load with the model.
    first = keras.layers.Cropping1D((0, tokens - 1), name="first_token")(features)
    return keras.layers.Flatten(name="pool")(first)
