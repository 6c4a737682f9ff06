"""The process tests/test_crash_safety.py kills: a DP fit, or a model save.

Usage: python crash_child.py fit DIR PAUSE_AT PHASE
       python crash_child.py save DIR

`fit` trains a ToyDPRegressor with AtomicBackupAndRestore, PrivacyLedger and
PrivacyBudget, pausing (for the kill) once the ledger has counted PAUSE_AT
steps: at the batch's begin (the step has begun, not run) or its end. A
run that is not killed writes DIR/result.json. `save` writes complete
files (atomically, and with Keras), then pauses while writing each again.
"""

import json
import os
import sys
import threading
import time

import keras
import numpy as np

from kdpemb import _atomic, callbacks, saving
from kdpemb.privacy import ledger, protocol
from kdpemb.testing import ToyDPRegressor, toy_regression_data

N, D, NOISE, Q = 64, 3, 1.5, 0.1
DELTA, TARGET = 1e-3, 1.0
STEPS_PER_EPOCH, EPOCHS, SAVE_FREQ = 10, 6, 4


def paths(directory):
    return {
        "backup": os.path.join(directory, "backup"),
        "ledger": os.path.join(directory, "ledger.json"),
        "epsilons": os.path.join(directory, "epsilons.txt"),
        "result": os.path.join(directory, "result.json"),
    }


def pause(message):
    print(message, flush=True)
    time.sleep(600)  # Killed here.


class Observer(keras.callbacks.Callback):
    """Records what the test checks; pauses where it is told to."""

    def __init__(self, where, pause_at, phase):
        super().__init__()
        self.where, self.pause_at, self.phase = where, pause_at, phase
        self.batches = 0

    def _ledger_steps(self):
        return ledger.read_ledger(self.where["ledger"])["steps"]

    def on_train_batch_begin(self, batch, logs=None):
        if self.phase == "begin" and self._ledger_steps() == self.pause_at:
            pause("PAUSED")

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1
        if self.phase == "end" and self._ledger_steps() == self.pause_at:
            pause("PAUSED")

    def on_epoch_end(self, epoch, logs=None):
        with open(self.where["epsilons"], "a") as file:
            file.write(f"{logs['epsilon']!r}\n")


class Restored(keras.callbacks.Callback):
    """The `private_steps` the backup restored (before the ledger raises it)."""

    steps = None

    def on_train_begin(self, logs=None):
        self.steps = protocol.read_private_steps(self.model)


def fit(directory, pause_at, phase):
    where = paths(directory)
    model = ToyDPRegressor(N, D, NOISE, Q)
    model.compile(optimizer="sgd")
    restored = Restored()
    privacy_ledger = callbacks.PrivacyLedger(where["ledger"])
    budget = callbacks.PrivacyBudget(DELTA, target_epsilon=TARGET, verbose=0)
    observer = Observer(where, pause_at, phase)
    model.fit(
        toy_regression_data(N, D, STEPS_PER_EPOCH),
        epochs=EPOCHS,
        verbose=0,
        callbacks=[
            callbacks.AtomicBackupAndRestore(
                where["backup"], save_freq=SAVE_FREQ, delete_checkpoint=False
            ),
            restored,
            privacy_ledger,
            budget,
            observer,
        ],
    )
    result = {
        "restored_steps": restored.steps,
        "ledger_raised_by": privacy_ledger.restored_steps,
        "batches_run": observer.batches,
        "private_steps": protocol.read_private_steps(model),
        "statement_steps": budget.statement.steps,
        "statement_epsilon": budget.statement.epsilon,
        "step_budget": budget.step_budget,
    }
    _atomic.write_text(where["result"], json.dumps(result))
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
            time.sleep(600)  # Killed here.


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


def save(directory):
    """Writes each file whole, then starts writing each again, concurrently,
    and pauses (for the kill) once every second write is half-way."""
    for name, write in SAVES.items():
        write(small_model(1.0), os.path.join(directory, name))
    PausesWhileSaved.pause.set()
    for name, write in SAVES.items():
        path = os.path.join(directory, name)
        thread = threading.Thread(target=write, args=(small_model(2.0), path))
        thread.daemon = True
        thread.start()
    for _ in SAVES:
        PausesWhileSaved.paused.acquire(timeout=300)
    pause("SAVING")


if __name__ == "__main__":
    mode, directory, *rest = sys.argv[1:]
    if mode == "fit":
        fit(directory, int(rest[0]), rest[1])
    else:
        save(directory)
