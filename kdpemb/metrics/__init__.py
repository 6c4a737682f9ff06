"""Verification quality of embeddings: Recall@FAR and the ROC over pairs.

`recall_at_far` and `verification_roc` are NumPy functions (no Keras
needed to call them); `RecallAtFARMetric` is the same value as a
`keras.metrics.Metric`. See `docs/evaluation.md`.

Example:

>>> import numpy as np
>>> import kdpemb
>>> embeddings = np.array([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])
>>> labels = np.array([0, 0, 1, 1])
>>> float(kdpemb.metrics.recall_at_far(embeddings, labels, far=0.25))
1.0
"""

import importlib
import warnings

from kdpemb.metrics.verification import recall_at_far, verification_roc

__all__ = ["RecallAtFARMetric", "recall_at_far", "verification_roc"]


def __getattr__(name):  # The Keras metric loads Keras only when asked for.
    if name in ("RecallAtFARMetric", "far_key"):
        module = importlib.import_module("kdpemb.metrics.recall_at_far_metric")
        return getattr(module, name)
    if name == "RecallAtFAR":  # Renamed in 0.2: the callback has this name.
        warnings.warn(
            "kdpemb.metrics.RecallAtFAR is now kdpemb.metrics.RecallAtFARMetric "
            "(kdpemb.callbacks.RecallAtFAR is the callback); the old name goes "
            "in the next release.",
            DeprecationWarning,
            stacklevel=2,
        )
        return __getattr__("RecallAtFARMetric")
    raise AttributeError(f"module 'kdpemb.metrics' has no attribute {name!r}")
