"""Opens and checks what users pass as user data (images, labels, user ids).

Accepted by `open_source`: a `UserImages`; arrays (or a lazy array-like
such as `SyntheticImages`) with labels and user ids; a `tf.data.Dataset`
or a `keras.utils.PyDataset` yielding `(images, labels, user_ids)`
(batched or not, or dicts with those keys). `kdpemb.datasets.inputs`
reads them. The checks (`check_image_shape`, `check_labels`,
`check_user_ids`; finite pixels: `kdpemb._finite_inputs`) serve
`kdpemb.data.VirtualClients` whole and `write_user_shards` block by
block. Imports no Keras.

Example:

>>> labels, num_classes = check_labels([0, 2, 1], 3, None)
>>> labels.tolist(), num_classes, check_user_ids(["a", "b", "a"], 3).tolist()
([0, 2, 1], 3, ['a', 'b', 'a'])
"""

import numpy as np

from kdpemb import _validation as validation
from kdpemb.datasets import inputs
from kdpemb.datasets.user_images import UserImages


def open_source(images, labels=None, user_ids=None, *, batch_size=256):
    """The `kdpemb.datasets.inputs.Input` of what `VirtualClients` takes.

    Refuses a wrong combination of arguments (labels with a `UserImages`
    or a dataset, or arrays without labels or user ids); reads nothing.

    Example:

    >>> import numpy as np
    >>> source = open_source(np.zeros((4, 2, 2, 1)), [0, 1, 1, 0], [7, 7, 8, 8])
    >>> source.kind, source.num_examples
    ('array', 4)
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
    return inputs.open_input(
        data, inputs.FIELDS, required=3, single_examples=True, batch_size=batch_size
    )


def check_image_shape(shape):
    """Refuses images that are not `(N, height, width, channels)`.

    Example:

    >>> check_image_shape((5, 8, 8, 1))
    >>> try:
    ...     check_image_shape((5, 8, 8))
    ... except ValueError as error:
    ...     print(str(error)[:60])
    images must have shape (N, height, width, channels), got (5,
    """
    shape = tuple(shape)
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


def check_labels(labels, n, num_classes):
    """Returns `(labels as int64, num_classes)`; `max(labels) + 1` by default.

    Example:

    >>> labels, num_classes = check_labels([0, 3, True], 3, None)
    >>> labels.tolist(), num_classes
    ([0, 3, 1], 4)
    """
    labels = np.asarray(labels)
    if labels.dtype == bool:  # Two identities, as 0 and 1.
        labels = labels.astype(np.int64)
    if num_classes is not None:
        num_classes = validation.check_positive_int(num_classes, "num_classes")
    labels = validation.check_labels(labels, num_examples=n, num_classes=num_classes)
    if num_classes is None:
        num_classes = int(labels.max()) + 1
    return labels, int(num_classes)


def check_user_ids(user_ids, n):
    """Returns `user_ids` (ints, or strings) after checking one per image.

    Whole floats become int64; other floats and other dtypes are refused.

    Example:

    >>> check_user_ids([3.0, 4.0], 2).tolist()
    [3, 4]
    """
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
