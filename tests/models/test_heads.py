"""The cosine head: its logits, and as an option of the two trainers."""

import keras
import numpy as np
import pytest

from kdpemb.models import CentralizedBaseline, CosineHead, FedEmbModel, heads, small_cnn
from kdpemb.models._shared import backends
from kdpemb.models.fedemb import fedemb_round
from tests.models import fedemb_reference as ref
from tests.models.test_fedemb import tiny_clients

pytestmark = [
    pytest.mark.filterwarnings("ignore::kdpemb.errors.ReproducibleNoiseWarning"),
    pytest.mark.filterwarnings("ignore::kdpemb.errors.ReproducibleSamplingWarning"),
]


def numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(x))


def test_cosine_logits_are_bounded_by_the_scale_and_are_cosines():
    rng = np.random.default_rng(0)
    embeddings = (100.0 * rng.normal(size=(50, 8))).astype("float32")
    kernel = (0.01 * rng.normal(size=(8, 7))).astype("float32")
    logits = numpy(heads.cosine_logits(embeddings, kernel, 5.0))
    assert np.all(np.abs(logits) <= 5.0 + 1e-4)
    expected = (embeddings / np.linalg.norm(embeddings, axis=1, keepdims=True)) @ (
        kernel / np.linalg.norm(kernel, axis=0, keepdims=True)
    )
    np.testing.assert_allclose(logits, 5.0 * expected, atol=1e-4)
    # The bound is reached by an embedding along a column.
    along = numpy(heads.cosine_logits(kernel[:, :1].T * 3.0, kernel, 5.0))
    np.testing.assert_allclose(along[0, 0], 5.0, rtol=1e-5)


def test_a_zero_embedding_or_column_gives_zero_logits_not_nan():
    logits = numpy(
        heads.cosine_logits(np.zeros((2, 4), "float32"), np.eye(4, dtype="float32"), 3)
    )
    np.testing.assert_array_equal(logits, 0.0)
    kernel = np.zeros((4, 2), "float32")
    logits = numpy(heads.cosine_logits(np.ones((1, 4), "float32"), kernel, 3))
    np.testing.assert_array_equal(logits, 0.0)


def test_the_margin_lowers_only_the_true_class_by_scale_times_margin():
    logits = np.zeros((2, 3), "float32")
    out = numpy(heads.margin_logits(logits, np.array([2, 0]), 3, 10.0, 0.2))
    np.testing.assert_allclose(out, [[0, 0, -2.0], [-2.0, 0, 0]], atol=1e-6)


def test_centralized_cosine_head_config_round_trip_and_bounded_logits():
    backbone = small_cnn((8, 8, 1), 4, width=4, groups=2)
    model = CentralizedBaseline(
        backbone, 5, head="cosine", head_scale=7.0, head_margin=0.1
    )
    assert isinstance(model.classifier, CosineHead)
    images = np.random.default_rng(0).integers(0, 255, (6, 8, 8, 1)).astype("uint8")
    logits = numpy(model(images))
    assert logits.shape == (6, 5) and np.all(np.abs(logits) <= 7.0 + 1e-4)
    config = model.get_config()
    assert (config["head"], config["head_scale"], config["head_margin"]) == (
        "cosine",
        7.0,
        0.1,
    )
    clone = CentralizedBaseline.from_config(config)
    clone.set_weights(model.get_weights())
    np.testing.assert_allclose(numpy(clone(images)), logits, atol=1e-5)


