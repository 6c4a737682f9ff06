"""The process tests/test_crash_safety.py kills: a DP fit, or a model save.

Usage: python crash_child.py fit DIR PAUSE_AT PHASE MODEL
       python crash_child.py save DIR

`fit` trains MODEL ("dp": a `DPModel`, example-level DP-SGD; "fedemb": a
`FedEmbModel` on `VirtualClients` rounds, user-level; "target": a
`DPModel` with a `target_epsilon`, over TARGET_EPOCHS epochs) with
AtomicBackupAndRestore, PrivacyLedger and PrivacyBudget, pausing (for the
kill) once the ledger has counted PAUSE_AT steps: at the batch's begin
(the step has begun, not run) or its end; PHASE "kill" SIGKILLs itself
at that batch's begin instead. A run that is not killed writes
DIR/result.json. `save` writes complete files (atomically, and
with Keras), then pauses while writing each again.

Both models are tiny (a linear network) so that the child's cost is
mostly starting Python and Keras; the sampling and the noise are drawn
from OS entropy (seed=None), as in a real run.

No clock: a paused child waits for its kill by reading its stdin, which
the test never writes, so it exits at once (status 1) if the test closes
it or dies; a save that fails or does not pause ends the child at once
rather than leave it waiting.
"""

import json
import os
import signal
import sys
import threading
import traceback

import keras
import numpy as np

from kdpemb import _atomic, callbacks, saving
from kdpemb.privacy import ledger, protocol

DELTA, TARGET, NOISE = 1e-3, 1.0, {"dp": 1.5, "fedemb": 2.5}
STEPS_PER_EPOCH, EPOCHS, SAVE_FREQ, TARGET_EPOCHS = 10, 6, 4, 4
# DPModel: N examples, expected batch B: q = 0.1, N / B = 10 steps an epoch.
N, D, B = 80, 3, 8
# FedEmbModel: USERS users of 2 examples in P = USERS / K virtual clients
# of K users, M of them expected per round (q = 0.1), 10 rounds an epoch.
USERS, K, M, IMAGE = 40, 2, 2, (2, 2, 1)
MODELS = ("dp", "fedemb", "target")


def paths(directory):
    return {
        "backup": os.path.join(directory, "backup"),
        "ledger": os.path.join(directory, "ledger.json"),
        "epsilons": os.path.join(directory, "epsilons.txt"),
        "result": os.path.join(directory, "result.json"),
    }


def pause(message):
    print(message, flush=True)
    sys.stdin.read()  # Killed here; EOF: the test is gone.
    print(f"stdin closed after {message}, not killed", file=sys.stderr, flush=True)
    os._exit(1)  # Never run on past the pause.


class Observer(keras.callbacks.Callback):
    """Records what the test checks; pauses where it is told to."""

    def __init__(self, where, pause_at, phase):
        super().__init__()
        self.where, self.pause_at, self.phase = where, pause_at, phase
        self.batches = 0
        self.epochs = []

    def _ledger_steps(self):
        return ledger.read_ledger(self.where["ledger"])["steps"]

    def on_epoch_begin(self, epoch, logs=None):
        self.epochs.append(epoch)

    def on_train_batch_begin(self, batch, logs=None):
        if self.phase == "begin" and self._ledger_steps() == self.pause_at:
            pause("PAUSED")
        if self.phase == "kill" and self._ledger_steps() == self.pause_at:
            os.kill(os.getpid(), signal.SIGKILL)  # The step has begun.

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1
        if self.phase == "end" and self._ledger_steps() == self.pause_at:
            pause("PAUSED")

    def on_epoch_end(self, epoch, logs=None):
        with open(self.where["epsilons"], "a") as file:
            file.write(f"{logs['epsilon']!r}\n")


class Restored(keras.callbacks.Callback):
    """What the backup restored (before the ledger raises `private_steps`)."""

    steps = epoch = None

    def on_train_begin(self, logs=None):
        self.steps = protocol.read_private_steps(self.model)
        self.epoch = self.model._initial_epoch or 0


def dp_fit(fit_callbacks, target=False):
    """A linear `DPModel` (DP-SGD, Poisson batches of B expected of N); with
    `target`, its noise calibrated for ε = TARGET over TARGET_EPOCHS."""
    from kdpemb.models import DPModel

    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, D)).astype("float32")
    y = (x @ rng.normal(size=D) + 0.1 * rng.normal(size=N)).astype("float32")
    network = keras.Sequential([keras.Input((D,)), keras.layers.Dense(1)])
    noise = (
        {"target_epsilon": TARGET, "delta": DELTA}
        if target
        else {"noise_multiplier": NOISE["dp"]}
    )
    model = DPModel(network, clip_norm=1.0, **noise)
    model.compile(optimizer="sgd", loss="mse")
    epochs = TARGET_EPOCHS if target else EPOCHS
    model.fit(x, y, batch_size=B, epochs=epochs, verbose=0, callbacks=fit_callbacks)
    extra = {}
    if target:
        extra = {
            "planned_steps": model.planned_steps,
            "noise_multiplier": model.noise_multiplier,
        }
    return model, extra


