"""`RoundConsumer`: the least a model can do with a DP-FedEmb round."""

import keras


class RoundConsumer(keras.Model):
    """Reads whole `VirtualClients` rounds with one trainable weight.

    Its prediction is `w` times the mean pixel over the examples that
    `example_mask` marks (images scaled by `scale`), and its loss is
    `(prediction - 1)²`. It checks that rounds flow through `fit` on a
    backend, and is the trivial step that `python -m benchmarks data`
    compares the pipeline against. It is not a DP model.

    Args:
        scale: float. Multiplies the pixels (1/255 for uint8 images).
            Defaults to `1.0`.

    Example:

    >>> import numpy as np
    >>> model = RoundConsumer()
    >>> element = {"images": np.ones((2, 1, 3, 4, 4, 1), np.uint8),
    ...            "example_mask": np.array([[[True, True, False]]] * 2)}
    >>> _ = model.w.assign(2.0)
    >>> float(model(element))
    2.0
    """

    def __init__(self, scale=1.0, name="round_consumer", **kwargs):
        super().__init__(name=name, **kwargs)
        self.scale = float(scale)
        self.w = self.add_weight(shape=(), initializer="zeros", name="w")

    def call(self, element):
        images = keras.ops.cast(element["images"], "float32") * self.scale
        mask = keras.ops.cast(element["example_mask"], "float32")
        pixels = keras.ops.mean(images, axis=(-3, -2, -1))
        total = keras.ops.maximum(keras.ops.sum(mask), 1.0)
        return self.w * keras.ops.sum(pixels * mask) / total

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, **kwargs):
        return keras.ops.square(y_pred - 1.0)
