"""What `LastLayerDPClassifier.fit` accepts: arrays of features and labels.

Checked before any step, each refusal naming the value and the fix.
"""

import warnings

import numpy as np

from kdpemb import _finite_inputs as finite_inputs
from kdpemb import _validation as validation
from kdpemb.errors import DegenerateFeaturesWarning

# Rows whose norm is below this share of the clip scale are degenerate: a
# class sum of n such rows (or a batch's gradient sum) stays below the
# noise's std z · C unless n > 1e6 / z.
DEGENERATE_NORM_RATIO = 1e-6
_ROWS_PER_CHUNK = 65_536


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
    # Refused, not dropped (the one rule, `kdpemb._finite_inputs`); checked
    # as the float32 they become (1e39 in float64 would turn infinite).
    finite_inputs.check_array(features, "features", action="fit", as_dtype="float32")
    labels = validation.check_labels(labels, len(features), num_classes)
    return features.astype(np.float32, copy=False), labels.astype(np.int32)


def check_epochs(epochs, initial_epoch, method):
    """`epochs`, checked with `initial_epoch` for `method` (a method class).

    >>> check_epochs(3, 1, method=None)
    3
    """
    epochs = validation.check_positive_int(epochs, "epochs")
    if (
        not isinstance(initial_epoch, int)
        or isinstance(initial_epoch, bool)
        or not 0 <= initial_epoch < epochs
    ):
        raise ValueError(
            f"initial_epoch={initial_epoch!r} must be an int in [0, epochs="
            f"{epochs}): the fit runs epochs - initial_epoch epochs, at "
            "least one."
        )
    if getattr(method, "single_step", False) and epochs - initial_epoch != 1:
        raise ValueError(
            f"{method.name} solves in one step: fit it with epochs=1 (each "
            "further fit would release the statistics again)."
        )
    return epochs


def warn_if_degenerate(features, scale, scale_name):
    """Warns `DegenerateFeaturesWarning` if most feature rows are ~zero.

    Degenerate: at least half the rows have an L2 norm below
    `DEGENERATE_NORM_RATIO` × `scale` (the clip norm that sets the noise),
    so the noise drowns them and the head ends near chance, as from an
    untrained backbone (norms ~1e-10). Checked before any step.

    Privacy: whether it warns is one bit computed from the private
    features, outside the DP guarantee (like the refusal of non-finite
    features). The warning states no norm, count or other statistic of
    the data, only the public threshold. Check features of public data
    with `kdpemb.models.suggest_feature_clip_norm` instead of reading norms
    of private ones.

    Example:

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warn_if_degenerate(np.full((4, 3), 1e-10), 1.0, "clip_norm")
    ...     warn_if_degenerate(np.ones((4, 3)), 1.0, "clip_norm")
    >>> [w.category.__name__ for w in caught]
    ['DegenerateFeaturesWarning']
    """
    threshold = DEGENERATE_NORM_RATIO * scale
    tiny = 0
    for start in range(0, len(features), _ROWS_PER_CHUNK):
        rows = features[start : start + _ROWS_PER_CHUNK]
        tiny += int(np.count_nonzero(np.linalg.norm(rows, axis=1) < threshold))
    if 2 * tiny < len(features):
        return
    warnings.warn(
        f"At least half of the feature rows have an L2 norm below "
        f"{threshold:.3g} ({DEGENERATE_NORM_RATIO:g} × {scale_name}={scale:g}): "
        "next to noise scaled to the clip norm they are (near) zero, and the "
        "head would end near chance. The backbone probably outputs (near) "
        "zeros: untrained or wrongly loaded weights, or features from the "
        "wrong layer. Check the backbone on public images, and set "
        f"{scale_name} to the norm of public features (kdpemb.models."
        "suggest_feature_clip_norm). (Only this yes/no is computed from the "
        "private features, outside the DP guarantee.)",
        DegenerateFeaturesWarning,
        stacklevel=3,
    )
