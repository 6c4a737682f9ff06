"""Classification heads over embeddings: plain softmax and cosine softmax.

- `"softmax"`: logits `e · W` (plus a bias in `CentralizedBaseline`).
- `"cosine"` (normalised softmax, the CosFace / ArcFace family): logits
  `s · normalize(e) · normalize(W)`, bounded by the scale `s` in absolute
  value; an optional additive margin `m` (CosFace) is subtracted from the
  true class's cosine in the training loss only, which pulls an identity's
  embeddings closer together than a plain softmax asks.

Cosine logits need a non-zero head: the direction of a zero column is
undefined, and a normalisation with a small epsilon would turn a zero head
into a huge first gradient step (its derivative there is 1 / sqrt(ε)). So
a cosine head starts from a random draw (`head_init="random"`) or, in
DP-FedEmb, from the client's class means (`"class_means"`), never from
zeros. The normalisation still adds `_EPSILON` under the square root,
so an all-zero embedding (or column) gives a zero logit, never a NaN.
"""

import keras
from keras import ops

from kdpemb import _validation as validation

HEADS = validation.HEADS
DEFAULT_SCALE = 16.0
_EPSILON = 1e-12


def l2_normalize(x, axis):
    """`x / sqrt(|x|² + ε)` along `axis`: 0 for a zero vector, never NaN."""
    squared = ops.sum(ops.square(x), axis=axis, keepdims=True)
    return x * ops.rsqrt(squared + _EPSILON)


def cosine_logits(embeddings, kernel, scale):
    """`scale · normalize(embeddings) @ normalize(kernel's columns)`.

    Args:
        embeddings: `[..., D]`.
        kernel: `[D, C]` (columns are the classes).
        scale: float, the bound on the logits' absolute value.

    Example:

    >>> import numpy as np
    >>> logits = cosine_logits(np.ones((2, 3), "float32"),
    ...                        np.eye(3, dtype="float32"), 10.0)
    >>> bool(np.all(np.abs(np.asarray(logits)) <= 10.0))
    True
    """
    unit = l2_normalize(embeddings, axis=-1)
    columns = l2_normalize(kernel, axis=-2)
    return scale * ops.matmul(unit, columns)


def margin_logits(logits, labels, num_classes, scale, margin):
    """`logits` with `scale · margin` taken off each example's true class."""
    if not margin:
        return logits
    labels = ops.reshape(ops.cast(labels, "int32"), ops.shape(logits)[:-1])
    one_hot = ops.one_hot(labels, num_classes, dtype=logits.dtype)
    return logits - (scale * margin) * one_hot


@keras.saving.register_keras_serializable(package="kdpemb")
class CosineHead(keras.layers.Layer):
    """Cosine logits `scale · normalize(e) · normalize(W)`, no bias.

    Args:
        units: int. Classes.
        scale: float. s, the bound on the logits. Defaults to 16.

    Example:

    >>> import numpy as np
    >>> head = CosineHead(5, scale=4.0)
    >>> logits = np.asarray(head(np.random.normal(size=(3, 8)).astype("float32")))
    >>> logits.shape, bool(np.all(np.abs(logits) <= 4.0 + 1e-5))
    ((3, 5), True)
    """

    def __init__(self, units, scale=DEFAULT_SCALE, **kwargs):
        super().__init__(**kwargs)
        self.units = validation.check_positive_int(units, "units")
        self.scale = float(validation.check_positive(scale, "scale"))

    def build(self, input_shape):
        dim = int(input_shape[-1])
        self.kernel = self.add_weight(
            shape=(dim, self.units),
            initializer=keras.initializers.RandomNormal(stddev=dim**-0.5),
            name="kernel",
        )

    def call(self, embeddings):
        return cosine_logits(ops.cast(embeddings, "float32"), self.kernel, self.scale)

    def get_config(self):
        return {**super().get_config(), "units": self.units, "scale": self.scale}
