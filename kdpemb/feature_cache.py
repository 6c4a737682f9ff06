"""Features kept on disk, keyed by the backbone's weights and names you give.

`kdpemb.features.extract(..., cache=directory, backbone_name=...)` keeps
its features here as `features-<key>.npy` (float32; plus
`features-<key>.labels.npy` for the labels of a stream), written
atomically, so an interrupted run leaves a whole file or none.

**The key** is a SHA-256 of: a format tag; `backbone_name`; the class and
configuration of every layer, without its name (so a layer without
weights, such as pooling or `Rescaling`, changes the key; auto-generated
names such as `dense_1` do not); every weight of the backbone
(`backbone.weights`, in order: shape, dtype and bytes); whether the
labels of a stream are stored with the features;
and the data: for arrays their shape, dtype and a SHA-256 of their bytes
(read in chunks of 16 MiB), plus `data_name` if given; for a
`tf.data.Dataset` or a `PyDataset`, the `data_name` you must give it.

The backbone's code is not hashed: `backbone_name` stands for it. Give a
new name whenever the backbone computes something else from the same
weights and layer configurations: a custom layer's new code, another
preprocessing outside the model.
The Keras backend and library versions are not part of the key.
"""

import contextlib
import hashlib
import math
import os
import pathlib
import tempfile
import warnings

import keras
import numpy as np

__all__ = ["FeatureCache", "cache_key", "data_fingerprint", "open_cache"]

_KEY_FORMAT = b"kdpemb.feature_cache/3"
_HASH_CHUNK_BYTES = 1 << 24


def _check_name(value, argument, example):
    if not isinstance(value, str) or not value:
        raise ValueError(
            f"{argument} must be a non-empty str, got {value!r}; e.g. "
            f"{argument}={example!r}."
        )
    return value


