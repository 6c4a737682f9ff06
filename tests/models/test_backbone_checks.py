"""Backbones whose state would leak private data are refused."""

import keras
import pytest

from kdpemb.models import UnsupportedLayerError, check_backbone


def conv_block(norm):
    return [keras.layers.Conv2D(4, 3, padding="same"), norm, keras.layers.ReLU()]


def test_trainable_batch_norm_is_refused_with_the_fix():
    model = keras.Sequential(
        [
            keras.Input((8, 8, 3)),
            *conv_block(keras.layers.BatchNormalization(name="bn")),
        ]
    )
    with pytest.raises(UnsupportedLayerError, match="'bn'") as error:
        check_backbone(model)
    assert "GroupNormalization" in str(error.value)
    assert "trainable = False" in str(error.value)


def test_batch_norm_inside_nested_and_functional_models_is_found():
    inner = keras.Sequential(
        [keras.Input((8, 8, 4)), keras.layers.BatchNormalization(name="deep_bn")]
    )
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 3, padding="same")(inputs)
    outputs = keras.layers.GlobalAveragePooling2D()(inner(x))
    with pytest.raises(UnsupportedLayerError, match="deep_bn"):
        check_backbone(keras.Model(inputs, outputs))


def test_a_backbone_with_many_batch_norms_is_refused_with_a_short_list():
    # As a keras.applications ResNet is (53 BatchNormalization layers), at a
    # size that builds in milliseconds.
    layers = [keras.Input((8, 8, 3))]
    for _ in range(12):
        layers += conv_block(keras.layers.BatchNormalization())
    with pytest.raises(UnsupportedLayerError, match=r"and \d+ more") as error:
        check_backbone(keras.Sequential(layers))
    assert len(str(error.value)) < 1_000


def test_group_norm_layer_norm_and_frozen_batch_norm_are_accepted():
    frozen = keras.layers.BatchNormalization()
    frozen.trainable = False
    for norm in (
        keras.layers.GroupNormalization(groups=2),
        keras.layers.LayerNormalization(),
        frozen,
    ):
        model = keras.Sequential([keras.Input((8, 8, 3)), *conv_block(norm)])
        assert check_backbone(model) is model


def test_a_frozen_batch_norm_really_keeps_its_statistics():
    # What the check relies on: Keras never updates a frozen BN's moving
    # statistics, even in training mode.
    norm = keras.layers.BatchNormalization()
    norm.trainable = False
    norm.build((None, 3))
    before = [keras.ops.convert_to_numpy(v).copy() for v in norm.non_trainable_weights]
    norm(keras.random.normal((16, 3), mean=5.0), training=True)
    after = [keras.ops.convert_to_numpy(v) for v in norm.non_trainable_weights]
    for a, b in zip(before, after, strict=True):
        assert (a == b).all()


def test_a_non_model_is_refused():
    with pytest.raises(TypeError, match=r"keras\.Model"):
        check_backbone(lambda x: x)
