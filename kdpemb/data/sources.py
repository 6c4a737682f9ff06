"""Turns what users pass to `VirtualClients` into checked arrays.

Accepted: a `UserImages`; arrays (or a lazy array-like such as
`SyntheticImages`) with labels and user ids; a `tf.data.Dataset` or a
`keras.utils.PyDataset` yielding `(images, labels, user_ids)` (batched or
not). Datasets are read once into memory, because rounds need random
access to every user's examples.
"""

import numbers

import numpy as np

from kdpemb.datasets.labels import check_labels
from kdpemb.datasets.user_images import UserImages

_SCAN_CHUNK = 4096


def read_source(images, labels=None, user_ids=None, *, num_classes=None):
    """Returns checked `(images, labels, user_ids, num_classes)`.

    `images` keeps its type when it is a NumPy array or a lazy array-like,
    so a large synthetic dataset is never materialised here.
    """
    if isinstance(images, UserImages):
        if labels is not None or user_ids is not None:
            raise ValueError(
                "Pass either a UserImages or (images, labels, user_ids), "
                "not both: a UserImages already carries labels and user ids."
            )
        images, labels, user_ids = images
    elif _is_tf_dataset(images) or _is_py_dataset(images):
        if labels is not None or user_ids is not None:
            raise ValueError(
                "A dataset must yield (images, labels, user_ids) itself; do "
                "not also pass labels or user_ids."
            )
        images, labels, user_ids = _read_dataset(images)
    elif labels is None or user_ids is None:
        raise ValueError(
            "VirtualClients needs an identity label and a user id per image: "
            "pass VirtualClients(images, labels, user_ids, ...) or a "
            "kdpemb.datasets.UserImages."
        )
    images = _check_images(images)
    labels, num_classes = _check_labels(labels, len(images), num_classes)
    user_ids = _check_user_ids(user_ids, len(images))
    return images, labels, user_ids, num_classes


def _is_tf_dataset(value):
    return type(value).__module__.startswith("tensorflow") and hasattr(
        value, "as_numpy_iterator"
    )


def _is_py_dataset(value):
    try:
        import keras
    except ImportError:  # pragma: no cover - keras is a dependency
        return False
    return isinstance(value, keras.utils.PyDataset)


def _read_dataset(dataset):
    if _is_tf_dataset(dataset):
        elements = dataset.as_numpy_iterator()
    else:
        elements = (dataset[i] for i in range(len(dataset)))
    parts = ([], [], [])
    first_shape = None
    for position, element in enumerate(elements):
        if isinstance(element, dict):
            try:
                element = tuple(element[k] for k in ("images", "labels", "user_ids"))
            except KeyError as missing:
                raise ValueError(
                    f"Dataset element {position} is a dict without key "
                    f"{missing}; use keys 'images', 'labels', 'user_ids'."
                ) from None
        if not isinstance(element, tuple | list) or len(element) != 3:
            raise ValueError(
                f"Dataset element {position} must be (images, labels, "
                f"user_ids), got {type(element).__name__} of length "
                f"{len(element) if hasattr(element, '__len__') else '?'}."
            )
        image, label, user = (np.asarray(part) for part in element)
        if label.ndim == 0:  # One example per element.
            image, label, user = image[None], label[None], user[None]
        if first_shape is None:
            first_shape = image.shape[1:]
        elif image.shape[1:] != first_shape:
            raise ValueError(
                "Images of inconsistent shapes: the first element has images "
                f"of shape {first_shape}, element {position} has "
                f"{image.shape[1:]}. Resize them to one size first (e.g. "
                "keras.layers.Resizing in a map)."
            )
        for store, value in zip(parts, (image, label, user), strict=True):
            store.append(value)
    if first_shape is None:
        raise ValueError("The dataset yielded no elements; it holds no images.")
    return tuple(np.concatenate(store) for store in parts)


def _check_images(images):
    if isinstance(images, list | tuple):
        shapes = {np.shape(image) for image in images}
        if len(shapes) > 1:
            raise ValueError(
                f"Images of inconsistent shapes: {sorted(shapes)[:3]}. Resize "
                "them to one size first."
            )
        images = np.asarray(images)
    if not all(hasattr(images, name) for name in ("shape", "dtype", "__getitem__")):
        images = np.asarray(images)
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
    if shape[0] == 0:
        raise ValueError("images is empty: there are no examples.")
    dtype = np.dtype(images.dtype)
    if dtype.kind not in "uif":
        raise ValueError(
            f"images must hold numbers (uint8 or float), got dtype {dtype}."
        )
    if dtype.kind == "f":
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
    labels = check_labels(labels, num_examples=n)
    if num_classes is None:
        num_classes = int(labels.max()) + 1
    elif not isinstance(num_classes, numbers.Integral) or num_classes < 1:
        raise ValueError(
            f"num_classes must be a positive integer, got {num_classes!r}."
        )
    if labels.max() >= num_classes:
        raise ValueError(
            f"labels must be < num_classes={num_classes}, got "
            f"{int(labels.max())} at index {int(np.argmax(labels))}. Raise "
            "num_classes or re-index the labels."
        )
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
