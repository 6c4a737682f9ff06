import io
import re
import sys
import warnings

import keras
import numpy as np
import pytest
from rich.console import Console

from kdpemb.callbacks.rich_progress import RichProgress, _format_number

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
SUMMARY = re.compile(r"^epoch \d+/\d+ · \d+(/\d+)? rounds? · ")
EPOCHS, STEPS = 3, 4  # 32 examples in batches of 8.


class WritesEpochLogs(keras.callbacks.Callback):
    """Stands in for PrivacyBudget and a Recall@FAR callback."""

    def on_epoch_end(self, epoch, logs=None):
        logs["epsilon"] = 0.5 * (epoch + 1)
        logs["recall@far=1e-03"] = np.float32(0.25 + 0.125 * epoch)


class StopsAt(keras.callbacks.Callback):
    def __init__(self, epoch, batch):
        super().__init__()
        self.epoch, self.batch, self.current = epoch, batch, None

    def on_epoch_begin(self, epoch, logs=None):
        self.current = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.current, batch) == (self.epoch, self.batch):
            self.model.stop_training = True


def no_live_display(console):
    # rich >= 14 keeps a stack of live displays, rich 13 a single one.
    return not getattr(console, "_live_stack", None) and not getattr(
        console, "_live", None
    )


def fit(callbacks, epochs=EPOCHS, verbose=0):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 5)).astype("float32")
    y = rng.normal(size=(32, 1)).astype("float32")
    return model.fit(
        x, y, batch_size=8, epochs=epochs, verbose=verbose, callbacks=callbacks
    )


def progress(force_terminal, **kwargs):
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=force_terminal, width=100)
    return RichProgress(console=console, **kwargs), buffer


def test_plain_output_has_one_line_per_epoch_with_the_epoch_logs():
    callback, buffer = progress(force_terminal=False)
    history = fit([WritesEpochLogs(), callback])
    text = buffer.getvalue()
    assert not ANSI.search(text)
    lines = text.splitlines()
    assert len(lines) == EPOCHS
    for epoch, line in enumerate(lines):
        loss = history.history["loss"][epoch]
        assert line.startswith(f"epoch {epoch + 1}/{EPOCHS} · {STEPS} rounds · ")
        assert re.search(r" · \d+\.\ds · ", line)
        parts = line.split(" · ")[3:]
        assert parts[0] == f"loss {_format_number(loss)}"
        assert parts[1] == f"ε {_format_number(0.5 * (epoch + 1), 'epsilon')}"
        assert parts[2] == f"recall@far=1e-03 {0.25 + 0.125 * epoch:.4g}"
        assert parts[3].startswith("mae ")


def test_values_written_after_richprogress_miss_that_epochs_line():
    # Callbacks run in list order: RichProgress must come last.
    callback, buffer = progress(force_terminal=False)
    fit([callback, WritesEpochLogs()], epochs=1)
    assert "ε" not in buffer.getvalue()
    assert "recall@far" not in buffer.getvalue()


def test_terminal_output_keeps_the_summary_lines_and_cleans_up():
    stdout = sys.stdout
    callback, buffer = progress(force_terminal=True)
    fit([WritesEpochLogs(), callback])
    assert sys.stdout is stdout  # The live display gave stdout back.
    assert callback._progress is None
    assert no_live_display(callback.console)
    text = ANSI.sub("", buffer.getvalue())
    for epoch in range(EPOCHS):
        pattern = (
            rf"epoch {epoch + 1}/{EPOCHS} · {STEPS} rounds · \S+ · loss \S+ · "
            rf"ε {_format_number(0.5 * (epoch + 1), 'epsilon')} · "
            r"recall@far=1e-03 \S+ · mae \S+\n"
        )
        assert re.search(pattern, text), text
    assert "\x1b[" in buffer.getvalue()


def test_print_every_adds_step_lines():
    callback, buffer = progress(force_terminal=False, print_every=2, unit="step")
    fit([WritesEpochLogs(), callback], epochs=2)
    lines = buffer.getvalue().splitlines()
    steps = [line for line in lines if " · step " in line]
    assert [line.split(" · ")[:2] for line in steps] == [
        ["epoch 1/2", "step 2/4"],
        ["epoch 1/2", "step 4/4"],
        ["epoch 2/2", "step 2/4"],
        ["epoch 2/2", "step 4/4"],
    ]
    assert all(" · loss " in line for line in steps)
    # From the second epoch on, the latest ε is that of the epoch before.
    assert "ε 0.5" in steps[2]
    assert lines[2].startswith("epoch 1/2 · 4 steps · ")


