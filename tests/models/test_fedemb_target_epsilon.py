"""FedEmbModel(target_epsilon=...): calibrated once, enforced at every fit."""

import warnings

import dp_accounting as dpa
import keras
import numpy as np
import pytest

from kdpemb.errors import PrivacyBudgetExhaustedError
from kdpemb.models import FedEmbModel
from kdpemb.privacy import protocol
from tests.models import fedemb_reference as ref
from tests.models.test_fedemb import DELTA, tiny_clients

pytestmark = [
    pytest.mark.filterwarnings("ignore::kdpemb.errors.ReproducibleNoiseWarning"),
    pytest.mark.filterwarnings("ignore::kdpemb.errors.ReproducibleSamplingWarning"),
]

TARGET = 2.0


def target_model(**overrides):
    settings = {
        "client_optimizer": 0.1,
        "clip_norm": 0.5,
        "target_epsilon": TARGET,
        "delta": DELTA,
        "client_parallelism": 1,
        **overrides,
    }
    model = FedEmbModel(ref.linear_backbone(), **settings)
    model.compile(optimizer=keras.optimizers.SGD(1.0))
    return model


def dp_accounting_epsilon(z, q, steps):
    """ε of `steps` Poisson rounds at rate q under replace-one (k = 2), from
    dp-accounting itself."""
    accountant = dpa.pld.PLDAccountant(dpa.NeighboringRelation.REPLACE_ONE)
    event = dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z))
    accountant.compose(dpa.SelfComposedDpEvent(event, steps))
    return accountant.get_epsilon(DELTA)


def kernel(model):
    return ref.kernel_of(model.backbone).copy()


def test_the_first_fit_calibrates_z_to_the_target_and_a_second_fit_is_refused(
    capsys,
):
    clients = tiny_clients()
    model = target_model(schedule=clients.schedule)
    with pytest.raises(ValueError, match="fit the model first"):
        model.privacy_mechanism()
    model.fit(clients, epochs=2, verbose=1)
    planned = 2 * clients.rounds_per_epoch
    out = capsys.readouterr().out
    assert f"calibrating the noise for ε = {TARGET:g}" in out
    assert f"over {planned} rounds" in out and "compiling the round" in out
    assert model.planned_steps == planned
    z = model.noise_multiplier
    assert z == model.calibrated_noise_multiplier > 0
    assert model.privacy_mechanism().noise_multiplier == z
    # dp-accounting directly: z meets the target, 2% less noise misses it.
    q = clients.schedule.sampling_probability
    assert dp_accounting_epsilon(z, q, planned) <= TARGET
    assert dp_accounting_epsilon(0.98 * z, q, planned) > TARGET
    assert model.privacy_statement().epsilon <= TARGET

    before, steps = kernel(model), protocol.read_private_steps(model)
    with pytest.raises(PrivacyBudgetExhaustedError) as error:
        model.fit(clients, epochs=1, verbose=0)
    message = str(error.value)
    assert f"target_epsilon={TARGET}" in message and "at most 0 more rounds" in message
    assert f"{steps} of the {planned} rounds" in message and "ε =" in message
    assert protocol.read_private_steps(model) == steps
    np.testing.assert_array_equal(kernel(model), before)
    with pytest.raises(PrivacyBudgetExhaustedError):
        model.train_on_batch(clients[0])
    assert protocol.read_private_steps(model) == steps


