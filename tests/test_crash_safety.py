"""A fit killed with SIGKILL and resumed from its checkpoint loses no private
step, never passes its target ε, and a kill mid-save leaves a whole file."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile

import dp_accounting as dpa
import keras
import numpy as np
import pytest

from kdpemb import _atomic, privacy
from kdpemb.privacy import ledger
from tests import crash_child as child

CHILD = pathlib.Path(child.__file__)
ROOT = CHILD.parents[1]


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """`start(*args)` runs crash_child.py with `args`, on this backend.

    The children share a JAX compilation cache (unless one is configured),
    so the resumed run reads the programs its killed run compiled."""
    cache = {}
    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        cache = {
            "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax-cache")),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        }
    env = dict(
        os.environ,
        KERAS_BACKEND=keras.backend.backend(),
        CUDA_VISIBLE_DEVICES="-1",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        TF_CPP_MIN_LOG_LEVEL="3",
        **cache,
    )

    def start(*args):
        # stdin: what a paused child waits on (EOF if this process dies).
        # stderr: a file, so that the child never blocks on a full pipe
        # while the test reads only its stdout.
        errors = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in stderr_of)
        process = subprocess.Popen(
            [sys.executable, str(CHILD), *map(str, args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            env=env,
        )
        process.errors = errors
        return process

    return start


def stderr_of(process):
    with process.errors as errors:
        errors.seek(0)
        return errors.read()


# No timeouts: the child's work is bounded, and it ends at once when it
# fails or is left waiting (tests/crash_child.py), so every wait returns.
def kill_when(process, line):
    """SIGKILLs `process` once it prints `line` (it then waits to be killed)."""
    for output in process.stdout:
        if output.strip() == line:
            process.send_signal(signal.SIGKILL)
            process.wait()
            process.stdin.close()
            stderr_of(process)
            assert process.returncode == -signal.SIGKILL
            return
    process.wait()
    raise AssertionError(f"exited without {line!r}: {stderr_of(process)}")


def run_killed(process):
    """Waits for a child that SIGKILLs itself (PHASE "kill")."""
    process.communicate()
    stderr = stderr_of(process)
    assert process.returncode == -signal.SIGKILL, stderr


def run_to_end(process):
    stdout, _ = process.communicate()  # Closes stdin: a pause would end it.
    stderr = stderr_of(process)
    assert process.returncode == 0, stderr
    assert "DONE" in stdout
    return stdout


def mechanism_of(kind):
    """The mechanism of one step of the child's `kind` of model, from the
    model's settings (not from the model)."""
    if kind == "dp":
        return privacy.dp_sgd(
            child.NOISE[kind], batch_size=child.B, num_examples=child.N, clip_norm=1.0
        )
    schedule = privacy.Schedule.virtual_clients(
        child.USERS,
        child.M,
        users_per_client=child.K,
        num_clients=child.USERS // child.K,
        local_steps=1,
    )
    return schedule.privacy_mechanism(child.NOISE[kind], clip_norm=1.0)


def dp_accounting_epsilon(kind, steps, noise=None):
    """ε of `steps` Poisson-sampled Gaussian steps, from dp-accounting itself:
    examples added or removed (DPModel, q = B / N); or a virtual client of
    K > 1 users replaced (FedEmbModel, q = M / P), as the user-level
    guarantee is accounted. `noise` defaults to the child's for `kind`."""
    noise = child.NOISE[kind] if noise is None else noise
    if kind in ("dp", "target"):
        q, relation = child.B / child.N, dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
    else:
        q = child.M / (child.USERS // child.K)
        relation = dpa.NeighboringRelation.REPLACE_ONE
    event = dpa.SelfComposedDpEvent(
        dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(noise)), steps
    )
    accountant = dpa.pld.PLDAccountant(relation, value_discretization_interval=1e-4)
    return accountant.compose(event).get_epsilon(child.DELTA)


def no_partial_files(directory):
    return [
        path
        for path in pathlib.Path(directory).rglob("*")
        if path.name.startswith(_atomic.PARTIAL_PREFIX)
    ]


# Kill points: after the ledger counts `s` steps, at the begin of step s
# (begun, not run) of a DPModel fit, or at the end of step s (run) of a
# FedEmbModel fit; never on a backup (every 4 steps), always before the
# budget (19 and 23 steps).
rng = np.random.default_rng(21)
KILLS = [
    (int(rng.choice([s for s in range(3, 18) if s % child.SAVE_FREQ])), phase, kind)
    for phase, kind in (("begin", "dp"), ("end", "fedemb"))
]


