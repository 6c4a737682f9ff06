"""What `VirtualClients` reads: `read_source` turns its arguments into arrays.

Arrays, a `UserImages`, a dataset (read once into memory, because rounds
need random access to every user's examples) or a `UserShards` directory
on disk (write the data with `kdpemb.datasets.write_user_shards` when it
does not fit). Opening and checking are `kdpemb.datasets.sources`.
"""

import warnings

import numpy as np

from kdpemb import _validation as validation
from kdpemb.datasets import sources as user_data
from kdpemb.datasets.user_shards_reader import UserShards

_SCAN_CHUNK = 4096


def read_source(images, labels=None, user_ids=None, *, num_classes=None):
    """Returns checked `(images, labels, user_ids, num_classes)`.

    `images` keeps its type when it is a NumPy array or a lazy array-like,
    so a large synthetic dataset is never materialised here. For a
    `UserShards` the images and labels are its lazy arrays and `user_ids`
    is the `UserShards` itself: its examples are already grouped by user
    and were checked when written, so nothing is scanned here.

    Example:

    >>> import numpy as np
    >>> images, labels, user_ids, num_classes = read_source(
    ...     np.zeros((4, 2, 2, 1), np.uint8), [0, 1, 1, 0], [7, 7, 8, 8])
    >>> images.shape, labels.tolist(), user_ids.tolist(), num_classes
    ((4, 2, 2, 1), [0, 1, 1, 0], [7, 7, 8, 8], 2)
    """
    if isinstance(images, UserShards):
        return _read_shards(images, labels, user_ids, num_classes)
    source = user_data.open_source(images, labels, user_ids)
    images, labels, user_ids, _ = source.arrays()
    user_data.check_image_shape(images.shape)
    if np.dtype(images.dtype).kind == "f":
        for start in range(0, len(images), _SCAN_CHUNK):
            user_data.check_finite(images[start : start + _SCAN_CHUNK], first=start)
    labels, num_classes = user_data.check_labels(labels, len(images), num_classes)
    user_ids = user_data.check_user_ids(user_ids, len(images))
    return images, labels, user_ids, num_classes


def _read_shards(shards, labels, user_ids, num_classes):
    if labels is not None or user_ids is not None:
        raise ValueError(
            "Pass either a UserShards or (images, labels, user_ids), not both: "
            "a UserShards already carries labels and user ids."
        )
    if num_classes is None:
        num_classes = shards.num_classes
    else:
        num_classes = validation.check_positive_int(num_classes, "num_classes")
        if num_classes <= shards.max_label:
            raise ValueError(
                f"num_classes={num_classes}, but the labels of {shards.directory} "
                f"go up to {shards.max_label}. Use num_classes >= "
                f"{shards.max_label + 1}, or leave it None "
                f"({shards.num_classes}, as written)."
            )
    return shards.images, shards.labels, shards, num_classes


_MOVED = (
    "open_source",
    "check_image_shape",
    "check_finite",
    "check_labels",
    "check_user_ids",
)


def __getattr__(name):  # Moved in 0.x (issue 32); the old paths go next.
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"kdpemb.data.sources.{name} is now kdpemb.datasets.sources.{name}; "
        "the old path goes in the next release.",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(user_data, name)
