"""The container every kdpemb dataset function returns."""

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class UserImages:
    """Images with an identity (class) label and a user id per example.

    It unpacks like a tuple, `images, labels, user_ids = data`, and is what
    `kdpemb.data.VirtualClients` takes. `images` is a NumPy array of shape
    `(N, H, W, C)`, or a lazy array-like with the same `shape`, `dtype`,
    `len()` and integer-array indexing (see `synthetic_identities`).

    Args:
        images: array-like `(N, H, W, C)`.
        labels: int array `(N,)`. Identity (class) of each image.
        user_ids: int array `(N,)`. The user who holds each image; all
            images of one user are that user's data for user-level DP.
        class_names: optional sequence. Name of each label value.
        user_names: optional sequence. Name of each user id value.

    Example:

    >>> import numpy as np
    >>> data = UserImages(np.zeros((4, 8, 8, 1), np.uint8),
    ...                   labels=np.array([0, 0, 1, 1]),
    ...                   user_ids=np.array([0, 0, 1, 1]))
    >>> images, labels, users = data
    >>> images.shape, data.num_classes, data.num_users
    ((4, 8, 8, 1), 2, 2)
    """

    images: object
    labels: np.ndarray
    user_ids: np.ndarray
    class_names: tuple | None = None
    user_names: tuple | None = None

    def __post_init__(self):
        n = len(self.images)
        for name in ("labels", "user_ids"):
            value = np.asarray(getattr(self, name))
            if value.shape != (n,):
                raise ValueError(
                    f"{name} must have shape ({n},), one per image, got {value.shape}."
                )
            object.__setattr__(self, name, value)

    def __iter__(self):
        return iter((self.images, self.labels, self.user_ids))

    def __len__(self):
        return len(self.images)

    @property
    def num_classes(self):
        """Number of distinct labels."""
        return int(np.unique(self.labels).size)

    @property
    def num_users(self):
        """Number of distinct users."""
        return int(np.unique(self.user_ids).size)
