"""A PyDataset of given elements, for tests of what reads datasets."""

import keras
import numpy as np


class Elements(keras.utils.PyDataset):
    """A PyDataset yielding `elements[0]`, `elements[1]`, ... in order."""

    def __init__(self, elements):
        super().__init__()
        self.elements = elements

    def __len__(self):
        return len(self.elements)

    def __getitem__(self, index):
        return self.elements[index]


def batches(*parts, size=3):
    """`(images, labels, ...)` batches of `size` rows of `parts`, as a list."""
    n = len(parts[0])
    return [tuple(p[i : i + size] for p in parts) for i in range(0, n, size)]


def population(num_users, seed, *, max_examples=6, num_classes=7):
    """Users with 1..max_examples examples; each image holds its example id."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, max_examples + 1, size=num_users)
    names = rng.choice(10 * num_users, size=num_users, replace=False) + 1000
    user_ids = np.repeat(names, counts)
    n = user_ids.size
    images = np.arange(n, dtype=np.float32).reshape(n, 1, 1, 1)
    labels = rng.integers(0, num_classes, size=n)
    return images, labels, user_ids


def without_user(images, labels, user_ids, user):
    """The data without `user`'s examples (the others keep their ids)."""
    keep = user_ids != user
    return images[keep], labels[keep], user_ids[keep]
