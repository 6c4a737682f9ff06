"""Fashion-MNIST and MNIST from local files, with Keras' download as a fallback.

Build and CI machines often cannot download anything, so these loaders look
for the standard files in several places before asking Keras to fetch them:

1. the explicit `path` argument, or else the environment variable
   `KDPEMB_FASHION_MNIST` / `KDPEMB_MNIST` (a directory or an `.npz` file);
2. the Keras cache, `$KERAS_HOME` or `~/.keras`: `datasets/fashion-mnist/`
   (the four idx `.gz` files) for Fashion-MNIST, `datasets/mnist.npz` for
   MNIST;
3. the Debian directory: `/usr/share/datasets/fashion-mnist` (package
   `dataset-fashion-mnist`) or `/usr/share/datasets/mnist`;
4. Keras' own download (`keras.datasets.fashion_mnist.load_data()`), only
   with `download=True`.

A directory may hold the four idx files (`train-images-idx3-ubyte`,
`train-labels-idx1-ubyte`, `t10k-images-idx3-ubyte`,
`t10k-labels-idx1-ubyte`, each gzipped or not) or an `.npz` with the keys
`x_train, y_train, x_test, y_test`. The idx format is parsed here with NumPy;
Keras and TensorFlow are imported only for the download. Nothing is cached
between calls.
"""

import gzip
import os
import pathlib
import zlib

import numpy as np

from kdpemb.errors import DatasetNotFoundError  # re-exported

FASHION_MNIST_ENV = "KDPEMB_FASHION_MNIST"
MNIST_ENV = "KDPEMB_MNIST"
DEBIAN_FASHION_MNIST_DIR = pathlib.Path("/usr/share/datasets/fashion-mnist")
DEBIAN_MNIST_DIR = pathlib.Path("/usr/share/datasets/mnist")

FASHION_MNIST_CLASS_NAMES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
class_names = FASHION_MNIST_CLASS_NAMES  # The name of each Fashion-MNIST label.

IDX_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")
_IMAGES_MAGIC = 2051
_LABELS_MAGIC = 2049


class _NotHere(Exception):
    """A place that does not hold the dataset (the reason is the message)."""


def _keras_home():
    return pathlib.Path(
        os.environ.get("KERAS_HOME") or pathlib.Path("~/.keras").expanduser()
    )


def _read_idx(path, magic):
    """The array stored in one idx file, gzipped or not; checks everything."""
    path = pathlib.Path(path)
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                data = f.read()
        else:
            data = path.read_bytes()
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise ValueError(
            f"{path} is not a valid gzip file ({e}); the download may be "
            "incomplete. Delete it and provide the file again."
        ) from e
    kind = "images" if magic == _IMAGES_MAGIC else "labels"
    if len(data) < 4:
        raise ValueError(
            f"{path} is truncated: {len(data)} bytes, too short for an idx header."
        )
    found = int.from_bytes(data[:4], "big")
    if found != magic:
        raise ValueError(
            f"{path} is not an idx {kind} file: its magic number is {found}, "
            f"expected {magic}. The file is corrupt or is not what its name says."
        )
    ndim = data[3]
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(
            f"{path} is truncated: {len(data)} bytes, the idx header needs {header}."
        )
    shape = tuple(
        int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)
    )
    expected = int(np.prod(shape))
    if len(data) - header != expected:
        what = "truncated" if len(data) - header < expected else "too long"
        raise ValueError(
            f"{path} is {what}: its header promises shape {shape}, "
            f"{expected} bytes of data, but {len(data) - header} follow. "
            "Delete it and provide the file again."
        )
    return np.frombuffer(data, np.uint8, offset=header).reshape(shape).copy()


def _idx_files(folder):
    """The four idx paths in `folder` (gzipped preferred), or the missing names."""
    found, missing = [], []
    for name in IDX_FILES:
        for candidate in (folder / f"{name}.gz", folder / name):
            if candidate.is_file():
                found.append(candidate)
                break
        else:
            missing.append(f"{name}.gz")
    return found, missing


def _load_idx(files):
    x_train, y_train, x_test, y_test = (
        _read_idx(path, _IMAGES_MAGIC if "images" in path.name else _LABELS_MAGIC)
        for path in files
    )
    return _checked(files[0].parent, x_train, y_train, x_test, y_test)


def _load_npz(path):
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {key: f[key] for key in NPZ_KEYS if key in f.files}
    except Exception as e:
        raise ValueError(f"{path} is not a readable .npz file ({e}).") from e
    missing = [key for key in NPZ_KEYS if key not in arrays]
    if missing:
        raise ValueError(
            f"{path} lacks the keys {', '.join(missing)}; it must hold "
            f"{', '.join(NPZ_KEYS)}."
        )
    return _checked(path, *(arrays[key] for key in NPZ_KEYS))


