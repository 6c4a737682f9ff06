"""A killed target-ε run resumes by running the same script again: the
ledger keeps the plan, a model built with the same arguments adopts it (a
model built with others is refused before any step), and the rerun
finishes the plan exactly. Here the kill is an exception raised as a
step begins, in process; tests/test_crash_safety.py SIGKILLs a DPModel."""

import json

import keras
import numpy as np
import pytest

from kdpemb.callbacks import AtomicBackupAndRestore, PrivacyLedger
from kdpemb.errors import PrivacyBudgetExhaustedError
from kdpemb.models import DPModel, LastLayerDPClassifier
from kdpemb.models._shared import plan_resume
from kdpemb.models.fedemb import fedemb_multi_host
from kdpemb.privacy import AdaptiveClipping, LossRelease, ledger, protocol
from tests.models.test_fedemb import tiny_clients
from tests.models.test_fedemb_target_epsilon import target_model
from tests.models.test_fedemb_tree import epochs_schedule

pytestmark = [
    pytest.mark.filterwarnings("ignore::kdpemb.errors.ReproducibleNoiseWarning"),
    pytest.mark.filterwarnings("ignore::kdpemb.errors.ReproducibleSamplingWarning"),
]

# 64 examples, expected batch 8: 8 steps an epoch, 16 over EPOCHS.
N, D, B, EPOCHS, TARGET, DELTA = 64, 3, 8, 2, 2.0, 1e-3
PLANNED = 16


class Killed(Exception):
    """What `Kill` raises: the process's end, as far as the fit knows."""


class Kill(keras.callbacks.Callback):
    """Ends the fit as a kill would, as the step that makes the ledger count
    `at` begins (counted, not run); placed after the ledger."""

    def __init__(self, path, at):
        super().__init__()
        self.path, self.at = path, at

    def on_train_batch_begin(self, batch, logs=None):
        if ledger.read_ledger(self.path)["steps"] == self.at:
            raise Killed


class Ran(keras.callbacks.Callback):
    """Counts the steps this fit ran."""

    steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1


class Begun(keras.callbacks.Callback):
    """Records, for each execution, the count the ledger wrote before it
    and the model's count after it (its logged `private_steps`); placed
    after the ledger."""

    def __init__(self, path):
        super().__init__()
        self.path, self.executions = path, []

    def on_train_batch_begin(self, batch, logs=None):
        self._written = ledger.read_ledger(self.path)["steps"]

    def on_train_batch_end(self, batch, logs=None):
        after = int(float(np.asarray(logs["private_steps"])))
        self.executions.append((self._written, after))


def paths(tmp_path):
    return str(tmp_path / "backup"), str(tmp_path / "ledger.json")


def run(model, fit, tmp_path, kill_at=None, extra=()):
    """`fit(callbacks)` with the recipe's backup and ledger (and `extra`
    callbacks; killed as the ledger counts `kill_at`); returns how many
    steps it ran (executions, with steps_per_execution > 1)."""
    backup, path = paths(tmp_path)
    ran = Ran()
    callbacks = [AtomicBackupAndRestore(backup, save_freq=4), PrivacyLedger(path), ran,
                 *extra]  # fmt: skip
    if kill_at is None:
        fit(callbacks)
    else:
        with pytest.raises(Killed):
            fit([*callbacks, Kill(path, kill_at)])
    return ran.steps


def dp_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, D)).astype("float32")
    return x, x.sum(axis=1)


def dp_script(tmp_path, kill_at=None, epochs=EPOCHS, verbose=0, steps_per_execution=1,
              extra=(), **changes):  # fmt: skip
    """The user's script: a DPModel with a target ε, fit over `epochs`;
    `changes` replace its arguments. Returns the model and steps run."""
    settings = {"target_epsilon": TARGET, "delta": DELTA, "clip_norm": 1.0, **changes}
    model = DPModel(keras.Sequential([keras.Input((D,)), keras.layers.Dense(1)]),
                    **settings)  # fmt: skip
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=steps_per_execution)
    x, y = dp_data()

    def fit(callbacks):
        model.fit(x, y, batch_size=B, epochs=epochs, verbose=verbose,
                  callbacks=callbacks)  # fmt: skip

    return model, run(model, fit, tmp_path, kill_at, extra)


