"""A PyDataset of given elements, for tests of what reads datasets."""

import keras


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
