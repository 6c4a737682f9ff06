"""replace_batchnorm: BatchNormalization replaced or frozen, the rest kept."""

import keras
import keras_hub
import numpy as np
import pytest
from keras.src.models.functional import Functional

from kdpemb.models import batchnorm_replacement, check_backbone, replace_batchnorm
from kdpemb.models._shared.layer_taps import all_layers as _all_layers
from kdpemb.models.batchnorm_replacement import group_count


def of_type(model, cls):
    return [layer for layer in _all_layers(model) if isinstance(layer, cls)]


def batch_norms(model):
    return of_type(model, keras.layers.BatchNormalization)


def group_norms(model):
    return of_type(model, keras.layers.GroupNormalization)


def randomise(model, seed=0):
    """Random values everywhere, so a weight left uncopied is caught."""
    rng = np.random.default_rng(seed)
    for variable in model.weights:
        values = rng.uniform(0.5, 1.5, variable.shape).astype(variable.dtype)
        variable.assign(values)
    return model


def sequential():
    return randomise(
        keras.Sequential(
            [
                keras.Input((6, 6, 3)),
                keras.layers.Conv2D(48, 3, name="conv_a"),
                keras.layers.BatchNormalization(name="bn_a", epsilon=0.01),
                keras.layers.ReLU(),
                keras.layers.Conv2D(7, 1, name="conv_b"),
                keras.layers.BatchNormalization(name="bn_b", center=False),
                keras.layers.GlobalAveragePooling2D(),
                keras.layers.Dense(4, name="dense"),
            ]
        )
    )


def functional(inner=None):
    inputs = keras.Input((6, 6, 3))
    x = keras.layers.Conv2D(8, 3, padding="same", name="conv_a")(inputs)
    x = keras.layers.BatchNormalization(name="bn_a")(x)
    x = keras.layers.Add()([x, keras.layers.Conv2D(8, 1, name="skip")(inputs)])
    if inner is not None:
        x = inner(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(4, name="dense")(x)
    return randomise(keras.Model(inputs, outputs, name="outer"))


def nested_inner():
    # A functional sub-model with BatchNormalization, as keras.applications.
    inputs = keras.Input((6, 6, 8))
    x = keras.layers.Conv2D(16, 3, padding="same", name="inner_conv")(inputs)
    x = keras.layers.BatchNormalization(axis=-1, name="inner_bn")(x)
    return keras.Model(inputs, keras.layers.ReLU()(x), name="inner")


def weights_by_path(model, prefix=""):
    # Layer paths, e.g. "inner/inner_conv", to compare two models layer by layer.
    out = {}
    for layer in model.layers:
        path = f"{prefix}{layer.name}"
        if isinstance(layer, keras.Model):
            out |= weights_by_path(layer, f"{path}/")
        else:
            out[path] = (type(layer).__name__, layer.get_weights())
    return out


def assert_replaced(old, new, groups):
    old_weights, new_weights = weights_by_path(old), weights_by_path(new)
    assert old_weights.keys() == new_weights.keys()
    for path, (old_type, old_arrays) in old_weights.items():
        new_type, new_arrays = new_weights[path]
        if old_type == "BatchNormalization":
            assert new_type == "GroupNormalization"
        else:
            assert new_type == old_type
            assert len(new_arrays) == len(old_arrays)
            for a, b in zip(old_arrays, new_arrays, strict=True):
                np.testing.assert_array_equal(a, b)
    news = {layer.name: layer for layer in group_norms(new)}
    for bn in batch_norms(old):
        gn = news[bn.name]
        channels = bn.moving_mean.shape[0]
        assert gn.groups == group_count(channels, groups)
        assert channels % gn.groups == 0
        assert (gn.axis, gn.epsilon) == (bn.axis, bn.epsilon)
        assert (gn.center, gn.scale) == (bn.center, bn.scale)
        for name in ("gamma", "beta"):
            if getattr(bn, {"gamma": "scale", "beta": "center"}[name]):
                np.testing.assert_array_equal(
                    keras.ops.convert_to_numpy(getattr(gn, name)),
                    keras.ops.convert_to_numpy(getattr(bn, name)),
                )
    assert batch_norms(new) == []
    assert check_backbone(new) is new


def images(n=4, seed=0):
    return np.random.default_rng(seed).normal(size=(n, 6, 6, 3)).astype("float32")


@pytest.mark.parametrize("build", [sequential, functional])
def test_batch_norm_becomes_group_norm_and_the_input_is_unchanged(build):
    old = build()
    before = weights_by_path(old)
    bn_layers = batch_norms(old)
    new = replace_batchnorm(old, groups=32)
    assert new is not old
    assert_replaced(old, new, groups=32)
    # The input keeps its layers and weights.
    assert batch_norms(old) == bn_layers
    for path, (kind, arrays) in weights_by_path(old).items():
        assert kind == before[path][0]
        for a, b in zip(arrays, before[path][1], strict=True):
            np.testing.assert_array_equal(a, b)
    # Separate variables: training the new model cannot move the old one.
    old_ids = {id(v) for v in old.weights}
    assert not any(id(v) in old_ids for v in new.weights)


def test_group_count_is_the_largest_divisor_not_above_groups():
    new = replace_batchnorm(sequential(), groups=32)
    assert {gn.name: gn.groups for gn in group_norms(new)} == {"bn_a": 24, "bn_b": 7}
    for channels in range(1, 70):
        for groups in (1, 4, 32):
            brute = [d for d in range(1, groups + 1) if channels % d == 0][-1]
            assert group_count(channels, groups) == brute


def test_batch_norm_inside_a_nested_functional_model_is_replaced():
    old = functional(inner=nested_inner())
    new = replace_batchnorm(old, groups=4)
    assert_replaced(old, new, groups=4)
    inner = new.get_layer("inner")
    assert isinstance(inner, keras.Model) and inner is not old.get_layer("inner")
    assert [gn.groups for gn in group_norms(inner)] == [4]
    assert batch_norms(old.get_layer("inner"))  # the original keeps its BN


def test_non_batch_norm_path_computes_the_same():
    # The layers up to the first normalisation give the same outputs.
    old = functional(inner=nested_inner())
    new = replace_batchnorm(old)
    x = images()
    for name in ("conv_a", "skip"):
        old_part = keras.Model(old.input, old.get_layer(name).output)
        new_part = keras.Model(new.input, new.get_layer(name).output)
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(new_part(x)),
            keras.ops.convert_to_numpy(old_part(x)),
            rtol=1e-6,
        )