def kept(tmp_path):
    return ledger.read_ledger(paths(tmp_path)[1])


# The releases a step may make beside the gradient: the calibrated z_eff
# is split among them before the plan is adopted, on the first run as on
# its rerun.
RELEASES = {
    "gradient_only": {},
    "noised_loss": {"noised_loss": LossRelease(2.0, 5.0)},
    "adaptive_clipping": {"adaptive_clipping": AdaptiveClipping(count_stddev=2.0)},
}


@pytest.mark.parametrize("releases", RELEASES.values(), ids=RELEASES.keys())
def test_a_rerun_of_the_same_script_adopts_the_kept_plan_and_finishes_it(
    tmp_path, capsys, releases
):
    killed, _ = dp_script(tmp_path, kill_at=11, **releases)  # 10 ran, 11 counted.
    record = kept(tmp_path)
    assert record["steps"] == 11
    plan = record["plan"]
    assert plan["planned_steps"] == PLANNED == killed.planned_steps
    assert plan["calibrated_noise_multiplier"] == killed.noise_multiplier
    assert plan["schedule"] == killed.schedule.get_config()
    for name, setting in releases.items():
        assert plan["releases"][name] == setting.get_config()
    # The gradient's z is what the other releases leave of the plan's z_eff.
    z_eff = killed.privacy_mechanism().noise_multiplier
    assert (killed.noise_multiplier > z_eff) == bool(releases)
    capsys.readouterr()

    resumed, ran = dp_script(tmp_path, verbose=1, **releases)
    out = capsys.readouterr().out
    assert "calibrating" not in out and "resuming the plan" in out
    assert "resuming a run with 11 of its 16 planned private steps" in out
    # The same plan; the 11 steps counted and the 5 left, though Keras
    # reran the backup's epoch from its start (8 or 16 steps).
    assert resumed.noise_multiplier == killed.noise_multiplier
    assert resumed.planned_steps == PLANNED and ran == PLANNED - 11
    assert protocol.read_private_steps(resumed) == PLANNED
    record = kept(tmp_path)
    assert record["steps"] == PLANNED and record["plan"] == plan
    assert record["mechanism"] == ledger.mechanism_parameters(
        resumed.privacy_mechanism()
    )
    statement = resumed.privacy_statement()
    assert statement.steps == PLANNED and statement.epsilon <= TARGET
    # A plan spent: running the script again trains nothing more, and says
    # what the plan spent at the gradient's z with the other releases.
    with pytest.raises(PrivacyBudgetExhaustedError, match="at most 0 more steps") as e:
        dp_script(tmp_path, **releases)
    assert f"spent ε = {statement.epsilon:.4g} of" in str(e.value)
    assert kept(tmp_path)["steps"] == PLANNED


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"target_epsilon": 3.0}, "target_epsilon"),
        ({"epochs": 3}, "planned_steps"),
        ({"clip_norm": 0.5}, "clip_norm"),
        (RELEASES["noised_loss"], "noised_loss"),
        (RELEASES["adaptive_clipping"], "adaptive_clipping"),
    ],
)
def test_a_rerun_with_another_argument_is_refused_before_any_step(
    tmp_path, changes, field
):
    dp_script(tmp_path, kill_at=5)
    before = kept(tmp_path)
    with pytest.raises(ValueError, match=f"{field}=") as error:
        dp_script(tmp_path, **changes)
    assert "plan_arguments" in str(error.value)
    assert kept(tmp_path) == before  # Nothing counted, the plan kept.


