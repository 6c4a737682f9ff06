import csv

import keras
import numpy as np
import pytest

from kdpemb import privacy
from kdpemb.callbacks import PrivacyBudget, PrivacyBudgetExhaustedError
from kdpemb.privacy import protocol
from kdpemb.testing import ToyDPRegressor, toy_regression_data

N, D, DELTA = 64, 3, 1e-3


def make_model(noise_multiplier=1.5, sampling_probability=0.1, **kwargs):
    model = ToyDPRegressor(
        N, D, noise_multiplier, sampling_probability, seed=1, **kwargs
    )
    model.compile(optimizer="sgd")
    return model


def steps_of(model):
    return protocol.read_private_steps(model)


def brute_force_budget(mechanism, target, delta=DELTA, accountant="pld"):
    """The last step whose ε is within target, by scanning step by step."""
    fresh = privacy.Accountant(mechanism, accountant)
    steps = 0
    while fresh.epsilon(steps + 1, delta) <= target:
        steps += 1
    return steps


def test_epsilon_is_logged_every_epoch_and_matches_the_accountant():
    model = make_model()
    history = model.fit(
        toy_regression_data(N, D, steps_per_epoch=7),
        epochs=3,
        verbose=0,
        callbacks=[PrivacyBudget(DELTA, verbose=0)],
    )
    expected = [
        privacy.Accountant(model.privacy_mechanism()).epsilon(steps, DELTA)
        for steps in (7, 14, 21)
    ]
    np.testing.assert_allclose(history.history["epsilon"], expected, rtol=1e-6)
    assert steps_of(model) == 21


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_training_stops_at_exactly_the_last_allowed_step(accountant):
    model = make_model()
    target = 1.0
    budget = brute_force_budget(
        model.privacy_mechanism(), target, accountant=accountant
    )
    assert budget % 10 != 0  # The budget falls inside an epoch.
    callback = PrivacyBudget(
        DELTA, target_epsilon=target, accountant=accountant, verbose=0
    )
    history = model.fit(
        toy_regression_data(N, D, steps_per_epoch=10),
        epochs=10,
        verbose=0,
        callbacks=[callback],
    )
    assert steps_of(model) == budget == callback.step_budget
    assert len(history.history["epsilon"]) == budget // 10 + 1
    assert max(history.history["epsilon"]) <= target
    assert callback.statement.steps == budget and callback.statement.epsilon <= target


def test_steps_per_execution_never_overshoots_the_budget():
    model = ToyDPRegressor(N, D, 1.5, 0.1, seed=1)
    model.compile(optimizer="sgd", steps_per_execution=4)
    budget = brute_force_budget(model.privacy_mechanism(), 1.0)
    model.fit(
        toy_regression_data(N, D, steps_per_epoch=12),
        epochs=10,
        verbose=0,
        callbacks=[PrivacyBudget(DELTA, target_epsilon=1.0, verbose=0)],
    )
    assert budget - 4 < steps_of(model) <= budget


def endless(x, y):
    while True:
        yield x, y


def test_the_budget_holds_when_training_runs_longer_than_planned():
    """Infinite data with steps_per_execution=4 runs 12 steps per 10-step epoch."""
    model = ToyDPRegressor(N, D, 1.5, 0.1, seed=1)
    model.compile(optimizer="sgd", steps_per_execution=4)
    data = toy_regression_data(N, D, 1)
    target = privacy.Accountant(model.privacy_mechanism()).epsilon(20, DELTA)
    model.fit(
        endless(data.x, data.y),
        steps_per_epoch=10,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[PrivacyBudget(DELTA, target_epsilon=target, verbose=0)],
    )
    assert 16 < steps_of(model) <= 20


class RestoreStepCount(keras.callbacks.Callback):
    """Sets private_steps at train begin, as BackupAndRestore can."""

    def __init__(self, steps):
        super().__init__()
        self.steps = steps

    def on_train_begin(self, logs=None):
        self.model.private_steps.assign(self.steps)


def test_the_budget_holds_when_a_later_callback_changes_the_count():
    model = make_model()
    target = privacy.Accountant(model.privacy_mechanism()).epsilon(20, DELTA)
    callback = PrivacyBudget(DELTA, target_epsilon=target, verbose=0)
    model.fit(
        toy_regression_data(N, D, 10),
        epochs=2,
        verbose=0,
        callbacks=[callback, RestoreStepCount(5)],
    )
    assert steps_of(model) == 20 == callback.step_budget