def test_names_sharing_and_frozen_sub_models_are_kept():
    # Two inputs (one named, one not), a layer called twice, and a frozen
    # Sequential sub-model called with training=False, as a keras.applications
    # backbone is in transfer learning.
    named, unnamed = keras.Input((6, 6, 3), name="image"), keras.Input((6, 6, 3))
    shared = keras.layers.Conv2D(4, 1, name="shared")
    frozen = keras.Sequential(
        [keras.Input((6, 6, 4)), keras.layers.BatchNormalization(name="frozen_bn")],
        name="frozen",
    )
    frozen.trainable = False
    x = frozen(keras.layers.Add()([shared(named), shared(unnamed)]), training=False)
    old = randomise(keras.Model([named, unnamed], x))
    new = replace_batchnorm(old)
    assert [layer.name for layer in new.layers] == [layer.name for layer in old.layers]
    assert_replaced(old, new, groups=32)
    assert len(new.get_layer("shared")._inbound_nodes) == 2  # still one layer
    assert not new.get_layer("frozen").trainable
    assert not new.get_layer("frozen").layers[0].trainable
    out = new([images(), images(seed=1)], training=True)
    assert np.isfinite(keras.ops.convert_to_numpy(out)).all()


def test_the_result_trains():
    new = replace_batchnorm(functional(inner=nested_inner()))
    out = keras.ops.convert_to_numpy(new(images(), training=True))
    assert out.shape == (4, 4) and np.isfinite(out).all()
    new.compile(optimizer="sgd", loss="mse")
    loss = new.train_on_batch(images(), np.zeros((4, 4), "float32"))
    assert np.isfinite(loss)


def test_mobilenet_v2_is_replaced_quickly(monkeypatch):
    """Quickly: in one pass over the layers (counted, not timed)."""
    backbone = keras.applications.MobileNetV2(
        input_shape=(32, 32, 3), weights=None, include_top=False, alpha=0.35
    )
    inputs = keras.Input((32, 32, 3))
    x = keras.layers.GlobalAveragePooling2D()(backbone(inputs))
    old = keras.Model(inputs, keras.layers.Dense(8)(x))
    cloned_models, cloned_layers = [], []
    clone_model = keras.models.clone_model
    clone = batchnorm_replacement._Rebuild.clone

    def counted_clone_model(model, *args, **kwargs):
        cloned_models.append(model)
        return clone_model(model, *args, **kwargs)

    def counted_clone(self, layer):
        cloned_layers.append(layer)
        return clone(self, layer)

    monkeypatch.setattr(keras.models, "clone_model", counted_clone_model)
    monkeypatch.setattr(batchnorm_replacement._Rebuild, "clone", counted_clone)
    new = replace_batchnorm(old)
    assert len(group_norms(new)) == len(batch_norms(old)) > 30
    assert_replaced(old, new, groups=32)
    # One pass: each model cloned once, each layer rebuilt once (not once
    # per BatchNormalization replaced, or per level it is nested in).
    layers = list(_all_layers(old))
    assert cloned_models == [old, backbone]
    assert len({id(layer) for layer in cloned_layers}) == len(cloned_layers)
    assert len(cloned_layers) <= len(layers)


def hub_resnet_v2():
    # Pre-activation bottleneck blocks: convolution shortcuts, and
    # `keras.ops.pad` in the graph (an operation, not a layer).

    return keras_hub.models.ResNetBackbone(
        input_conv_filters=[64], input_conv_kernel_sizes=[3],
        stackwise_num_filters=[64, 8], stackwise_num_blocks=[1, 1],
        stackwise_num_strides=[1, 2], block_type="bottleneck_block",
        use_pre_activation=True, image_shape=(8, 8, 3),
    )  # fmt: skip


