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
