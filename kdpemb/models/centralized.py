"""The non-private centralized baseline: backbone + global softmax head.

DP-FedEmb's utility is judged against ordinary training of the same
backbone on the same examples with a softmax over every identity. This is
that model, trained with plain `compile` / `fit` on `(images, labels)`.
It has no privacy guarantee at all. Like every kdpemb trainer, it refuses
NaN or infinite pixels in arrays before training.
"""

import inspect

import keras
import numpy as np
from keras import ops

from kdpemb import _finite_inputs as finite_inputs
from kdpemb import _validation as validation
from kdpemb.models import backbone_checks, heads


@keras.saving.register_keras_serializable(package="kdpemb")
class CentralizedBaseline(keras.Model):
    """`backbone` followed by a softmax head over every identity (no DP).

    Args:
        backbone: `keras.Model` from images to embeddings `[batch, D]`, as
            for `FedEmbModel` (images arrive as float32 pixel values).
        num_classes: int. Identities in the training data.
        head: "softmax" (default): a `Dense(num_classes)` layer; or
            "cosine": `s · normalize(e) · normalize(W)`, a normalised
            softmax (`kdpemb.models.heads`), which usually gives better
            embeddings for verification.
        head_scale: float. s, the bound on the cosine logits. Defaults to 16.
        head_margin: float in [0, 1). Additive cosine margin (CosFace),
            taken off the true class's cosine in the training loss only
            (`compute_loss`); 0 (default) for none. Cosine head only.

    Example:

    >>> import keras, numpy as np
    >>> from kdpemb.models import CentralizedBaseline, small_cnn
    >>> model = CentralizedBaseline(small_cnn((8, 8, 1), 4, width=4, groups=2), 3)
    >>> model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(
    ...     from_logits=True))
    >>> model.predict(np.zeros((2, 8, 8, 1), "uint8"), verbose=0).shape
    (2, 3)
    """

    def __init__(
        self,
        backbone,
        num_classes,
        head="softmax",
        head_scale=heads.DEFAULT_SCALE,
        head_margin=0.0,
        **kwargs,
    ):
        super().__init__(**kwargs)
        backbone_checks.check_backbone(backbone)
        self.backbone = backbone
        self.num_classes = validation.check_positive_int(num_classes, "num_classes")
        self.head, self.head_scale, self.head_margin = validation.check_head(
            head, head_scale, head_margin
        )
        if self.head == "cosine":
            self.classifier = heads.CosineHead(
                self.num_classes, self.head_scale, name="classifier"
            )
        else:
            self.classifier = keras.layers.Dense(self.num_classes, name="classifier")
        self.classifier.build((None, backbone_checks.output_dim(backbone)))
        self.built = True

    def imprint_head(self, images, labels, batch_size=256):
        """Starts the head at each identity's mean embedding ("weight
        imprinting"): column c becomes the normalised mean of the
        normalised embeddings of the images of identity c (a softmax head's
        bias becomes 0); identities without images keep their column.

        A random head over many identities sends large, uninformative
        gradients into a pretrained backbone in the first epoch and can
        undo its pretraining; an imprinted head starts where the backbone
        already is. It reads `images` without noise: like the rest of this
        model, it has no privacy guarantee.

        Args:
            images: array `[N, H, W, C]`.
            labels: int array `[N]` of identities below `num_classes`.
            batch_size: int. Images embedded at once.

        Returns:
            int: the number of columns imprinted.

        >>> import numpy as np
        >>> from kdpemb.models import CentralizedBaseline, small_cnn
        >>> model = CentralizedBaseline(small_cnn((8, 8, 1), 4, width=4, groups=2),
        ...                             3, head="cosine")
        >>> images = np.random.default_rng(0).normal(size=(6, 8, 8, 1))
        >>> model.imprint_head(images, np.array([0, 0, 1, 1, 2, 2]))
        3
        """
        labels = np.asarray(labels)
        if not np.issubdtype(labels.dtype, np.integer):
            raise ValueError(
                f"labels must be integer identities; got dtype {labels.dtype}. "
                "Pass them as ints (e.g. labels.astype('int64'))."
            )
        if labels.ndim != 1 or len(labels) != len(images):
            raise ValueError(
                f"labels must be one identity per image: got shape {labels.shape} "
                f"for {len(images)} images."
            )
        if len(labels) and (labels.min() < 0 or labels.max() >= self.num_classes):
            raise ValueError(
                f"labels must lie in [0, {self.num_classes}) (num_classes); got "
                f"values from {labels.min()} to {labels.max()}."
            )
        finite_inputs.check_array(
            images, "images", what="pixels", action="imprint_head", as_dtype="float32"
        )
        images = np.asarray(images, "float32")
        embeddings = np.asarray(
            self.backbone.predict(images, batch_size=batch_size, verbose=0),
            "float64",
        )
        norms = np.linalg.norm(embeddings, axis=1, keepdims=True)
        embeddings /= np.maximum(norms, 1e-12)
        sums = np.zeros((embeddings.shape[1], self.num_classes))
        np.add.at(sums.T, labels, embeddings)
        norms = np.linalg.norm(sums, axis=0)
        kernel = np.asarray(keras.ops.convert_to_numpy(self.classifier.kernel))
        present = norms > 0
        kernel[:, present] = sums[:, present] / norms[present]
        self.classifier.kernel.assign(kernel.astype(kernel.dtype))
        if getattr(self.classifier, "bias", None) is not None:
            self.classifier.bias.assign(np.zeros(self.num_classes, "float32"))
        return int(present.sum())

    def fit(self, x=None, y=None, *args, **kwargs):
        """Keras' `fit`. NaN or infinite pixels, float targets or sample
        weights in arrays (`x`, `y`, `sample_weight`, `validation_data`)
        are refused first (`kdpemb.errors.NonFiniteInputError`), as by
        every kdpemb trainer, and so are pixels beyond float32's range; a
        dataset or generator is passed on as it is, unchecked."""
        given = inspect.signature(super().fit).bind(x, y, *args, **kwargs).arguments
        for part, what in (
            ("x", "pixels"),
            ("y", "targets"),
            ("sample_weight", "weights"),
        ):
            finite_inputs.check_structure(
                given.get(part), part, what=what, action="fit", as_dtype="float32"
            )
        finite_inputs.check_validation_data(
            given.get("validation_data"), as_dtype="float32"
        )
        return super().fit(x, y, *args, **kwargs)

    def call(self, images, training=False):
        """Class logits of `images`."""
        embeddings = self.backbone(ops.cast(images, "float32"), training=training)
        return self.classifier(embeddings)

    def compute_loss(
        self, x=None, y=None, y_pred=None, sample_weight=None, training=True
    ):
        """The compiled loss, with the cosine margin on the true class
        while training (integer labels)."""
        if self.head_margin and training and y is not None and y_pred is not None:
            y_pred = heads.margin_logits(
                y_pred, y, self.num_classes, self.head_scale, self.head_margin
            )
        return super().compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
        )

    def get_config(self):
        return {
            **super().get_config(),
            "backbone": keras.saving.serialize_keras_object(self.backbone),
            "num_classes": self.num_classes,
            "head": self.head,
            "head_scale": self.head_scale,
            "head_margin": self.head_margin,
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["backbone"] = keras.saving.deserialize_keras_object(config["backbone"])
        return cls(**config)
