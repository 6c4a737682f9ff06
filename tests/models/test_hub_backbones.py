"""hub_backbone: keras-hub backbones, BatchNorm replaced, trained by both models.

Tiny configs built offline (no preset, no download): a ResNet-18-like
backbone (the stem and one basic block, BatchNormalization after each
convolution; keras-hub wants 64 filters in the first stack) and a ViT
(patch 4, one layer) on 8×8 images.
"""

import sys

import keras
import keras_hub
import numpy as np
import pytest

from kdpemb.data import VirtualClients
from kdpemb.datasets import synthetic_identities
from kdpemb.models import DPModel, FedEmbModel, hub_backbone
from kdpemb.models._shared.layer_taps import all_layers
from tests.models import test_clipped_gradients as clipped

pytestmark = [
    pytest.mark.filterwarnings("ignore::kdpemb.errors.ReproducibleNoiseWarning"),
    pytest.mark.filterwarnings("ignore::kdpemb.errors.ReproducibleSamplingWarning"),
]
SIZE = 8
TENSORFLOW = keras.backend.backend() == "tensorflow"


def resnet():
    return keras_hub.models.ResNetBackbone(
        input_conv_filters=[64],
        input_conv_kernel_sizes=[3],
        stackwise_num_filters=[64],
        stackwise_num_blocks=[1],
        stackwise_num_strides=[1],
        block_type="basic_block",
        image_shape=(SIZE, SIZE, 3),
    )


def vit():
    return keras_hub.models.ViTBackbone(
        image_shape=(SIZE, SIZE, 3),
        patch_size=4,
        num_layers=1,
        num_heads=2,
        hidden_dim=8,
        mlp_dim=16,
    )


BUILDS = [resnet, vit]


def embedding(build, seed=0):
    keras.utils.set_random_seed(seed)
    return hub_backbone(build(), embedding_dim=4, groups=8)


def images(n=8, seed=0):
    rng = np.random.default_rng(seed)
    return rng.uniform(0, 255, (n, SIZE, SIZE, 3)).astype("float32")


def values(variables):
    return [keras.ops.convert_to_numpy(v).copy() for v in variables]


def assert_trained(before, model):
    after = values(model.trainable_variables)
    assert len(after) == len(before) > 0
    assert all(np.isfinite(a).all() for a in after)
    moved = [not np.array_equal(a, b) for a, b in zip(before, after, strict=True)]
    assert all(moved), f"{moved.count(False)} of {len(moved)} variables unchanged"


def batch_norms(model):
    return [
        layer
        for layer in all_layers(model)
        if isinstance(layer, keras.layers.BatchNormalization)
    ]


def jit_compile(build):
    # TensorFlow 2.21's oneDNN CPU kernels corrupt the heap on the
    # vectorised per-example gradients of EinsumDense (the ViT's attention)
    # that the whole-model path takes; XLA compiles them soundly.
    return "auto" if not TENSORFLOW or build is resnet else True


def test_the_resnet_has_batch_norm_and_the_embedding_model_has_none():
    backbone = resnet()
    assert len(batch_norms(backbone)) == 3  # the stem's, 2 in the block
    model = hub_backbone(backbone, embedding_dim=4, groups=8)
    assert batch_norms(model) == []
    assert len(batch_norms(backbone)) == 3  # the backbone given is unchanged
    assert model.output_shape == (None, 4)


@pytest.mark.slow
@pytest.mark.parametrize("build", BUILDS)
def test_one_dp_model_step_trains_every_weight(build):
    network = keras.Sequential([embedding(build), keras.layers.Dense(3)])
    model = DPModel(network, clip_norm=1.0, noise_multiplier=1.0, seed=0)
    model.compile(
        keras.optimizers.SGD(0.1),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile(build),
    )
    before = values(network.trainable_variables)
    labels = np.arange(8) % 3
    model.fit(images(), labels, batch_size=8, epochs=1, verbose=0)  # one step
    assert int(model.private_steps) == 1
    assert_trained(before, network)
    assert batch_norms(network) == []


@pytest.mark.slow
@pytest.mark.parametrize("build", [resnet, vit])
def test_one_fedemb_round_trains_every_weight(build):
    backbone = embedding(build)
    data = synthetic_identities(8, 2, image_size=SIZE)
    clients = VirtualClients(
        data, clients_per_round=2, users_per_client=2, num_clients=4,
        local_steps=1, batch_size=2, rounds_per_epoch=1, seed=0,
    )  # fmt: skip
    model = FedEmbModel(
        backbone, client_optimizer=0.1, clip_norm=1.0, noise_multiplier=1.0,
        delta=1e-2, seed=0,
    )  # fmt: skip
    model.compile()
    before = values(backbone.trainable_variables)
    model.fit(clients, epochs=1, verbose=0)
    assert int(model.private_steps) == 1
    assert_trained(before, backbone)


