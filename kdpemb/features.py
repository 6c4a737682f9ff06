"""Features (embeddings) of a frozen backbone, for last-layer DP fine-tuning.

`extract` runs a backbone over images once, in inference mode and batch by
batch, and returns its embeddings as a float32 NumPy array, which a
classifier then fits a linear head to with DP. With `cache=` the features
are kept on disk under a SHA-256 of the backbone and the data, so running
the same backbone on the same images again loads them instead.

**The cache key** is a SHA-256 of: a format tag; the backbone's
architecture (`backbone.to_json()`, the `get_config()` of every layer it
holds, and the bytecode of every method of the non-Keras classes among
them, i.e. custom layers and subclassed models, whose `call` no config
describes); every weight's shape, dtype and bytes, in order; and the data:
for arrays their shape, dtype and a SHA-256 of their bytes (read in chunks
of 16 MiB), for streams the `cache_key` you name them by. The Keras backend
is not part of it (TensorFlow and JAX agree up to float error), nor is
kdpemb's or Keras' version. Layer names are part of it, so a model rebuilt
in the same process with auto-generated names (`dense_1` for `dense`)
misses the cache and is recomputed; a backbone whose behaviour hangs on
state outside its configs, weights and code (a closure, a global) is not
told apart: use `cache=None` or a fresh directory for those.
"""

import contextlib
import hashlib
import json
import math
import numbers
import os
import pathlib
import sys
import tempfile
import types
import warnings

import keras
import numpy as np

__all__ = ["extract"]

VERBOSE = ("auto", 0, 1, 2)
_KEY_FORMAT = b"kdpemb.features/1"
_HASH_CHUNK_BYTES = 1 << 24
# Classes whose code the cache key leaves out: their behaviour is their config.
_LIBRARY_MODULES = ("builtins", "abc", "typing", "keras", "tensorflow", "jax")
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
    cache_key=None,
    verbose="auto",
):
    """Returns the features of `backbone` on every image of `data`, in order.

    The backbone runs in inference mode (`training=False`, so Dropout is
    off and BatchNormalization uses its moving statistics), compiled, one
    batch at a time (`backbone.predict_on_batch`): memory holds one batch
    of images plus the features. Images of any numeric dtype (e.g. uint8)
    are cast to the dtype of the backbone's input. Rows with NaN or
    infinite features raise instead of feeding a DP fit.

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
      or `(features, labels)` with the labels of all batches concatenated.

    Args:
        backbone: a built `keras.Model` mapping images to `(batch, D)`.
        data: the images, as above.
        batch_size: int. Images per backbone call for array data. Defaults
            to `256`.
        cache: str, path-like or None. A directory (created if missing) to
            keep the features in, as `features-<key>.npy` (float32, plus
            `features-<key>.labels.npy` for labels), written atomically.
            `None` computes every time. Defaults to `None`.
        cache_key: str or None. The name of the data in the cache key, in
            place of hashing it. Required with `cache` for a `tf.data.Dataset`
            or a `PyDataset` (reading a stream twice may not give the same
            batches, so it is not hashed); optional for arrays, to skip
            hashing large ones. The same name must mean the same images in
            the same order. Defaults to `None`.
        verbose: "auto", 0, 1 or 2. 0 is silent, 1 a `keras.utils.Progbar`,
            2 one line at the end; "auto" is 1 when stdout is a terminal or
            a notebook and 0 otherwise (logs, CI, doctests). Defaults to
            `"auto"`.

    Returns:
        A float32 NumPy array `(N, D)`, or `(features, labels)` for data
        with labels (see above).

    Raises:
        TypeError: if `backbone` is not a `keras.Model` or `data` is of no
            kind above.
        ValueError: if `batch_size`, `verbose`, `cache` or `cache_key` is
            invalid; the backbone is not built or does not output
            `(batch, D)`; the data is empty, not numeric, or of an image
            shape the backbone does not take (both shapes are named); or
            features are NaN or infinite (their rows are counted).

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
    ...     first = extract(backbone, images, cache=cache)
    ...     again = extract(backbone, images, cache=cache)  # Loaded from disk.
    ...     files = len(os.listdir(cache))
    >>> np.array_equal(first, again), files
    (True, 1)
    """
    _check_batch_size(batch_size)
    verbose = _check_verbose(verbose)
    directory = _check_cache(cache, cache_key)
    spec = _BackboneSpec(backbone)
    source = _source(data, batch_size)
    source.check(spec)

    paths = None
    expect_labels = False
    if directory is not None:
        if cache_key is None:
            fingerprint = source.fingerprint()
        else:
            fingerprint = [("data", "cache_key"), ("cache_key", cache_key)]
        expect_labels = source.stores_labels()
        fingerprint.append(("stored_labels", str(expect_labels)))
        directory.mkdir(parents=True, exist_ok=True)
        key = _cache_key(backbone, fingerprint)
        paths = (
            directory / f"features-{key}.npy",
            directory / f"features-{key}.labels.npy",
        )
        cached = _load_cached(*paths, source.num_examples, expect_labels)
        if cached is not None:
            if verbose:
                print(f"Loaded {len(cached[0])} cached features from {paths[0]}")
            return source.result(*cached)

    features, labels, bad_images = _compute(spec, source, verbose)
    _check_finite(features, bad_images)
    if paths is not None:
        _save_cached(*paths, features, labels if expect_labels else None)
    return source.result(features, labels)