def test_a_second_fit_continues_the_count_and_refuses_an_exhausted_budget():
    model = make_model()
    data = toy_regression_data(N, D, steps_per_epoch=5)
    model.fit(data, epochs=2, verbose=0, callbacks=[PrivacyBudget(DELTA, verbose=0)])
    history = model.fit(
        data, epochs=1, verbose=0, callbacks=[PrivacyBudget(DELTA, verbose=0)]
    )
    accountant = privacy.Accountant(model.privacy_mechanism())
    assert steps_of(model) == 15
    assert history.history["epsilon"] == [pytest.approx(accountant.epsilon(15, DELTA))]

    callback = PrivacyBudget(DELTA, target_epsilon=1.0, verbose=0)
    model.fit(data, epochs=100, verbose=0, callbacks=[callback])
    spent = steps_of(model)
    assert spent == brute_force_budget(model.privacy_mechanism(), 1.0)
    weights = [w.copy() for w in model.get_weights()]
    with pytest.raises(PrivacyBudgetExhaustedError, match="No privacy budget left"):
        model.fit(
            data,
            epochs=1,
            verbose=0,
            callbacks=[PrivacyBudget(DELTA, target_epsilon=1.0, verbose=0)],
        )
    assert steps_of(model) == spent
    for before, after in zip(weights, model.get_weights(), strict=True):
        np.testing.assert_array_equal(before, after)


def test_save_and_load_keep_the_private_step_count(tmp_path):
    model = make_model()
    data = toy_regression_data(N, D, steps_per_epoch=6)
    model.fit(data, epochs=1, verbose=0, callbacks=[PrivacyBudget(DELTA, verbose=0)])
    model.save(tmp_path / "model.keras")
    restored = keras.saving.load_model(tmp_path / "model.keras")
    restored.compile(optimizer="sgd")
    assert steps_of(restored) == 6
    history = restored.fit(
        data, epochs=1, verbose=0, callbacks=[PrivacyBudget(DELTA, verbose=0)]
    )
    assert steps_of(restored) == 12
    expected = privacy.Accountant(restored.privacy_mechanism()).epsilon(12, DELTA)
    assert history.history["epsilon"] == [pytest.approx(expected)]

    fresh = make_model()
    fresh.load_weights(tmp_path / "model.keras")
    assert steps_of(fresh) == 6


def test_csv_logger_after_the_callback_records_epsilon(tmp_path):
    path = tmp_path / "log.csv"
    make_model().fit(
        toy_regression_data(N, D, steps_per_epoch=4),
        epochs=2,
        verbose=0,
        callbacks=[
            PrivacyBudget(DELTA, verbose=0),
            keras.callbacks.CSVLogger(str(path)),
        ],
    )
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and float(rows[1]["epsilon"]) > float(rows[0]["epsilon"]) > 0


def test_early_stopping_can_monitor_epsilon():
    model = make_model()
    model.fit(
        toy_regression_data(N, D, steps_per_epoch=4),
        epochs=20,
        verbose=0,
        callbacks=[
            PrivacyBudget(DELTA, verbose=0),
            keras.callbacks.EarlyStopping(monitor="epsilon", mode="min", patience=0),
        ],
    )
    assert steps_of(model) == 8  # ε rises every epoch: stopped after the second.


def test_a_target_below_one_step_refuses_to_train():
    model = make_model(noise_multiplier=0.5, sampling_probability=0.5)
    one_step = privacy.epsilon(privacy.dp_sgd(0.5, N / 2, N), 1, DELTA)
    assert one_step > 0.1  # The first step alone exceeds the target.
    with pytest.raises(
        PrivacyBudgetExhaustedError, match=r"budget for ε <= 0\.1 is 0"
    ) as info:
        model.fit(
            toy_regression_data(N, D, 3),
            epochs=1,
            verbose=0,
            callbacks=[PrivacyBudget(DELTA, target_epsilon=0.1, verbose=0)],
        )
    assert steps_of(model) == 0
    assert f"One more step would take ε to {one_step:.4g}." in str(info.value)


def test_zero_noise_with_a_target_says_no_noise_not_raise_the_target():
    # Review finding: it said "ε = 0 ... Raise target_epsilon", which no
    # target can fix.
    model = make_model(noise_multiplier=0.0)
    with pytest.raises(PrivacyBudgetExhaustedError) as info:
        model.fit(
            toy_regression_data(N, D, 2),
            epochs=1,
            verbose=0,
            callbacks=[PrivacyBudget(DELTA, target_epsilon=1e6, verbose=0)],
        )
    message = str(info.value)
    assert message.startswith("No noise: ε is infinite.")
    assert "noise_multiplier = 0" in message and "ε = 0" not in message
    assert "Raise target_epsilon" not in message
    assert steps_of(model) == 0


