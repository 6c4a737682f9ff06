"""Small embedding backbones for tests, examples and benchmarks.

Any `keras.Model` from images to `[batch, D]` embeddings is a backbone;
these are small ones that train privately out of the box: they rescale
0-255 pixels themselves and use GroupNormalization, never BatchNorm.
"""

import keras


def small_cnn(input_shape, embedding_dim=64, width=32, groups=8, name="small_cnn"):
    """A 3-block CNN: Rescaling, then (Conv 3×3, GroupNorm, ReLU, pool) × 3,
    global average pooling and a Dense embedding layer.

    Args:
        input_shape: tuple `(H, W, C)`.
        embedding_dim: int. D. Defaults to 64.
        width: int. Filters of the first block (doubled in the next two).
            Defaults to 32.
        groups: int. GroupNormalization groups; must divide `width`.
            Defaults to 8.
        name: str. The model's name.

    Example:

    >>> backbone = small_cnn((32, 32, 3), embedding_dim=16, width=8, groups=4)
    >>> backbone.output_shape
    (None, 16)
    """
    if width % groups:
        raise ValueError(f"groups={groups} must divide width={width}.")
    layers = [keras.Input(tuple(input_shape)), keras.layers.Rescaling(1 / 255)]
    for block, filters in enumerate((width, 2 * width, 4 * width)):
        layers += [
            keras.layers.Conv2D(filters, 3, padding="same", name=f"conv{block}"),
            keras.layers.GroupNormalization(groups=groups, name=f"norm{block}"),
            keras.layers.Activation("relu"),
        ]
        if block < 2:
            layers.append(keras.layers.MaxPooling2D(2))
    layers += [
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(embedding_dim, name="embedding"),
    ]
    return keras.Sequential(layers, name=name)


def resnet_gn(
    input_shape,
    embedding_dim=64,
    width=32,
    groups=8,
    blocks=(1, 1, 1),
    pooling="depthwise",
    name="resnet_gn",
):
    """A small residual network with GroupNorm: the default backbone.

    Rescaling, a 3×3 stem convolution, then three stages of residual
    blocks (two 3×3 convolutions with GroupNorm, added to the block's
    input) of `width`, `2 * width` and `4 * width` filters; the first
    block of the second and third stages halves the resolution (stride 2,
    with a 1×1 convolution on the shortcut). Global average pooling and a
    Dense embedding layer end it. No BatchNorm, so it trains privately and
    federatedly as is. At `width=32` it has about 0.3 M parameters; at the
    default it trains at 32×32 on a CPU in minutes (see docs/fedemb.md).

    Args:
        input_shape: tuple `(H, W, C)`.
        embedding_dim: int. D. Defaults to 64.
        width: int. Filters of the first stage (doubled in each next one).
            Defaults to 32.
        groups: int. GroupNormalization groups; must divide `width`.
            Defaults to 8.
        blocks: tuple of 3 ints. Residual blocks per stage, each at least
            1. Defaults to `(1, 1, 1)`.
        name: str. The model's name.

    Example:

    >>> backbone = resnet_gn((32, 32, 3), embedding_dim=16, width=8, groups=4)
    >>> backbone.output_shape
    (None, 16)
    """
    if width % groups:
        raise ValueError(
            f"groups={groups} must divide width={width}; pass e.g. groups=8 "
            "with width=32."
        )
    if pooling not in ("depthwise", "average"):
        raise ValueError(f"pooling must be 'depthwise' or 'average', got {pooling!r}.")
    blocks = tuple(blocks)
    if len(blocks) != 3 or any(
        isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in blocks
    ):
        raise ValueError(
            f"blocks must be 3 ints >= 1 (blocks per stage), got {blocks!r}; "
            "pass e.g. blocks=(1, 1, 1)."
        )
    inputs = keras.Input(tuple(input_shape))
    x = keras.layers.Rescaling(1 / 255)(inputs)
    x = keras.layers.Conv2D(width, 3, padding="same", name="stem_conv")(x)
    x = keras.layers.GroupNormalization(groups=groups, name="stem_norm")(x)
    x = keras.layers.Activation("relu")(x)
    for stage, (count, filters) in enumerate(
        zip(blocks, (width, 2 * width, 4 * width), strict=True)
    ):
        for index in range(count):
            stride = 2 if stage > 0 and index == 0 else 1
            x = _residual_block(x, filters, stride, groups, f"stage{stage}_{index}")
    if pooling == "depthwise":
        # One learnt weight per position and channel (a global depthwise
        # convolution): where a feature is matters for identity (eye
        # spacing, mouth height), and an average would discard it.
        x = keras.layers.DepthwiseConv2D(
            tuple(x.shape[1:3]), padding="valid", name="pool"
        )(x)
        x = keras.layers.Flatten()(x)
    else:
        x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(embedding_dim, name="embedding")(x)
    return keras.Model(inputs, outputs, name=name)


def _residual_block(x, filters, stride, groups, name):
    """ReLU(GN(conv(ReLU(GN(conv(x))))) + shortcut(x))."""
    shortcut = x
    if stride != 1 or x.shape[-1] != filters:
        shortcut = keras.layers.Conv2D(
            filters, 1, strides=stride, name=f"{name}_shortcut"
        )(x)
    x = keras.layers.Conv2D(
        filters, 3, strides=stride, padding="same", name=f"{name}_conv0"
    )(x)
    x = keras.layers.GroupNormalization(groups=groups, name=f"{name}_norm0")(x)
    x = keras.layers.Activation("relu")(x)
    x = keras.layers.Conv2D(filters, 3, padding="same", name=f"{name}_conv1")(x)
    x = keras.layers.GroupNormalization(groups=groups, name=f"{name}_norm1")(x)
    x = keras.layers.Add(name=f"{name}_add")([x, shortcut])
    return keras.layers.Activation("relu")(x)
