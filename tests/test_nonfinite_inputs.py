"""One rule for NaN or infinite inputs in every trainer: refused, before use.

Each case poisons one row of otherwise valid data with NaN, +inf or -inf,
or with 1e39 in float64 data (finite there, infinite once cast to the
float32 every trainer computes in), and checks that it is refused with
the same `NonFiniteInputError`, naming that row, before anything is
trained or spent: the weights are those before, no private step is
counted, no plan is fixed, arrays are refused before the backbone runs,
and a stream at its first bad batch before the backbone runs on it.
"""

import keras
import numpy as np
import pytest

from kdpemb import FedEmbModel, LastLayerDPClassifier
from kdpemb.data import VirtualClients
from kdpemb.datasets import write_user_shards
from kdpemb.errors import NonFiniteInputError
from kdpemb.features import extract
from kdpemb.models import CentralizedBaseline, DPModel, pretrain
from tests.data.elements import Elements, batches

VALUES = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf, "1e39-float64": 1e39}
ROW = 5  # The poisoned row, in the second batch of 4.


def dtype_of(value):
    """float64 for a finite value (1e39: too large for float32 only)."""
    return "float64" if np.isfinite(value) else "float32"


def poisoned(shape, value, dtype=None):
    x = np.random.default_rng(0).normal(size=shape).astype(dtype or dtype_of(value))
    x[ROW].flat[-1] = value
    return x


def mlp(inputs=3, outputs=2):
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((inputs,)), keras.layers.Dense(4), keras.layers.Dense(outputs)]
    )


def image_backbone():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((4, 4, 1)), keras.layers.Flatten(), keras.layers.Dense(3)]
    )


class Counted:
    """A backbone's `predict_on_batch`, counting the batches it runs on;
    `expected` of them may run before the refusal."""

    def __init__(self, backbone, expected):
        self.calls, self.expected, self.run = 0, expected, backbone.predict_on_batch
        backbone.predict_on_batch = self

    def __call__(self, images):
        self.calls += 1
        return self.run(images)


# Each case: (model, whose private step count is checked or None;
# the call that must be refused; the backbone's counter or None).


def dp_model(value, targets=False):
    model = DPModel(mlp(), noise_multiplier=1.0, delta=1e-3)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    x, y = (poisoned(shape, 0.0, dtype_of(value)) for shape in ((16, 3), (16, 2)))
    (y if targets else x)[ROW, -1] = value
    return model, lambda: model.fit(x, y, batch_size=8, verbose=0), None


def dp_model_calibrated(value):
    model = DPModel(mlp(), target_epsilon=2.0, delta=1e-3)
    model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
    x, y = poisoned((16, 3), value), np.arange(16) % 2
    return model, lambda: model.fit(x, y, batch_size=8, epochs=2, verbose=0), None


def last_layer(value):
    model = LastLayerDPClassifier(2, noise_multiplier=1.0, delta=1e-3)
    x, y = poisoned((16, 3), value), np.arange(16) % 2
    return model, lambda: model.fit(x, y, batch_size=8, verbose=0), None


def fedemb(value):
    model = FedEmbModel(image_backbone(), clip_norm=1.0, noise_multiplier=1.0)
    model.compile()
    images = poisoned((16, 4, 4, 1), value)

    def fit():
        clients = VirtualClients(
            images, labels=np.arange(16) % 4, user_ids=np.arange(16) // 2,
            clients_per_round=2, local_steps=1, batch_size=2,
        )  # fmt: skip
        model.fit(clients, verbose=0)

    return model, fit, None


def centralized(value):
    model = CentralizedBaseline(image_backbone(), 4)
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = poisoned((16, 4, 4, 1), value), np.arange(16) % 4
    return model, lambda: model.fit(x, y, batch_size=4, verbose=0), None


def extract_arrays(value):
    backbone = image_backbone()
    counted = Counted(backbone, expected=0)  # Scanned whole first.
    images = poisoned((16, 4, 4, 1), value)
    return backbone, lambda: extract(backbone, images, batch_size=4, verbose=0), counted


def extract_stream(value):
    backbone = image_backbone()
    counted = Counted(backbone, expected=1)  # The first batch only.
    stream = Elements(np.split(poisoned((16, 4, 4, 1), value), 4))  # Batches of 4.
    return backbone, lambda: extract(backbone, stream, verbose=0), counted


def shards_stream(value, tmp_path):
    images, labels = poisoned((16, 4, 4, 1), value), np.arange(16) % 2
    user_ids = np.arange(16) // 2
    stream = Elements(batches(images, labels, user_ids, size=4))
    return None, lambda: write_user_shards(tmp_path / "out", stream), None


CASES = {
    "DPModel": dp_model,
    "DPModel-float-targets": lambda value: dp_model(value, targets=True),
    "DPModel-target-epsilon": dp_model_calibrated,
    "LastLayerDPClassifier": last_layer,
    "FedEmbModel-VirtualClients": fedemb,
    "CentralizedBaseline": centralized,
    "extract-arrays": extract_arrays,
    "extract-stream": extract_stream,
}


def weights(model):
    return [] if model is None else [np.array(w) for w in model.get_weights()]


