"""What `LastLayerDPClassifier.fit` accepts: arrays of features and labels.

Checked before any step, each refusal naming the value and the fix.
"""

import keras
import numpy as np


def check_single_device():
    """Refuses a multi-replica strategy or a `keras.distribution`."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        if (
            tf.distribute.has_strategy()
            and tf.distribute.get_strategy().num_replicas_in_sync > 1
        ):
            raise ValueError(
                "LastLayerDPClassifier trains on one device (a linear head is "
                "cheap); build and fit it outside the tf.distribute strategy scope."
            )
    if keras.distribution.distribution() is not None:
        raise ValueError(
            "LastLayerDPClassifier trains on one device; fit it with no "
            "keras.distribution set."
        )


def check_data(features, labels, num_classes):
    """Features as finite float32 [N, d] and labels as int32 in [0, K)."""
    if features is None or labels is None:
        raise ValueError("fit takes features (x) and labels (y) as arrays.")
    if not hasattr(features, "shape") or not hasattr(labels, "shape"):
        raise ValueError(
            "LastLayerDPClassifier.fit takes NumPy arrays of features and labels "
            f"(got {type(features).__name__}); compute them with "
            "kdpemb.features.extract. A dataset would hide the sampling that the "
            "accounting assumes."
        )
    features = np.asarray(features)
    labels = np.asarray(labels)
    if features.ndim != 2:
        raise ValueError(
            f"features must be [num_examples, dim], got shape {features.shape}; "
            "pool or flatten the backbone's output."
        )
    if not np.issubdtype(features.dtype, np.number) or np.issubdtype(
        features.dtype, np.complexfloating
    ):
        raise ValueError(f"features must be real numbers, got dtype {features.dtype}.")
    if len(features) == 0:
        raise ValueError("features is empty: there is nothing to train on.")
    finite = np.isfinite(features).all(axis=1)
    if not finite.all():
        bad = np.flatnonzero(~finite)
        raise ValueError(
            f"{len(bad)} feature rows hold NaN or infinite values (first: row "
            f"{bad[0]}); fix the backbone or drop those examples before training."
        )
    if labels.shape != (len(features),):
        raise ValueError(
            f"labels must have shape ({len(features)},) to match the features, got "
            f"{labels.shape}."
        )
    if not np.issubdtype(labels.dtype, np.integer) and (
        not np.issubdtype(labels.dtype, np.floating)
        or np.any(labels != np.round(labels))
    ):
        raise ValueError(
            f"labels must be integer class indices, got dtype {labels.dtype}."
        )
    if labels.min() < 0 or labels.max() >= num_classes:
        bad = labels[(labels < 0) | (labels >= num_classes)][0]
        raise ValueError(
            f"label {bad} is out of range for num_classes={num_classes}: labels "
            f"must be in [0, {num_classes})."
        )
    return features.astype(np.float32, copy=False), labels.astype(np.int32)
