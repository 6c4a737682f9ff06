"""The RecallAtFAR callback writes exact values into the epoch logs."""

import csv

import keras
import numpy as np
import pytest

from kdpemb.callbacks import RecallAtFAR
from kdpemb.datasets import UserImages
from kdpemb.metrics import recall_at_far
from tests.data.elements import Elements, batches


def held_out(seed=0, identities=15, per_identity=4, dim=6):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(identities, dim))
    labels = np.repeat(np.arange(identities), per_identity)
    x = centres[labels] + 0.7 * rng.normal(size=(labels.size, dim))
    return x.astype("float32"), labels


class WithBackbone(keras.Model):
    """A wrapper whose `backbone` is the embedding model, like FedEmbModel."""

    def __init__(self, backbone):
        super().__init__()
        self.backbone = backbone
        self.head = keras.layers.Dense(1)

    def call(self, x):
        return self.head(self.backbone(x))


def backbone(dim=6, width=3):
    return keras.Sequential([keras.Input((dim,)), keras.layers.Dense(width)])


def test_keys_appear_in_history_and_equal_the_function(tmp_path):
    x, labels = held_out()
    net = backbone()
    model = WithBackbone(net)
    model.compile(optimizer="sgd", loss="mse")
    callback = RecallAtFAR((x, labels), far=(0.01, 0.1))
    log_file = tmp_path / "log.csv"
    history = model.fit(
        x, np.zeros(len(x)), epochs=3, verbose=0,
        callbacks=[callback, keras.callbacks.CSVLogger(str(log_file))],
    )  # fmt: skip
    assert len(history.history["recall@far=1e-02"]) == 3
    assert len(history.history["recall@far=1e-01"]) == 3
    # The last value is the function on the backbone's embeddings.
    embeddings = net.predict(x, verbose=0)
    assert history.history["recall@far=1e-01"][-1] == pytest.approx(
        recall_at_far(embeddings, labels, 0.1)
    )
    rows = list(csv.DictReader(log_file.open()))
    assert len(rows) == 3 and "recall@far=1e-01" in rows[0]
    assert callback.last_roc[0][-1] <= 0.1


def test_every_n_epochs_and_early_stopping_on_the_key():
    x, labels = held_out(1)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")  # Frozen.
    # EarlyStopping warns on the epochs without the key, and waits for it.
    with pytest.warns(UserWarning, match="not available"):
        history = model.fit(
            x, np.zeros((len(x), 3)), epochs=6, verbose=0,
            callbacks=[
                RecallAtFAR((x, labels), far=0.1, every_n_epochs=2),
                keras.callbacks.EarlyStopping(
                    monitor="recall@far=1e-01", mode="max", patience=1
                ),
            ],
        )  # fmt: skip
    # Evaluated at epochs 2 and 4; no improvement at 4 stops the run.
    assert len(history.history["recall@far=1e-01"]) == 2
    assert len(history.history["loss"]) == 4


def test_user_images_tf_data_and_an_explicit_backbone():
    tf = pytest.importorskip("tensorflow")
    x, labels = held_out(2)
    net = backbone()
    values = []
    for data in (
        UserImages(x, labels, np.arange(len(x))),
        tf.data.Dataset.from_tensor_slices((x, labels)).batch(16),
        tf.data.Dataset.from_tensor_slices((x, labels, np.ones(len(x)))).batch(9),
    ):
        callback = RecallAtFAR(data, far=0.1, backbone=net)
        callback.set_model(WithBackbone(backbone()))  # Not this one's backbone.
        values.append(callback.evaluate()["recall@far=1e-01"])
    expected = recall_at_far(net.predict(x, verbose=0), labels, 0.1)
    assert values == pytest.approx([expected] * 3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(far=2.0), "far must be"),
        (dict(every_n_epochs=0), "every_n_epochs"),
        (dict(far=(1e-2, 0.01)), "same FAR twice"),
    ],
)
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RecallAtFAR(held_out(), **kwargs)


def test_a_pydataset_gives_the_values_of_arrays_in_any_batch_size():
    x, labels = held_out(3)
    net = backbone()
    values = []
    for data, batch_size in (
        ((x, labels), 5),
        ((x, labels), 256),
        (Elements(batches(x, labels, labels, size=7)), 1),
    ):
        callback = RecallAtFAR(data, far=0.1, backbone=net, batch_size=batch_size)
        values.append(callback.evaluate()["recall@far=1e-01"])
    expected = recall_at_far(net.predict(x, verbose=0), labels, 0.1)
    assert values == pytest.approx([expected] * 3)


