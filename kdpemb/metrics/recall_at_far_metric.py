"""`RecallAtFARMetric`: exact Recall@FAR as a `keras.metrics.Metric`."""

import warnings

import keras
import numpy as np

from kdpemb import _validation as validation
from kdpemb.metrics import verification


def _is_symbolic(value):
    """True inside a traced function (a TF graph or a JAX trace)."""
    if keras.backend.backend() == "jax":
        import jax

        return isinstance(value, jax.core.Tracer)
    import tensorflow as tf

    return not tf.executing_eagerly()


def far_key(far):
    """The log key of one FAR, e.g. `recall@far=1e-03`.

    Powers of ten read `1e-03`; any other FAR is written in full, so two
    FARs never share a key.

    >>> far_key(1e-3), far_key(0.25), far_key(1.5e-3)
    ('recall@far=1e-03', 'recall@far=0.25', 'recall@far=0.0015')
    """
    short = f"{far:.0e}"
    return f"recall@far={short if float(short) == far else repr(float(far))}"


@keras.saving.register_keras_serializable(package="kdpemb")
class RecallAtFARMetric(keras.metrics.Metric):
    """Recall@FAR over every pair of the evaluation set, as a Keras metric.

    (The `kdpemb.callbacks.RecallAtFAR` callback measures the same value on
    held-out identities at the end of each epoch of training.)

    `update_state(labels, embeddings)` appends each batch to a buffer of
    `capacity` rows (kept in metric variables, so it works inside compiled
    `evaluate` steps on both backends); `result()` computes the exact
    all-pairs value with `kdpemb.metrics.recall_at_far` on the host, once
    per number of rows collected. Inside a compiled step it returns NaN, so
    progress bars show `nan`; the logs that `evaluate` and
    `fit(validation_data=...)` return hold the exact value over the set.

    It is meant for evaluation. In `fit`, Keras also feeds it the training
    batches: the training-set value is computed too (costly for large
    sets), and it is NaN, with a warning, once they exceed `capacity`.
    Too few pairs to measure `far` also give NaN (the function raises).

    Memory: `capacity × embedding_dim` float32 in variables (10,000 × 128
    is 5 MB), plus the blocks of the pair computation at `result()`. Rows
    beyond `capacity` are never silently dropped: the result is NaN.

    Args:
        far: float. The false-accept rate. Defaults to `1e-3`.
        embedding_dim: int. Width of the embeddings (the variables are
            created up front, as a compiled step requires).
        capacity: int. Most embeddings one evaluation can hold. Defaults
            to `10_000`.
        pairs: str. `"all"` or `"in_batch"` (see `recall_at_far`).
            Defaults to `"all"`.
        in_batch_size: int. Batch size of `pairs="in_batch"` (the
            collected rows are cut into consecutive batches of this size).
            Defaults to `256`.
        name: str. Defaults to `far_key(far)`.

    Example:

    >>> import numpy as np
    >>> metric = RecallAtFARMetric(far=0.25, embedding_dim=2, capacity=8)
    >>> metric.update_state(np.array([0, 0, 1, 1]),
    ...                     np.array([[1, 0], [1, .1], [0, 1], [.1, 1]]))
    >>> float(metric.result())
    1.0
    """

    def __init__(
        self,
        far=1e-3,
        *,
        embedding_dim,
        capacity=10_000,
        pairs="all",
        in_batch_size=256,
        name=None,
        dtype=None,
    ):
        far_value = float(verification.check_far(far)[0])
        if np.ndim(far) != 0:
            raise ValueError(
                "RecallAtFARMetric takes one far; make one metric per FAR."
            )
        if pairs not in verification.PAIRS:
            raise ValueError(
                f"pairs must be one of {verification.PAIRS}, got {pairs!r}."
            )
        validation.check_positive_int(embedding_dim, "embedding_dim")
        validation.check_positive_int(capacity, "capacity")
        super().__init__(name=name or far_key(far_value), dtype=dtype)
        self.far = far_value
        self.embedding_dim = embedding_dim
        self.capacity = capacity
        self.pairs = pairs
        self.in_batch_size = in_batch_size
        self._cache = (None, None)
        self.embeddings = self.add_variable(
            shape=(capacity, embedding_dim), initializer="zeros", name="embeddings"
        )
        self.labels = self.add_variable(
            shape=(capacity,), initializer="zeros", dtype="int32", name="labels"
        )
        self.count = self.add_variable(
            shape=(), initializer="zeros", dtype="int32", name="count"
        )
        self.overflow = self.add_variable(
            shape=(), initializer="zeros", dtype="int32", name="overflow"
        )

    def update_state(self, y_true, y_pred, sample_weight=None):
        if sample_weight is not None:
            raise ValueError(
                "RecallAtFARMetric counts every pair once; it takes no sample_weight."
            )
        ops = keras.ops
        y_pred = ops.cast(ops.convert_to_tensor(y_pred), "float32")
        y_true = ops.reshape(ops.cast(ops.convert_to_tensor(y_true), "int32"), (-1,))
        if y_pred.shape[-1] is not None and y_pred.shape[-1] != self.embedding_dim:
            raise ValueError(
                f"RecallAtFARMetric(embedding_dim={self.embedding_dim}) got embeddings "
                f"of width {y_pred.shape[-1]}."
            )
        if y_pred.shape[0] is not None and y_pred.shape[0] > self.capacity:
            raise ValueError(
                f"RecallAtFARMetric(capacity={self.capacity}) got a batch of "
                f"{y_pred.shape[0]} embeddings; pass a larger capacity."
            )
        size = ops.shape(y_pred)[0]
        count = self.count.value
        fits = count + size <= self.capacity
        start = ops.minimum(count, ops.maximum(self.capacity - size, 0))
        self.embeddings.assign(
            ops.slice_update(self.embeddings.value, [start, 0], y_pred)
        )
        self.labels.assign(ops.slice_update(self.labels.value, [start], y_true))
        self.count.assign(ops.where(fits, count + size, count))
        self.overflow.assign(ops.where(fits, self.overflow.value, 1))

    def result(self):
        count = self.count.value
        if _is_symbolic(count):
            return keras.ops.convert_to_tensor(float("nan"))
        nan = keras.ops.convert_to_tensor(float("nan"))
        if int(np.asarray(self.overflow.value)):
            warnings.warn(
                f"RecallAtFARMetric(capacity={self.capacity}) received more "
                "embeddings than it can hold, so its value is NaN. Pass a "
                "larger capacity (in fit, the training batches count too).",
                UserWarning,
                stacklevel=2,
            )
            return nan
        count = int(np.asarray(count))
        if self._cache[0] != count:
            embeddings = np.asarray(self.embeddings.value)[:count]
            labels = np.asarray(self.labels.value)[:count]
            try:
                value = verification.recall_at_far(
                    embeddings, labels, self.far, self.pairs, self.in_batch_size
                )
            except ValueError:  # Too few pairs (so far) to measure far.
                value = float("nan")
            self._cache = (count, value)
        return keras.ops.convert_to_tensor(self._cache[1], dtype="float32")

    def reset_state(self):
        super().reset_state()
        self._cache = (None, None)

    def get_config(self):
        return {
            **super().get_config(),
            "far": self.far,
            "embedding_dim": self.embedding_dim,
            "capacity": self.capacity,
            "pairs": self.pairs,
            "in_batch_size": self.in_batch_size,
        }