@pytest.mark.parametrize(("pause_at", "phase", "kind"), KILLS)
def test_a_killed_fit_resumes_with_every_step_it_began_counted(
    start, tmp_path, pause_at, phase, kind
):
    kill_when(start("fit", tmp_path, pause_at, phase, kind), "PAUSED")
    where = child.paths(tmp_path)
    counted = ledger.read_ledger(where["ledger"])["steps"]
    ran = pause_at if phase == "end" else pause_at - 1
    assert counted == pause_at >= ran  # Never fewer than the steps that ran.
    assert not os.path.exists(where["result"])

    run_to_end(start("fit", tmp_path, -1, phase, kind))
    result = json.loads(pathlib.Path(where["result"]).read_text())
    assert result["model"] == {"dp": "DPModel", "fedemb": "FedEmbModel"}[kind]
    # The backup alone would have lost steps; the ledger restored them.
    assert result["restored_steps"] < counted
    assert result["restored_steps"] % child.SAVE_FREQ == 0
    assert result["ledger_raised_by"] == counted - result["restored_steps"]
    # Keras resumes at the backup's epoch and runs it again from its start.
    backup_epoch = max(0, result["restored_steps"] - 1) // child.STEPS_PER_EPOCH
    assert result["restored_epoch"] == backup_epoch
    epochs = result["epochs_run"]
    assert epochs == list(range(backup_epoch, backup_epoch + len(epochs)))
    # Exact: the steps counted before the kill plus those run after, which is
    # what the model counts and what its own statement and the budget state.
    final = counted + result["batches_run"]
    assert result["private_steps"] == result["statement_steps"] == final
    assert result["model_statement_steps"] == final
    assert ledger.read_ledger(where["ledger"])["steps"] == final
    # The ledger names the model and the mechanism of its settings.
    mechanism = mechanism_of(kind)
    assert result["mechanism"] == ledger.mechanism_parameters(mechanism)
    assert ledger.read_ledger(where["ledger"], mechanism, result["model"])
    # ε is that of the count, and never above the target.
    epsilon = privacy.epsilon(mechanism, final, child.DELTA)
    assert result["statement_epsilon"] == pytest.approx(epsilon, rel=1e-9)
    assert result["model_statement_epsilon"] == pytest.approx(epsilon, rel=1e-9)
    assert epsilon == pytest.approx(dp_accounting_epsilon(kind, final), rel=1e-3)
    statement = privacy.ledger_statement(where["ledger"], mechanism, child.DELTA)
    assert statement.epsilon == pytest.approx(epsilon, rel=1e-9)
    assert final == result["step_budget"]  # It ran until the budget.
    logged = [float(x) for x in pathlib.Path(where["epsilons"]).read_text().split()]
    assert max([*logged, epsilon]) <= child.TARGET
    assert dp_accounting_epsilon(kind, final + 1) > child.TARGET  # It binds.
    if kind == "fedemb":
        # The resumed process trained on rounds none of which it served
        # twice (the rounds of a Keras epoch are an epoch of the
        # VirtualClients never served before; seed=None, so the killed
        # process's rounds were of other draws).
        served = [tuple(pair) for pair in result["served"]]
        assert len(set(served)) == len(served) >= result["batches_run"]
    assert no_partial_files(tmp_path) == []