def _checked(source, x_train, y_train, x_test, y_test):
    """Arrays in kdpemb's layout: uint8 `(N, H, W, 1)` images, `(N,)` labels."""
    result = []
    for split, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
        x, y = np.asarray(x), np.asarray(y)
        if x.ndim == 4 and x.shape[-1] == 1:
            x = x[..., 0]
        if x.ndim != 3:
            raise ValueError(
                f"{source}: x_{split} must have shape (N, 28, 28), got {x.shape}."
            )
        if x.dtype != np.uint8:
            if not np.issubdtype(x.dtype, np.integer) or (
                x.size and (x.min() < 0 or x.max() > 255)
            ):
                raise ValueError(
                    f"{source}: x_{split} must hold uint8 pixels 0..255, got "
                    f"dtype {x.dtype}."
                )
            x = x.astype(np.uint8)
        if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
            raise ValueError(
                f"{source}: y_{split} must be 1-D integer labels, got dtype "
                f"{y.dtype} and shape {y.shape}."
            )
        if len(x) != len(y):
            raise ValueError(
                f"{source}: {len(x)} {split} images but {len(y)} {split} labels."
            )
        result.append((x[..., np.newaxis], y))
    return tuple(result)


def _load_place(place, npz_name):
    """The dataset at `place` (a directory or an `.npz`); `_NotHere` if absent."""
    place = pathlib.Path(place).expanduser()
    if place.is_file():
        if place.suffix != ".npz":
            raise _NotHere(
                "is a file but not an .npz; give the directory of the idx files"
            )
        return _load_npz(place)
    if not place.exists():
        raise _NotHere("does not exist")
    if not place.is_dir():
        raise _NotHere("is neither a directory nor an .npz file")
    files, missing = _idx_files(place)
    if not missing:
        return _load_idx(files)
    npz = sorted(p for p in place.glob("*.npz") if not p.name.startswith("."))
    if (place / npz_name).is_file():
        return _load_npz(place / npz_name)
    if len(npz) == 1:
        return _load_npz(npz[0])
    reason = f"missing {', '.join(missing)} (gzipped or not)"
    if npz:
        names = ", ".join(p.name for p in npz)
        reason += f"; several .npz files ({names}), pass path= to the one to use"
    else:
        reason += " and no .npz file"
    raise _NotHere(reason)


def _download(keras_module):
    import keras  # Imported here only: nothing else in kdpemb.datasets needs it.

    (x_train, y_train), (x_test, y_test) = getattr(
        keras.datasets, keras_module
    ).load_data()
    return _checked(f"keras.datasets.{keras_module}", x_train, y_train, x_test, y_test)


def _not_found(name, tried, how):
    lines = [f"{name} was not found. Looked in:"]
    lines += [f"  - {place}: {reason}" for place, reason in tried]
    lines.append("To provide the files:")
    lines += [f"  - {line}" for line in how]
    return DatasetNotFoundError("\n".join(lines))


def _load(name, env_var, npz_name, path, cache, debian, download, keras_module, how):
    if path is not None:
        source, where = path, f"path={str(path)!r}"
    elif os.environ.get(env_var):
        source = os.environ[env_var]
        where = f"${env_var}={source}"
    else:
        source = None
    if source is not None:
        # Given explicitly: an error here must not be hidden by another copy.
        try:
            return _load_place(source, npz_name)
        except _NotHere as e:
            raise _not_found(name, [(where, str(e))], how) from None
    tried = [(f"${env_var}", "not set")]
    for label, place in (("Keras cache", cache), ("Debian directory", debian)):
        try:
            return _load_place(place, npz_name)
        except _NotHere as e:
            tried.append((f"{label} {place}", str(e)))
    if not download:
        tried.append((f"keras.datasets.{keras_module}.load_data()", "download=False"))
        raise _not_found(name, tried, how)
    try:
        return _download(keras_module)
    except Exception as e:
        tried.append(
            (
                f"keras.datasets.{keras_module}.load_data()",
                f"download failed: {type(e).__name__}: {e}",
            )
        )
        raise _not_found(name, tried, how) from e