def test_a_loaded_model_keeps_its_plan_and_refuses_past_it(tmp_path):
    clients = tiny_clients()
    per_epoch = clients.rounds_per_epoch
    model = target_model(planned_steps=3 * per_epoch)
    model.fit(clients, epochs=1, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        loaded = keras.saving.load_model(path)
    assert loaded.noise_multiplier == model.noise_multiplier
    assert (loaded.target_epsilon, loaded.planned_steps) == (TARGET, 3 * per_epoch)
    assert loaded.privacy_mechanism() == model.privacy_mechanism()
    if getattr(loaded, "optimizer", None) is None:
        loaded.compile(optimizer=keras.optimizers.SGD(1.0))
    before = kernel(loaded)
    with pytest.raises(PrivacyBudgetExhaustedError, match=f"at most {2 * per_epoch}"):
        loaded.fit(clients, epochs=3, verbose=0)
    np.testing.assert_array_equal(kernel(loaded), before)
    assert protocol.read_private_steps(loaded) == per_epoch
    loaded.fit(clients, epochs=2, verbose=0)  # Exactly the plan.
    assert protocol.read_private_steps(loaded) == 3 * per_epoch
    assert loaded.privacy_statement().epsilon <= TARGET


def test_a_first_fit_longer_than_the_given_plan_is_refused_before_a_round():
    clients = tiny_clients()
    model = target_model(planned_steps=1)
    before = kernel(model)
    with pytest.raises(PrivacyBudgetExhaustedError, match="at most 1 more round"):
        model.fit(clients, epochs=1, verbose=0)
    np.testing.assert_array_equal(kernel(model), before)
    assert protocol.read_private_steps(model) == 0


def test_target_epsilon_settings_are_checked():
    backbone = ref.linear_backbone()
    with pytest.raises(ValueError, match="exactly one of noise_multiplier"):
        FedEmbModel(backbone, noise_multiplier=1.0, target_epsilon=1.0, delta=DELTA)
    with pytest.raises(ValueError, match="exactly one of noise_multiplier"):
        FedEmbModel(backbone)
    with pytest.raises(ValueError, match="needs delta"):
        FedEmbModel(backbone, target_epsilon=1.0)
    with pytest.raises(ValueError, match="belong to a target_epsilon"):
        FedEmbModel(backbone, noise_multiplier=1.0, planned_steps=10)


def test_an_unsized_round_source_is_refused_with_a_target():
    clients = tiny_clients()
    model = target_model(schedule=clients.schedule)

    def endless():
        while True:
            yield clients[0]

    with pytest.raises(ValueError, match="steps_per_epoch"):
        model.fit(endless(), epochs=1, verbose=0)
    assert model.noise_multiplier is None


def test_steps_per_execution_rounds_are_planned():
    # Keras runs whole executions of steps_per_execution (k) rounds: an
    # epoch of steps_per_epoch=3 at k=2 runs 4 rounds.
    clients = tiny_clients(rounds_per_epoch=10)
    model = FedEmbModel(
        ref.linear_backbone(),
        client_optimizer=0.1,
        clip_norm=0.5,
        target_epsilon=TARGET,
        delta=DELTA,
        client_parallelism=1,
    )
    model.compile(optimizer=keras.optimizers.SGD(1.0), steps_per_execution=2)
    model.fit(clients, epochs=1, steps_per_epoch=3, verbose=0)
    taken = protocol.read_private_steps(model)
    assert taken == 4 and taken <= model.planned_steps
    q = clients.schedule.sampling_probability
    assert dp_accounting_epsilon(model.noise_multiplier, q, taken) <= TARGET


def test_weights_loaded_into_a_new_model_are_not_recalibrated(tmp_path):
    clients = tiny_clients()
    trained = target_model(schedule=clients.schedule)
    trained.fit(clients, epochs=1, verbose=0)
    path = tmp_path / "trained.weights.h5"
    trained.save_weights(path)
    fresh = target_model(schedule=clients.schedule)
    fresh.load_weights(path)
    with pytest.raises(ValueError, match=r"keras\.saving\.load_model"):
        fresh.fit(clients, epochs=1, verbose=0)
    assert fresh.noise_multiplier is None and fresh.planned_steps is None
    # With the plan of the model that took the rounds, it keeps counting.
    plan = {
        "planned_steps": trained.planned_steps + clients.rounds_per_epoch,
        "calibrated_noise_multiplier": trained.noise_multiplier,
    }
    # That plan (more rounds at the same z) misses the target: refused.
    q = clients.schedule.sampling_probability
    assert dp_accounting_epsilon(trained.noise_multiplier, q, plan["planned_steps"]) > (
        TARGET
    )
    resumed = target_model(schedule=clients.schedule, **plan)
    resumed.load_weights(path)
    with pytest.raises(ValueError, match="more than its target_epsilon"):
        resumed.fit(clients, epochs=1, verbose=0)
    assert protocol.read_private_steps(resumed) == clients.rounds_per_epoch


def test_a_refused_first_fit_fixes_no_plan():
    clients = tiny_clients()
    model = target_model(planned_steps=1)
    with pytest.raises(PrivacyBudgetExhaustedError, match="at most 1 more round"):
        model.fit(clients, epochs=1, verbose=0)
    assert model.noise_multiplier is None
    assert model.calibrated_noise_multiplier is None


def test_a_given_calibrated_noise_multiplier_must_meet_the_target():
    clients = tiny_clients()
    # dp-accounting: z = 0.8 over 8 rounds spends more than the target.
    q = clients.schedule.sampling_probability
    assert dp_accounting_epsilon(0.8, q, 8) > TARGET
    model = target_model(
        schedule=clients.schedule, planned_steps=8, calibrated_noise_multiplier=0.8
    )
    before = kernel(model)
    with pytest.raises(ValueError, match=r"calibrated_noise_multiplier=0\.8"):
        model.fit(clients, epochs=2, verbose=0)
    with pytest.raises(ValueError, match=r"calibrated_noise_multiplier=0\.8"):
        model.train_on_batch(clients[0])
    assert protocol.read_private_steps(model) == 0
    np.testing.assert_array_equal(kernel(model), before)


def test_a_given_plan_that_meets_the_target_is_accepted():
    clients = tiny_clients()
    first = target_model(schedule=clients.schedule, planned_steps=6)
    first.fit(clients, epochs=1, verbose=0)
    again = target_model(
        schedule=clients.schedule,
        planned_steps=6,
        calibrated_noise_multiplier=first.noise_multiplier,
    )
    again.fit(clients, epochs=1, verbose=0)
    assert protocol.read_private_steps(again) == clients.rounds_per_epoch


class _Restores(keras.callbacks.Callback):
    """Sets `private_steps` when training begins (as `BackupAndRestore`
    does when it loads a checkpoint) or before batch `at_batch`."""

    def __init__(self, steps, at_batch=None):
        super().__init__()
        self.steps, self.at_batch = steps, at_batch
        self.kernel = None

    def _restore(self):
        if keras.backend.backend() == "jax":
            self.model.jax_state_sync()  # The next round reads the variables.
        self.model.private_steps.assign(self.steps)
        self.kernel = kernel(self.model)

    def on_train_begin(self, logs=None):
        if self.at_batch is None:
            self._restore()

    def on_train_batch_begin(self, batch, logs=None):
        if batch == self.at_batch:
            self._restore()


def test_steps_restored_when_training_begins_resume_the_plan_to_its_end():
    clients = tiny_clients()
    planned = 2 * clients.rounds_per_epoch
    model = target_model(schedule=clients.schedule, planned_steps=planned)
    model.fit(clients, epochs=1, verbose=0)  # Calibrates; half the plan.
    # A resumed run (the steps restored at train begin): its epoch of 3
    # rounds stops after the 1 round the plan has left.
    model.fit(clients, epochs=1, verbose=0, callbacks=[_Restores(planned - 1)])
    assert protocol.read_private_steps(model) == planned
    before = kernel(model)
    with pytest.raises(PrivacyBudgetExhaustedError, match="at most 0 more round"):
        model.fit(clients, epochs=1, verbose=0, callbacks=[_Restores(planned)])
    np.testing.assert_array_equal(kernel(model), before)
    assert protocol.read_private_steps(model) == planned


def crashed_with_backup(tmp_path):
    """`(clients, model, backup dir)` of a fit planned for 6 rounds that
    crashed after round 5, backed up by `BackupAndRestore` every round."""
    clients = tiny_clients(rounds_per_epoch=3)

    class Crash(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(np.asarray(logs["private_steps"])) == 5:
                raise KeyboardInterrupt

    backup = str(tmp_path / "backup")
    crashed = target_model(schedule=clients.schedule)
    with pytest.raises(KeyboardInterrupt):
        crashed.fit(
            clients,
            epochs=2,
            verbose=0,
            callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=1), Crash()],
        )
    return clients, crashed, backup