def test_a_killed_target_epsilon_run_finishes_its_plan_when_rerun(start, tmp_path):
    # The same script (a DPModel with target_epsilon over epochs=4) is
    # killed twice mid-epoch, between backups, and run again unchanged:
    # each rerun adopts the plan the ledger keeps (no new calibration) and
    # the last finishes it exactly, counting the steps the killed
    # processes began, not the epochs Keras reruns from their start.
    where = child.paths(tmp_path)
    planned = child.TARGET_EPOCHS * child.STEPS_PER_EPOCH
    plans = []
    for kill_at in (13, 27):  # Never on a backup (every 4 steps of a run).
        run_killed(start("fit", tmp_path, kill_at, "kill", "target"))
        record = ledger.read_ledger(where["ledger"])
        assert record["steps"] == kill_at
        plans.append(record["plan"])
    plan = plans[0]
    assert plans[1] == plan  # The rerun adopted the kept plan.
    assert plan["planned_steps"] == planned and plan["target_epsilon"] == child.TARGET
    assert not os.path.exists(where["result"])

    run_to_end(start("fit", tmp_path, -1, "kill", "target"))
    result = json.loads(pathlib.Path(where["result"]).read_text())
    z = plan["calibrated_noise_multiplier"]
    assert result["noise_multiplier"] == z  # The first run's, not another.
    assert result["planned_steps"] == planned
    # The backup alone would have lost steps; the ledger restored them.
    assert result["restored_steps"] < 27
    assert result["ledger_raised_by"] == 27 - result["restored_steps"]
    # Keras reran the backup's epoch from its start, and would have run
    # more steps than the plan had left: the guard stopped at its end.
    assert result["restored_epoch"] >= 1
    epochs_left = child.TARGET_EPOCHS - result["restored_epoch"]
    assert result["batches_run"] == planned - 27 < epochs_left * child.STEPS_PER_EPOCH
    assert result["private_steps"] == result["model_statement_steps"] == planned
    assert result["statement_steps"] == planned
    record = ledger.read_ledger(where["ledger"])
    assert record["steps"] == planned and record["plan"] == plan
    mechanism = privacy.dp_sgd(
        z, batch_size=child.B, num_examples=child.N, clip_norm=1.0
    )
    assert result["mechanism"] == record["mechanism"]
    assert record["mechanism"] == ledger.mechanism_parameters(mechanism)
    # ε of the plan: the target, spent and never exceeded.
    epsilon = privacy.epsilon(mechanism, planned, child.DELTA)
    assert result["model_statement_epsilon"] == pytest.approx(epsilon, rel=1e-9)
    assert child.TARGET * 0.99 < epsilon <= child.TARGET * (1 + 1e-6)
    assert epsilon == pytest.approx(
        dp_accounting_epsilon("target", planned, z), rel=1e-3
    )
    logged = [float(x) for x in pathlib.Path(where["epsilons"]).read_text().split()]
    assert max(logged) <= epsilon
    assert no_partial_files(tmp_path) == []


def test_the_ledger_refuses_another_mechanism(tmp_path):
    path = tmp_path / "ledger.json"
    mechanism = privacy.dp_sgd(1.5, batch_size=6.4, num_examples=64)
    ledger.write_ledger(path, mechanism, 7, model="ToyDPRegressor")
    other = privacy.dp_sgd(1.0, batch_size=6.4, num_examples=64)
    with pytest.raises(ValueError, match="not of this one"):
        ledger.read_ledger(path, other)
    with pytest.raises(ValueError, match="not of this MyModel"):
        ledger.read_ledger(path, mechanism, model="MyModel")
    assert ledger.read_ledger(path, mechanism, "ToyDPRegressor")["steps"] == 7


def load(path):
    if path.name.endswith(".weights.h5"):
        model = child.small_model(0.0)
        model.load_weights(path)
        return model
    return keras.saving.load_model(
        path, custom_objects={"PausesWhileSaved": child.PausesWhileSaved}
    )


def test_a_kill_during_a_save_leaves_the_previous_file_whole_if_atomic(start, tmp_path):
    kill_when(start("save", tmp_path), "SAVING")
    # Each atomic save leaves its previous file, whole, and a partial file.
    assert len(no_partial_files(tmp_path)) == 2
    for name in ("atomic.keras", "atomic.weights.h5"):
        for variable in load(tmp_path / name).weights:
            np.testing.assert_array_equal(keras.ops.convert_to_numpy(variable), 1.0)
    # Why they exist: Keras writes into the previous file.
    with pytest.raises(Exception):  # noqa: B017 (any load error)
        load(tmp_path / "plain.keras")


def test_a_restore_after_the_ledger_is_refused_before_any_step(tmp_path):
    from kdpemb.callbacks import PrivacyLedger
    from kdpemb.privacy import protocol
    from kdpemb.testing import ToyDPRegressor, toy_regression_data

    n, d, noise, q = 64, 3, 1.5, 0.1

    class RestoresOlder(keras.callbacks.Callback):  # BackupAndRestore, misplaced
        def on_train_begin(self, logs=None):
            self.model.private_steps.assign(2)

    model = ToyDPRegressor(n, d, noise, q)
    model.compile(optimizer="sgd")
    data = toy_regression_data(n, d, steps_per_epoch=3)
    path = tmp_path / "ledger.json"
    model.fit(data, epochs=2, verbose=0, callbacks=[PrivacyLedger(path)])
    with pytest.raises(RuntimeError, match="went down to 2"):
        model.fit(
            data, verbose=0, callbacks=[PrivacyLedger(path, verbose=0), RestoresOlder()]
        )
    assert protocol.read_private_steps(model) == 2  # No step ran.
    assert ledger.read_ledger(path)["steps"] == 6
