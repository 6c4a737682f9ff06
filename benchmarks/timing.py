"""Small helpers shared by the benchmarks: timing and the device in use."""

import statistics
import time

import keras


def timed(function, *args, **kwargs):
    """`(function(*args, **kwargs), seconds it took)`."""
    start = time.perf_counter()
    result = function(*args, **kwargs)
    return result, time.perf_counter() - start


def time_fit(model, *args, **kwargs):
    """Seconds of one silent `model.fit(*args, **kwargs)`."""
    return timed(model.fit, *args, verbose=0, **kwargs)[1]


class StepClock(keras.callbacks.Callback):
    """Times the steps of a fit without its set-up or epoch boundaries.

    `step_seconds()` is the median interval between consecutive batch ends
    of the same epoch: the steady-state cost of a step, as opposed to
    `time_fit`, which also counts copying the data in, building the input
    pipeline, and each epoch's start. A callback that reads the logs makes
    JAX finish each step before the next starts, so measure the two apart.
    """

    def __init__(self):
        super().__init__()
        self.intervals = []
        self._last = None

    def on_epoch_begin(self, epoch, logs=None):
        self._last = None

    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()
        if self._last is not None:
            self.intervals.append(now - self._last)
        self._last = now

    def step_seconds(self):
        return statistics.median(self.intervals)


def gpu_available():
    """Whether the active Keras backend sees a GPU."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return jax.default_backend() == "gpu"
    if backend == "tensorflow":
        import tensorflow as tf

        return bool(tf.config.list_physical_devices("GPU"))
    return False