def load_fashion_mnist(path=None, *, download=True):
    """Load Fashion-MNIST from local files, or download it with Keras.

    Returns the same splits as `keras.datasets.fashion_mnist.load_data()`,
    except that the images get a channel axis, `(N, 28, 28, 1)`, as every
    image model needs. The files are searched in this order: (1) `path`, or
    else the directory in `$KDPEMB_FASHION_MNIST`; (2) the Keras cache
    `$KERAS_HOME/datasets/fashion-mnist/` (default `~/.keras`); (3) Debian's
    `/usr/share/datasets/fashion-mnist` (`apt-get install
    dataset-fashion-mnist`); (4) Keras' download, if `download`. A path given
    explicitly (argument or environment variable) that lacks the files is an
    error: the search does not go on to the other places. A directory may
    hold the four idx files (gzipped or not) or one `.npz` with the keys
    `x_train, y_train, x_test, y_test`. Label names are in `class_names`.

    Args:
        path: str or path-like. A directory with the files, or an `.npz`
            file. Defaults to `None` (search as above).
        download: bool. Whether to fall back to Keras' download when no
            local copy is found. Defaults to `True`.

    Returns:
        `(x_train, y_train), (x_test, y_test)`: uint8 images `(N, 28, 28, 1)`
        (60,000 train and 10,000 test for the real data) and uint8 labels
        `(N,)` in 0..9.

    Raises:
        DatasetNotFoundError: if no place holds the files (the message lists
            every place and why it failed) or the given path lacks them.
        ValueError: if a file is corrupt or truncated (the message names it).

    Example:

    >>> import tempfile, numpy as np
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     np.savez(f"{folder}/fashion-mnist.npz",
    ...              x_train=np.zeros((6, 28, 28), np.uint8),
    ...              y_train=np.arange(6, dtype=np.uint8),
    ...              x_test=np.zeros((2, 28, 28), np.uint8),
    ...              y_test=np.array([9, 0], np.uint8))
    ...     (x_train, y_train), (x_test, y_test) = load_fashion_mnist(folder)
    >>> x_train.shape, x_test.shape, x_train.dtype
    ((6, 28, 28, 1), (2, 28, 28, 1), dtype('uint8'))
    >>> [class_names[i] for i in y_test]
    ['Ankle boot', 'T-shirt/top']
    """
    return _load(
        "Fashion-MNIST",
        FASHION_MNIST_ENV,
        "fashion-mnist.npz",
        path,
        _keras_home() / "datasets" / "fashion-mnist",
        DEBIAN_FASHION_MNIST_DIR,
        download,
        "fashion_mnist",
        how=(
            "apt-get install dataset-fashion-mnist (puts the files in "
            f"{DEBIAN_FASHION_MNIST_DIR})",
            f"set {FASHION_MNIST_ENV}=/dir, a directory holding "
            + ", ".join(f"{n}.gz" for n in IDX_FILES),
            "pass path=/dir (or path=/file.npz) to load_fashion_mnist",
            "copy the four .gz files into "
            f"{_keras_home() / 'datasets' / 'fashion-mnist'}",
            "or run keras.datasets.fashion_mnist.load_data() once on a machine "
            "with internet (download=True does this)",
        ),
    )


def load_mnist(path=None, *, download=True):
    """Load MNIST from local files, or download it with Keras.

    Returns the same splits as `keras.datasets.mnist.load_data()`, except
    that the images get a channel axis, `(N, 28, 28, 1)`, as every image
    model needs. The files are searched in this order: (1) `path`, or else
    the directory in `$KDPEMB_MNIST`; (2) the Keras cache
    `$KERAS_HOME/datasets/mnist.npz` (default `~/.keras`); (3)
    `/usr/share/datasets/mnist` if present; (4) Keras' download, if
    `download`. A path given explicitly (argument or environment variable)
    that lacks the files is an error: the search does not go on to the other
    places. A directory may hold the four idx files (gzipped or not) or one
    `.npz` with the keys `x_train, y_train, x_test, y_test`.

    Args:
        path: str or path-like. A directory with the files, or an `.npz`
            file. Defaults to `None` (search as above).
        download: bool. Whether to fall back to Keras' download when no
            local copy is found. Defaults to `True`.

    Returns:
        `(x_train, y_train), (x_test, y_test)`: uint8 images `(N, 28, 28, 1)`
        (60,000 train and 10,000 test for the real data) and labels `(N,)`
        in 0..9.

    Raises:
        DatasetNotFoundError: if no place holds the files (the message lists
            every place and why it failed) or the given path lacks them.
        ValueError: if a file is corrupt or truncated (the message names it).

    Example:

    >>> import tempfile, numpy as np
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     np.savez(f"{folder}/mnist.npz",
    ...              x_train=np.full((3, 28, 28), 255, np.uint8),
    ...              y_train=np.array([7, 2, 1], np.uint8),
    ...              x_test=np.zeros((1, 28, 28), np.uint8),
    ...              y_test=np.array([4], np.uint8))
    ...     (x_train, y_train), (x_test, y_test) = load_mnist(path=folder)
    >>> x_train.shape, y_train.tolist(), int(x_train.max())
    ((3, 28, 28, 1), [7, 2, 1], 255)
    """
    cache = _keras_home() / "datasets" / "mnist.npz"
    return _load(
        "MNIST",
        MNIST_ENV,
        "mnist.npz",
        path,
        cache,
        DEBIAN_MNIST_DIR,
        download,
        "mnist",
        how=(
            f"set {MNIST_ENV}=/dir, a directory holding mnist.npz or the idx "
            "files " + ", ".join(f"{n}.gz" for n in IDX_FILES),
            "pass path=/dir (or path=/file.npz) to load_mnist",
            f"copy mnist.npz into {cache}",
            "or run keras.datasets.mnist.load_data() once on a machine with "
            "internet (download=True does this)",
        ),
    )