def test_data_without_labels_is_refused_before_training():
    x, labels = held_out()
    with pytest.raises(ValueError, match=r"data must be \(images, labels, \.\.\.\)"):
        RecallAtFAR(x)
    with pytest.raises(ValueError, match=r"first element of the PyDataset must be"):
        RecallAtFAR(Elements(batches(x)))
    with pytest.raises(ValueError, match=r"labels must have shape \(60, \.\.\.\)"):
        RecallAtFAR((x, labels[:-1]))
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        RecallAtFAR((x, labels), batch_size=0)


def test_diverged_embeddings_get_the_callbacks_own_message():
    x, labels = held_out()
    broken = backbone()
    kernel, bias = broken.get_weights()
    kernel[0, 0] = np.nan
    broken.set_weights([kernel, bias])
    callback = RecallAtFAR((x, labels), far=0.1, backbone=broken, verbose=0)
    with pytest.raises(ValueError, match=r"RecallAtFAR: .*not finite.*diverged"):
        callback.evaluate()


def test_an_input_without_labels_is_refused_when_the_callback_is_made():
    from kdpemb.datasets import inputs

    images_only = inputs.open_input(held_out()[0])
    with pytest.raises(ValueError, match=r"without labels"):
        RecallAtFAR(images_only, far=0.1)


def test_an_empty_dataset_is_called_empty():
    with pytest.raises(ValueError, match="empty"):
        RecallAtFAR(Elements([]), far=0.1)


class CountSteps(keras.callbacks.Callback):
    """Counts training steps (a check before training leaves it at 0)."""

    steps = 0

    def on_train_batch_begin(self, batch, logs=None):
        self.steps += 1


def fit_with(callback, dim=6):
    """Fits a tiny model with `callback` after a step counter; the count."""
    counter = CountSteps()
    model = keras.Sequential([keras.Input((dim,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse")
    x = np.zeros((8, dim), "float32")
    try:
        model.fit(x, np.zeros((8, 3)), epochs=1, verbose=0,
                  callbacks=[counter, callback])  # fmt: skip
    finally:
        assert counter.steps == 0, "the bad data was refused only after training"


@pytest.mark.parametrize(
    ("labels", "far", "message"),
    [
        (np.zeros(60, int), 0.1, "at least two identities"),
        (np.arange(60), 0.1, "No genuine pair"),
        (np.repeat(np.arange(15), 4) + 0.5, 0.1, "fractions"),
        (np.stack([np.arange(60)] * 2, 1), 0.1, "1-D"),
        (np.repeat(np.arange(15), 4), 1e-5, "far=1e-05 is below 1 / 1680"),
    ],
    ids=["one-identity", "no-genuine-pair", "fractions", "2-d", "far-too-small"],
)
@pytest.mark.parametrize("kind", ["arrays", "pydataset"])
def test_bad_labels_are_refused_before_the_first_training_step(
    labels, far, message, kind
):
    x, _ = held_out()
    data = (x, labels) if kind == "arrays" else Elements(batches(x, labels, size=16))
    pattern = rf"RecallAtFAR: the held-out data \(argument data\).*{message}"
    with pytest.raises(ValueError, match=pattern):
        fit_with(RecallAtFAR(data, far=far))


@pytest.mark.parametrize("kind", ["arrays", "pydataset"])
def test_images_the_backbone_does_not_take_are_refused_before_training(kind):
    x, labels = held_out(dim=7)  # The model takes 6 features.
    data = (x, labels) if kind == "arrays" else Elements(batches(x, labels, size=16))
    pattern = r"RecallAtFAR: The backbone takes images of shape \(6,\).*shape \(7,\)"
    with pytest.raises(ValueError, match=pattern):
        fit_with(RecallAtFAR(data, far=0.1))


def test_good_data_is_read_once_per_input_shape_and_string_labels_work():
    x, labels = held_out()
    reads = []

    class Counted(Elements):
        def __getitem__(self, index):
            reads.append(index)
            return super().__getitem__(index)

    data = Counted(batches(x, labels.astype(str), size=16))
    callback = RecallAtFAR(data, far=0.1)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse")
    callback.set_model(model)
    callback.on_train_begin()
    first_pass = len(reads)
    assert first_pass >= 4  # The 4 batches (and the structure).
    callback.on_train_begin()  # Checked already: not read again.
    assert len(reads) == first_pass
    assert 0.0 <= callback.evaluate()["recall@far=1e-01"] <= 1.0


def test_a_bad_in_batch_size_is_refused_when_the_callback_is_made():
    with pytest.raises(ValueError, match="batch_size must be an int >= 2"):
        RecallAtFAR(held_out(), far=0.1, pairs="in_batch", in_batch_size=1)
