"""Poisson-sampled, padded batches of examples for example-level DP-SGD.

DP-SGD's accounting assumes that every example joins every step
independently with probability q = B / N (Poisson sampling), so a batch
has a random size. A compiled `train_step` wants few shapes, so batches
are padded and a mask marks the real examples (`padding`):

- "bound": every batch to one static bound B_max, exceeded with
  probability at most 1e-9 per step (one shape; about 6 standard
  deviations of the size are padding).
- "multiple": to the next multiple of a power of two of about two
  standard deviations of the size (a handful of shapes, one compilation
  each; a few percent of padding).
- "none": not at all (for a graph that takes any batch size).

A batch is never truncated (that would change the sampling the
accountant assumes): one above B_max is padded to a larger shape, at the
cost of one more trace.

`PoissonIndices` yields the sampled indices, for a train step that gathers
the rows from data already on the device (a few kilobytes per step cross
to the device); `PoissonBatches` gathers the rows on the host.
"""

import math
import numbers
import secrets
import threading

import keras
import numpy as np

from kdpemb import _validation as validation
from kdpemb.data.round_size import max_clients_per_round

PADDINGS = ("bound", "multiple", "none")
SAMPLINGS = ("poisson", "fixed")


class PoissonIndices(keras.utils.PyDataset):
    """`steps` batches `(indices, mask)`, each of N examples with prob. q.

    A `keras.utils.PyDataset`, so it is the `x` of `model.fit`. `indices`
    (int32; int64 beyond 2³¹ − 1 examples) lists the sampled examples in
    increasing order, then zeros up to the padded size; `mask` (float32, 1
    for a sampled example, 0 for padding) marks which entries are real.

    Args:
        num_examples: int. N.
        batch_size: int or None. Expected batch size B (q = B / N). None:
            every example in one batch per step (q = 1).
        steps: int. Batches per epoch.
        seed: int or None. None draws the sampling from OS entropy.
        padding: "bound" (default), "multiple" or "none"; see the module.
        sampling: "poisson" (default) or "fixed": exactly `batch_size`
            examples, drawn uniformly without replacement (its accounting
            is replace-one, `Schedule.examples(..., sampling="fixed")`).
        multiple_of: int. The padded size is also rounded up to a multiple
            of it (e.g. a physical batch size that splits the batch).

    Example:

    >>> batches = PoissonIndices(1000, batch_size=50, steps=3, seed=0)
    >>> indices, mask = batches[0]
    >>> indices.shape == mask.shape == (batches.max_batch_size,), len(batches)
    (True, 3)
    >>> bool(np.all(np.diff(indices[mask == 1]) > 0))
    True
    """

    def __init__(
        self,
        num_examples,
        batch_size,
        steps,
        seed=None,
        padding="bound",
        *,
        sampling="poisson",
        multiple_of=1,
    ):
        super().__init__()
        self.padding = validation.check_choice(padding, PADDINGS, "padding")
        self.sampling = validation.check_choice(sampling, SAMPLINGS, "sampling")
        self.multiple_of = validation.check_positive_int(multiple_of, "multiple_of")
        self.num_examples = validation.check_positive_int(
            num_examples, "num_examples", "There must be at least one example."
        )
        if batch_size is not None:
            batch_size = validation.check_sample_size(
                batch_size, self.num_examples, "batch_size", sampling
            )
            if sampling == "fixed":
                batch_size = int(batch_size)
        self.batch_size = batch_size
        self.steps = validation.check_positive_int(steps, "steps")
        seed = check_seed(seed)
        self.index_dtype = np.dtype(
            np.int32 if self.num_examples <= np.iinfo(np.int32).max else np.int64
        )
        if batch_size is None:
            self.sampling_probability = 1.0
            self.max_batch_size = self.num_examples
        else:
            self.sampling_probability = batch_size / self.num_examples
            self.max_batch_size = max_clients_per_round(
                self.num_examples, self.sampling_probability, tolerance=1e-9
            )
        q = self.sampling_probability
        spread = 2 * math.sqrt(self.num_examples * q * (1 - q))
        self.size_multiple = 2 ** max(3, math.ceil(math.log2(max(spread, 1.0))))
        self._rng = np.random.default_rng(
            secrets.randbits(128) if seed is None else seed
        )
        self._lock = threading.Lock()  # Prefetch threads share the generator.

    def __len__(self):
        return self.steps

    def __getitem__(self, index):
        return self.sample(index)

    def sample(self, index):
        """Batch `index`: a fresh Poisson sample, as `(indices, mask)`."""
        if index >= self.steps:
            raise IndexError(index)
        if self.batch_size is None:
            chosen = np.arange(self.num_examples)
        elif self.sampling == "fixed":
            with self._lock:
                chosen = np.sort(
                    self._rng.choice(self.num_examples, self.batch_size, replace=False)
                )
        else:
            chosen = np.sort(self._draw())
        size = self._padded_size(len(chosen))
        indices = np.zeros(size, dtype=self.index_dtype)
        indices[: len(chosen)] = chosen
        mask = np.zeros(size, dtype=np.float32)
        mask[: len(chosen)] = 1.0
        return indices, mask

    def _padded_size(self, size):
        multiple, size = self.multiple_of, self._bucket(size)
        # At least one row: an empty draw is one masked-out row.
        return multiple * max(1, math.ceil(size / multiple))

    def _bucket(self, size):
        if (
            self.padding == "none"
            or self.batch_size is None
            or self.sampling == "fixed"
        ):
            return size
        if self.padding == "multiple":
            return self.size_multiple * max(1, math.ceil(size / self.size_multiple))
        if size > self.max_batch_size:  # Probability <= 1e-9: a larger shape.
            return 128 * math.ceil(size / 128)
        return self.max_batch_size

    def _draw(self):
        """Indices of a Poisson sample, drawn in O(B) rather than O(N).

        N independent draws with probability q give a Binomial(N, q)
        number of examples, and, given that number, every subset of that
        size equally likely; drawing the two in turn is the same
        distribution, without a random number per example and step.
        """
        with self._lock:
            size = self._rng.binomial(self.num_examples, self.sampling_probability)
            return self._rng.choice(self.num_examples, size, replace=False)


