"""RichProgress: a progress bar and one summary line per epoch, with ε."""

import atexit
import math
import time
import warnings

import keras
import numpy as np
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

from kdpemb import _validation as validation

_SEPARATOR = " · "
_NAMES = {"epsilon": "ε"}


class RichProgress(keras.callbacks.Callback):
    """Shows training progress with rich: rounds, time, loss, ε and recall.

    Use it in place of Keras' progress bar:
    `model.fit(..., verbose=0, callbacks=[..., RichProgress()])`.

    On a terminal it draws a live bar for the current epoch: the steps
    ("rounds") done out of `params["steps"]` (an indeterminate bar when
    Keras does not know the number), the elapsed time and the latest
    values from the logs. At each epoch end the bar gives way to one
    summary line that stays on screen, such as
    `epoch 3/10 · 50 rounds · 12.3s · loss 0.4521 · ε 1.23 ·
    recall@far=1e-03 0.8123` (an epoch cut short reads `7/50 rounds`).
    Elsewhere (CI logs, files, notebooks) there is no live display and no
    ANSI escape: the same summary line per epoch, in plain text, and with
    `print_every` a plain line every so many steps.

    The values are the numeric scalars in the logs: by default `loss`
    first, then `epsilon` (written by `PrivacyBudget`), then keys starting
    with `recall@far` (written by a Recall@FAR callback), then the rest in
    alphabetical order; values that are not numbers are left out. The bar
    shows the latest value of each key, so during an epoch ε and recall are
    those of the epoch before. Whole numbers show as such (Keras turns
    counts into floats), others with 4 significant digits (ε 3), in
    exponent form below 1e-4 or from 10⁴ (ε from 10³).

    Keras calls callbacks in list order and the epoch-end values of other
    callbacks only exist once they have run: put `RichProgress` last. If
    `fit` raises, Keras skips `on_train_end`; the live display is then
    stopped at the next `fit` with this callback or when Python exits.

    Args:
        console: `rich.console.Console` or None. Where to write. Defaults
            to `None`, a console on standard output.
        print_every: int or None. Without a live display, also print a line
            every this many steps. Defaults to `None` (epoch lines only).
        unit: str. The word for one step; plural with "s" (or "es").
            Defaults to `"round"`.
        keys: sequence of str or None. The log keys to show, in this order.
            Defaults to `None`, all numeric keys in the order above.

    Example:

    >>> import kdpemb
    >>> from rich.console import Console
    >>> from kdpemb.callbacks.rich_progress import RichProgress
    >>> model = kdpemb.testing.ToyDPRegressor(
    ...     num_examples=64, num_features=3, noise_multiplier=1.5,
    ...     sampling_probability=0.1, seed=0)
    >>> model.compile(optimizer="sgd")
    >>> data = kdpemb.testing.toy_regression_data(64, 3, steps_per_epoch=10)
    >>> callbacks = [
    ...     kdpemb.callbacks.PrivacyBudget(delta=1e-3, verbose=0),
    ...     RichProgress(console=Console(force_terminal=False)),
    ... ]
    >>> history = model.fit(data, epochs=2, verbose=0, callbacks=callbacks)
    epoch 1/2 · 10 rounds · ...s · ε 0.711 · private_steps 10
    epoch 2/2 · 10 rounds · ...s · ε ... · private_steps 20
    """

    # Models that print progress lines at fit (calibration, compiling)
    # print them with this callback even under `verbose=0`.
    shows_progress = True

    def __init__(self, console=None, print_every=None, unit="round", keys=None):
        super().__init__()
        if print_every is not None:
            validation.check_positive_int(print_every, "print_every", "Or None.")
        if not isinstance(unit, str) or not unit.strip():
            raise ValueError(f"unit must be a non-empty str, got {unit!r}.")
        if isinstance(keys, str):
            keys = (keys,)
        self.console = Console() if console is None else console
        self.print_every = None if print_every is None else int(print_every)
        self.unit = unit.strip()
        self.keys = None if keys is None else tuple(keys)
        self._progress = None
        self._task = None
        self._epochs = None
        self._steps = None
        self._epoch = 0
        self._epoch_start = time.monotonic()
        self._done = 0
        self._printed = 0
        self._latest = {}
        self._epoch_values = {}

    # Keras hooks.

    def on_train_begin(self, logs=None):
        self._stop_display()  # Left over from a fit that raised.
        params = self.params or {}
        self._epochs = params.get("epochs")
        self._steps = params.get("steps")
        self._latest = {}
        if params.get("verbose"):
            warnings.warn(
                "RichProgress shows progress already: pass verbose=0 to fit to "
                "hide Keras' own progress bar.",
                stacklevel=2,
            )
        if self.console.is_terminal and not self.console.is_dumb_terminal:
            self._progress = Progress(
                TextColumn("{task.description}", style="bold", markup=False),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[unit]}", markup=False),
                TimeElapsedColumn(),
                TextColumn("{task.fields[values]}", markup=False),
                console=self.console,
                transient=True,
                refresh_per_second=4,
            )
            self._progress.start()
            atexit.register(self._stop_display)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._epoch_start = time.monotonic()
        self._done = 0
        self._printed = 0
        self._epoch_values = {}
        if self._progress is not None:
            self._remove_task()
            self._task = self._progress.add_task(
                self._epoch_label(),
                total=self._steps,
                unit=self._plural(2),
                values=self._values_text(self._latest),
            )

    def on_train_batch_end(self, batch, logs=None):
        # With steps_per_execution > 1, `batch` is the last step run so far.
        self._done = max(self._done, int(batch) + 1)
        values = _numbers(logs)
        self._latest.update(values)
        self._epoch_values.update(values)
        if self._progress is not None and self._task is not None:
            self._progress.update(
                self._task,
                completed=self._done,
                values=self._values_text(self._latest),
            )
        elif self.print_every and self._done // self.print_every > self._printed:
            self._printed = self._done // self.print_every
            self.console.print(
                self._step_line(),
                markup=False,
                highlight=False,
                emoji=False,
                soft_wrap=True,
            )

    def on_epoch_end(self, epoch, logs=None):
        values = _numbers(logs)
        self._latest.update(values)
        self._epoch_values.update(values)
        parts = self._epoch_parts(epoch, self._epoch_values)
        if self._progress is not None:
            self._remove_task()
            line = Text()
            for index, (text, style) in enumerate(parts):
                if index:
                    line.append(_SEPARATOR, style="dim")
                line.append(text, style=style)
            self.console.print(line, soft_wrap=True)
        else:
            self.console.print(
                _SEPARATOR.join(text for text, _ in parts),
                markup=False,
                highlight=False,
                emoji=False,
                soft_wrap=True,
            )

    def on_train_end(self, logs=None):
        self._stop_display()

    # Helpers.

    def _stop_display(self):
        progress, self._progress = self._progress, None
        self._task = None
        atexit.unregister(self._stop_display)
        if progress is not None:
            progress.stop()

    def _remove_task(self):
        if self._task is not None:
            self._progress.remove_task(self._task)
            self._task = None
            self._progress.refresh()  # Not the old bar under the next print.

    def _epoch_label(self, epoch=None):
        number = (self._epoch if epoch is None else epoch) + 1
        return f"epoch {number}/{self._epochs}" if self._epochs else f"epoch {number}"

    def _plural(self, count):
        if count == 1:
            return self.unit
        if self.unit.endswith(("s", "x", "z", "ch", "sh")):
            return self.unit + "es"
        return self.unit + "s"

    def _ordered(self, values):
        if self.keys is not None:
            return [(key, values[key]) for key in self.keys if key in values]
        first = [key for key in ("loss", "epsilon") if key in values]
        recall = sorted(key for key in values if key.startswith("recall@far"))
        rest = sorted(set(values) - set(first) - set(recall))
        return [(key, values[key]) for key in first + recall + rest]

    def _value_parts(self, values):
        return [
            (f"{_NAMES.get(key, key)} {_format_number(value, key)}", None)
            for key, value in self._ordered(values)
        ]

    def _values_text(self, values):
        return _SEPARATOR.join(text for text, _ in self._value_parts(values))

    def _elapsed(self):
        return _format_duration(time.monotonic() - self._epoch_start)

    def _epoch_parts(self, epoch, values):
        if self._steps and self._done < self._steps:
            count = f"{self._done}/{self._steps} {self._plural(self._steps)}"
        else:
            count = f"{self._done} {self._plural(self._done)}"
        return [
            (self._epoch_label(epoch), "bold"),
            (count, None),
            (self._elapsed(), None),
            *self._value_parts(values),
        ]

    def _step_line(self):
        total = f"/{self._steps}" if self._steps else ""
        parts = [
            self._epoch_label(),
            f"{self.unit} {self._done}{total}",
            self._elapsed(),
            self._values_text(self._latest),
        ]
        return _SEPARATOR.join(part for part in parts if part)


def _numbers(logs):
    """The numeric scalars of `logs` as int or float, by key."""
    numbers = {}
    for key, value in (logs or {}).items():
        number = _number(value)
        if number is not None:
            numbers[str(key)] = number
    return numbers


def _number(value):
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    try:
        array = np.asarray(value)
    except (TypeError, ValueError, RuntimeError):
        return None
    if array.size != 1 or array.dtype.kind not in "iuf":
        return None
    scalar = array.reshape(()).item()
    return int(scalar) if array.dtype.kind in "iu" else float(scalar)


def _format_number(value, key=None):
    """Whole numbers as such, others with 4 significant digits (ε 3)."""
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "∞" if value > 0 else "-∞"
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.{3 if key == 'epsilon' else 4}g}"


def _format_duration(seconds):
    if seconds < 60:
        return f"{seconds:.1f}s"
    seconds = round(seconds)
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m {seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {seconds:02d}s"
