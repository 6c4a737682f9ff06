"""`RecallAtFAR`: exact Recall@FAR as a `keras.metrics.Metric`."""

import keras
import numpy as np

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

    >>> far_key(1e-3)
    'recall@far=1e-03'
    """
    return f"recall@far={far:.0e}"


class RecallAtFAR(keras.metrics.Metric):
    """Recall@FAR over every pair of the evaluation set, as a Keras metric.

    `update_state(labels, embeddings)` appends each batch to a buffer of
    `capacity` rows (kept in metric variables, so it works inside compiled
    `evaluate` steps on both backends); `result()` computes the exact
    all-pairs value with `kdpemb.metrics.recall_at_far` on the host. Inside
    a compiled step (the per-batch progress bar) it returns NaN; the value
    in the logs that `evaluate` and `fit(validation_data=...)` return is
    the exact one over the whole set.

    Memory: `capacity × embedding_dim` float32 in variables (10,000 × 128
    is 5 MB), plus the blocks of the pair computation at `result()`. More
    rows than `capacity` make `result()` raise rather than drop data.

    Args:
        far: float. The false-accept rate. Defaults to `1e-3`.
        embedding_dim: int. Width of the embeddings (the variables are
            created up front, as a compiled step requires).
        capacity: int. Most embeddings one evaluation can hold. Defaults
            to `10_000`.
        pairs: str. `"all"` or `"in_batch"` (see `recall_at_far`).
            Defaults to `"all"`.
        name: str. Defaults to `recall@far=1e-03` style.

    Example:

    >>> import numpy as np
    >>> metric = RecallAtFAR(far=0.25, embedding_dim=2, capacity=8)
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
        name=None,
        dtype=None,
    ):
        far_value = float(verification._check_far(far)[0])
        if np.ndim(far) != 0:
            raise ValueError("RecallAtFAR takes one far; make one metric per FAR.")
        if pairs not in verification.PAIRS:
            raise ValueError(
                f"pairs must be one of {verification.PAIRS}, got {pairs!r}."
            )
        for value, label in ((embedding_dim, "embedding_dim"), (capacity, "capacity")):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{label} must be a positive int, got {value!r}.")
        super().__init__(name=name or far_key(far_value), dtype=dtype)
        self.far = far_value
        self.embedding_dim = embedding_dim
        self.capacity = capacity
        self.pairs = pairs
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
                "RecallAtFAR counts every pair once; it takes no sample_weight."
            )
        ops = keras.ops
        y_pred = ops.cast(ops.convert_to_tensor(y_pred), "float32")
        y_true = ops.reshape(ops.cast(ops.convert_to_tensor(y_true), "int32"), (-1,))
        if y_pred.shape[-1] is not None and y_pred.shape[-1] != self.embedding_dim:
            raise ValueError(
                f"RecallAtFAR(embedding_dim={self.embedding_dim}) got embeddings "
                f"of width {y_pred.shape[-1]}."
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
        if int(np.asarray(self.overflow.value)):
            raise ValueError(
                f"RecallAtFAR(capacity={self.capacity}) received more "
                "embeddings than it can hold; pass a larger capacity."
            )
        count = int(np.asarray(count))
        embeddings = np.asarray(self.embeddings.value)[:count]
        labels = np.asarray(self.labels.value)[:count]
        value = verification.recall_at_far(embeddings, labels, self.far, self.pairs)
        return keras.ops.convert_to_tensor(value, dtype="float32")

    def get_config(self):
        return {
            **super().get_config(),
            "far": self.far,
            "embedding_dim": self.embedding_dim,
            "capacity": self.capacity,
            "pairs": self.pairs,
        }