def test_centralized_margin_raises_the_training_loss_only():
    backbone = small_cnn((8, 8, 1), 4, width=4, groups=2)
    images = np.random.default_rng(1).integers(0, 255, (6, 8, 8, 1)).astype("uint8")
    labels = np.array([0, 1, 2, 0, 1, 2])
    losses, kernel = {}, None
    for margin in (0.0, 0.3):
        model = CentralizedBaseline(backbone, 3, head="cosine", head_margin=margin)
        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        if kernel is None:
            kernel = model.classifier.get_weights()
        model.classifier.set_weights(kernel)  # The same head for both.
        logits = model(images)
        losses[margin] = float(
            numpy(model.compute_loss(y=labels, y_pred=logits, training=True))
        )
        losses[margin, "eval"] = float(
            numpy(model.compute_loss(y=labels, y_pred=logits, training=False))
        )
    assert losses[0.3] > losses[0.0] + 0.1
    assert losses[0.3, "eval"] == pytest.approx(losses[0.0, "eval"], rel=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"head": "arcface"}, r"head must be one of .*got 'arcface'"),
        ({"head": "cosine", "head_scale": 0}, r"head_scale must be > 0"),
        ({"head": "cosine", "head_margin": 1.5}, r"head_margin must be in \[0, 1\)"),
        ({"head_margin": 0.2}, r"head_margin applies to head='cosine' only"),
    ],
)
def test_bad_head_settings_are_refused_by_both_models(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        CentralizedBaseline(small_cnn((8, 8, 1), 4, width=4, groups=2), 3, **kwargs)
    with pytest.raises(ValueError, match=pattern):
        FedEmbModel(ref.linear_backbone(), noise_multiplier=1.0, **kwargs)


def test_a_zero_cosine_head_is_refused_and_cosine_defaults_to_class_means():
    with pytest.raises(ValueError, match=r"zero column has no direction"):
        FedEmbModel(
            ref.linear_backbone(),
            noise_multiplier=1.0,
            head="cosine",
            head_init="zeros",
        )
    model = FedEmbModel(ref.linear_backbone(), noise_multiplier=1.0, head="cosine")
    assert model.head_init == "class_means"  # The utility study's choice.
    assert FedEmbModel(ref.linear_backbone(), noise_multiplier=1.0).head_init == "zeros"
    full = FedEmbModel(
        ref.linear_backbone(),
        noise_multiplier=1.0,
        aggregation="full",
        num_classes=5,
        head="cosine",
    )
    assert full.head_init == "random"  # A global head: no client's data.
    assert np.linalg.norm(numpy(full.head.value), axis=0).min() > 0  # Not zeros.


def test_fedemb_head_settings_are_frozen_and_round_trip_through_the_config():
    model = FedEmbModel(
        ref.linear_backbone(),
        noise_multiplier=1.0,
        head="cosine",
        head_scale=12.0,
        head_margin=0.2,
    )
    for name, value in (("head_type", "softmax"), ("head_scale", 1.0)):
        with pytest.raises(AttributeError, match="fixed at construction"):
            setattr(model, name, value)
    with pytest.raises(AttributeError, match="fixed at construction"):
        model.head_margin = 0.0
    clone = FedEmbModel.from_config(model.get_config())
    assert (clone.head_type, clone.head_scale, clone.head_margin, clone.head_init) == (
        "cosine",
        12.0,
        0.2,
        "class_means",
    )
    config = clone._round_config(2)
    assert (config.head, config.head_scale, config.head_margin) == ("cosine", 12.0, 0.2)
    assert config.class_mean_heads


@pytest.mark.parametrize("margin", [0.0, 0.2])
def test_local_training_with_a_cosine_head_reduces_the_local_loss(margin):
    """One client, 6 local steps on one batch: the loss of its final
    backbone and head on that batch is below that of the starting ones."""
    rng = np.random.default_rng(0)
    backbone = ref.linear_backbone(embedding_dim=4)
    config = fedemb_round.RoundConfig(
        learning_rate=0.1,
        momentum=0.0,
        nesterov=False,
        head_lr_scale=10.0,
        reconstruction_steps=1,
        clip_norm=1e9,
        client_parallelism=1,
        full_aggregation=True,  # So that the head's change comes back.
        head="cosine",
        head_scale=8.0,
        head_margin=margin,
    )
    trainer = fedemb_round.ClientTrainer(
        backbone, config, backends.current().value_and_grad
    )
    images = rng.normal(size=(8, *ref.IMAGE_SHAPE)).astype("float32")
    labels = np.arange(8) % 3
    client = {
        "images": np.stack([images] * 6),
        "labels": np.stack([labels] * 6),
        "example_mask": np.ones((6, 8), bool),
        "num_local_classes": np.int32(3),
    }
    client = {k: keras.ops.convert_to_tensor(v) for k, v in client.items()}
    head = rng.normal(scale=0.5, size=(4, 3)).astype("float32")
    theta = [v.value for v in backbone.trainable_variables]
    start = keras.ops.convert_to_tensor(head)
    update, mean_loss = trainer.train(theta, [], start, client)

    def loss(kernel, head):
        embeddings = images.reshape(len(images), -1) @ kernel
        logits = fedemb_round.head_logits(embeddings, head, 3, 8.0)
        logits = heads.margin_logits(logits, labels, 3, 8.0, margin)
        return float(numpy(fedemb_round.masked_cross_entropy(logits, labels, True)))

    kernel = numpy(theta[0])
    before = loss(kernel, head)
    after = loss(kernel + numpy(update[0]), head + numpy(update[1]))
    assert np.isfinite(float(numpy(mean_loss)))
    assert after < before - 0.1
    assert np.abs(numpy(update[0])).max() > 0  # The backbone moved.


def test_a_fedemb_round_with_the_cosine_head_trains_the_backbone():
    clients = tiny_clients()
    model = FedEmbModel(
        ref.linear_backbone(),
        head="cosine",
        client_optimizer=0.1,
        clip_norm=1e9,
        noise_multiplier=0.0,
        seed=0,
        log_local_loss=True,
    )
    model.compile(optimizer=keras.optimizers.SGD(1.0))
    before = numpy(model.backbone.trainable_variables[0].value).copy()
    history = model.fit(clients, epochs=1, steps_per_epoch=2, verbose=0)
    after = numpy(model.backbone.trainable_variables[0].value)
    assert np.isfinite(history.history["local_loss"]).all()
    assert not np.allclose(before, after)


@pytest.mark.parametrize("head", ["cosine", "softmax"])
def test_an_imprinted_centralized_head_starts_at_each_identitys_mean_embedding(head):
    backbone = ref.linear_backbone(3, seed=1)
    model = CentralizedBaseline(backbone, 4, head=head)
    before = numpy(model.classifier.kernel.value)
    images = np.random.default_rng(2).normal(size=(7, *ref.IMAGE_SHAPE))
    labels = np.array([0, 0, 2, 2, 2, 1, 0])  # Identity 3 has no image.
    assert model.imprint_head(images, labels, batch_size=3) == 3
    kernel = numpy(model.classifier.kernel.value)
    embeddings = images.reshape(7, -1) @ ref.kernel_of(backbone)
    embeddings /= np.linalg.norm(embeddings, axis=1, keepdims=True)
    for identity in range(3):
        mean = embeddings[labels == identity].sum(axis=0)
        np.testing.assert_allclose(
            kernel[:, identity], mean / np.linalg.norm(mean), rtol=1e-5, atol=1e-6
        )
    np.testing.assert_array_equal(kernel[:, 3], before[:, 3])
    if head == "softmax":
        np.testing.assert_array_equal(numpy(model.classifier.bias.value), 0)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        model.imprint_head(images, np.array([0, 0, 2, 2, 2, 1, 4]))
    with pytest.raises(ValueError, match="one identity per image"):
        model.imprint_head(images, labels[:5])
    with pytest.raises(ValueError, match="integer identities"):
        model.imprint_head(images, labels.astype("float32"))