# Arguments.


def _check_batch_size(batch_size):
    if (
        isinstance(batch_size, bool)
        or not isinstance(batch_size, numbers.Integral)
        or batch_size < 1
    ):
        raise ValueError(
            f"batch_size must be a positive int, got {batch_size!r}; e.g. "
            "batch_size=256 (lower it if the backbone runs out of memory)."
        )


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


def _check_cache(cache, cache_key):
    if cache_key is not None and (not isinstance(cache_key, str) or not cache_key):
        raise ValueError(
            f"cache_key must be a non-empty str naming the data, got {cache_key!r}; "
            "e.g. cache_key='fashion-mnist-train-v1'."
        )
    if cache is None:
        if cache_key is not None:
            raise ValueError(
                "cache_key names the data in the cache, but cache is None; pass "
                "cache='some/directory' too, or drop cache_key."
            )
        return None
    try:
        directory = pathlib.Path(cache).expanduser()
    except TypeError as error:
        raise ValueError(
            f"cache must be a directory path (str or path-like) or None, got {cache!r}."
        ) from error
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(
            f"cache={str(directory)!r} is a file; pass a directory to keep the "
            "features in (it is created if missing)."
        )
    return directory


# The backbone.


def _optional_attribute(model, name):
    """`model.inputs` or `model.outputs`, or None for a subclassed model."""
    try:
        value = getattr(model, name)
    except (AttributeError, ValueError):
        return None
    return None if value is None else list(value)