def test_a_keras_hub_backbone_a_subclassed_functional_model_is_rebuilt():
    old = randomise(hub_resnet_v2())
    assert type(old).__name__ == "ResNetBackbone" and len(batch_norms(old)) == 7
    new = replace_batchnorm(old, groups=8)
    assert_replaced(old, new, groups=8)
    assert type(new) is Functional  # the layers, not the class
    x = np.random.default_rng(0).normal(size=(2, 8, 8, 3)).astype("float32")
    # Up to the first normalisation (the stem) both compute the same.
    old_part = keras.Model(old.input, old.get_layer("conv1_conv").output)
    new_part = keras.Model(new.input, new.get_layer("conv1_conv").output)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(new_part(x)),
        keras.ops.convert_to_numpy(old_part(x)),
        rtol=1e-6,
    )
    assert np.isfinite(keras.ops.convert_to_numpy(new(x, training=True))).all()


def test_a_model_without_batch_norm_is_returned_as_is():

    plain = keras.Sequential([keras.Input((6, 6, 3)), keras.layers.Conv2D(4, 3)])
    assert replace_batchnorm(plain) is plain
    # keras-hub's ViT: a layer of it does not survive from_config(get_config()).
    vit = keras_hub.models.ViTBackbone(
        image_shape=(8, 8, 3), patch_size=4, num_layers=1, num_heads=2,
        hidden_dim=8, mlp_dim=16,
    )  # fmt: skip
    assert replace_batchnorm(vit) is vit


class LosesItsConfig(keras.layers.Layer):
    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(units)

    def call(self, x):
        return self.dense(x)

    def get_config(self):
        return super().get_config()  # without `units`: from_config fails


def test_a_layer_that_cannot_be_copied_is_named_with_the_fix():
    inputs = keras.Input((6, 6, 3))
    x = keras.layers.BatchNormalization()(LosesItsConfig(3, name="lossy")(inputs))
    with pytest.raises(
        TypeError, match=r"(?s)cannot copy LosesItsConfig 'lossy'.*'units'"
    ):
        replace_batchnorm(keras.Model(inputs, x))


def test_keras_hub_mobilenet_blocks_are_refused_and_can_be_frozen():
    mobilenet = keras_hub.models.MobileNetBackbone(
        stackwise_expansion=[[16]], stackwise_num_blocks=[1],
        stackwise_num_filters=[[8]], stackwise_kernel_size=[[3]],
        stackwise_num_strides=[[2]], stackwise_se_ratio=[[None]],
        stackwise_activation=[["relu"]], stackwise_padding=[[1]],
        output_num_filters=16, depthwise_filters=8, depthwise_stride=1,
        depthwise_residual=False, last_layer_filter=16, image_shape=(8, 8, 3),
        input_num_filters=8,
    )  # fmt: skip
    with pytest.raises(TypeError, match=r"holds BatchNormalization inside"):
        replace_batchnorm(mobilenet)
    assert check_backbone(replace_batchnorm(mobilenet, mode="freeze")) is mobilenet


def test_freeze_keeps_the_model_and_its_statistics():
    old = functional(inner=nested_inner())
    same = replace_batchnorm(old, mode="freeze")
    assert same is old
    assert len(batch_norms(old)) == 2
    assert not any(bn.trainable for bn in batch_norms(old))
    assert check_backbone(old) is old

    def moving_means():
        return [np.array(bn.moving_mean) for bn in batch_norms(old)]

    before = moving_means()
    old(images() + 5.0, training=True)
    after = moving_means()
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.conv = keras.layers.Conv2D(4, 3)
        self.norm = keras.layers.BatchNormalization()

    def call(self, x):
        return self.norm(self.conv(x))


def test_a_subclassed_model_is_refused_with_the_ways_out():
    model = Subclassed()
    model(images())
    with pytest.raises(TypeError, match="cannot rebuild Subclassed") as error:
        replace_batchnorm(model)
    assert "GroupNormalization" in str(error.value)
    assert "mode='freeze'" in str(error.value)
    # ... and freezing works on it.
    assert check_backbone(replace_batchnorm(model, mode="freeze")) is model


def test_a_subclassed_layer_holding_batch_norm_inside_a_functional_model_is_refused():
    inputs = keras.Input((6, 6, 3))
    model = keras.Model(inputs, Subclassed()(inputs))
    with pytest.raises(TypeError, match="inside"):
        replace_batchnorm(model)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "groupnorm"}, r"mode must be one of .*'group_norm'.*'groupnorm'"),
        ({"groups": 0}, "groups must be a positive integer, got 0"),
        ({"groups": 2.5}, r"groups must be a positive integer, got 2\.5"),
    ],
)
def test_bad_mode_or_groups_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        replace_batchnorm(sequential(), **kwargs)


def test_an_unbuilt_model_is_refused_with_the_fix():
    model = keras.Sequential([keras.layers.Dense(3), keras.layers.BatchNormalization()])
    with pytest.raises(ValueError, match=r"keras\.Input"):
        replace_batchnorm(model)
