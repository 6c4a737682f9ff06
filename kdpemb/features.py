"""Features (embeddings) of a frozen backbone, for last-layer DP fine-tuning.

`extract` runs a backbone over images once, in inference mode and batch by
batch, and returns its embeddings as a float32 NumPy array, which a
classifier then fits a linear head to with DP. With `cache=` and
`backbone_name=` the features are kept on disk (`kdpemb.feature_cache`),
so running the same backbone on the same images again loads them instead.
What `data` may be is read by `kdpemb.datasets.inputs`.

Example:

>>> import keras, numpy as np
>>> import kdpemb
>>> backbone = keras.Sequential([keras.Input((2, 2, 1)), keras.layers.Flatten()])
>>> features = kdpemb.features.extract(backbone, np.ones((3, 2, 2, 1)), verbose=0)
>>> features.shape, features.dtype
((3, 4), dtype('float32'))
"""

import sys

import keras
import numpy as np

from kdpemb import _finite_inputs as finite_inputs
from kdpemb import feature_cache
from kdpemb.datasets import inputs
from kdpemb.errors import NonFiniteFeaturesError

__all__ = ["extract"]

VERBOSE = ("auto", 0, 1, 2)
_POOLING_FIX = (
    "Pool or flatten the other axes inside the backbone, e.g. end it with "
    "keras.layers.GlobalAveragePooling2D() (or pass pooling='avg' to a "
    "keras.applications model)."
)


def extract(
    backbone,
    data,
    *,
    batch_size=256,
    cache=None,
    backbone_name=None,
    data_name=None,
    verbose="auto",
):
    """Returns the features of `backbone` on every image of `data`, in order.

    The backbone runs in inference mode (`training=False`, so Dropout is
    off and BatchNormalization uses its moving statistics), compiled, one
    batch at a time (`backbone.predict_on_batch`): memory holds one batch
    of images plus the features. Images of any numeric dtype (e.g. uint8)
    are cast to the dtype of the backbone's input. NaN or infinite pixels
    (after that cast) are refused before the backbone runs on them
    (`kdpemb.errors.NonFiniteInputError`): arrays are scanned whole first,
    a stream at its first such batch. Rows with NaN or infinite features
    raise (`NonFiniteFeaturesError`) instead of feeding a DP fit.

    On several devices of one host (a backbone built in a `tf.distribute`
    strategy's scope, or a JAX `keras.distribution` set) each batch is
    split into equal shares, one per device, padded with copies of its
    last image whose features are dropped: the same features as on one
    device. A job of several hosts is refused (extract on each host
    without the distribution, or on one).

    Which `data` gives what:

    - a NumPy array `(N, ...)` of images (or an array-like with `shape`,
      `dtype` and slicing, like `synthetic_identities().images`), cut into
      batches of `batch_size`: returns `features`;
    - an object with an `.images` attribute (a `kdpemb.datasets.UserImages`):
      its images, as above; returns `features`, whose rows match its
      `labels` and `user_ids`;
    - a tuple `(images, labels)` of arrays (e.g. one split of
      `load_fashion_mnist()`): returns `(features, labels)`;
    - a `tf.data.Dataset` or a `keras.utils.PyDataset` yielding batches of
      images, or of `(images, labels)`, read once in order with their own
      batching (`batch_size` is unused; a PyDataset's batches are read one
      by one in this process, whatever its `workers`): returns `features`,
      or `(features, labels)` with the labels of all batches concatenated;
    - an `Input` from `kdpemb.datasets.inputs.open_input`, read as it is.

    Args:
        backbone: a built `keras.Model` mapping images to `(batch, D)`.
        data: the images, as above.
        batch_size: int. Images per backbone call for array data. Defaults
            to `256`.
        cache: str, path-like or None. A directory (created if missing) to
            keep the features in, under a key of `backbone_name`, the
            backbone's weights and the data (see `kdpemb.feature_cache`).
            `None` computes every time. Defaults to `None`.
        backbone_name: str or None. Required with `cache`: a name for the
            backbone's code and architecture, which the key does not hash
            (it hashes the weights). Change it whenever the backbone
            computes something else from the same weights. Defaults to
            `None`.
        data_name: str or None. A name for the data in the key. Required
            with `cache` for a `tf.data.Dataset` or a `PyDataset` (reading
            a stream twice may not give the same batches, so it is not
            hashed): the same name must mean the same images in the same
            order. Arrays are hashed; a name given for them is added to the
            key. Defaults to `None`.
        verbose: "auto", 0, 1 or 2. 0 is silent, 1 a `keras.utils.Progbar`,
            2 a line at the start and one at the end; "auto" is 1 when
            stdout is a terminal or a notebook and 0 otherwise (logs, CI,
            doctests). Defaults to `"auto"`.

    Returns:
        A float32 NumPy array `(N, D)`, or `(features, labels)` for data
        with labels (see above).

    Raises:
        TypeError: if `backbone` is not a `keras.Model` or `data` is of no
            kind above.
        ValueError: if `batch_size`, `verbose`, `cache`, `backbone_name` or
            `data_name` is invalid or missing; the backbone is not built or
            does not output `(batch, D)`; the data is empty, not numeric, or
            of an image shape the backbone does not take (both shapes are
            named); or pixels or features are NaN or infinite
            (`NonFiniteInputError`, naming the first row; for features
            `NonFiniteFeaturesError`, which counts their rows).

    Example:

    >>> import os, tempfile
    >>> import keras, numpy as np
    >>> backbone = keras.Sequential([keras.Input((8, 8, 1)),
    ...                              keras.layers.GlobalAveragePooling2D()])
    >>> images = np.full((5, 8, 8, 1), 2, np.uint8)
    >>> features = extract(backbone, images, batch_size=2)
    >>> features.shape, features.dtype, features[:, 0].tolist()
    ((5, 1), dtype('float32'), [2.0, 2.0, 2.0, 2.0, 2.0])
    >>> features, labels = extract(backbone, (images, np.arange(5)))
    >>> labels.tolist()
    [0, 1, 2, 3, 4]
    >>> with tempfile.TemporaryDirectory() as cache:
    ...     first = extract(backbone, images, cache=cache, backbone_name="mean-v1")
    ...     again = extract(backbone, images, cache=cache, backbone_name="mean-v1")
    ...     files = len(os.listdir(cache))  # `again` was loaded from disk.
    >>> np.array_equal(first, again), files
    (True, 1)
    """
    verbose = _check_verbose(verbose)
    cache = feature_cache.open_cache(cache, backbone_name, data_name)
    spec = _BackboneSpec(backbone)  # The cheapest checks first.
    source = inputs.open_input(data, ("images", "labels"), batch_size=batch_size)
    if not source.is_stream and spec.input_shape is not None:
        spec.check_image_shape(source.shape, source.name, stream=False)
    if not source.is_stream:  # Arrays: scanned whole before the backbone runs.
        finite_inputs.check_array(
            source.arrays().images, "images", what="pixels", action="extract",
            as_dtype=spec.dtype_for(source.dtype),
        )  # fmt: skip

    if cache is not None:
        # A stream's labels are kept with its features; arrays' are the caller's.
        stored_labels = source.is_stream and "labels" in source.fields
        key = cache.key(backbone, source, stored_labels)
        cached = cache.load(key, source.num_examples, stored_labels)
        if cached is not None:
            if verbose:
                path = cache.paths(key)[0]
                print(f"Loaded {len(cached[0])} cached features from {path}")
            features, labels = cached
            if "labels" not in source.fields:
                return features
            return features, labels if stored_labels else source.arrays().labels

    features, labels = _compute(spec, source, verbose)
    _check_finite(features)
    if cache is not None:
        cache.save(key, features, labels if stored_labels else None)
    return features if labels is None else (features, labels)


