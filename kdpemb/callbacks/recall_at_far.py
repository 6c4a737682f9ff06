"""`RecallAtFAR` callback: verification quality on held-out identities."""

import keras
import numpy as np

from kdpemb import _validation as validation
from kdpemb import distribute
from kdpemb.datasets import inputs
from kdpemb.errors import NonFiniteFeaturesError
from kdpemb.features import extract
from kdpemb.metrics import verification
from kdpemb.metrics.recall_at_far_metric import far_key


class RecallAtFAR(keras.callbacks.Callback):
    """Writes Recall@FAR on held-out identities into the epoch logs.

    At the end of every `every_n_epochs`-th epoch it embeds `data` with the
    backbone (`model.backbone` when the model has one, such as a kdpemb
    federated model, else the model itself) in inference mode, as
    `kdpemb.features.extract` does, computes the ROC over all
    pairs once, and writes one key per FAR, e.g. `recall@far=1e-03`, into
    the logs, where `History`, `CSVLogger`, `TensorBoard` and
    `EarlyStopping(monitor="recall@far=1e-03", mode="max")` see it (place
    it before them in `callbacks`). On other epochs the keys are absent.
    `last_roc` holds the latest `(far, tar, thresholds)` for plotting.

    The held-out identities must not be training identities: this measures
    how the embedding generalises to people it never saw.

    Args:
        data: a tuple `(images, labels)`, a `UserImages`, or a
            `tf.data.Dataset` / `keras.utils.PyDataset` yielding batches
            `(images, labels, ...)` (anything after the labels is ignored).
            Its structure (and the labels of arrays) is checked here; at
            `on_train_begin`, before any training step, the data is read
            once (without the backbone) to check the images' dtype and
            shape against the backbone's input and that the labels give
            genuine and impostor pairs enough for every `far`.
        far: float or sequence of floats. FARs to report. Defaults to
            `(1e-3, 1e-2)`.
        every_n_epochs: int. Defaults to `1`.
        backbone: `keras.Model` or None. The embedding model. Defaults to
            `model.backbone`, or the model.
        batch_size: int. Images per backbone call for array data (a
            dataset keeps its own batches). Defaults to `256`.
        pairs: str. `"all"` or `"in_batch"`. Defaults to `"all"`.
        in_batch_size: int. Batch size of `pairs="in_batch"`. Defaults to
            `256`.
        verbose: int. 1 prints the values each time. Defaults to `0`.

    Example:

    >>> import keras, numpy as np
    >>> rng = np.random.default_rng(0)
    >>> images = rng.normal(size=(60, 8)).astype("float32")
    >>> labels = np.repeat(np.arange(12), 5)
    >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    >>> model.compile(loss="mse", optimizer="sgd")
    >>> callback = RecallAtFAR((images, labels), far=0.1)
    >>> history = model.fit(images, images[:, :4], epochs=2, verbose=0,
    ...                     callbacks=[callback])
    >>> len(history.history["recall@far=1e-01"])
    2
    """

    def __init__(
        self,
        data,
        far=(1e-3, 1e-2),
        every_n_epochs=1,
        backbone=None,
        batch_size=256,
        pairs="all",
        in_batch_size=256,
        verbose=0,
    ):
        super().__init__()
        self.fars = tuple(float(f) for f in verification.check_far(far))
        validation.check_positive_int(every_n_epochs, "every_n_epochs")
        if pairs not in verification.PAIRS:
            raise ValueError(
                f"pairs must be one of {verification.PAIRS}, got {pairs!r}."
            )
        if pairs == "in_batch":
            verification.check_in_batch_size(in_batch_size, "in_batch_size")
        self.data = data
        self._input = inputs.open_input(
            data,
            ("images", "labels"),
            required=2,
            ignore_extra=True,
            batch_size=batch_size,
        )
        # Reads a dataset's structure now, to refuse a bad one before training.
        self.fields = self._input.fields
        self._checked_for = None  # The input shape the data was checked for.
        self.every_n_epochs = every_n_epochs
        self.backbone = backbone
        self.batch_size = batch_size
        self.pairs = pairs
        self.in_batch_size = in_batch_size
        self.verbose = verbose
        self.last_roc = None
        self.keys = tuple(far_key(f) for f in self.fars)
        if len(set(self.keys)) != len(self.keys):
            raise ValueError(f"far lists the same FAR twice: {far!r}.")
        if not self._input.is_stream:  # Labels in memory: checked now.
            self._check_labels(self._input.arrays().labels)

    def _embedding_model(self):
        if self.backbone is not None:
            return self.backbone
        backbone = getattr(self.model, "backbone", None)
        return self.model if backbone is None else backbone

    def _check_labels(self, labels):
        try:
            verification.check_labels(
                labels, list(self.fars), self.pairs, self.in_batch_size
            )
        except ValueError as error:
            raise ValueError(
                "RecallAtFAR: the held-out data (argument data) cannot give "
                f"Recall@FAR at far={', '.join(f'{f:g}' for f in self.fars)}: "
                f"{error}"
            ) from None

    def check_data(self):
        """Checks the data against the embedding model now, without it.

        Reads the data once: every batch's images must be numbers of a
        shape the model's input takes (where the model declares one), and
        the labels must give genuine and impostor pairs enough for every
        `far`. Runs at `on_train_begin`, so bad held-out data fails before
        the first training step rather than after the first epoch; once
        per input shape.
        """
        input_shape = inputs.model_input_shape(self._embedding_model())
        if self._checked_for == (input_shape,):
            return
        source = self._input
        if not source.is_stream:  # One dtype and shape; labels checked already.
            self._check_shape(input_shape, source.shape, source.name)
        else:
            labels = []
            for batch in source.batches():  # Checks each batch's dtype.
                self._check_shape(input_shape, batch.images.shape, batch.where)
                labels.append(np.reshape(batch.labels, (len(batch.images), -1)))
            labels = np.concatenate(labels)
            self._check_labels(labels[:, 0] if labels.shape[1] == 1 else labels)
        self._checked_for = (input_shape,)

    def _check_shape(self, input_shape, shape, where):
        try:
            inputs.check_input_shape(
                input_shape, shape, where, stream=self._input.is_stream
            )
        except ValueError as error:
            raise ValueError(f"RecallAtFAR: {error}") from None

    def on_train_begin(self, logs=None):
        hosts = distribute.current_hosts(self.model)
        if hosts.count > 1:
            raise ValueError(
                f"RecallAtFAR evaluates in one process, and this job has "
                f"{hosts.count} hosts: leave it out of the multi-host fit, "
                "save the model (kdpemb.saving.save_model, called on every "
                "host; the chief writes the file) and evaluate it in one "
                "process afterwards (kdpemb.metrics.recall_at_far on its "
                "embeddings)."
            )
        self.check_data()

    def evaluate(self):
        """Embeds the data now and returns `{key: value}`."""
        try:
            embeddings, labels = extract(
                self._embedding_model(), self._input, verbose=0
            )
        except NonFiniteFeaturesError as error:
            raise NonFiniteFeaturesError(
                f"RecallAtFAR: the model's embeddings of the held-out data are "
                f"not finite ({error.summary}): the model diverged or its input "
                "was bad; Recall@FAR of non-finite embeddings is undefined. "
                "Lower the learning rate or the clip norm."
            ) from None
        self.last_roc, values = verification.roc_and_recall(
            embeddings, labels, list(self.fars), self.pairs, self.in_batch_size
        )
        return dict(zip(self.keys, (float(v) for v in values), strict=True))

    def on_epoch_end(self, epoch, logs=None):
        if (epoch + 1) % self.every_n_epochs:
            return
        results = self.evaluate()
        if logs is not None:
            logs.update(results)
        if self.verbose:
            text = ", ".join(f"{k} {v:.4f}" for k, v in results.items())
            print(f"RecallAtFAR: epoch {epoch + 1}: {text}")
