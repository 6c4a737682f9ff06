"""Mistakes a user can make get kdpemb's error, naming their values and
the fix, before anything is trained: not Keras' or a backend's."""

import keras
import numpy as np
import pytest

from kdpemb.models import DPModel, LastLayerDPClassifier

pytestmark = pytest.mark.filterwarnings(
    "ignore::kdpemb.errors.DegenerateFeaturesWarning"
)


def classifier_network():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])


def dp_model(loss):
    model = DPModel(classifier_network(), clip_norm=1.0, noise_multiplier=1.0)
    model.compile("sgd", loss)
    return model


X = np.random.default_rng(0).normal(size=(40, 4)).astype("float32")
CLASSES = np.arange(40) % 3


@pytest.mark.parametrize(
    "loss",
    [
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "sparse_categorical_crossentropy",
    ],
)
def test_one_hot_labels_with_a_sparse_loss_name_the_data_and_the_fixes(loss):
    model = dp_model(loss)
    with pytest.raises(ValueError) as caught:
        model.fit(X, np.eye(3)[CLASSES], batch_size=10, verbose=0)
    message = str(caught.value)
    # The user's 40 rows, not the 3 rows the network is built on.
    assert "shape (40, 3): one-hot" in message and "shape (40,)" in message
    assert "y.argmax(axis=-1)" in message and "CategoricalCrossentropy" in message
    assert int(model.private_steps.numpy()) == 0 and model.schedule is None


def test_class_indices_with_a_categorical_loss_name_the_data_and_the_fixes():
    model = dp_model(keras.losses.CategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError) as caught:
        model.fit(X, CLASSES, batch_size=10, verbose=0)
    message = str(caught.value)
    assert "shape (40,): class indices" in message and "(40, 3)" in message
    assert "to_categorical(y, 3)" in message
    assert "SparseCategoricalCrossentropy" in message


def fitted_head(dim):
    rng = np.random.default_rng(1)
    head = LastLayerDPClassifier(
        3, "dp-ls", feature_clip_norm=1.0, noise_multiplier=1.0
    )
    head.fit(rng.normal(size=(30, dim)), np.arange(30) % 3, verbose=0)
    return head


def test_stack_on_a_backbone_of_another_width_names_both_widths():
    head = fitted_head(4)
    wider = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5)])
    with pytest.raises(ValueError) as caught:
        head.stack_on(wider)
    message = str(caught.value)
    assert "(None, 5)" in message and "4-dimensional" in message
    assert "the backbone whose features it was fitted on" in message
    # The right width still stacks.
    narrow = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4)])
    assert head.stack_on(narrow).output_shape == (None, 3)


@pytest.mark.parametrize("num_classes", [1, 0, -2, 2.5, "3", True, None])
def test_a_head_needs_at_least_two_classes(num_classes):
    with pytest.raises(ValueError, match=r"num_classes.*at least 2"):
        LastLayerDPClassifier(num_classes, "dp-ls", feature_clip_norm=1.0,
                              noise_multiplier=1.0)  # fmt: skip
