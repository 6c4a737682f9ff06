"""Which Keras backend is selected, found without importing Keras.

Importing Keras imports its backend (TensorFlow takes seconds), so
`import kdpemb` reads the selection the way Keras does: a Keras that is
already imported wins; then the `KERAS_BACKEND` variable; then the
`backend` entry of `keras.json` in `$KERAS_HOME` or `~/.keras`; then
Keras' default, TensorFlow.
"""

import json
import os
import sys

from kdpemb.errors import UnsupportedBackendError  # re-exported

SUPPORTED_BACKENDS = ("tensorflow", "jax")


def selected_backend():
    """Returns `(backend, source)`: the backend Keras will use and why."""
    keras = sys.modules.get("keras")
    if keras is not None and hasattr(keras, "backend"):
        return keras.backend.backend(), "the already imported keras"
    if os.environ.get("KERAS_BACKEND"):
        return os.environ["KERAS_BACKEND"], "the KERAS_BACKEND variable"
    keras_home = os.environ.get("KERAS_HOME") or os.path.join(
        os.path.expanduser("~"), ".keras"
    )
    config_path = os.path.join(keras_home, "keras.json")
    try:
        with open(config_path) as f:
            backend = json.load(f).get("backend")
    except (OSError, ValueError):
        backend = None
    if backend:
        return backend, config_path
    return "tensorflow", "Keras' default"


def check_supported_backend():
    """Raises `UnsupportedBackendError` unless the backend is supported."""
    backend, source = selected_backend()
    if backend not in SUPPORTED_BACKENDS:
        supported = " and ".join(repr(b) for b in SUPPORTED_BACKENDS)
        raise UnsupportedBackendError(
            f"kdpemb supports the Keras backends {supported}, but Keras is set "
            f"to use {backend!r} (from {source}). Set KERAS_BACKEND=tensorflow "
            "or KERAS_BACKEND=jax before importing kdpemb or keras."
        )
    return backend
