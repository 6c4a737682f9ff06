"""Small helpers shared by the benchmarks: timing and the device in use."""

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
