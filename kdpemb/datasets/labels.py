"""The one check of class (identity) labels that every data entry point uses."""

import numpy as np


def check_labels(labels, num_examples=None):
    """Returns `labels` as a 1-D int64 array of non-negative class indices.

    Floats are accepted when they are whole numbers. Raises `ValueError`
    naming the first offending label and the fix.

    Args:
        labels: array-like `(N,)`.
        num_examples: int or None. The required length N, if known.

    Example:

    >>> check_labels([0, 2.0, 1]).tolist()
    [0, 2, 1]
    """
    try:
        array = np.asarray(labels)
    except Exception as error:
        raise ValueError(
            f"labels must be a 1-D array of non-negative integers ({error})."
        ) from error
    if num_examples is not None and array.shape != (num_examples,):
        raise ValueError(
            f"labels must have shape ({num_examples},), one per image, got "
            f"{array.shape}."
        )
    if array.ndim != 1:
        raise ValueError(
            f"labels must be 1-D, one class per example, got shape {array.shape}; "
            "flatten one-hot or (N, 1) labels first (e.g. labels.argmax(-1) or "
            "labels.reshape(-1))."
        )
    if array.size == 0:
        raise ValueError("labels is empty: there are no examples.")
    if array.dtype == bool or array.dtype.kind not in "iuf":
        raise ValueError(
            f"labels must be non-negative integers, got dtype {array.dtype}; map "
            "class names to integers first (e.g. np.unique(names, "
            "return_inverse=True)[1])."
        )
    if array.dtype.kind == "f":
        bad = ~np.isfinite(array) | (array != np.round(array))
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                "labels must be whole numbers (integer identity indices), but "
                f"labels[{i}] = {array[i].item()!r}; pass integer class labels, "
                "not scores or NaN."
            )
    if (array < 0).any():
        i = int(np.argmax(array < 0))
        raise ValueError(
            f"labels must be >= 0 (non-negative), but labels[{i}] = "
            f"{array[i].item()!r}. Map identities to 0..num_classes-1."
        )
    return array.astype(np.int64)