def target_fit(fit_callbacks):
    return dp_fit(fit_callbacks, target=True)


def fedemb_fit(fit_callbacks):
    """A linear `FedEmbModel` (DP-FedEmb) on Poisson rounds of clients."""
    from kdpemb.data import VirtualClients
    from kdpemb.models import FedEmbModel

    served = []

    class Clients(VirtualClients):
        """Records which round of which of its epochs Keras reads."""

        def __getitem__(self, index):
            served.append([self.planner.epoch, index])
            return super().__getitem__(index)

    rng = np.random.default_rng(0)
    user_ids = np.repeat(np.arange(USERS), 2)
    images = rng.normal(size=(user_ids.size, *IMAGE)).astype("float32")
    clients = Clients(
        images,
        rng.integers(0, 4, size=user_ids.size),
        user_ids,
        clients_per_round=M,
        users_per_client=K,
        num_clients=USERS // K,  # A public count.
        rounds_per_epoch=STEPS_PER_EPOCH,
        local_steps=1,
        batch_size=2,
        num_classes=4,
    )
    backbone = keras.Sequential(
        [keras.Input(IMAGE), keras.layers.Flatten(), keras.layers.Dense(2)]
    )
    model = FedEmbModel(
        backbone, clip_norm=1.0, noise_multiplier=NOISE["fedemb"], delta=DELTA
    )
    model.compile()
    model.fit(clients, epochs=EPOCHS, verbose=0, callbacks=fit_callbacks)
    return model, {"served": served}


def fit(directory, pause_at, phase, kind):
    where = paths(directory)
    restored = Restored()
    privacy_ledger = callbacks.PrivacyLedger(where["ledger"])
    # A target-ε model keeps its own plan: the budget only states ε.
    budget = callbacks.PrivacyBudget(
        DELTA, target_epsilon=None if kind == "target" else TARGET, verbose=0
    )
    observer = Observer(where, pause_at, phase)
    fit_callbacks = [
        callbacks.AtomicBackupAndRestore(
            where["backup"], save_freq=SAVE_FREQ, delete_checkpoint=False
        ),
        restored,
        privacy_ledger,
        budget,
        observer,
    ]
    fits = {"dp": dp_fit, "fedemb": fedemb_fit, "target": target_fit}
    model, extra = fits[kind](fit_callbacks)
    statement = model.privacy_statement(DELTA)
    result = {
        "model": type(model).__name__,
        "mechanism": model.privacy_mechanism().parameters(),
        "restored_steps": restored.steps,
        "restored_epoch": restored.epoch,
        "ledger_raised_by": privacy_ledger.restored_steps,
        "batches_run": observer.batches,
        "epochs_run": observer.epochs,
        "private_steps": protocol.read_private_steps(model),
        "statement_steps": budget.statement.steps,
        "statement_epsilon": budget.statement.epsilon,
        "model_statement_steps": statement.steps,
        "model_statement_epsilon": statement.epsilon,
        "step_budget": budget.step_budget,
        **extra,
    }
    _atomic.write_text(where["result"], json.dumps(result, default=str))
    print("DONE", flush=True)


class PausesWhileSaved(keras.layers.Layer):
    """A layer whose saving pauses half-way through the file, once asked to."""

    pause = threading.Event()
    paused = threading.Semaphore(0)

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(input_shape[-1],), initializer="ones")

    def call(self, x):
        return x * self.scale

    def save_own_variables(self, store):
        super().save_own_variables(store)
        if PausesWhileSaved.pause.is_set():
            PausesWhileSaved.paused.release()
            threading.Event().wait()  # Killed here (or ended with the child).


def small_model(value):
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(64), PausesWhileSaved()]
    )
    for variable in model.weights:
        variable.assign(np.full(variable.shape, value, "float32"))
    return model


SAVES = {  # File name: how it is written.
    "atomic.keras": saving.save_model,
    "atomic.weights.h5": saving.save_weights,
    "plain.keras": keras.saving.save_model,
}


def pausing_write(write, model, path):
    """`write(model, path)`, which pauses half-way; a write that raises or
    ends without pausing ends the child (no one then waits for it)."""
    try:
        write(model, path)
    except BaseException:
        traceback.print_exc()
    else:
        print(f"{path} was written without pausing", file=sys.stderr, flush=True)
    os._exit(1)


def save(directory):
    """Writes each file whole, then starts writing each again, concurrently,
    and pauses (for the kill) once every second write is half-way."""
    for name, write in SAVES.items():
        write(small_model(1.0), os.path.join(directory, name))
    PausesWhileSaved.pause.set()
    for name, write in SAVES.items():
        path = os.path.join(directory, name)
        thread = threading.Thread(
            target=pausing_write, args=(write, small_model(2.0), path)
        )
        thread.daemon = True
        thread.start()
    for _ in SAVES:
        PausesWhileSaved.paused.acquire()  # Each write pauses, or ends the child.
    pause("SAVING")


if __name__ == "__main__":
    mode, directory, *rest = sys.argv[1:]
    if mode == "fit":
        fit(directory, int(rest[0]), rest[1], rest[2])
    else:
        save(directory)