def _shape_text(shape):
    return "(" + ", ".join("None" if d is None else str(d) for d in shape) + ")"


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
                f"but its output has shape {_shape_text(shape)}. {_POOLING_FIX}"
            )

    def prepare(self, images, where, stream):
        """`images` as a NumPy batch the backbone takes, or a clear error."""
        images = np.asarray(images)
        if images.dtype == bool or images.dtype.kind not in "uif":
            raise ValueError(
                f"Images must be numbers, but {where} has dtype {images.dtype}; "
                "pass pixel values, e.g. uint8 or float32."
            )
        if images.ndim < 2:
            raise ValueError(
                f"{where} must be a batch of images (N, ...), but has shape "
                f"{_shape_text(images.shape)}."
            )
        if self.input_shape is not None:
            self.check_image_shape(images.shape, where, stream)
        if self.input_dtype is not None:
            try:
                target = np.dtype(self.input_dtype)
            except TypeError:  # e.g. bfloat16: the backbone converts.
                target = images.dtype
        elif images.dtype.kind == "f":
            target = images.dtype
        else:
            target = np.dtype(keras.config.floatx())
        return images.astype(target, copy=False)

    def check_image_shape(self, shape, where, stream):
        expected = self.input_shape[1:]
        got = tuple(shape[1:])
        if len(got) == len(expected) and all(
            e is None or e == g for e, g in zip(expected, got, strict=True)
        ):
            return
        fix = "Resize the images or build the backbone for their shape."
        if (
            stream
            and len(shape) == len(expected)
            and all(e is None or e == g for e, g in zip(expected, shape, strict=True))
        ):
            fix = (
                "It seems to yield single images, not batches; batch it first "
                "(e.g. dataset.batch(256))."
            )
        elif len(got) == len(expected) - 1 and expected[-1] == 1:
            fix = "Add the channel axis: images[..., None]."
        raise ValueError(
            f"The backbone takes images of shape {_shape_text(expected)} (its "
            f"input is {_shape_text(self.input_shape)}), but {where} has images "
            f"of shape {_shape_text(got)}. {fix}"
        )

    def run(self, images, where, first):
        try:
            output = self.model.predict_on_batch(images)
        except Exception as error:
            if self.input_shape is not None or not first:
                raise
            raise ValueError(
                f"The backbone failed on the first batch, images of shape "
                f"{_shape_text(images.shape[1:])} and dtype {images.dtype} from "
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
        if output.shape[0] != images.shape[0]:
            raise ValueError(
                f"The backbone returned {output.shape[0]} rows of features for "
                f"{images.shape[0]} images ({where}); it must map each image to "
                "one row."
            )
        return output.astype(np.float32, copy=False)


# The data.


def _is_tf_dataset(data):
    tf = sys.modules.get("tensorflow")  # A tf.data.Dataset means TF is loaded.
    return tf is not None and isinstance(data, tf.data.Dataset)


def _is_array_like(data):
    return all(hasattr(data, a) for a in ("shape", "dtype", "__len__", "__getitem__"))


def _source(data, batch_size):
    if _is_tf_dataset(data):
        return _TFDataSource(data)
    if isinstance(data, keras.utils.PyDataset):
        return _PyDataSource(data)
    if isinstance(data, np.ndarray):
        return _ArraySource(data, batch_size)
    if hasattr(data, "images"):
        return _ArraySource(data.images, batch_size, name="data.images")
    if isinstance(data, tuple):
        if len(data) != 2:
            raise TypeError(
                f"A tuple data must be (images, labels), got a tuple of "
                f"{len(data)} items."
            )
        return _ArraySource(data[0], batch_size, labels=data[1], name="images")
    if isinstance(data, list):
        return _ArraySource(np.asarray(data), batch_size)
    if _is_array_like(data):
        return _ArraySource(data, batch_size)
    raise TypeError(
        f"data must be a NumPy array of images, an object with .images (e.g. "
        "kdpemb.datasets.synthetic_identities(...)), a tuple (images, labels), "
        f"a tf.data.Dataset or a keras.utils.PyDataset; got "
        f"{type(data).__name__}. Wrap a generator in a PyDataset or "
        "tf.data.Dataset.from_generator."
    )


class _ArraySource:
    """Images in memory (or a lazy array), cut into batches of `batch_size`."""

    def __init__(self, images, batch_size, labels=None, name="data"):
        if not isinstance(images, np.ndarray) and not _is_array_like(images):
            images = np.asarray(images)
        self.images = images
        self.name = name
        self.batch_size = batch_size
        self.shape = tuple(int(d) for d in images.shape)
        if len(self.shape) < 2:
            raise ValueError(
                f"{name} must be images (N, height, width, channels) or at least "
                f"(N, ...), got shape {_shape_text(self.shape)}."
            )
        self.num_examples = self.shape[0]
        if self.num_examples == 0:
            raise ValueError(
                f"{name} holds no images (shape {_shape_text(self.shape)}); there "
                "is nothing to extract features from."
            )
        # The dtype of a lazy array-like is that of what indexing it gives.
        first = images[:1] if isinstance(images, np.ndarray) else self._take(0, 1)
        self.dtype = first.dtype
        if self.dtype == bool or self.dtype.kind not in "uif":
            raise ValueError(
                f"Images must be numbers, but {name} has dtype {self.dtype}; pass "
                "pixel values, e.g. uint8 or float32."
            )
        self.labels = None
        if labels is not None:
            self.labels = np.asarray(labels)
            if self.labels.shape[:1] != (self.num_examples,):
                raise ValueError(
                    f"labels must hold one label per image ({self.num_examples}), "
                    f"got shape {self.labels.shape}."
                )

    @property
    def num_batches(self):
        return math.ceil(self.num_examples / self.batch_size)

    def capacity(self, first_rows):
        return self.num_examples

    def check(self, spec):
        if spec.input_shape is not None:
            spec.check_image_shape(self.shape, self.name, stream=False)

    def stores_labels(self):
        return False  # Labels of arrays come from the caller, not the cache.

    def _take(self, start, stop):
        return np.asarray(self.images[start:stop])

    def batches(self):
        for start in range(0, self.num_examples, self.batch_size):
            stop = min(start + self.batch_size, self.num_examples)
            yield self._take(start, stop), None, f"{self.name}[{start}:{stop}]"

    def fingerprint(self):
        digest = hashlib.sha256()
        row_bytes = max(1, math.prod(self.shape[1:]) * self.dtype.itemsize)
        rows = max(1, _HASH_CHUNK_BYTES // row_bytes)
        for start in range(0, self.num_examples, rows):
            chunk = self._take(start, start + rows).astype(self.dtype, copy=False)
            chunk = np.ascontiguousarray(chunk)
            digest.update(chunk.reshape(-1).view(np.uint8))
        return [
            ("data", "array"),
            ("shape", repr(self.shape)),
            ("dtype", self.dtype.str),
            ("sha256", digest.hexdigest()),
        ]

    def result(self, features, labels):
        return features if self.labels is None else (features, self.labels)


def _split_batch(batch, where):
    if isinstance(batch, dict):
        raise ValueError(
            f"{where} is a dict; extract takes batches of images or (images, "
            "labels) tuples. Map it, e.g. dataset.map(lambda d: (d['image'], "
            "d['label']))."
        )
    if isinstance(batch, list | tuple):
        if len(batch) == 1:
            return batch[0], None
        if len(batch) == 2:
            return batch[0], batch[1]
        raise ValueError(
            f"{where} is a tuple of {len(batch)} items; extract takes batches of "
            "images or (images, labels). Drop the others (e.g. sample weights)."
        )
    return batch, None


class _StreamSource:
    """Batches from a tf.data.Dataset or a PyDataset, read once in order."""

    num_examples = None

    def check(self, spec):
        pass  # Each batch is checked as it comes.

    def capacity(self, first_rows):
        return None if self.num_batches is None else self.num_batches * first_rows

    def fingerprint(self):
        raise ValueError(
            f"cache needs cache_key= for a {self.kind}: reading a stream to hash "
            "it may not give the same batches twice (shuffling, augmentation). "
            "Name the data, e.g. cache_key='train-v1' (the same name must mean "
            "the same images in the same order), or pass the images as a NumPy "
            "array, which is hashed."
        )

    def batches(self):
        has_labels = None
        for step, batch in enumerate(self._raw_batches()):
            where = f"batch {step} of the {self.kind}"
            images, labels = _split_batch(batch, where)
            if has_labels is None:
                has_labels = labels is not None
            elif has_labels != (labels is not None):
                raise ValueError(
                    f"{where} {'has' if labels is not None else 'lacks'} labels but "
                    "the first batch does not; yield images or (images, labels) "
                    "in every batch."
                )
            yield images, labels, where

    def stores_labels(self):
        where = f"the first batch of the {self.kind}"
        return _split_batch(self._first_batch(), where)[1] is not None

    def result(self, features, labels):
        return features if labels is None else (features, labels)


class _TFDataSource(_StreamSource):
    kind = "tf.data.Dataset"

    def __init__(self, dataset):
        self.dataset = dataset
        cardinality = int(dataset.cardinality())
        if cardinality == -1:  # tf.data.INFINITE_CARDINALITY
            raise ValueError(
                "The tf.data.Dataset repeats forever; extract reads it once. "
                "Remove .repeat() or end it with .take(num_batches)."
            )
        self.num_batches = cardinality if cardinality >= 0 else None

    def _raw_batches(self):
        return self.dataset.as_numpy_iterator()

    def _first_batch(self):
        import tensorflow as tf

        # The structure of the elements, without reading any.
        return tf.nest.map_structure(lambda _: np.empty(0), self.dataset.element_spec)


class _PyDataSource(_StreamSource):
    kind = "PyDataset"

    def __init__(self, dataset):
        self.dataset = dataset
        num_batches = dataset.num_batches
        if num_batches is None:
            raise ValueError(
                "The PyDataset is infinite (num_batches is None); extract reads "
                "it once. Give it a finite num_batches (or __len__)."
            )
        self.num_batches = int(num_batches)

    def _raw_batches(self):
        for index in range(self.num_batches):
            yield self.dataset[index]

    def _first_batch(self):
        if self.num_batches == 0:
            return np.empty(0)
        return self.dataset[0]


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
        return np.concatenate(self.chunks) if self.chunks else None


def _compute(spec, source, verbose):
    progbar = (
        keras.utils.Progbar(source.num_batches, verbose=verbose) if verbose else None
    )
    stream = isinstance(source, _StreamSource)
    rows = _Rows(source.capacity)
    labels = []
    bad_images = 0
    step = 0
    for images, batch_labels, where in source.batches():
        images = spec.prepare(images, where, stream)
        if batch_labels is not None:
            batch_labels = np.asarray(batch_labels)
            if batch_labels.shape[:1] != images.shape[:1]:
                raise ValueError(
                    f"{where} has {images.shape[0]} images but labels of shape "
                    f"{batch_labels.shape}; give one label per image."
                )
            labels.append(batch_labels)
        if len(images):
            if images.dtype.kind == "f":
                finite = np.isfinite(images.reshape(len(images), -1)).all(axis=1)
                bad_images += int(np.count_nonzero(~finite))
            rows.append(spec.run(images, where, first=rows.count == 0), where)
        step += 1
        if progbar is not None:
            progbar.update(step)
    if progbar is not None and source.num_batches is None:
        progbar.update(step, finalize=True)
    features = rows.array()
    if features is None:
        what = f"the {source.kind}" if stream else "data"
        raise ValueError(
            f"{what} yielded no images ({step} batches); there is nothing to "
            "extract features from."
        )
    if stream and labels:
        return features, np.concatenate(labels), bad_images
    return features, None, bad_images


def _check_finite(features, bad_images):
    finite = np.isfinite(features).all(axis=1)
    if finite.all():
        return
    bad = np.flatnonzero(~finite)
    cause = (
        f"{bad_images} image(s) hold NaN or infinite pixels; clean the data"
        if bad_images
        else "the images are finite, so check the backbone's weights for NaN "
        "(e.g. a diverged pre-training) and its layers"
    )
    raise ValueError(
        f"{bad.size} of {len(features)} feature rows hold NaN or infinite values "
        f"(the first is row {bad[0]}); {cause}. A DP fit on them would be "
        "meaningless, so nothing was returned or cached."
    )


# The cache.


def _is_library_class(cls):
    return cls.__module__.split(".")[0] in _LIBRARY_MODULES


def _const_text(value):
    if isinstance(value, types.CodeType):
        return _code_text(value)
    if isinstance(value, frozenset):  # Set order varies with the hash seed.
        return "frozenset(" + repr(sorted(_const_text(v) for v in value)) + ")"
    if isinstance(value, tuple):
        return "(" + ",".join(_const_text(v) for v in value) + ")"
    return repr(value)


def _code_text(code):
    """What a code object does, without its line numbers or file name."""
    return repr(
        (
            code.co_code.hex(),
            code.co_names,
            code.co_varnames,
            code.co_freevars,
            [_const_text(c) for c in code.co_consts],
        )
    )


def _class_text(cls):
    parts = [f"{cls.__module__}.{cls.__qualname__}"]
    for name, member in sorted(vars(cls).items()):
        if isinstance(member, staticmethod | classmethod):
            member = member.__func__
        functions = (
            [member.fget, member.fset, member.fdel]
            if isinstance(member, property)
            else [member]
        )
        for function in functions:
            if isinstance(function, types.FunctionType):
                parts.append(f"{name}: {_code_text(function.__code__)}")
    return "\n".join(parts)


def _architecture(backbone):
    """The backbone's configs and custom code, as text."""
    try:
        parts = [backbone.to_json()]
    except Exception as error:  # The layer configs below still describe it.
        parts = [f"to_json failed: {type(error).__name__}"]
    classes = []
    for layer in backbone._flatten_layers(include_self=True, recursive=True):
        try:
            config = json.dumps(layer.get_config(), sort_keys=True, default=str)
        except Exception as error:
            config = f"get_config failed: {type(error).__name__}"
        cls = type(layer)
        parts.append(f"{cls.__module__}.{cls.__qualname__} {config}")
        classes += [c for c in cls.__mro__ if c not in classes]
    parts += [_class_text(c) for c in classes if not _is_library_class(c)]
    return "\n".join(parts)


def _cache_key(backbone, data_fingerprint):
    digest = hashlib.sha256()

    def field(tag, payload):
        if isinstance(payload, str):
            payload = payload.encode()
        digest.update(tag.encode() + b"\0")
        digest.update(len(payload).to_bytes(8, "little"))
        digest.update(payload)

    field("format", _KEY_FORMAT)
    field("architecture", _architecture(backbone))
    for weight in backbone.weights:
        value = np.ascontiguousarray(keras.ops.convert_to_numpy(weight))
        field("weight", f"{value.shape} {value.dtype.str}")
        field("bytes", value.reshape(-1).view(np.uint8))
    for tag, value in data_fingerprint:
        field(tag, value)
    return digest.hexdigest()


def _load_cached(features_path, labels_path, num_examples, expect_labels):
    """The cached `(features, labels)`, or None to compute them."""
    if not features_path.exists() or (expect_labels and not labels_path.exists()):
        return None
    try:
        features = np.load(features_path, allow_pickle=False)
        labels = np.load(labels_path, allow_pickle=False) if expect_labels else None
        if features.dtype != np.float32 or features.ndim != 2:
            raise ValueError(f"holds {features.dtype} {features.shape}")
        if num_examples is not None and len(features) != num_examples:
            raise ValueError(f"holds {len(features)} rows, not {num_examples}")
        if labels is not None and len(labels) != len(features):
            raise ValueError("its labels do not match its rows")
        if not np.isfinite(features).all():
            raise ValueError("holds non-finite values")
    except (OSError, ValueError, EOFError) as error:
        warnings.warn(
            f"The cached features {features_path} are unusable ({error}); "
            "computing them again.",
            UserWarning,
            stacklevel=3,
        )
        return None
    return features, labels


def _save_atomically(path, array):
    """Writes `array` to `path` via a temporary file, so `path` is whole or absent."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as file:
            np.save(file, array, allow_pickle=False)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _save_cached(features_path, labels_path, features, labels):
    # Labels first: the features file marks a complete entry.
    try:
        if labels is not None:
            _save_atomically(labels_path, labels)
        _save_atomically(features_path, features)
    except (OSError, ValueError) as error:
        warnings.warn(
            f"Could not cache the features in {features_path.parent} "
            f"({type(error).__name__}: {error}); they are returned but not cached.",
            UserWarning,
            stacklevel=3,
        )
