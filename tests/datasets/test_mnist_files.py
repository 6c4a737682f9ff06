import gzip
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from kdpemb.datasets import mnist_files
from kdpemb.datasets.mnist_files import (
    DatasetNotFoundError,
    load_fashion_mnist,
    load_mnist,
)

REAL_DEBIAN_DIR = pathlib.Path("/usr/share/datasets/fashion-mnist")
IMAGES_MAGIC, LABELS_MAGIC = 2051, 2049


def idx_bytes(array, magic):
    shape = b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return magic.to_bytes(4, "big") + shape + array.astype(np.uint8).tobytes()


def make_splits(seed, n_train=5, n_test=3):
    rng = np.random.default_rng(seed)
    return (
        rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        rng.integers(0, 10, n_train, dtype=np.uint8),
        rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        rng.integers(0, 10, n_test, dtype=np.uint8),
    )


def write_idx(folder, splits, gz=True):
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    magics = (IMAGES_MAGIC, LABELS_MAGIC, IMAGES_MAGIC, LABELS_MAGIC)
    paths = []
    for name, array, magic in zip(mnist_files.IDX_FILES, splits, magics, strict=True):
        data = idx_bytes(array, magic)
        path = folder / (f"{name}.gz" if gz else name)
        path.write_bytes(gzip.compress(data) if gz else data)
        paths.append(path)
    return paths


def write_npz(path, splits):
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **dict(zip(mnist_files.NPZ_KEYS, splits, strict=True)))
    return path


def assert_loaded(result, splits):
    (x_train, y_train), (x_test, y_test) = result
    for got, want in ((x_train, splits[0]), (x_test, splits[2])):
        assert got.dtype == np.uint8
        assert got.shape == (*want.shape, 1)
        np.testing.assert_array_equal(got[..., 0], want)
    for got, want in ((y_train, splits[1]), (y_test, splits[3])):
        assert got.shape == want.shape
        np.testing.assert_array_equal(got, want)


@pytest.fixture(autouse=True)
def nowhere(tmp_path, monkeypatch):
    """No env var, an empty Keras cache and no Debian files, unless a test adds."""
    monkeypatch.delenv(mnist_files.FASHION_MNIST_ENV, raising=False)
    monkeypatch.delenv(mnist_files.MNIST_ENV, raising=False)
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras_home"))
    monkeypatch.setattr(mnist_files, "DEBIAN_FASHION_MNIST_DIR", tmp_path / "deb-f")
    monkeypatch.setattr(mnist_files, "DEBIAN_MNIST_DIR", tmp_path / "deb-m")

    def no_download(module):
        raise AssertionError("a test tried to download")

    monkeypatch.setattr(mnist_files, "_download", no_download)


@pytest.mark.parametrize("gz", [True, False], ids=["gzipped", "plain"])
def test_idx_files_round_trip_through_path(tmp_path, gz):
    splits = make_splits(0)
    write_idx(tmp_path / "data", splits, gz=gz)
    assert_loaded(load_fashion_mnist(path=tmp_path / "data"), splits)
    assert_loaded(load_mnist(path=str(tmp_path / "data")), splits)


def test_npz_round_trips_through_the_env_var(tmp_path, monkeypatch):
    splits = make_splits(1)
    write_npz(tmp_path / "f" / "whatever.npz", splits)
    monkeypatch.setenv("KDPEMB_FASHION_MNIST", str(tmp_path / "f"))
    assert_loaded(load_fashion_mnist(download=False), splits)


def test_npz_file_itself_can_be_the_path(tmp_path, monkeypatch):
    splits = make_splits(2)
    npz = write_npz(tmp_path / "m.npz", splits)
    assert_loaded(load_mnist(path=npz), splits)
    monkeypatch.setenv("KDPEMB_MNIST", str(npz))
    assert_loaded(load_mnist(download=False), splits)


def test_npz_images_with_a_channel_axis_are_accepted(tmp_path):
    splits = make_splits(3)
    write_npz(
        tmp_path / "mnist.npz", [a[..., None] if a.ndim == 3 else a for a in splits]
    )
    assert_loaded(load_mnist(path=tmp_path), splits)


