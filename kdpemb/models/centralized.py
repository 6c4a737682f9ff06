"""The non-private centralized baseline: backbone + global softmax head.

DP-FedEmb's utility is judged against ordinary training of the same
backbone on the same examples with a softmax over every identity. This is
that model, trained with plain `compile` / `fit` on `(images, labels)`.
It has no privacy guarantee at all.
"""

import keras
from keras import ops

from kdpemb import _validation as validation
from kdpemb.models import backbone_checks, fedemb


@keras.saving.register_keras_serializable(package="kdpemb")
class CentralizedBaseline(keras.Model):
    """`backbone` followed by a `Dense(num_classes)` softmax head (no DP).

    Args:
        backbone: `keras.Model` from images to embeddings `[batch, D]`, as
            for `FedEmbModel` (images arrive as float32 pixel values).
        num_classes: int. Identities in the training data.

    Example:

    >>> import keras, numpy as np
    >>> from kdpemb.models import CentralizedBaseline, small_cnn
    >>> model = CentralizedBaseline(small_cnn((8, 8, 1), 4, width=4, groups=2), 3)
    >>> model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(
    ...     from_logits=True))
    >>> model.predict(np.zeros((2, 8, 8, 1), "uint8"), verbose=0).shape
    (2, 3)
    """

    def __init__(self, backbone, num_classes, **kwargs):
        super().__init__(**kwargs)
        backbone_checks.check_backbone(backbone)
        self.backbone = backbone
        self.num_classes = validation.check_positive_int(num_classes, "num_classes")
        self.classifier = keras.layers.Dense(self.num_classes, name="classifier")
        self.classifier.build((None, fedemb._output_dim(backbone)))
        self.built = True

    def call(self, images, training=False):
        """Class logits of `images`."""
        embeddings = self.backbone(ops.cast(images, "float32"), training=training)
        return self.classifier(embeddings)

    def get_config(self):
        return {
            **super().get_config(),
            "backbone": keras.saving.serialize_keras_object(self.backbone),
            "num_classes": self.num_classes,
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["backbone"] = keras.saving.deserialize_keras_object(config["backbone"])
        return cls(**config)