def test_backup_and_restore_mid_epoch_resumes_to_the_plan_exactly(tmp_path):
    clients, crashed, backup = crashed_with_backup(tmp_path)
    resumed = target_model(
        schedule=clients.schedule,
        planned_steps=crashed.planned_steps,
        calibrated_noise_multiplier=crashed.noise_multiplier,
    )
    # Keras reruns all of epoch 1 (3 rounds) from round 5 of 6: the fit
    # counts the 5 taken and stops after the 1 left.
    ran = []
    resumed.fit(
        clients,
        epochs=2,
        verbose=0,
        callbacks=[
            keras.callbacks.BackupAndRestore(backup, save_freq=1),
            keras.callbacks.LambdaCallback(
                on_train_batch_end=lambda batch, logs: ran.append(batch)
            ),
        ],
    )
    assert protocol.read_private_steps(resumed) == crashed.planned_steps == 6
    assert len(ran) == 1


def test_a_fresh_plan_refuses_rounds_a_backup_restores_at_train_begin(tmp_path):
    # The crashed run's noise is unknown to a new model that plans afresh:
    # resuming its backup would account its rounds at the new noise.
    clients, _, backup = crashed_with_backup(tmp_path)
    resumed = target_model(schedule=clients.schedule, planned_steps=100)
    with pytest.raises(ValueError, match="restored 5 private rounds"):
        resumed.fit(
            clients,
            epochs=2,
            verbose=0,
            callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=1)],
        )
    # Nothing ran, and the calibration of the refused fit is undone.
    assert protocol.read_private_steps(resumed) == 5
    assert resumed.calibrated_noise_multiplier is None
    assert resumed.noise_multiplier is None and resumed.planned_steps == 100


def test_a_round_past_the_plan_uses_no_data_and_is_not_counted():
    # A callback that moves private_steps mid-fit: the rounds past the
    # plan (traced, so they cannot raise) change nothing and count nothing.
    clients = tiny_clients()
    planned = clients.rounds_per_epoch
    model = target_model(schedule=clients.schedule, planned_steps=planned)
    restore = _Restores(planned, at_batch=1)  # Before the second of 3 rounds.
    model.fit(clients, epochs=1, verbose=0, callbacks=[restore])
    assert protocol.read_private_steps(model) == planned
    np.testing.assert_array_equal(kernel(model), restore.kernel)
