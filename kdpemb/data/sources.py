"""Turns what users pass to `VirtualClients` into checked arrays.

Accepted: a `UserImages`; arrays (or a lazy array-like such as
`SyntheticImages`) with labels and user ids; a `tf.data.Dataset` or a
`keras.utils.PyDataset` yielding `(images, labels, user_ids)` (batched or
not, or dicts with those keys). `kdpemb.data.inputs` reads them; datasets
are read once into memory, because rounds need random access to every
user's examples.
"""

import numpy as np

from kdpemb import _validation as validation
from kdpemb.data import inputs
from kdpemb.datasets.user_images import UserImages

_SCAN_CHUNK = 4096


def read_source(images, labels=None, user_ids=None, *, num_classes=None):
    """Returns checked `(images, labels, user_ids, num_classes)`.

    `images` keeps its type when it is a NumPy array or a lazy array-like,
    so a large synthetic dataset is never materialised here.

    Example:

    >>> import numpy as np
    >>> images, labels, user_ids, num_classes = read_source(
    ...     np.zeros((4, 2, 2, 1), np.uint8), [0, 1, 1, 0], [7, 7, 8, 8])
    >>> images.shape, labels.tolist(), user_ids.tolist(), num_classes
    ((4, 2, 2, 1), [0, 1, 1, 0], [7, 7, 8, 8], 2)
    """
    if isinstance(images, UserImages):
        if labels is not None or user_ids is not None:
            raise ValueError(
                "Pass either a UserImages or (images, labels, user_ids), "
                "not both: a UserImages already carries labels and user ids."
            )
        data = images
    elif inputs.is_dataset(images):
        if labels is not None or user_ids is not None:
            raise ValueError(
                "A dataset must yield (images, labels, user_ids) itself; do "
                "not also pass labels or user_ids."
            )
        data = images
    elif labels is None or user_ids is None:
        raise ValueError(
            "VirtualClients needs an identity label and a user id per image: "
            "pass VirtualClients(images, labels, user_ids, ...) or a "
            "kdpemb.datasets.UserImages."
        )
    else:
        data = (images, labels, user_ids)
    source = inputs.open_input(data, inputs.FIELDS, required=3, single_examples=True)
    images, labels, user_ids, _ = source.arrays()
    images = _check_images(images)
    labels, num_classes = _check_labels(labels, len(images), num_classes)
    user_ids = _check_user_ids(user_ids, len(images))
    return images, labels, user_ids, num_classes


def _check_images(images):
    """Numeric images (from `kdpemb.data.inputs`) of four axes, all finite."""
    shape = tuple(images.shape)
    if len(shape) != 4:
        hint = (
            " For grayscale images of shape (N, H, W) add a channel axis: "
            "images[..., None]."
            if len(shape) == 3
            else ""
        )
        raise ValueError(
            f"images must have shape (N, height, width, channels), got {shape}." + hint
        )
    if np.dtype(images.dtype).kind == "f":
        _check_finite(images)
    return images


def _check_finite(images):
    for start in range(0, len(images), _SCAN_CHUNK):
        chunk = np.asarray(images[start : start + _SCAN_CHUNK])
        bad = ~np.isfinite(chunk).reshape(len(chunk), -1).all(axis=1)
        if bad.any():
            index = start + int(np.flatnonzero(bad)[0])
            count = int(bad.sum())
            raise ValueError(
                f"images[{index}] holds NaN or infinite pixels ({count} bad "
                f"image(s) in rows {start}..{start + len(chunk) - 1} alone). "
                "Remove or repair these images before training; a non-finite "
                "input would poison the clipped update of its virtual client."
            )


def _check_labels(labels, n, num_classes):
    labels = np.asarray(labels)
    if labels.dtype == bool:  # Two identities, as 0 and 1.
        labels = labels.astype(np.int64)
    if num_classes is not None:
        num_classes = validation.check_positive_int(num_classes, "num_classes")
    labels = validation.check_labels(labels, num_examples=n, num_classes=num_classes)
    if num_classes is None:
        num_classes = int(labels.max()) + 1
    return labels, int(num_classes)


def _check_user_ids(user_ids, n):
    user_ids = np.asarray(user_ids)
    if user_ids.shape != (n,):
        raise ValueError(
            f"user_ids must have shape ({n},), one per image, got {user_ids.shape}."
        )
    if user_ids.dtype.kind == "f":
        if not np.isfinite(user_ids).all() or (user_ids != np.round(user_ids)).any():
            raise ValueError("user_ids must be integers or strings, got floats.")
        user_ids = user_ids.astype(np.int64)
    elif user_ids.dtype.kind not in "iuUSO":
        raise ValueError(
            f"user_ids must be integers or strings, got dtype {user_ids.dtype}."
        )
    return user_ids