@pytest.mark.parametrize("force_terminal", [False, True])
def test_an_early_stop_ends_cleanly(force_terminal):
    stdout = sys.stdout
    callback, buffer = progress(force_terminal=force_terminal)
    history = fit([StopsAt(epoch=1, batch=1), WritesEpochLogs(), callback])
    assert len(history.history["loss"]) == 2
    assert sys.stdout is stdout
    assert callback._progress is None
    lines = ANSI.sub("", buffer.getvalue()).splitlines()
    summaries = [line for line in lines if SUMMARY.match(line)]
    assert [line.split(" · ")[:2] for line in summaries] == [
        ["epoch 1/3", "4 rounds"],
        ["epoch 2/3", "2/4 rounds"],
    ]
    # The callback can be used again.
    fit([callback], epochs=1)
    assert callback._progress is None


@pytest.mark.parametrize("force_terminal", [False, True])
def test_empty_and_non_numeric_logs_do_not_crash(force_terminal):
    callback, buffer = progress(force_terminal=force_terminal, print_every=1)
    callback.set_params({"epochs": 2, "steps": None, "verbose": 0})
    callback.on_train_begin(None)
    callback.on_epoch_begin(0, None)
    callback.on_train_batch_end(0, None)
    callback.on_train_batch_end(1, {})
    weird = {"note": "text", "none": None, "vector": np.ones(3), "flag": True}
    callback.on_train_batch_end(2, {**weird, "loss": np.float64(0.25)})
    callback.on_epoch_end(0, {})
    callback.on_epoch_begin(1, None)
    callback.on_epoch_end(1, None)
    callback.on_train_end(None)
    lines = ANSI.sub("", buffer.getvalue()).splitlines()
    epochs = [line for line in lines if SUMMARY.match(line)]
    assert epochs[0].startswith("epoch 1/2 · 3 rounds · ")
    assert epochs[0].endswith(" · loss 0.25")
    assert epochs[1].startswith("epoch 2/2 · 0 rounds · ")
    assert "note" not in buffer.getvalue()
    assert "vector" not in buffer.getvalue()
    if not force_terminal:
        # Unknown steps per epoch; no values yet.
        assert re.fullmatch(r"epoch 1/2 · round 1 · \d+\.\ds", lines[0])
        assert lines[2].startswith("epoch 1/2 · round 3 · ")
        assert lines[2].endswith("s · loss 0.25")


def test_keys_choose_and_order_the_values():
    callback, buffer = progress(force_terminal=False, keys=["mae", "epsilon"])
    fit([WritesEpochLogs(), callback], epochs=1)
    parts = buffer.getvalue().strip().split(" · ")
    assert parts[3].startswith("mae ")
    assert parts[4] == "ε 0.5"
    assert len(parts) == 5


def test_values_from_numpy_and_jax_like_scalars():
    callback, buffer = progress(force_terminal=False)
    callback.set_params({"epochs": 1, "steps": 1, "verbose": 0})
    callback.on_train_begin()
    callback.on_epoch_begin(0)
    callback.on_train_batch_end(0, {"loss": keras.ops.convert_to_tensor(0.125)})
    logs = {
        "epsilon": np.float32(2.0),
        "private_steps": 12.0,
        "count": np.int64(7),
        "tiny": 1.5e-7,
        "huge": 123456.7,
    }
    callback.on_epoch_end(0, logs)
    callback.on_train_end()
    assert buffer.getvalue().strip().split(" · ")[3:] == [
        "loss 0.125",
        "ε 2",
        "count 7",
        "huge 1.235e+05",
        "private_steps 12",
        "tiny 1.5e-07",
    ]


def test_number_format():
    assert _format_number(0.45213) == "0.4521"
    assert _format_number(1.23456, "epsilon") == "1.23"
    assert _format_number(float("inf"), "epsilon") == "∞"
    assert _format_number(float("nan")) == "nan"
    assert _format_number(3e-6) == "3e-06"
    assert _format_number(5.0) == "5"


def test_verbose_fit_warns_about_two_progress_bars():
    callback, _ = progress(force_terminal=False)
    with pytest.warns(UserWarning, match="verbose=0"):
        fit([callback], epochs=1, verbose=2)


def test_quiet_fit_does_not_warn():
    callback, _ = progress(force_terminal=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        fit([callback], epochs=1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"print_every": 0}, "print_every"),
        ({"print_every": 1.5}, "print_every"),
        ({"unit": ""}, "unit"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RichProgress(**kwargs)


class Fails(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        raise RuntimeError("boom")


def test_a_display_left_by_a_failed_fit_is_stopped_by_the_next_fit():
    stdout = sys.stdout
    callback, buffer = progress(force_terminal=True)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            fit([Fails(), callback], epochs=1)
        assert callback._progress is not None  # Keras skipped on_train_end.
        fit([callback], epochs=1)
        assert callback._progress is None
        assert sys.stdout is stdout
        assert no_live_display(callback.console)
    finally:
        callback.on_train_end()
    assert "epoch 1/1 · 4 rounds · " in ANSI.sub("", buffer.getvalue())