# steps_per_execution = 3 over epochs of 8 steps: executions of 3, 3 and 2
# steps; the ledger writes 3, 6, 9 (an epoch's last execution may run on
# into the next epoch's data), 8 at the epoch's end, then 11, 14 and 16.
@pytest.mark.parametrize("kill_at", [11, 14])
def test_a_rerun_with_steps_per_execution_ends_at_the_plan_and_counts_within_it(
    tmp_path, recwarn, kill_at
):
    dp_script(tmp_path, kill_at=kill_at, steps_per_execution=3)
    assert kept(tmp_path)["steps"] == kill_at
    begun = Begun(paths(tmp_path)[1])
    resumed, _ = dp_script(tmp_path, steps_per_execution=3, extra=[begun])
    # Every planned step is taken, though the rerun's executions of 3 reach
    # past the plan (a step past it counts nothing, releases nothing) ...
    assert protocol.read_private_steps(resumed) == PLANNED == kept(tmp_path)["steps"]
    # ... and the ledger never counts one past it, nor fewer than began.
    assert max(written for written, _ in begun.executions) == PLANNED
    assert all(after <= written for written, after in begun.executions)
    statement = ledger.ledger_statement(
        paths(tmp_path)[1], resumed.privacy_mechanism(), DELTA
    )
    assert statement.steps == PLANNED and statement.epsilon <= TARGET
    assert not [w for w in recwarn if "planned private" in str(w.message)]


