"""Poisson-sampled, fixed-shape batches of examples for example-level DP-SGD.

DP-SGD's accounting assumes that every example joins every step
independently with probability q = B / N (Poisson sampling), so a batch
has a random size. A compiled `train_step` wants a fixed shape: each batch
is padded to a static bound B_max (exceeded with probability at most
1e-9 per step), and a mask marks the real examples. A batch that would
exceed B_max is not truncated (that would change the sampling the
accountant assumes): it is padded to a larger shape instead, at the cost of
one more trace.
"""

import math
import secrets
import threading

import keras
import numpy as np

from kdpemb.data.round_size import max_clients_per_round


class PoissonBatches(keras.utils.PyDataset):
    """`steps` batches `(features, labels, mask)`, each example with prob. q.

    A `keras.utils.PyDataset`, so it is the `x` of `model.fit`. The mask
    (float32, 1 for a sampled example, 0 for padding) arrives in
    `train_step` as the sample weight.

    Args:
        features: array [N, ...].
        labels: int array [N].
        batch_size: int or None. Expected batch size B (q = B / N). None:
            every example in one batch per step (q = 1).
        steps: int. Batches per epoch.
        seed: int or None. None draws the sampling from OS entropy.

    Example:

    >>> batches = PoissonBatches(np.zeros((1000, 4)), np.zeros(1000, "int32"),
    ...                          batch_size=50, steps=3, seed=0)
    >>> features, labels, mask = batches[0]
    >>> features.shape == (batches.max_batch_size, 4), len(batches)
    (True, 3)
    """

    def __init__(self, features, labels, batch_size, steps, seed=None):
        super().__init__()
        self.features, self.labels = features, labels
        self.num_examples = len(features)
        self.batch_size = batch_size
        self.steps = int(steps)
        if batch_size is None:
            self.sampling_probability = 1.0
            self.max_batch_size = self.num_examples
        else:
            self.sampling_probability = batch_size / self.num_examples
            self.max_batch_size = max_clients_per_round(
                self.num_examples, self.sampling_probability, tolerance=1e-9
            )
        self._rng = np.random.default_rng(
            secrets.randbits(128) if seed is None else seed
        )
        self._lock = threading.Lock()  # Prefetch threads share the generator.

    def __len__(self):
        return self.steps

    def __getitem__(self, index):
        if index >= self.steps:
            raise IndexError(index)
        if self.batch_size is None:
            chosen = np.arange(self.num_examples)
        else:
            chosen = np.sort(self._sample())
        size = self.max_batch_size
        if len(chosen) > size:  # Probability <= 1e-9: a larger shape, same batch.
            size = 128 * math.ceil(len(chosen) / 128)
        padded = np.zeros(size, dtype=np.int64)
        padded[: len(chosen)] = chosen
        mask = np.zeros(size, dtype=np.float32)
        mask[: len(chosen)] = 1.0
        return self.features[padded], self.labels[padded], mask

    def _sample(self):
        """Indices of a Poisson sample, drawn in O(B) rather than O(N).

        N independent draws with probability q give a Binomial(N, q)
        number of examples, and, given that number, every subset of that
        size equally likely; drawing the two in turn is the same
        distribution, without a random number per example and step.
        """
        with self._lock:
            size = self._rng.binomial(self.num_examples, self.sampling_probability)
            return self._rng.choice(self.num_examples, size, replace=False)