def test_zero_noise_reports_infinite_epsilon():
    model = make_model(noise_multiplier=0.0)
    history = model.fit(
        toy_regression_data(N, D, 2),
        epochs=1,
        verbose=0,
        callbacks=[PrivacyBudget(DELTA, verbose=0)],
    )
    assert history.history["epsilon"] == [float("inf")]
    with pytest.raises(PrivacyBudgetExhaustedError, match="No noise: ε is infinite"):
        model.fit(
            toy_regression_data(N, D, 2),
            epochs=1,
            verbose=0,
            callbacks=[PrivacyBudget(DELTA, target_epsilon=10.0, verbose=0)],
        )


def test_delta_too_large_for_the_population_is_refused_before_training():
    model = make_model()
    with pytest.raises(ValueError, match="1/population"):
        model.fit(
            toy_regression_data(N, D, 2),
            epochs=1,
            verbose=0,
            callbacks=[PrivacyBudget(1.0 / N, verbose=0)],
        )
    assert steps_of(model) == 0


def test_models_without_the_protocol_get_a_clear_error():
    model = keras.Sequential([keras.Input((D,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(TypeError, match="private_steps and privacy_mechanism"):
        model.fit(
            np.zeros((8, D)),
            np.zeros((8, 1)),
            verbose=0,
            callbacks=[PrivacyBudget(DELTA, verbose=0)],
        )


class VirtualClientToy(ToyDPRegressor):
    def privacy_mechanism(self):
        return privacy.virtual_clients(1.0, 8, 400, users_per_client=4)


def test_an_accountant_that_cannot_express_the_relation_refuses():
    model = VirtualClientToy(N, D, 1.0, 0.1, seed=0)
    model.compile(optimizer="sgd")
    with pytest.raises(privacy.UnsupportedMechanismError, match="replace-one"):
        model.fit(
            toy_regression_data(N, D, 2),
            epochs=1,
            verbose=0,
            callbacks=[PrivacyBudget(1e-4, accountant="rdp", verbose=0)],
        )


class DoubleCountingToy(ToyDPRegressor):
    def _private_update(self, x, y):
        logs = super()._private_update(x, y)
        self.private_steps.assign_add(1)
        return logs


def test_a_model_that_breaks_the_one_step_per_batch_protocol_is_caught():
    model = DoubleCountingToy(N, D, 1.0, 0.1, seed=0)
    model.compile(optimizer="sgd")
    with pytest.raises(RuntimeError, match="exactly 1"):
        model.fit(
            toy_regression_data(N, D, 3),
            epochs=1,
            verbose=0,
            callbacks=[PrivacyBudget(DELTA, verbose=0)],
        )


@pytest.mark.parametrize("q", [0.0, 1.5, float("nan")])
def test_a_sampling_probability_outside_zero_one_is_refused(q):
    with pytest.raises(ValueError, match="sampling_probability"):
        ToyDPRegressor(N, D, 1.0, q)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"delta": 0.0}, r"in \(0, 1\)"),
        ({"delta": 1e-5, "target_epsilon": -1.0}, "> 0"),
        ({"delta": 1e-5, "accountant": "moments"}, "one of"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PrivacyBudget(**kwargs)


def test_delta_is_given_once_to_the_model():
    import kdpemb

    model = kdpemb.testing.ToyDPRegressor(
        num_examples=64, num_features=3, noise_multiplier=1.5, sampling_probability=0.1
    )
    model.compile(optimizer="sgd")
    data = kdpemb.testing.toy_regression_data(64, 3, steps_per_epoch=2)
    budget = kdpemb.callbacks.PrivacyBudget(verbose=0)
    with pytest.raises(ValueError, match=r"needs δ.*delta=") as error:
        model.fit(data, epochs=1, verbose=0, callbacks=[budget])
    assert kdpemb.privacy.protocol.read_private_steps(model) == 0, error.value
    model.delta = 1e-3  # The model's own δ, as kdpemb's models take it.
    history = model.fit(data, epochs=1, verbose=0, callbacks=[budget])
    assert budget.delta == 1e-3
    statement = kdpemb.privacy.privacy_statement(model)
    assert statement.delta == 1e-3
    assert history.history["epsilon"][-1] == pytest.approx(statement.epsilon)
    # An explicit δ still wins over the model's.
    assert kdpemb.privacy.privacy_statement(model, delta=1e-4).delta == 1e-4
