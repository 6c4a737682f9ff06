"""Public pre-training: the non-private first step of the workflow.

Train the backbone on **public** identities with an ordinary softmax over
them (`CentralizedBaseline`, a cosine head by default), then fine-tune it
privately with `FedEmbModel` on the private users. Pre-training uses no
private data and spends no privacy budget, and it has no privacy guarantee
of its own: whatever it is given must be public (or otherwise consented
to be used without protection).
"""

import keras
import numpy as np

from kdpemb import _finite_inputs as finite_inputs
from kdpemb import _validation as checks
from kdpemb.datasets.user_images import UserImages
from kdpemb.models import backbone_checks, heads
from kdpemb.models.centralized import CentralizedBaseline


def pretrain(
    backbone,
    public_data,
    *,
    epochs,
    head="cosine",
    head_scale=heads.DEFAULT_SCALE,
    head_margin=0.0,
    optimizer=None,
    batch_size=64,
    validation=None,
    callbacks=None,
    verbose="auto",
):
    """Trains `backbone` non-privately on public identities; returns it.

    The backbone gets a softmax head over the public identities
    (`CentralizedBaseline(backbone, K, head=...)`) and is trained with
    `fit`; the head is then dropped. The backbone object itself is
    trained (and returned), ready for `FedEmbModel(backbone, ...)`.

    **Only for public data.** Nothing here is private: no clipping, no
    noise, no accounting. Images of the users you want to protect must
    not be given here; they belong to the private fine-tuning.

    Args:
        backbone: `keras.Model` from images to embeddings `[batch, D]`,
            built, as for `FedEmbModel`.
        public_data: `(images, labels)` arrays or a `UserImages` (its user
            ids are ignored) of public identities; labels are identity
            ids (any non-negative ints; at least 2 identities). Lazy
            images (`synthetic_identities`) are rendered once, up front.
        epochs: int. Passes over `public_data`.
        head: "cosine" (default) or "softmax"; see `CentralizedBaseline`.
        head_scale: float. s of the cosine logits. Defaults to 16.
        head_margin: float in [0, 1). Cosine margin. Defaults to 0.
        optimizer: a Keras optimizer or None for `Adam(1e-3)`.
        batch_size: int. Defaults to 64.
        validation: None, or held-out identities as `(images,
            labels)` or `UserImages`: Recall@FAR=1e-3 and 1e-2 of the
            backbone on them is logged after each epoch
            (`history.history["recall@far=1e-03"]`, ...).
        callbacks: list of Keras callbacks or None.
        verbose: as for `fit`. Defaults to "auto".

    Returns:
        `(backbone, history)`: the same backbone object, trained, and
        the `keras.callbacks.History` of the fit.

    Raises:
        ValueError: for input that is not `(images, labels)` or
            `UserImages`, of another image shape than the backbone's,
            with fewer than 2 identities, or bad settings.

    Example:

    >>> from kdpemb.datasets import synthetic_identities
    >>> from kdpemb.models import pretrain, resnet_gn
    >>> public = synthetic_identities(8, 2, image_size=16, domain="public")
    >>> backbone = resnet_gn((16, 16, 3), embedding_dim=8, width=8, groups=4)
    >>> trained, history = pretrain(backbone, public, epochs=1, verbose=0)
    >>> trained is backbone, len(history.history["loss"])
    (True, 1)
    """
    backbone_checks.check_backbone(backbone)
    epochs = checks.check_positive_int(epochs, "epochs")
    batch_size = checks.check_positive_int(batch_size, "batch_size")
    images, labels = _public_arrays(backbone, public_data, "public_data")
    classes, labels = np.unique(labels, return_inverse=True)
    if classes.size < 2:
        raise ValueError(
            f"public_data holds {classes.size} identity; a softmax over "
            "identities needs at least 2 (usually hundreds or more)."
        )
    callbacks = list(callbacks or [])
    if validation is not None:
        held_images, held_labels = _public_arrays(backbone, validation, "validation")
        # Refused as in every fit (`public_data` is, by CentralizedBaseline.fit).
        finite_inputs.check_array(
            held_images, "images", what="pixels", where="validation",
            action="pretrain", as_dtype="float32",
        )  # fmt: skip
        from kdpemb.callbacks import RecallAtFAR

        callbacks.insert(0, RecallAtFAR((held_images, held_labels), backbone=backbone))
    model = CentralizedBaseline(
        backbone,
        int(classes.size),
        head=head,
        head_scale=head_scale,
        head_margin=head_margin,
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3) if optimizer is None else optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    history = model.fit(
        images,
        labels,
        batch_size=batch_size,
        epochs=epochs,
        shuffle=True,
        callbacks=callbacks,
        verbose=verbose,
    )
    return backbone, history


def _public_arrays(backbone, data, name):
    """`(images, labels)` NumPy arrays of `data`, or a clear ValueError."""
    if isinstance(data, UserImages):
        images, labels = data.images, data.labels
    elif isinstance(data, (tuple, list)) and len(data) == 2:
        images, labels = data
    else:
        raise ValueError(
            f"{name} must be a tuple (images, labels) or a kdpemb UserImages "
            f"(e.g. synthetic_identities(..., domain='public')), got "
            f"{type(data).__name__}."
        )
    images = np.asarray(images)
    expected = tuple(backbone_checks.input_shape(backbone)[1:])
    if images.ndim != 4 or tuple(images.shape[1:]) != expected:
        raise ValueError(
            f"{name}'s images have shape {images.shape}, but the backbone takes "
            f"(N, {', '.join(str(d) for d in expected)}): pass images of the "
            "backbone's input shape."
        )
    labels = checks.check_labels(labels, num_examples=len(images))
    return images, labels
