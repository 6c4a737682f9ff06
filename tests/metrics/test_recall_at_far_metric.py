"""The Keras metric equals the function, inside compiled evaluate steps."""

import keras
import numpy as np
import pytest

from kdpemb.metrics import RecallAtFAR, recall_at_far


def data(seed=0, identities=20, per_identity=5, dim=8):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(identities, dim))
    labels = np.repeat(np.arange(identities), per_identity)
    rng.shuffle(labels)
    x = centres[labels] + 0.9 * rng.normal(size=(labels.size, dim))
    return x.astype("float32"), labels


def identity_model(dim, metrics):
    inputs = keras.Input((dim,))
    outputs = keras.layers.Dense(dim, use_bias=False, kernel_initializer="identity")(
        inputs
    )
    model = keras.Model(inputs, outputs)
    model.compile(loss=lambda y, p: keras.ops.mean(p * 0.0), metrics=metrics)
    return model


@pytest.mark.parametrize("batch_size", [7, 32, 100])
def test_metric_in_evaluate_equals_the_function(batch_size):
    x, y = data()
    metric = RecallAtFAR(far=0.02, embedding_dim=8, capacity=128)
    model = identity_model(8, [metric])
    logs = model.evaluate(x, y, batch_size=batch_size, verbose=0, return_dict=True)
    assert logs["recall@far=2e-02"] == pytest.approx(recall_at_far(x, y, 0.02))
    # A second evaluate starts from an empty buffer.
    x2, y2 = data(seed=1)
    logs = model.evaluate(x2, y2, batch_size=batch_size, verbose=0, return_dict=True)
    assert logs["recall@far=2e-02"] == pytest.approx(recall_at_far(x2, y2, 0.02))


def test_metric_in_fit_validation_logs():
    x, y = data()
    model = identity_model(8, [RecallAtFAR(0.05, embedding_dim=8, capacity=100)])
    model.compile(
        optimizer="sgd",
        loss=lambda t, p: keras.ops.mean(p * 0.0),
        metrics=[RecallAtFAR(0.05, embedding_dim=8, capacity=100)],
    )
    history = model.fit(
        x, y, validation_data=(x, y), epochs=2, batch_size=25, verbose=0
    )
    assert history.history["val_recall@far=5e-02"] == pytest.approx(
        [recall_at_far(x, y, 0.05)] * 2
    )


def test_more_embeddings_than_capacity_raise_instead_of_dropping():
    x, y = data()
    model = identity_model(8, [RecallAtFAR(0.05, embedding_dim=8, capacity=60)])
    with pytest.raises(ValueError, match="capacity=60"):
        model.evaluate(x, y, batch_size=25, verbose=0)


def test_eager_update_and_reset():
    x, y = data()
    metric = RecallAtFAR(0.05, embedding_dim=8, capacity=100)
    metric.update_state(y[:50], x[:50])
    metric.update_state(y[50:], x[50:])
    assert float(metric.result()) == pytest.approx(recall_at_far(x, y, 0.05))
    metric.reset_state()
    metric.update_state(y[:40], x[:40])
    assert float(metric.result()) == pytest.approx(recall_at_far(x[:40], y[:40], 0.05))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(far=0.0, embedding_dim=4), "far must be"),
        (dict(far=[1e-3, 1e-2], embedding_dim=4), "one far"),
        (dict(embedding_dim=0), "embedding_dim"),
        (dict(embedding_dim=4, capacity=-1), "capacity"),
        (dict(embedding_dim=4, pairs="x"), "pairs"),
    ],
)
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RecallAtFAR(**kwargs)


def test_wrong_width_and_sample_weights_are_refused():
    metric = RecallAtFAR(0.1, embedding_dim=4, capacity=10)
    with pytest.raises(ValueError, match="width 3"):
        metric.update_state(np.zeros(2), np.zeros((2, 3)))
    with pytest.raises(ValueError, match="sample_weight"):
        metric.update_state(np.zeros(2), np.zeros((2, 4)), sample_weight=np.ones(2))


def test_config_round_trip():
    metric = RecallAtFAR(0.01, embedding_dim=4, capacity=10, pairs="in_batch")
    clone = RecallAtFAR.from_config(metric.get_config())
    assert (clone.far, clone.embedding_dim, clone.capacity, clone.pairs) == (
        0.01,
        4,
        10,
        "in_batch",
    )
    assert clone.name == "recall@far=1e-02"
