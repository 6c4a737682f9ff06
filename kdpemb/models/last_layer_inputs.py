"""What `LastLayerDPClassifier.fit` accepts: arrays of features and labels.

Checked before any step, each refusal naming the value and the fix.
"""

import keras
import numpy as np

from kdpemb import _validation as validation


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
    labels = validation.check_labels(labels, len(features), num_classes)
    return features.astype(np.float32, copy=False), labels.astype(np.int32)