def open_cache(cache, backbone_name=None, data_name=None):
    """Returns a `FeatureCache` for `extract`'s arguments, or None without `cache`.

    Args:
        cache: str, path-like or None. The directory (created when first
            written to).
        backbone_name: str. Names the backbone's code and architecture;
            required with `cache`.
        data_name: str or None. Names the data; required for streams.

    Example:

    >>> open_cache(None) is None
    True
    >>> open_cache("features")
    Traceback (most recent call last):
    ...
    ValueError: cache needs backbone_name=...
    """
    if cache is None:
        if backbone_name is not None or data_name is not None:
            raise ValueError(
                "backbone_name and data_name name the backbone and the data in "
                "the cache, but cache is None; pass cache='some/directory' too, "
                "or drop them."
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
    if backbone_name is None:
        raise ValueError(
            "cache needs backbone_name=, a name for the backbone's code and "
            "architecture: the cache key holds its weights, not its code. E.g. "
            "backbone_name='resnet50-imagenet-v1'; give a new name whenever the "
            "backbone's layers or code change."
        )
    _check_name(backbone_name, "backbone_name", "resnet50-imagenet-v1")
    if data_name is not None:
        _check_name(data_name, "data_name", "fashion-mnist-train-v1")
    return FeatureCache(directory, backbone_name, data_name)


def data_fingerprint(data, data_name=None):
    """The data's part of the key: `(tag, value)` pairs.

    Args:
        data: an `Input` (`kdpemb.datasets.inputs.open_input`).
        data_name: str or None. Required for a stream, which is not hashed.

    Example:

    >>> import numpy as np
    >>> from kdpemb.datasets.inputs import open_input
    >>> pairs = data_fingerprint(open_input(np.zeros((2, 3), np.uint8)))
    >>> [tag for tag, _ in pairs]
    ['data', 'shape', 'dtype', 'sha256']
    """
    if data.is_stream:
        if data_name is None:
            raise ValueError(
                f"cache needs data_name= for a {data.kind}: reading a stream to "
                "hash it may not give the same batches twice (shuffling, "
                "augmentation). Name the data, e.g. data_name='train-v1' (the "
                "same name must mean the same images in the same order), or pass "
                "the images as a NumPy array, which is hashed."
            )
        return [("data", "stream"), ("data_name", data_name)]
    digest = hashlib.sha256()
    row_bytes = max(1, math.prod(data.shape[1:]) * data.dtype.itemsize)
    for batch in data.batches(max(1, _HASH_CHUNK_BYTES // row_bytes)):
        chunk = np.ascontiguousarray(batch.images.astype(data.dtype, copy=False))
        digest.update(chunk.reshape(-1).view(np.uint8))
    pairs = [
        ("data", "array"),
        ("shape", repr(data.shape)),
        ("dtype", data.dtype.str),
        ("sha256", digest.hexdigest()),
    ]
    return pairs if data_name is None else [*pairs, ("data_name", data_name)]


def cache_key(backbone, backbone_name, fingerprint):
    """SHA-256 (hex) of the format tag, the name, the weights and `fingerprint`.

    Example:

    >>> import keras
    >>> backbone = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    >>> key = cache_key(backbone, "toy-v1", [("data_name", "train")])
    >>> len(key), key == cache_key(backbone, "toy-v2", [("data_name", "train")])
    (64, False)
    """
    digest = hashlib.sha256()

    def field(tag, payload):
        if isinstance(payload, str):
            payload = payload.encode()
        digest.update(tag.encode() + b"\0")
        digest.update(len(payload).to_bytes(8, "little"))
        digest.update(payload)

    field("format", _KEY_FORMAT)
    field("backbone_name", backbone_name)
    field("architecture", _architecture(backbone))
    for weight in backbone.weights:
        value = np.ascontiguousarray(keras.ops.convert_to_numpy(weight))
        field("weight", f"{value.shape} {value.dtype.str}")
        field("bytes", value.reshape(-1).view(np.uint8))
    for tag, value in fingerprint:
        field(tag, value)
    return digest.hexdigest()


def _architecture(backbone):
    """Every layer's class and config without its name, and the input shape.

    A cheap guard under `backbone_name`: layers without weights (pooling,
    `Rescaling`, `Normalization(mean=...)`, a dtype policy) change the key.
    Names are left out, so a model rebuilt with auto-generated names
    (`dense_1`) still hits the cache; code is not hashed.
    """
    parts = [repr(getattr(backbone, "input_shape", None))]
    for layer in backbone._flatten_layers(include_self=False, recursive=True):
        if isinstance(layer, keras.Model):
            continue  # Its layers are listed one by one.
        try:
            config = dict(layer.get_config())
        except NotImplementedError:
            config = {}
        config.pop("name", None)
        parts.append(f"{type(layer).__qualname__} {sorted(config.items())!r}")
    return "\n".join(parts)


class FeatureCache:
    """A directory of cached features, for one backbone name (and data name).

    Args:
        directory: `pathlib.Path`. Created when first written to.
        backbone_name: str. See the module docstring.
        data_name: str or None.

    Example:

    >>> import pathlib, tempfile
    >>> import numpy as np
    >>> with tempfile.TemporaryDirectory() as directory:
    ...     cache = FeatureCache(pathlib.Path(directory), "toy-v1")
    ...     cache.save("0" * 64, np.ones((2, 3), np.float32))
    ...     features, labels = cache.load("0" * 64, num_examples=2)
    >>> features.tolist(), labels
    ([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], None)
    """

    def __init__(self, directory, backbone_name, data_name=None):
        self.directory = directory
        self.backbone_name = backbone_name
        self.data_name = data_name

    def key(self, backbone, data, with_labels):
        """The key of `backbone`'s features of `data` (an `Input`)."""
        fingerprint = data_fingerprint(data, self.data_name)
        fingerprint.append(("stored_labels", str(bool(with_labels))))
        return cache_key(backbone, self.backbone_name, fingerprint)

    def paths(self, key):
        """The features' and the labels' file of `key`."""
        return (
            self.directory / f"features-{key}.npy",
            self.directory / f"features-{key}.labels.npy",
        )

    def load(self, key, num_examples=None, with_labels=False):
        """The cached `(features, labels)`, or None (with a warning if unusable)."""
        features_path, labels_path = self.paths(key)
        if not features_path.exists() or (with_labels and not labels_path.exists()):
            return None
        try:
            features = np.load(features_path, allow_pickle=False)
            labels = np.load(labels_path, allow_pickle=False) if with_labels else None
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

    def save(self, key, features, labels=None):
        """Writes the entry atomically; warns (and keeps going) if it cannot."""
        features_path, labels_path = self.paths(key)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            if labels is not None:  # First: the features file marks a whole entry.
                _save_atomically(labels_path, labels)
            _save_atomically(features_path, features)
        except (OSError, ValueError) as error:
            warnings.warn(
                f"Could not cache the features in {self.directory} "
                f"({type(error).__name__}: {error}); they are returned but not "
                "cached.",
                UserWarning,
                stacklevel=3,
            )


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