# Arguments.


def _check_verbose(verbose):
    if isinstance(verbose, str) and verbose == "auto":
        stdout_is_terminal = getattr(sys.stdout, "isatty", None)
        interactive = bool(stdout_is_terminal and stdout_is_terminal())
        return 1 if interactive or "ipykernel" in sys.modules else 0
    if isinstance(verbose, bool) or verbose not in VERBOSE[1:]:
        raise ValueError(
            f"verbose must be one of {', '.join(map(repr, VERBOSE))}, got "
            f"{verbose!r}; 0 is silent, 1 shows a progress bar."
        )
    return int(verbose)


# The backbone.


def _optional_attribute(model, name):
    """`model.inputs` or `model.outputs`, or None for a subclassed model."""
    try:
        value = getattr(model, name)
    except (AttributeError, ValueError):
        return None
    return None if value is None else list(value)


class _BackboneSpec:
    """The backbone with what it tells of its input and output."""

    def __init__(self, backbone):
        if not isinstance(backbone, keras.Model):
            raise TypeError(
                "backbone must be a keras.Model mapping images to features "
                f"(batch, D), got {type(backbone).__name__}; wrap a layer with "
                "keras.Sequential([keras.Input(image_shape), layer])."
            )
        if not backbone.built:
            raise ValueError(
                f"The backbone {backbone.name!r} is not built, so it has no "
                "weights yet; start it with keras.Input(shape=image_shape), or "
                "call it once on a batch of images."
            )
        self.model = backbone
        self.devices = _Devices(backbone)
        self.input_shape = self.input_dtype = None
        inputs = _optional_attribute(backbone, "inputs")
        if inputs is not None:
            if len(inputs) != 1:
                raise ValueError(
                    f"The backbone takes {len(inputs)} inputs; extract feeds it "
                    "one batch of images. Wrap it in a model with one image input."
                )
            self.input_shape = tuple(inputs[0].shape)
            self.input_dtype = inputs[0].dtype
        outputs = _optional_attribute(backbone, "outputs")
        if outputs is not None:
            if len(outputs) != 1:
                raise ValueError(
                    f"The backbone has {len(outputs)} outputs; extract needs one, "
                    "the features (batch, D). Build a model with that output only."
                )
            self.check_output_shape(tuple(outputs[0].shape))

    def check_output_shape(self, shape):
        if len(shape) != 2:
            raise ValueError(
                f"The backbone must map images to features of shape (batch, D), "
                f"but its output has shape {inputs.shape_text(shape)}. {_POOLING_FIX}"
            )

    def prepare(self, images, where, stream):
        """`images` (numeric, from `kdpemb.datasets.inputs`) cast for the backbone."""
        if self.input_shape is not None:
            self.check_image_shape(images.shape, where, stream)
        return images.astype(self.dtype_for(images.dtype), copy=False)

    def dtype_for(self, dtype):
        """The dtype images of `dtype` are cast to for the backbone."""
        if self.input_dtype is not None:
            try:
                return np.dtype(self.input_dtype)
            except TypeError:  # e.g. bfloat16: the backbone converts.
                return np.dtype(dtype)
        if np.dtype(dtype).kind == "f":
            return np.dtype(dtype)
        return np.dtype(keras.config.floatx())

    def check_image_shape(self, shape, where, stream):
        inputs.check_input_shape(self.input_shape, shape, where, stream=stream)

    def run(self, images, where, first):
        padded = self.devices.pad(images)
        try:
            output = self.devices.predict(padded)
        except Exception as error:
            if self.input_shape is not None or not first:
                raise
            raise ValueError(
                f"The backbone failed on the first batch, images of shape "
                f"{inputs.shape_text(images.shape[1:])} and dtype {images.dtype} from "
                f"{where}; check that it takes such images. "
                f"({type(error).__name__}: {error})"
            ) from error
        if isinstance(output, list | tuple) and len(output) == 1:
            output = output[0]
        if isinstance(output, dict | list | tuple):
            raise ValueError(
                "The backbone returned several outputs; extract needs one, the "
                "features (batch, D). Build a model with that output only."
            )
        output = np.asarray(output)
        self.check_output_shape(output.shape)
        if output.shape[0] != padded.shape[0]:
            raise ValueError(
                f"The backbone returned {output.shape[0]} rows of features for "
                f"{padded.shape[0]} images ({where}); it must map each image to "
                "one row."
            )
        return output[: len(images)].astype(np.float32, copy=False)