def test_env_var_wins_over_the_keras_cache_and_debian(tmp_path, monkeypatch):
    env, cache, debian = make_splits(10), make_splits(11), make_splits(12)
    write_idx(tmp_path / "env", env)
    write_idx(tmp_path / "keras_home" / "datasets" / "fashion-mnist", cache)
    write_idx(mnist_files.DEBIAN_FASHION_MNIST_DIR, debian)
    monkeypatch.setenv("KDPEMB_FASHION_MNIST", str(tmp_path / "env"))
    assert_loaded(load_fashion_mnist(download=False), env)


def test_keras_cache_wins_over_debian(tmp_path):
    cache, debian = make_splits(20), make_splits(21)
    write_idx(tmp_path / "keras_home" / "datasets" / "fashion-mnist", cache)
    write_idx(mnist_files.DEBIAN_FASHION_MNIST_DIR, debian)
    assert_loaded(load_fashion_mnist(download=False), cache)


def test_mnist_is_found_as_mnist_npz_in_the_keras_cache(tmp_path):
    cache, debian = make_splits(30), make_splits(31)
    write_npz(tmp_path / "keras_home" / "datasets" / "mnist.npz", cache)
    write_idx(mnist_files.DEBIAN_MNIST_DIR, debian, gz=False)
    assert_loaded(load_mnist(download=False), cache)


def test_debian_directory_is_used_when_nothing_comes_before_it():
    fashion, digits = make_splits(40), make_splits(41)
    write_idx(mnist_files.DEBIAN_FASHION_MNIST_DIR, fashion)
    write_idx(mnist_files.DEBIAN_MNIST_DIR, digits, gz=False)
    assert_loaded(load_fashion_mnist(download=False), fashion)
    assert_loaded(load_mnist(download=False), digits)


def test_explicit_path_without_the_files_raises_instead_of_falling_through(tmp_path):
    write_idx(mnist_files.DEBIAN_FASHION_MNIST_DIR, make_splits(50))
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        DatasetNotFoundError, match=r"missing train-images-idx3-ubyte\.gz"
    ):
        load_fashion_mnist(path=tmp_path / "empty")


def test_env_var_without_the_files_raises_instead_of_falling_through(
    tmp_path, monkeypatch
):
    write_idx(mnist_files.DEBIAN_FASHION_MNIST_DIR, make_splits(51))
    partial = write_idx(tmp_path / "partial", make_splits(52))
    partial[2].unlink()  # t10k-images
    monkeypatch.setenv("KDPEMB_FASHION_MNIST", str(tmp_path / "partial"))
    with pytest.raises(DatasetNotFoundError) as error:
        load_fashion_mnist()
    message = str(error.value)
    assert "KDPEMB_FASHION_MNIST" in message
    # The reason names the one missing file, not the three present.
    assert ": missing t10k-images-idx3-ubyte.gz (gzipped or not)" in message


def test_wrong_magic_number_is_a_value_error_naming_the_file(tmp_path):
    paths = write_idx(tmp_path / "d", make_splits(60))
    # An images file holding a labels header.
    paths[0].write_bytes(gzip.compress(idx_bytes(np.zeros(4, np.uint8), LABELS_MAGIC)))
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte\.gz.*magic"):
        load_fashion_mnist(path=tmp_path / "d")


@pytest.mark.parametrize("gz", [True, False], ids=["gzipped", "plain"])
def test_truncated_file_is_a_value_error_naming_the_file(tmp_path, gz):
    paths = write_idx(tmp_path / "d", make_splits(61), gz=gz)
    labels = paths[3]
    data = labels.read_bytes()
    labels.write_bytes(data[: len(data) - 2])
    name = labels.name.replace(".", r"\.")
    with pytest.raises(ValueError, match=rf"{name}.*(truncated|gzip)"):
        load_fashion_mnist(path=tmp_path / "d")


def test_header_promising_more_data_than_present_is_truncated(tmp_path):
    paths = write_idx(tmp_path / "d", make_splits(62), gz=False)
    data = paths[0].read_bytes()
    paths[0].write_bytes(data[:-28])  # One image row short.
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte is truncated"):
        load_fashion_mnist(path=tmp_path / "d")


def test_images_and_labels_of_different_lengths_are_rejected(tmp_path):
    splits = list(make_splits(63))
    splits[1] = splits[1][:-1]
    write_idx(tmp_path / "d", splits)
    with pytest.raises(ValueError, match="5 train images but 4 train labels"):
        load_fashion_mnist(path=tmp_path / "d")


