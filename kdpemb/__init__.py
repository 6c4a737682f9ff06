"""kdpemb: differentially private image embeddings and classifiers for Keras 3.

`import kdpemb` is cheap: submodules load on first use, and only
`kdpemb.callbacks` (and later the models) import Keras.

Example:

>>> import kdpemb
>>> mechanism = kdpemb.privacy.dp_sgd(
...     noise_multiplier=1.1, batch_size=256, num_examples=60_000)
>>> round(kdpemb.privacy.epsilon(mechanism, steps=14_063, delta=1e-5), 2)
2.38
"""

import importlib

from kdpemb import _console, _keras_registration, _moved
from kdpemb._backend_selection import check_supported_backend
from kdpemb.version import __version__

check_supported_backend()
_console.install()  # A quiet console (kdpemb._console; KDPEMB_BACKEND_LOGS=1).
_moved.install()  # Old import paths, for one release (kdpemb._moved).

_SUBMODULES = (
    "callbacks",
    "cli",
    "data",
    "datasets",
    "distribute",
    "features",
    "metrics",
    "models",
    "plots",
    "privacy",
    "saving",
    "testing",
)

# The models, also reachable from the top level (`kdpemb.FedEmbModel`).
_MODELS = ("CentralizedBaseline", "DPModel", "FedEmbModel", "LastLayerDPClassifier")

__all__ = ["__version__", *_SUBMODULES, *_MODELS]


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"kdpemb.{name}")
    if name in _MODELS:
        return getattr(importlib.import_module("kdpemb.models"), name)
    raise AttributeError(f"module 'kdpemb' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)


# `keras.saving.load_model` finds kdpemb's classes once Keras is imported.
_keras_registration.install()