class _Devices:
    """Where the backbone runs: one device (`predict_on_batch`), or each
    batch split into equal shares over the replicas of the backbone's
    `tf.distribute` strategy, or over the devices of the JAX
    `keras.distribution` (a batch sharded along its rows); one host only."""

    def __init__(self, backbone):
        from kdpemb import distribute

        self.model, self.strategy, self.count = backbone, None, 1
        self._replicas_run = None
        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf

            # Keras' own choice: the scope the backbone was built in, or
            # the one open now.
            strategy = getattr(backbone, "_distribute_strategy", None)
            if strategy is None and tf.distribute.has_strategy():
                strategy = tf.distribute.get_strategy()
            if strategy is not None and strategy.num_replicas_in_sync > 1:
                self.strategy, self.count = strategy, strategy.num_replicas_in_sync
        elif keras.backend.backend() == "jax":
            distribution = keras.distribution.distribution()
            if distribution is not None:
                self.count = int(distribution.device_mesh.devices.size)
        if self.count == 1:
            return
        hosts = distribute.current_hosts(backbone).count
        if hosts > 1:
            engine = (
                "no tf.distribute strategy (build the backbone outside its scope)"
                if self.strategy is not None
                else "no keras.distribution set"
            )
            raise ValueError(
                f"extract splits each batch over the devices of one host, but "
                f"this job spans {hosts} hosts: extract each host's images with "
                f"{engine}, or on one host, then fit on the features."
            )

    def pad(self, images):
        """`images` and copies of its last image, a multiple of the devices."""
        extra = -len(images) % self.count
        if not extra:
            return images
        return np.concatenate([images, np.repeat(images[-1:], extra, axis=0)])

    def predict(self, images):
        """The backbone's output on `images` (rows a multiple of the devices)."""
        if self.count == 1:
            return self.model.predict_on_batch(images)
        if self.strategy is not None:
            return self._replicas_predict(images)
        import jax

        layout = keras.distribution.distribution().get_data_layout(images.shape)
        # Sharded along the rows: each device runs the backbone on its own.
        sharded = jax.device_put(images, layout.backend_layout)
        return self.model.predict_on_batch(sharded)

    def _replicas_predict(self, images):
        """TensorFlow: replica i runs `predict_step` on the i-th share of
        `images` (Keras' `predict_on_batch` would give every replica the
        whole batch and return each row once per replica)."""
        import tensorflow as tf

        strategy, share = self.strategy, len(images) // self.count
        if self._replicas_run is None:

            def run(values):
                outputs = strategy.run(
                    lambda x: self.model.predict_step((x,)), args=(values,)
                )
                return tf.nest.map_structure(
                    lambda o: tf.concat(strategy.experimental_local_results(o), 0),
                    outputs,
                )

            self._replicas_run = tf.function(run)  # A trace per batch shape.
        values = strategy.experimental_distribute_values_from_function(
            lambda context: tf.constant(
                images[context.replica_id_in_sync_group * share :][:share]
            )
        )
        return tf.nest.map_structure(np.asarray, self._replicas_run(values))


