"""Atomic model saves: a kill mid-save leaves the old file whole, never half.

`keras.saving.save_model` and `Model.save_weights` (and so
`keras.callbacks.ModelCheckpoint` and `BackupAndRestore`) open the target
file and write into it: a process killed while saving leaves a truncated
file where the last good one was. `save_model` and `save_weights` here
write to a temporary file in the same directory, fsync it and
`os.replace` it onto the target, so the target is always either the
previous complete file or the new one. `kdpemb.callbacks.AtomicBackupAndRestore`
saves its backups this way. On several hosts (`kdpemb.distribute`) every
host must call them, as the same script does (reading a variable may be
a collective), and only the chief's file is kept.
Importing this module imports Keras.

Example:

>>> import os, tempfile, kdpemb
>>> model = kdpemb.testing.ToyDPRegressor(
...     num_examples=8, num_features=2, noise_multiplier=1.0,
...     sampling_probability=0.5)
>>> path = os.path.join(tempfile.mkdtemp(), "model.weights.h5")
>>> save_weights(model, path)
>>> os.listdir(os.path.dirname(path))
['model.weights.h5']
"""

import contextlib
import os
import tempfile

import keras

from kdpemb import _atomic

__all__ = ["save_model", "save_weights"]


def save_model(model, filepath, **kwargs):
    """`keras.saving.save_model(model, filepath, **kwargs)`, atomically.

    `filepath` is a single file (".keras"); `kwargs` go to Keras.

    Example:

    >>> import os, tempfile
    >>> import keras
    >>> from kdpemb.saving import save_model
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    >>> with tempfile.TemporaryDirectory() as directory:
    ...     path = os.path.join(directory, "model.keras")
    ...     save_model(model, path)
    ...     files = os.listdir(directory)  # no temporary file left behind
    ...     restored = keras.saving.load_model(path)
    >>> files, restored.count_params()
    (['model.keras'], 4)
    """
    with _target(model, filepath) as temporary:
        keras.saving.save_model(model, temporary, **kwargs)


def save_weights(model, filepath, **kwargs):
    """`model.save_weights(filepath, **kwargs)`, atomically.

    `filepath` ends with ".weights.h5" (a single file, not sharded).

    Example:

    >>> import os, tempfile
    >>> import keras
    >>> from kdpemb.saving import save_weights
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    >>> with tempfile.TemporaryDirectory() as directory:
    ...     save_weights(model, os.path.join(directory, "model.weights.h5"))
    ...     model.load_weights(os.path.join(directory, "model.weights.h5"))
    ...     os.listdir(directory)
    ['model.weights.h5']
    """
    if kwargs.get("max_shard_size") is not None:
        raise ValueError(
            "save_weights writes one file atomically; sharded weights "
            "(max_shard_size) are several files. Save without max_shard_size."
        )
    with _target(model, filepath) as temporary:
        model.save_weights(temporary, **kwargs)


@contextlib.contextmanager
def _target(model, filepath):
    """Where to save: a temporary file moved onto `filepath` on the chief,
    a scratch file deleted afterwards on the other hosts (every host runs
    the save: reading a variable may be a collective of the engine)."""
    if writes_here(model):
        with _atomic.atomic_path(filepath) as temporary:
            yield temporary
        return
    with tempfile.TemporaryDirectory() as scratch:
        yield os.path.join(scratch, os.path.basename(os.fspath(filepath)))


def writes_here(model):
    """True unless this is a host other than the chief of a multi-host job
    (`kdpemb.distribute.current_hosts`): one host writes each file."""
    from kdpemb import distribute

    return distribute.current_hosts(model).is_chief