def test_npz_missing_keys_is_a_value_error_naming_the_file(tmp_path):
    np.savez(tmp_path / "bad.npz", x_train=np.zeros((1, 28, 28), np.uint8))
    with pytest.raises(ValueError, match=r"bad\.npz lacks the keys y_train"):
        load_mnist(path=tmp_path / "bad.npz")


def test_nothing_anywhere_raises_naming_every_place(tmp_path):
    for load, env_var, debian, cache in (
        (
            load_fashion_mnist,
            "KDPEMB_FASHION_MNIST",
            mnist_files.DEBIAN_FASHION_MNIST_DIR,
            "fashion-mnist",
        ),
        (load_mnist, "KDPEMB_MNIST", mnist_files.DEBIAN_MNIST_DIR, "mnist.npz"),
    ):
        with pytest.raises(DatasetNotFoundError) as error:
            load(download=False)
        assert isinstance(error.value, FileNotFoundError)
        message = str(error.value)
        assert f"${env_var}: not set" in message
        assert f"{tmp_path / 'keras_home' / 'datasets' / cache}: does not exist" in (
            message
        )
        assert f"{debian}: does not exist" in message
        assert "download=False" in message
        assert f"set {env_var}=/dir" in message
        assert "pass path=" in message
    with pytest.raises(DatasetNotFoundError) as error:
        load_fashion_mnist(download=False)
    assert "apt-get install dataset-fashion-mnist" in str(error.value)


def test_keras_cache_with_some_files_reports_which_are_missing(tmp_path):
    cache = write_idx(
        tmp_path / "keras_home" / "datasets" / "fashion-mnist", make_splits(70)
    )
    cache[1].unlink()
    with pytest.raises(DatasetNotFoundError, match="missing train-labels-idx1-ubyte"):
        load_fashion_mnist(download=False)


def test_failed_download_is_reported_with_its_reason(monkeypatch):
    def offline(module):
        raise OSError(f"no route to host for {module}")

    monkeypatch.setattr(mnist_files, "_download", offline)
    with pytest.raises(
        DatasetNotFoundError, match="download failed: OSError: no route"
    ):
        load_fashion_mnist()


def test_download_is_the_last_resort(monkeypatch):
    splits = make_splits(80)
    monkeypatch.setattr(
        mnist_files,
        "_download",
        lambda module: mnist_files._checked(module, *splits),
    )
    assert_loaded(load_mnist(), splits)


def test_fashion_mnist_class_names():
    assert len(mnist_files.class_names) == 10
    assert mnist_files.class_names[0] == "T-shirt/top"
    assert mnist_files.class_names[9] == "Ankle boot"


def test_importing_the_loaders_imports_neither_keras_nor_tensorflow():
    code = (
        "import sys, kdpemb.datasets.mnist_files, kdpemb.datasets.simulate_users, "
        "kdpemb.datasets.directory; "
        "print(sorted({'keras', 'tensorflow'} & set(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_real_fashion_mnist_from_the_debian_package(monkeypatch):
    files = [REAL_DEBIAN_DIR / f"{name}.gz" for name in mnist_files.IDX_FILES]
    if not all(f.is_file() for f in files):
        pytest.skip(
            "Fashion-MNIST is not installed: apt-get install dataset-fashion-mnist"
        )
    monkeypatch.setattr(mnist_files, "DEBIAN_FASHION_MNIST_DIR", REAL_DEBIAN_DIR)
    # Fast because each file is read once and nothing else is (counted, not
    # timed; `nowhere` fails a download).
    read, read_idx = [], mnist_files._read_idx

    def counted(path, magic):
        read.append(pathlib.Path(path))
        return read_idx(path, magic)

    monkeypatch.setattr(mnist_files, "_read_idx", counted)
    (x_train, y_train), (x_test, y_test) = load_fashion_mnist(download=False)
    assert read == files
    assert x_train.shape == (60_000, 28, 28, 1)
    assert x_test.shape == (10_000, 28, 28, 1)
    assert x_train.dtype == x_test.dtype == np.uint8
    assert y_train.shape == (60_000,)
    assert y_test.shape == (10_000,)
    assert np.unique(y_train).tolist() == list(range(10))
    assert np.bincount(y_test).tolist() == [1000] * 10
    assert x_train.max() == 255
