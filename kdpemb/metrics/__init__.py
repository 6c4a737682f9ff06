"""Verification quality of embeddings: Recall@FAR and the ROC over pairs.

`recall_at_far` and `verification_roc` are NumPy functions (no Keras
needed to call them); `RecallAtFAR` is the same value as a
`keras.metrics.Metric`. See `docs/evaluation.md`.
"""

import importlib

from kdpemb.metrics.verification import recall_at_far, verification_roc

__all__ = ["RecallAtFAR", "far_key", "recall_at_far", "verification_roc"]


def __getattr__(name):  # The Keras metric loads Keras only when asked for.
    if name in ("RecallAtFAR", "far_key"):
        module = importlib.import_module("kdpemb.metrics.recall_at_far_metric")
        return getattr(module, name)
    raise AttributeError(f"module 'kdpemb.metrics' has no attribute {name!r}")