class StopAfterOne(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        self.model.stop_training = True


def test_a_resumed_fit_that_ends_before_the_plan_says_so(tmp_path):
    dp_script(tmp_path, kill_at=11)
    with pytest.warns(UserWarning, match=r"ended with 12 of its 16 planned private "
                      r"steps taken, 4 left.*Run the same script again"):  # fmt: skip
        resumed, _ = dp_script(tmp_path, extra=[StopAfterOne()])
    assert kept(tmp_path)["steps"] == protocol.read_private_steps(resumed) == 12


def test_a_backup_ahead_of_the_ledger_is_refused_before_any_step(tmp_path):
    # The ledger counts each step of its run before it runs: a backup with
    # more steps is another run's (here the ledger is set back to 2, as if
    # its backup directory held a longer run's backup).
    dp_script(tmp_path, kill_at=11)
    record = {**kept(tmp_path), "steps": 2}
    ledger.write_record(paths(tmp_path)[1], record)
    with pytest.raises(ValueError, match=r"restored with [3-9] private steps .*more "
                       "than the 2 that the privacy ledger") as error:  # fmt: skip
        dp_script(tmp_path)
    assert "new ledger path and an empty backup directory" in str(error.value)
    assert kept(tmp_path) == record  # Nothing counted, nothing trained.


def test_a_fixed_noise_model_is_refused_on_a_ledger_that_keeps_a_plan(tmp_path):
    killed, _ = dp_script(tmp_path, kill_at=5)
    before = kept(tmp_path)
    # The plan's own z: the ledger's mechanism check alone would pass it.
    z = killed.noise_multiplier
    with pytest.raises(ValueError, match=r"keeps the target-ε plan.*has a fixed "
                       r"noise_multiplier.*plan_arguments"):  # fmt: skip
        dp_script(tmp_path, target_epsilon=None, noise_multiplier=z)
    assert kept(tmp_path) == before


def test_a_refused_rerun_takes_no_step_and_keeps_no_plan(tmp_path):
    dp_script(tmp_path, kill_at=5)
    model = DPModel(keras.Sequential([keras.Input((D,)), keras.layers.Dense(1)]),
                    target_epsilon=TARGET, delta=DELTA, clip_norm=0.5)  # fmt: skip
    model.compile(optimizer="sgd", loss="mse")
    x, y = dp_data()
    weights = [w.copy() for w in model.get_weights()]
    backup, path = paths(tmp_path)
    with pytest.raises(ValueError, match="the mechanism's clip_norm"):
        model.fit(x, y, batch_size=B, epochs=EPOCHS, verbose=0, callbacks=[
            AtomicBackupAndRestore(backup), PrivacyLedger(path)])  # fmt: skip
    assert protocol.read_private_steps(model) == 0
    for got, want in zip(model.get_weights(), weights, strict=True):
        np.testing.assert_array_equal(got, want)
    assert model.schedule is None and model.calibrated_noise_multiplier is None


def test_plan_arguments_rebuild_the_model_of_a_ledger(tmp_path):
    killed, _ = dp_script(tmp_path, kill_at=11)
    arguments = ledger.plan_arguments(paths(tmp_path)[1])
    network = keras.Sequential([keras.Input((D,)), keras.layers.Dense(1)])
    rebuilt = DPModel(network, clip_norm=1.0, **arguments)
    assert rebuilt.planned_steps == killed.planned_steps
    assert rebuilt.noise_multiplier == killed.noise_multiplier
    assert rebuilt.schedule == killed.schedule
    assert rebuilt.privacy_mechanism() == killed.privacy_mechanism()
    # It resumes the run as the same script does.
    rebuilt.compile(optimizer="sgd", loss="mse")
    x, y = dp_data()
    ran = run(rebuilt, lambda callbacks: rebuilt.fit(
        x, y, batch_size=B, epochs=EPOCHS, verbose=0, callbacks=callbacks),
        tmp_path)  # fmt: skip
    assert ran == PLANNED - 11 and protocol.read_private_steps(rebuilt) == PLANNED
    assert kept(tmp_path)["plan"]["unit_noise_multiplier"] is not None
    # Its plan, changed, is refused: not the plan of the steps counted.
    with pytest.raises(ValueError, match="planned_steps=17"):
        other = DPModel(network, clip_norm=1.0, **{**arguments, "planned_steps": 17})
        other.compile(optimizer="sgd", loss="mse")
        other.fit(x, y, batch_size=B, epochs=EPOCHS, verbose=0,
                  callbacks=[PrivacyLedger(paths(tmp_path)[1])])  # fmt: skip


# With steps_per_execution = 3 and steps_per_epoch = 8, TensorFlow runs
# executions of 3 on into the next epoch's data (9, then 7 steps: the
# ledger writes 3, 6, 9, 12, 15), JAX cuts them at the epoch's end (3, 6,
# 9, 11, 14). Killed at the last before 16, the rerun's first execution
# reaches past the plan.
@pytest.mark.parametrize("steps_per_execution", [1, 3])
def test_a_killed_last_layer_dp_sgd_run_resumes_to_its_plan(
    tmp_path, steps_per_execution
):
    kill_at = 11 if steps_per_execution == 1 else 15
    if steps_per_execution > 1 and keras.backend.backend() == "jax":
        kill_at = 14
    rng = np.random.default_rng(0)
    features = rng.normal(size=(N, 4)).astype("float32")
    labels = (features[:, 0] > 0).astype("int32")
    begun = Begun(paths(tmp_path)[1])

    def script(kill_at=None):
        model = LastLayerDPClassifier(2, method="dp-sgd", target_epsilon=TARGET,
                                      delta=DELTA)  # fmt: skip
        model.compile(steps_per_execution=steps_per_execution)

        def fit(callbacks):
            model.fit(features, labels, batch_size=B, epochs=EPOCHS, verbose=0,
                      callbacks=callbacks)  # fmt: skip

        return model, run(model, fit, tmp_path, kill_at, [begun])

    killed, _ = script(kill_at=kill_at)
    resumed, ran = script()
    assert resumed.noise_multiplier == killed.noise_multiplier
    assert protocol.read_private_steps(resumed) == PLANNED
    assert ran == -((kill_at - PLANNED) // steps_per_execution)  # Executions.
    assert kept(tmp_path)["steps"] == PLANNED
    assert resumed.privacy_statement().epsilon <= TARGET
    # Each execution's steps were counted before it ran, none past the plan.
    assert all(after <= written <= PLANNED for written, after in begun.executions)


def test_a_killed_fedemb_run_resumes_to_its_plan(tmp_path):
    clients = tiny_clients(rounds_per_epoch=3)  # 6 rounds over 2 epochs.

    def script(kill_at=None):
        model = target_model(schedule=clients.schedule)
        fit = lambda callbacks: model.fit(  # noqa: E731
            clients, epochs=2, verbose=0, callbacks=callbacks
        )
        return model, run(model, fit, tmp_path, kill_at)

    killed, _ = script(kill_at=5)
    assert kept(tmp_path)["plan"]["planned_steps"] == 6
    resumed, ran = script()
    assert resumed.noise_multiplier == killed.noise_multiplier
    assert ran == 1 and protocol.read_private_steps(resumed) == 6
    assert kept(tmp_path)["steps"] == 6
    # The killed run calibrated the same plan that its rerun adopted: hosts
    # compare where their plan came from too, so a host that could not see
    # the ledger (and calibrated alone) is refused with the others.
    assert plan_resume.model_plan(killed) == plan_resume.model_plan(resumed)
    digest = fedemb_multi_host.settings_digest
    assert digest(killed) != digest(resumed)


def test_a_fedemb_epochs_resume_is_never_raised_past_the_plan():
    # Rounds without sampling resume at the next whole epoch of R = 3
    # rounds, but never past a plan of 7 (no round is taken past it).
    schedule = epochs_schedule(rounds_per_epoch=3)
    model = target_model(schedule=schedule, planned_steps=7,
                         calibrated_noise_multiplier=3.0)  # fmt: skip
    assert [model.ledger_resume_steps(c) for c in (4, 6, 7)] == [6, 6, 7]
    fixed = target_model(schedule=schedule, target_epsilon=None, noise_multiplier=3.0)
    assert fixed.ledger_resume_steps(7) == 9


def test_the_ledger_refuses_a_broken_plan_and_states_a_missing_one(tmp_path):
    from kdpemb import privacy

    path = tmp_path / "ledger.json"
    mechanism = privacy.dp_sgd(1.5, batch_size=8, num_examples=64)
    ledger.write_ledger(path, mechanism, 3, model="DPModel")  # A fixed noise.
    assert ledger.read_plan(path) is None
    with pytest.raises(ValueError, match="keeps no target-ε plan"):
        ledger.plan_arguments(path)
    with pytest.raises(FileNotFoundError, match="No privacy ledger"):
        ledger.plan_arguments(tmp_path / "none.json")
    record = json.loads(path.read_text())
    record["plan"] = {"target_epsilon": 1.0, "delta": 1e-3, "planned_steps": 0,
                      "calibrated_noise_multiplier": 1.5}  # fmt: skip
    path.write_text(json.dumps(record))
    with pytest.raises(ValueError, match=r"ledger\.json is unreadable .*planned_steps"):
        ledger.read_plan(path)


def test_steps_of_a_backup_without_a_ledger_stay_refused_on_every_rerun(tmp_path):
    # Killed with a backup but no ledger: a rerun's fresh calibration does
    # not know the noise of the steps the backup restores, so each rerun
    # is refused, and the ledger it adds keeps no plan that a later rerun
    # could adopt for them.
    backup, path = paths(tmp_path)
    x, y = dp_data()

    def script(callbacks):
        model = DPModel(keras.Sequential([keras.Input((D,)), keras.layers.Dense(1)]),
                        target_epsilon=TARGET, delta=DELTA)  # fmt: skip
        model.compile(optimizer="sgd", loss="mse")
        model.fit(x, y, batch_size=B, epochs=EPOCHS, verbose=0, callbacks=callbacks)
        return model

    class KillAt(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 5:
                raise Killed

    with pytest.raises(Killed):
        script([AtomicBackupAndRestore(backup, save_freq=4), KillAt()])
    for _ in range(2):
        with pytest.raises(ValueError, match="restored 4 private steps"):
            script([AtomicBackupAndRestore(backup, save_freq=4), PrivacyLedger(path)])
        assert kept(tmp_path)["steps"] == 4 and "plan" not in kept(tmp_path)