@pytest.mark.filterwarnings("ignore::kdpemb.errors.PrivacyWarning")
@pytest.mark.parametrize("value", VALUES.values(), ids=VALUES)
@pytest.mark.parametrize("case", CASES.values(), ids=CASES)
def test_a_non_finite_input_is_refused_before_any_use(case, value):
    model, run, backbone = case(value)
    before = weights(model)
    with pytest.raises(NonFiniteInputError, match="holds NaN or infinite") as caught:
        run()
    assert caught.value.row == ROW
    assert f"[{ROW}]" in str(caught.value) and "nothing was trained" in str(
        caught.value
    )
    for old, new in zip(before, weights(model), strict=True):
        np.testing.assert_array_equal(old, new)
    if hasattr(model, "private_steps"):
        assert int(model.private_steps.value) == 0
    if isinstance(model, DPModel):
        assert model.planned_steps is None and model.schedule is None
    if backbone is not None:  # The poisoned batch never ran.
        assert backbone.calls == backbone.expected


@pytest.mark.parametrize("value", VALUES.values(), ids=VALUES)
def test_writing_user_shards_refuses_a_stream_at_its_bad_batch(value, tmp_path):
    _, run, _ = shards_stream(value, tmp_path)
    with pytest.raises(NonFiniteInputError, match=rf"images\[{ROW}\]") as caught:
        run()
    assert caught.value.row == ROW and list(tmp_path.iterdir()) == []


# Validation data and other arrays of `fit`: the same rule. Each case
# returns (the model, the call that must be refused, the name in the error).


def dp_model_validation(value):
    model, _, _ = dp_model(0.0)
    x, y = poisoned((16, 3), 0.0, "float32"), poisoned((16, 2), 0.0, "float32")
    held = (poisoned((8, 3), value), y[:8])
    run = lambda: model.fit(x, y, batch_size=8, validation_data=held, verbose=0)  # noqa: E731
    return model, run, "x_val"


def last_layer_validation(value):
    model, _, _ = last_layer(0.0)
    x, y = poisoned((16, 3), 0.0, "float32"), np.arange(16) % 2
    held = [poisoned((8, 3), value), y[:8]]
    run = lambda: model.fit(x, y, batch_size=8, validation_data=held, verbose=0)  # noqa: E731
    return model, run, "x_val"


def centralized_validation(value):
    model, _, _ = centralized(0.0)
    x, y = poisoned((16, 4, 4, 1), 0.0, "float32"), np.arange(16) % 4
    held = (poisoned((8, 4, 4, 1), value), y[:8])
    # Passed by position, after batch_size, epochs, verbose, callbacks and
    # validation_split, as Keras' `fit` takes it.
    run = lambda: model.fit(x, y, 4, 1, 0, None, 0.0, held)  # noqa: E731
    return model, run, "x_val"


def centralized_sample_weight(value):
    model, _, _ = centralized(0.0)
    x, y = poisoned((16, 4, 4, 1), 0.0, "float32"), np.arange(16) % 4
    weights = np.ones(16, dtype_of(value))
    weights[ROW] = value
    run = lambda: model.fit(x, y, sample_weight=weights, verbose=0)  # noqa: E731
    return model, run, "sample_weight"


def centralized_dict_targets(value):
    # y checked whatever x is (here a dict of arrays).
    model, _, _ = centralized(0.0)
    x = {"images": poisoned((16, 4, 4, 1), 0.0, "float32")}
    y = keras.utils.to_categorical(np.arange(16) % 4).astype(dtype_of(value))
    y[ROW, 0] = value
    model.compile("sgd", keras.losses.CategoricalCrossentropy(from_logits=True))
    return model, lambda: model.fit(x, y, verbose=0), "y"


def pretrain_validation(value):
    backbone = image_backbone()
    public = (poisoned((16, 4, 4, 1), 0.0, "float32"), np.arange(16) % 4)
    held = (poisoned((8, 4, 4, 1), value), np.arange(8) % 4)
    run = lambda: pretrain(backbone, public, epochs=1, validation=held, verbose=0)  # noqa: E731
    return backbone, run, "images"


FIT_CASES = {
    "DPModel-validation_data": dp_model_validation,
    "LastLayerDPClassifier-validation_data": last_layer_validation,
    "CentralizedBaseline-validation_data": centralized_validation,
    "CentralizedBaseline-sample_weight": centralized_sample_weight,
    "CentralizedBaseline-y": centralized_dict_targets,
    "pretrain-validation": pretrain_validation,
}


@pytest.mark.filterwarnings("ignore::kdpemb.errors.PrivacyWarning")
@pytest.mark.parametrize("value", [np.nan, 1e39], ids=["nan", "1e39-float64"])
@pytest.mark.parametrize("case", FIT_CASES.values(), ids=FIT_CASES)
def test_non_finite_validation_data_and_weights_are_refused_before_fit(case, value):
    model, run, name = case(value)
    before = weights(model)
    with pytest.raises(NonFiniteInputError, match=rf"^{name}\[{ROW}\]") as caught:
        run()
    assert caught.value.row == ROW and "nothing was trained" in str(caught.value)
    for old, new in zip(before, weights(model), strict=True):
        np.testing.assert_array_equal(old, new)
    if hasattr(model, "private_steps"):
        assert int(model.private_steps.value) == 0