@pytest.mark.slow
@pytest.mark.parametrize("build", BUILDS)
def test_dp_model_per_example_norms_equal_brute_force(build, monkeypatch):
    # Ghost norms layer by layer for the ResNet; the ViT's position
    # embedding is called without the batch axis, so it takes the
    # whole-model per-example gradients.
    if jit_compile(build) is True:
        import tensorflow as tf

        monkeypatch.setattr(
            clipped, "compiled", lambda fn: tf.function(fn, jit_compile=True)
        )
    plan = clipped.check_norms_and_sum(embedding(build), images(4))
    if build is resnet:
        assert plan.methods == ("ghost",) * len(plan.methods), plan.describe()
    else:
        assert "whole model" in plan.describe()


def test_vit_pools_its_class_token_and_the_pixels_are_rescaled():
    model = embedding(vit)
    x = images(2)
    backbone = model.layers[2]  # input, rescaling, the ViT
    tokens = keras.ops.convert_to_numpy(backbone(x / 255.0))
    pooled = keras.Model(model.input, model.get_layer("pool").output)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(pooled(x)), tokens[:, 0], rtol=1e-5, atol=1e-6
    )
    average = hub_backbone(vit(), embedding_dim=4, pooling="average")
    assert isinstance(average.get_layer("pool"), keras.layers.GlobalAveragePooling1D)


class SelfRescaling(keras.Model):
    """A backbone that rescales its pixels itself, as keras-cv's do."""

    include_rescaling = True


def self_rescaling_backbone():
    inputs = keras.Input((SIZE, SIZE, 3))
    x = keras.layers.Rescaling(1 / 255)(inputs)
    x = keras.layers.Conv2D(4, 3, padding="same")(x)
    return SelfRescaling(inputs, keras.layers.BatchNormalization()(x))


def test_a_backbone_that_rescales_itself_is_not_rescaled_twice():
    model = hub_backbone(self_rescaling_backbone(), embedding_dim=4, groups=2)
    assert not any(isinstance(layer, keras.layers.Rescaling) for layer in model.layers)
    assert batch_norms(model) == []
    halved = hub_backbone(self_rescaling_backbone(), embedding_dim=4, rescale=0.5)
    assert halved.get_layer("rescaling").scale == 0.5


def test_freeze_keeps_the_batch_norm_frozen_in_place():
    backbone = resnet()
    model = hub_backbone(backbone, embedding_dim=4, batchnorm="freeze")
    assert model.layers[2] is backbone
    assert len(batch_norms(model)) == 3
    assert not any(layer.trainable for layer in batch_norms(model))


def test_the_embedding_model_saves_and_loads(tmp_path):
    for build in BUILDS:
        model = embedding(build)
        path = tmp_path / f"{build.__name__}.keras"
        model.save(path)
        loaded = keras.saving.load_model(path)
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(loaded(images(2))),
            keras.ops.convert_to_numpy(model(images(2))),
            rtol=1e-5,
            atol=1e-6,
        )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"pooling": "max"}, ValueError, r"pooling must be one of .*'max'"),
        ({"pooling": "token"}, ValueError, r"pooling='token'.*pooling='average'"),
        ({"embedding_dim": 0}, ValueError, "embedding_dim must be a positive"),
        ({"batchnorm": "drop"}, ValueError, r"batchnorm must be one of"),
        ({"rescale": "1/255"}, ValueError, r"rescale must be a number"),
        ({"rescale": 0}, ValueError, r"rescale must be > 0"),
        ({"input_shape": (16, 16, 3)}, ValueError, r"does not match"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_rebuilt(kwargs, error, match):
    with pytest.raises(error, match=match):
        hub_backbone(resnet(), **kwargs)


def test_other_models_are_refused_with_what_to_pass():
    with pytest.raises(TypeError, match="keras-hub preset name"):
        hub_backbone(np.zeros(3))
    head = keras.Sequential([keras.Input((SIZE, SIZE, 3)), keras.layers.Flatten()])
    with pytest.raises(ValueError, match=r"\.backbone"):
        hub_backbone(head)
    flat = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
    with pytest.raises(ValueError, match=r"images \[batch, H, W, C\]"):
        hub_backbone(flat)


def test_a_preset_name_without_keras_hub_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "keras_hub", None)  # import fails
    with pytest.raises(ImportError, match=r'pip install "kdpemb\[hub\]"'):
        hub_backbone("resnet_18_imagenet")
