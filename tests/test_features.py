"""`extract` equals the backbone in inference mode, and its cache is keyed right."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from kdpemb import feature_cache
from kdpemb.datasets import UserImages, synthetic_identities
from kdpemb.errors import NonFiniteInputError
from kdpemb.features import extract

N = 10  # Not a multiple of the batch size 4.
SHAPE = (6, 6, 1)
NAME = "tiny-v1"  # The backbone's name in the cache key.


class Tripwire(keras.layers.Layer):
    """Identity, or an error when armed: shows whether the backbone ran."""

    armed = False  # An attribute, not config: it is not part of the cache key.

    def call(self, x):
        if self.armed:
            raise RuntimeError("the backbone was called")
        return x


def make_backbone(seed=0, armed=False, shape=SHAPE, pool=True):
    """A tiny conv backbone with fixed names, so rebuilding gives the same key."""
    inputs = keras.Input(shape, name="images")
    x = Tripwire(name="tripwire")(inputs)
    x = keras.layers.Conv2D(3, 3, name="conv", kernel_initializer=init(seed))(x)
    x = keras.layers.Dropout(0.5, name="drop")(x)
    if pool:
        x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
        x = keras.layers.Dense(4, name="dense", kernel_initializer=init(seed + 1))(x)
    model = keras.Model(inputs, x, name="backbone")
    model.get_layer("tripwire").armed = armed
    return model


def init(seed):
    return keras.initializers.RandomNormal(stddev=0.5, seed=seed)


def copy_of(backbone, armed=False):
    """The same architecture and weights, as a new model."""
    copy = make_backbone(armed=armed)
    copy.set_weights(backbone.get_weights())
    return copy


def images(n=N, seed=0, shape=SHAPE):
    return np.random.default_rng(seed).integers(0, 256, (n, *shape), dtype=np.uint8)


def reference(backbone, x, batch_size):
    """`backbone(x, training=False)`, batch by batch."""
    x = np.asarray(x).astype("float32")
    return np.concatenate(
        [
            keras.ops.convert_to_numpy(backbone(x[i : i + batch_size], training=False))
            for i in range(0, len(x), batch_size)
        ]
    )


def assert_equal_features(actual, expected):
    assert isinstance(actual, np.ndarray)
    assert actual.dtype == np.float32
    assert actual.shape == expected.shape
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)


def cache_files(directory):
    return sorted(os.listdir(directory))


class Batches(keras.utils.PyDataset):
    """A PyDataset of `batch_size` images, with labels or not."""

    def __init__(self, x, y=None, batch_size=4):
        super().__init__()
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self):
        return -(-len(self.x) // self.batch_size)

    def __getitem__(self, index):
        part = slice(index * self.batch_size, (index + 1) * self.batch_size)
        return self.x[part] if self.y is None else (self.x[part], self.y[part])


class LazyImages:
    """An array-like that records the rows each read asks for."""

    def __init__(self, array):
        self.array, self.reads = array, []
        self.shape, self.dtype = array.shape, array.dtype

    def __len__(self):
        return len(self.array)

    def __getitem__(self, key):
        part = self.array[key]
        self.reads.append(len(part))
        return part


# What is computed.


@pytest.mark.parametrize("batch_size", [1, 4, 256])
def test_array_features_are_the_backbone_in_inference_mode(batch_size):
    backbone, x = make_backbone(), images()
    features = extract(backbone, x, batch_size=batch_size, verbose=0)
    expected = reference(backbone, x, batch_size)
    assert_equal_features(features, expected)
    # Dropout is active in training mode, so the test tells the modes apart.
    training = keras.ops.convert_to_numpy(backbone(x.astype("float32"), training=True))
    assert not np.allclose(training, expected, atol=1e-3)


def test_float_images_and_a_user_images_object_give_the_same_features():
    backbone, x = make_backbone(), images()
    expected = reference(backbone, x, 4)
    data = UserImages(x, labels=np.arange(N), user_ids=np.arange(N))
    assert_equal_features(extract(backbone, data, batch_size=4, verbose=0), expected)
    floats = x.astype("float64")
    assert_equal_features(extract(backbone, floats, batch_size=4, verbose=0), expected)


def test_synthetic_identities_are_read_in_order():
    data = synthetic_identities(3, 3, image_size=8, channels=1, seed=2)
    backbone = make_backbone(shape=(8, 8, 1))
    features = extract(backbone, data, batch_size=4, verbose=0)
    assert_equal_features(features, reference(backbone, np.asarray(data.images), 4))


def test_a_lazy_array_is_read_one_batch_at_a_time():
    backbone, x = make_backbone(), images()
    lazy = LazyImages(x)
    features = extract(backbone, lazy, batch_size=4, verbose=0)
    assert_equal_features(features, reference(backbone, x, 4))
    assert max(lazy.reads) <= 4
    assert sum(lazy.reads[-3:]) == N  # The three batches, after a 1-row dtype probe.


def test_a_tuple_of_images_and_labels_returns_the_labels():
    backbone, x, y = make_backbone(), images(), np.arange(N) % 3
    features, labels = extract(backbone, (x, y), batch_size=4, verbose=0)
    assert_equal_features(features, reference(backbone, x, 4))
    np.testing.assert_array_equal(labels, y)


def test_tf_data_of_images():
    backbone, x = make_backbone(), images()
    dataset = tf.data.Dataset.from_tensor_slices(x).batch(4)
    features = extract(backbone, dataset, verbose=0)
    assert_equal_features(features, reference(backbone, x, 4))


def test_tf_data_of_images_and_labels_keeps_the_labels_in_order():
    backbone, x, y = make_backbone(), images(), np.arange(N)[::-1].copy()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    dataset = dataset.filter(lambda a, b: True)  # Unknown cardinality.
    features, labels = extract(backbone, dataset, verbose=0)
    assert_equal_features(features, reference(backbone, x, 4))
    np.testing.assert_array_equal(labels, y)


@pytest.mark.parametrize("with_labels", [False, True])
def test_pydataset(with_labels):
    backbone, x, y = make_backbone(), images(), np.arange(N) + 100
    result = extract(backbone, Batches(x, y if with_labels else None), verbose=0)
    features, labels = result if with_labels else (result, None)
    assert_equal_features(features, reference(backbone, x, 4))
    if with_labels:
        np.testing.assert_array_equal(labels, y)


# The cache.


def test_a_cache_hit_does_not_call_the_backbone(tmp_path):
    backbone, x = make_backbone(), images()
    first = extract(
        backbone, x, batch_size=4, cache=tmp_path, backbone_name=NAME, verbose=0
    )
    assert len(cache_files(tmp_path)) == 1
    armed = copy_of(backbone, armed=True)
    with pytest.raises(RuntimeError, match="the backbone was called"):
        extract(armed, x, verbose=0)  # The tripwire works without a cache...
    again = extract(
        armed, x, cache=str(tmp_path), backbone_name=NAME, verbose=0
    )  # ...and a hit skips it.
    np.testing.assert_array_equal(again, first)
    assert again.dtype == np.float32
    assert len(cache_files(tmp_path)) == 1


def test_changing_one_weight_misses_the_cache(tmp_path):
    backbone, x = make_backbone(), images()
    first = extract(backbone, x, cache=tmp_path, backbone_name=NAME, verbose=0)
    weights = backbone.get_weights()
    weights[-2][0, 0] += 1.0  # One entry of the dense kernel.
    changed = copy_of(backbone)
    changed.set_weights(weights)
    with pytest.raises(RuntimeError, match="the backbone was called"):
        extract(
            copy_of(changed, armed=True),
            x,
            cache=tmp_path,
            backbone_name=NAME,
            verbose=0,
        )
    features = extract(changed, x, cache=tmp_path, backbone_name=NAME, verbose=0)
    assert_equal_features(features, reference(changed, x, 256))
    assert not np.allclose(features, first)
    assert len(cache_files(tmp_path)) == 2


def test_changing_one_pixel_misses_the_cache(tmp_path):
    backbone, x = make_backbone(), images()
    first = extract(backbone, x, cache=tmp_path, backbone_name=NAME, verbose=0)
    x2 = x.copy()
    x2[3, 2, 2, 0] ^= 0xFF
    features = extract(backbone, x2, cache=tmp_path, backbone_name=NAME, verbose=0)
    assert_equal_features(features, reference(backbone, x2, 256))
    assert not np.allclose(features[3], first[3])
    np.testing.assert_allclose(np.delete(features, 3, 0), np.delete(first, 3, 0))
    assert len(cache_files(tmp_path)) == 2


def test_another_backbone_name_misses_the_cache(tmp_path):
    backbone, x = make_backbone(), images()
    first = extract(backbone, x, cache=tmp_path, backbone_name=NAME, verbose=0)
    armed = copy_of(backbone, armed=True)
    with pytest.raises(RuntimeError, match="the backbone was called"):
        extract(armed, x, cache=tmp_path, backbone_name="tiny-v2", verbose=0)
    again = extract(backbone, x, cache=tmp_path, backbone_name="tiny-v2", verbose=0)
    np.testing.assert_array_equal(again, first)
    assert len(cache_files(tmp_path)) == 2


def test_a_layer_without_weights_changes_the_key_under_the_same_name(tmp_path):
    # Same weights and name, one more layer (Rescaling has no weights): the
    # layer configurations are part of the key, so nothing stale is loaded.
    backbone, x = make_backbone(), images()
    doubled = keras.Sequential([backbone, keras.layers.Rescaling(2.0)])
    halved = keras.Sequential([backbone, keras.layers.Rescaling(0.5)])
    first = extract(backbone, x, cache=tmp_path, backbone_name=NAME, verbose=0)
    twice = extract(doubled, x, cache=tmp_path, backbone_name=NAME, verbose=0)
    half = extract(halved, x, cache=tmp_path, backbone_name=NAME, verbose=0)
    np.testing.assert_allclose(twice, 2.0 * first, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(half, 0.5 * first, rtol=1e-5, atol=1e-5)
    assert len(cache_files(tmp_path)) == 3


def test_a_cache_without_a_backbone_name_is_refused_before_any_work(tmp_path):
    armed = make_backbone(armed=True)
    with pytest.raises(
        ValueError, match=r"cache needs backbone_name=.*backbone_name='resnet50"
    ):
        extract(armed, images(), cache=tmp_path, verbose=0)
    for name in ("", 3):
        with pytest.raises(ValueError, match="backbone_name must be a non-empty"):
            extract(armed, images(), cache=tmp_path, backbone_name=name)
    with pytest.raises(ValueError, match="data_name must be a non-empty"):
        extract(armed, images(), cache=tmp_path, backbone_name=NAME, data_name="")
    assert cache_files(tmp_path) == []


def test_a_data_name_for_arrays_is_added_to_their_hash(tmp_path):
    backbone, x = make_backbone(), images()
    first = extract(
        backbone, x, cache=tmp_path, backbone_name=NAME, data_name="a", verbose=0
    )
    again = extract(copy_of(backbone, armed=True), x, cache=tmp_path,
                    backbone_name=NAME, data_name="a", verbose=0)  # fmt: skip
    np.testing.assert_array_equal(again, first)  # A hit.
    x2 = x.copy()
    x2[0, 0, 0, 0] ^= 0xFF  # Other pixels under the same data name: a miss.
    with pytest.raises(RuntimeError, match="the backbone was called"):
        extract(copy_of(backbone, armed=True), x2, cache=tmp_path,
                backbone_name=NAME, data_name="a", verbose=0)  # fmt: skip
    with pytest.raises(RuntimeError, match="the backbone was called"):
        extract(copy_of(backbone, armed=True), x, cache=tmp_path,
                backbone_name=NAME, data_name="b", verbose=0)  # fmt: skip


def test_a_stream_needs_a_data_name_and_its_labels_are_cached(tmp_path):
    backbone, x, y = make_backbone(), images(), np.arange(N) * 7
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    with pytest.raises(ValueError, match="cache needs data_name="):
        extract(backbone, dataset, cache=tmp_path, backbone_name=NAME, verbose=0)
    first, labels = extract(
        backbone,
        dataset,
        cache=tmp_path,
        backbone_name=NAME,
        data_name="toy-v1",
        verbose=0,
    )
    np.testing.assert_array_equal(labels, y)
    assert len(cache_files(tmp_path)) == 2  # Features and labels.
    armed = copy_of(backbone, armed=True)
    again, labels_again = extract(
        armed,
        Batches(x, y),
        cache=tmp_path,
        backbone_name=NAME,
        data_name="toy-v1",
        verbose=0,
    )
    np.testing.assert_array_equal(again, first)
    np.testing.assert_array_equal(labels_again, y)
    with pytest.raises(RuntimeError, match="the backbone was called"):
        extract(
            armed,
            dataset,
            cache=tmp_path,
            backbone_name=NAME,
            data_name="toy-v2",
            verbose=0,
        )


@pytest.mark.parametrize("error", [KeyboardInterrupt, OSError])
def test_an_interrupted_write_leaves_no_cache_file(tmp_path, monkeypatch, error):
    backbone, x = make_backbone(), images()

    replace = os.replace

    def fail(source, target):  # Only for the cache: leave other writers alone.
        if os.path.dirname(target) == str(tmp_path):
            raise error("interrupted")
        replace(source, target)

    monkeypatch.setattr(feature_cache.os, "replace", fail)
    if error is KeyboardInterrupt:
        with pytest.raises(KeyboardInterrupt):
            extract(backbone, x, cache=tmp_path, backbone_name=NAME, verbose=0)
    else:  # A failed write is reported, and the features are still returned.
        with pytest.warns(UserWarning, match="not cached"):
            features = extract(
                backbone, x, cache=tmp_path, backbone_name=NAME, verbose=0
            )
        assert_equal_features(features, reference(backbone, x, 256))
    assert cache_files(tmp_path) == []
    monkeypatch.undo()
    extract(backbone, x, cache=tmp_path, backbone_name=NAME, verbose=0)
    assert len(cache_files(tmp_path)) == 1


def test_a_truncated_cache_file_is_recomputed(tmp_path):
    backbone, x = make_backbone(), images()
    first = extract(backbone, x, cache=tmp_path, backbone_name=NAME, verbose=0)
    (path,) = tmp_path.iterdir()
    path.write_bytes(path.read_bytes()[:-8])  # Cut into the data.
    with pytest.warns(UserWarning, match="unusable"):
        again = extract(backbone, x, cache=tmp_path, backbone_name=NAME, verbose=0)
    np.testing.assert_array_equal(again, first)
    np.testing.assert_array_equal(np.load(path), first)


# Errors.


def test_nan_pixels_are_refused_before_the_backbone_and_not_cached(tmp_path):
    # Arrays are scanned whole before the backbone runs on any batch (armed:
    # a run raises), so the count covers every row, not one batch's.
    backbone = make_backbone(armed=True)
    x = images().astype("float32")
    x[[6, 7], 0, 0, 0] = np.nan  # The second batch of 4.
    with pytest.raises(NonFiniteInputError, match=r"images\[6\] holds NaN") as seen:
        extract(
            backbone, x, batch_size=4, cache=tmp_path, backbone_name=NAME, verbose=0
        )
    assert seen.value.row == 6 and f"2 of the rows 0..{N - 1}" in str(seen.value)
    assert cache_files(tmp_path) == []


def test_nan_weights_raise_naming_every_row():
    backbone = make_backbone()
    weights = backbone.get_weights()
    weights[0][0, 0, 0, 0] = np.nan
    backbone.set_weights(weights)
    with pytest.raises(ValueError, match=r"10 of 10 rows.*weights"):
        extract(backbone, images(), batch_size=4, verbose=0)


def test_an_output_that_is_not_batch_by_dim_raises():
    with pytest.raises(ValueError, match=r"\(None, 4, 4, 3\).*GlobalAveragePooling"):
        extract(make_backbone(pool=False), images(), verbose=0)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (images(shape=(7, 7, 1)), r"\(6, 6, 1\).*\(7, 7, 1\)"),
        (images(shape=(6, 6, 3)), r"\(6, 6, 1\).*\(6, 6, 3\)"),
        (images(shape=(6, 6)), r"\(6, 6\).*images\[\.\.\., None\]"),
        (tf.data.Dataset.from_tensor_slices(images()), r"\(6, 6, 1\).*dataset.batch"),
        (Batches(images(shape=(5, 6, 1))), r"\(6, 6, 1\).*\(5, 6, 1\)"),
    ],
    ids=["size", "channels", "no-channel-axis", "unbatched-tf-data", "pydataset"],
)
def test_a_wrong_image_shape_names_both_shapes(data, message):
    with pytest.raises(ValueError, match=message):
        extract(make_backbone(), data, verbose=0)


def test_a_subclassed_model_that_fails_on_the_images_names_their_shape():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(keras.ops.reshape(x, (keras.ops.shape(x)[0], 36)))

    net = Net()
    net(np.zeros((1, *SHAPE), "float32"))
    with pytest.raises(ValueError, match=r"first batch, images of shape \(7, 7, 1\)"):
        extract(net, images(shape=(7, 7, 1)), verbose=0)


@pytest.mark.parametrize(
    "data",
    [
        np.zeros((0, *SHAPE), np.uint8),
        tf.data.Dataset.from_tensor_slices(np.zeros((0, *SHAPE), np.uint8)).batch(4),
        Batches(np.zeros((0, *SHAPE), np.uint8)),
    ],
    ids=["array", "tf-data", "pydataset"],
)
def test_empty_data_raises(data):
    with pytest.raises(ValueError, match="no images"):
        extract(make_backbone(), data, verbose=0)


@pytest.mark.parametrize("batch_size", [0, -4, 2.5, True, "8", None])
def test_batch_size_must_be_a_positive_int(batch_size):
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        extract(make_backbone(), images(), batch_size=batch_size, verbose=0)


def test_other_bad_arguments_raise_clearly(tmp_path):
    backbone, x = make_backbone(), images()
    with pytest.raises(TypeError, match=r"backbone must be a keras\.Model"):
        extract(keras.layers.Dense(2), x)
    with pytest.raises(ValueError, match="not built"):
        extract(keras.Sequential([keras.layers.Dense(2)]), x)
    with pytest.raises(TypeError, match="data must be"):
        extract(backbone, (batch for batch in [x]))
    with pytest.raises(ValueError, match="must be numbers"):
        extract(backbone, np.full((2, *SHAPE), "a"))
    for names in (dict(data_name="k"), dict(backbone_name="k")):
        with pytest.raises(ValueError, match="cache is None"):
            extract(backbone, x, **names)
    with pytest.raises(ValueError, match="verbose must be one of"):
        extract(backbone, x, verbose="loud")
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError, match="is a file"):
        extract(backbone, x, cache=tmp_path / "file", backbone_name=NAME)


def test_verbose_0_and_auto_print_nothing_and_1_shows_a_progress_bar(tmp_path, capsys):
    backbone, x = make_backbone(), images()
    for verbose in (0, "auto"):  # stdout is not a terminal under pytest.
        extract(backbone, x, batch_size=4, verbose=verbose)
        extract(
            backbone,
            x,
            batch_size=4,
            cache=tmp_path,
            backbone_name=NAME,
            verbose=verbose,
        )
        assert capsys.readouterr().out == ""
    extract(backbone, x, batch_size=5, verbose=1)
    assert "2/2" in capsys.readouterr().out
    extract(backbone, x, batch_size=4, cache=tmp_path, backbone_name=NAME, verbose=1)
    assert "cached" in capsys.readouterr().out


def test_auto_generated_layer_names_do_not_change_the_key(tmp_path):
    def unnamed():
        return keras.Sequential(
            [keras.Input(SHAPE), keras.layers.Flatten(), keras.layers.Dense(3)]
        )

    first_model, second_model = unnamed(), unnamed()
    second_model.set_weights(first_model.get_weights())
    names = [[layer.name for layer in m.layers] for m in (first_model, second_model)]
    assert names[0] != names[1]  # e.g. dense and dense_1
    x = images()
    first = extract(first_model, x, cache=tmp_path, backbone_name=NAME, verbose=0)
    again = extract(second_model, x, cache=tmp_path, backbone_name=NAME, verbose=0)
    np.testing.assert_array_equal(first, again)
    assert len(cache_files(tmp_path)) == 1