def check_seed(seed):
    """None, an int >= 0, or a sequence of them (NumPy's entropy), checked."""
    parts = seed if isinstance(seed, (list, tuple)) else [seed]
    if seed is None or (
        parts
        and all(
            isinstance(p, numbers.Integral) and not isinstance(p, bool) and p >= 0
            for p in parts
        )
    ):
        return seed
    raise ValueError(
        f"seed must be None (OS entropy) or an int >= 0, got {seed!r}. A fixed "
        "seed makes the sampling predictable: use it for tests only."
    )


class PoissonBatches(PoissonIndices):
    """`steps` batches `(features, labels, mask)`, each example with prob. q.

    `PoissonIndices` with the sampled rows gathered on the host (padding
    rows repeat example 0 and are masked out).

    Args:
        features: array [N, ...].
        labels: int array [N].
        batch_size, steps, seed, padding, sampling, multiple_of: as for
            `PoissonIndices`.

    Example:

    >>> batches = PoissonBatches(np.zeros((1000, 4)), np.zeros(1000, "int32"),
    ...                          batch_size=50, steps=3, seed=0)
    >>> features, labels, mask = batches[0]
    >>> features.shape == (batches.max_batch_size, 4), len(batches)
    (True, 3)
    """

    def __init__(
        self, features, labels, batch_size, steps, seed=None, padding="bound", **kwargs
    ):
        check_rows(features, labels)
        super().__init__(
            len(features), batch_size, steps, seed=seed, padding=padding, **kwargs
        )
        self.features, self.labels = features, labels

    def __getitem__(self, index):
        indices, mask = self.sample(index)
        return self.features[indices], self.labels[indices], mask


def check_rows(features, labels):
    """Refuses `features` and `labels` that are not arrays of rows, one
    label per example, at least one example."""
    for name, rows in (("features", features), ("labels", labels)):
        if not hasattr(rows, "__len__") or not hasattr(rows, "__getitem__"):
            raise ValueError(
                f"{name} must be an array with one row per example, got "
                f"{type(rows).__name__}."
            )
    if len(features) != len(labels):
        raise ValueError(
            f"features has {len(features)} rows but labels has {len(labels)}; "
            "pass one label per example."
        )
    if not len(features):
        raise ValueError("features is empty: there are no examples to sample.")
