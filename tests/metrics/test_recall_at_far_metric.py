"""The Keras metric equals the function, inside compiled evaluate steps."""

import keras
import numpy as np
import pytest

from kdpemb.metrics import RecallAtFARMetric, recall_at_far
from kdpemb.metrics.recall_at_far_metric import far_key


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
    metric = RecallAtFARMetric(far=0.02, embedding_dim=8, capacity=128)
    model = identity_model(8, [metric])
    logs = model.evaluate(x, y, batch_size=batch_size, verbose=0, return_dict=True)
    assert logs["recall@far=2e-02"] == pytest.approx(recall_at_far(x, y, 0.02))
    # A second evaluate starts from an empty buffer.
    x2, y2 = data(seed=1)
    logs = model.evaluate(x2, y2, batch_size=batch_size, verbose=0, return_dict=True)
    assert logs["recall@far=2e-02"] == pytest.approx(recall_at_far(x2, y2, 0.02))


def test_metric_in_fit_validation_logs_even_when_training_overflows():
    x, y = data()
    x_train, y_train = data(seed=3, identities=50)  # 250 rows > capacity.
    model = identity_model(8, [])
    model.compile(
        optimizer="sgd",
        loss=lambda t, p: keras.ops.mean(p * 0.0),
        metrics=[RecallAtFARMetric(0.05, embedding_dim=8, capacity=120)],
    )
    with pytest.warns(UserWarning, match="capacity=120"):
        history = model.fit(
            x_train, y_train, validation_data=(x, y), epochs=2, batch_size=25,
            verbose=0,
        )  # fmt: skip
    assert history.history["val_recall@far=5e-02"] == pytest.approx(
        [recall_at_far(x, y, 0.05)] * 2
    )
    assert np.isnan(history.history["recall@far=5e-02"]).all()


def test_metric_runs_eagerly_batch_by_batch():
    x, y = data()
    model = identity_model(
        8, [RecallAtFARMetric(far=1e-3, embedding_dim=8, capacity=128)]
    )
    model.compile(
        loss=lambda t, p: keras.ops.mean(p * 0.0),
        metrics=[RecallAtFARMetric(far=1e-3, embedding_dim=8, capacity=128)],
        run_eagerly=True,
    )
    logs = model.evaluate(x, y, batch_size=10, verbose=0, return_dict=True)
    assert logs["recall@far=1e-03"] == pytest.approx(recall_at_far(x, y, 1e-3))


def test_in_batch_pairs_use_the_given_batch_size():
    x, y = data()
    metric = RecallAtFARMetric(
        0.05, embedding_dim=8, pairs="in_batch", in_batch_size=50
    )
    metric.update_state(y, x)
    expected = recall_at_far(x, y, 0.05, pairs="in_batch", batch_size=50)
    assert float(metric.result()) == pytest.approx(expected)
    assert expected != recall_at_far(x, y, 0.05, pairs="in_batch", batch_size=20)


def test_far_keys_never_collide():
    fars = [1e-3, 1.5e-3, 0.01, 0.014, 0.25, 2e-1, 1.0]
    keys = [far_key(f) for f in fars]
    assert len(set(keys)) == len(keys)
    assert keys[0] == "recall@far=1e-03" and keys[3] == "recall@far=0.014"


def test_more_embeddings_than_capacity_give_nan_never_a_partial_value():
    x, y = data()
    model = identity_model(8, [RecallAtFARMetric(0.05, embedding_dim=8, capacity=60)])
    with pytest.warns(UserWarning, match="capacity=60"):
        logs = model.evaluate(x, y, batch_size=25, verbose=0, return_dict=True)
    assert np.isnan(logs["recall@far=5e-02"])
    with pytest.raises(ValueError, match="batch of 100"):
        RecallAtFARMetric(0.05, embedding_dim=8, capacity=60).update_state(y, x)


def test_eager_update_and_reset():
    x, y = data()
    metric = RecallAtFARMetric(0.05, embedding_dim=8, capacity=100)
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
        RecallAtFARMetric(**kwargs)


def test_wrong_width_and_sample_weights_are_refused():
    metric = RecallAtFARMetric(0.1, embedding_dim=4, capacity=10)
    with pytest.raises(ValueError, match="width 3"):
        metric.update_state(np.zeros(2), np.zeros((2, 3)))
    with pytest.raises(ValueError, match="sample_weight"):
        metric.update_state(np.zeros(2), np.zeros((2, 4)), sample_weight=np.ones(2))


def test_config_round_trip():
    metric = RecallAtFARMetric(
        0.01, embedding_dim=4, capacity=10, pairs="in_batch", in_batch_size=7
    )
    clone = RecallAtFARMetric.from_config(metric.get_config())
    assert (clone.far, clone.capacity, clone.pairs, clone.in_batch_size) == (
        0.01,
        10,
        "in_batch",
        7,
    )
    assert clone.name == "recall@far=1e-02"


def test_the_metric_is_serialisable():
    metric = RecallAtFARMetric(0.05, embedding_dim=8, capacity=64, name="tar")
    clone = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(metric)
    )
    assert type(clone) is RecallAtFARMetric
    assert (clone.far, clone.capacity, clone.name) == (0.05, 64, "tar")
    x, y = data(seed=1, identities=10)
    logs = identity_model(8, [clone]).evaluate(x, y, verbose=0, return_dict=True)
    assert logs["tar"] == pytest.approx(recall_at_far(x, y, 0.05))


def test_the_old_metric_name_still_works_and_warns():
    import kdpemb.metrics

    with pytest.warns(DeprecationWarning, match="RecallAtFARMetric"):
        assert kdpemb.metrics.RecallAtFAR is RecallAtFARMetric