# Computing.


class _Rows:
    """Feature rows appended batch by batch, in one buffer when the size is known."""

    def __init__(self, capacity):
        self.capacity = capacity  # f(rows of the first batch): total rows or None.
        self.buffer = None
        self.chunks = []
        self.count = 0

    def append(self, rows, where):
        if self.count and rows.shape[1] != self.width:
            raise ValueError(
                f"The backbone returned {rows.shape[1]} features per image for "
                f"{where} but {self.width} before; it must give every image the "
                "same number of features."
            )
        self.width = rows.shape[1]
        if self.count == 0:
            capacity = self.capacity(len(rows))
            if capacity is not None:
                self.buffer = np.empty((capacity, self.width), np.float32)
        if self.buffer is not None and self.count + len(rows) <= len(self.buffer):
            self.buffer[self.count : self.count + len(rows)] = rows
        else:
            if self.buffer is not None:  # More rows than expected.
                self.chunks.append(self.buffer[: self.count])
                self.buffer = None
            self.chunks.append(rows)
        self.count += len(rows)

    def array(self):
        if self.buffer is not None:
            return self.buffer[: self.count]
        return np.concatenate(self.chunks)


def _compute(spec, source, verbose):
    progbar = (
        keras.utils.Progbar(source.num_batches, verbose=verbose) if verbose else None
    )
    if verbose == 2:  # A log: what runs, before the line at the end.
        count = source.num_examples
        of = "" if count is None else f" of {count:,} images"
        print(f"Extracting the features{of}…", flush=True)

    def capacity(first_rows):  # Total rows, or None where unknown.
        if not source.is_stream or source.num_batches is None:
            return source.num_examples
        return source.num_batches * first_rows

    rows = _Rows(capacity)
    labels = []
    step = 0
    for batch in source.batches():
        if source.is_stream:  # Refused before the cast and the backbone.
            finite_inputs.check_rows(
                batch.images, "images", first=rows.count, what="pixels",
                where=batch.where, action="extract",
                as_dtype=spec.dtype_for(batch.images.dtype),
            )  # fmt: skip
        images = spec.prepare(batch.images, batch.where, source.is_stream)
        if batch.labels is not None:
            labels.append(batch.labels)
        if len(images):
            first = rows.count == 0
            rows.append(spec.run(images, batch.where, first), batch.where)
        step += 1
        if progbar is not None:
            progbar.update(step)
    if progbar is not None and source.num_batches is None:
        progbar.update(step, finalize=True)
    return rows.array(), np.concatenate(labels) if labels else None


def _check_finite(features):
    finite = np.isfinite(features).all(axis=1)
    if finite.all():
        return
    bad = np.flatnonzero(~finite)
    # Non-finite images were refused before the backbone ran on them.
    cause = (
        "the images are finite, so check the backbone's weights for NaN "
        "(e.g. a diverged pre-training) and its layers"
    )
    summary = (
        f"{bad.size} of {len(features)} rows hold NaN or infinite values, the "
        f"first is row {bad[0]}"
    )
    raise NonFiniteFeaturesError(
        f"{summary}; {cause}. A DP fit on them would be meaningless, so "
        "nothing was returned or cached.",
        summary,
        row=int(bad[0]),
    )
