"""Keras' progress bar, with kdpemb's counters shown as whole numbers.

Keras prints every logged value with four decimals (`private_steps:
47.0000`, `nonfinite_updates: 0.0000e+00`). The kdpemb models log counts:
steps taken, rounds with a non-finite update, hosts out of step.
`CountProgbarLogger` is Keras' `ProgbarLogger` that prints those as
integers (`private_steps: 47`) and everything else as Keras does. The
kdpemb models add it to a `fit` (`with_count_progbar`) unless the fit has
a progress logger already; `verbose` works as in Keras.

Example:

>>> from kdpemb.callbacks.count_progbar import CountProgbarLogger, as_counts
>>> as_counts({"private_steps": 47.0, "loss": 0.25})["private_steps"]
47
>>> f"{as_counts({'private_steps': 47.0})['private_steps']:.4f}"
'47'
"""

import keras

# The names of the counts the kdpemb models log.
COUNTS = frozenset({"private_steps", "nonfinite_updates", "misaligned_hosts"})


class Count(float):
    """A logged count: a float to Keras' progress bar, printed as an integer
    whatever the format asked (the bar averages a value over 1 step and
    formats it with `.4f`)."""

    def __format__(self, spec):
        return str(round(self))

    def __str__(self):
        return str(round(self))

    __repr__ = __str__

    def __truediv__(self, other):
        return Count(float(self) / other)

    def __abs__(self):
        return Count(abs(float(self)))


def as_counts(logs):
    """`logs` with each finite kdpemb count made a `Count` (a new dict)."""
    if not logs:
        return logs
    shown = dict(logs)
    for name in COUNTS.intersection(shown):
        try:
            value = float(shown[name])
        except (TypeError, ValueError):
            continue
        if value == value and abs(value) != float("inf"):
            shown[name] = Count(value)
    return shown


class CountProgbarLogger(keras.callbacks.ProgbarLogger):
    """Keras' `ProgbarLogger`, printing kdpemb's counts as integers. Other
    callbacks see the logs unchanged."""

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, as_counts(logs))

    def on_test_batch_end(self, batch, logs=None):
        super().on_test_batch_end(batch, as_counts(logs))

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, as_counts(logs))

    def on_test_end(self, logs=None):
        super().on_test_end(as_counts(logs))


def with_count_progbar(callbacks):
    """`callbacks` with a `CountProgbarLogger` added when it holds no
    progress logger (a `CallbackList` is returned as it is: Keras adds
    none to one)."""
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks
    callbacks = list(callbacks or ())
    if not any(isinstance(c, keras.callbacks.ProgbarLogger) for c in callbacks):
        callbacks.append(CountProgbarLogger())
    return callbacks
