"""`import kdpemb` is enough for `keras.saving.load_model` of kdpemb's models.

Keras finds the class of a saved kdpemb object (`DPModel`, `FedEmbModel`,
`LastLayerDPClassifier`, `ClipFeatures`, ...) only once the module that
registers it (`keras.saving.register_keras_serializable`) has been
imported, and those modules import Keras, which `import kdpemb` must not
(it takes seconds). So `install` imports them as soon as Keras itself has
been imported, by whoever imports it, or at once if it already is.

When Keras is imported by a kdpemb module (`import kdpemb.callbacks`),
that module is still half-run: the registering modules are imported once
the outermost kdpemb import has finished, so that none of them finds a
kdpemb module half-done. Until then a finder on `sys.meta_path` watches
the imports of Keras and of kdpemb's own modules; it leaves once the
classes are registered. Standard library only.

Example:

>>> REGISTERING_MODULES[0]
'kdpemb.models'
"""

import contextlib
import importlib
import importlib.abc
import importlib.util
import sys
import threading
import warnings

# The modules whose import registers every kdpemb class Keras may load.
REGISTERING_MODULES = (
    "kdpemb.models",
    "kdpemb.metrics.recall_at_far_metric",
    "kdpemb.testing.toy_dp_regressor",
)


def registered():
    """Whether every registering module has been imported."""
    return all(name in sys.modules for name in REGISTERING_MODULES)


def _fully_imported(name):
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    return module is not None and not getattr(spec, "_initializing", False)


_lock = threading.RLock()


def _register():
    """Imports the registering modules, each tried. A failure there must not
    fail the import that Keras (or a kdpemb module) was being imported for,
    even where warnings are errors: it warns if it can, and the import of
    that module raises it again when it is used."""
    with _lock:
        for name in REGISTERING_MODULES:
            try:
                importlib.import_module(name)
            except Exception as error:  # Reported; raised again on use.
                # -W error: never break `import keras`.
                with contextlib.suppress(Exception):
                    warnings.warn(
                        f"kdpemb could not register its Keras classes ({name}: "
                        f"{type(error).__name__}: {error}); "
                        "keras.saving.load_model of a kdpemb model needs "
                        f"`import {name}`.",
                        RuntimeWarning,
                        stacklevel=2,
                    )


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loaders of Keras and of kdpemb's modules, to register
    kdpemb's classes once Keras is in and no kdpemb module is half-run."""

    def __init__(self):
        self._local = threading.local()  # finding: bool; depth: int
        self._keras_loaded = False

    def find_spec(self, name, path=None, target=None):
        if name != "keras" and not name.startswith("kdpemb."):
            return None
        if getattr(self._local, "finding", False):
            return None  # The search below, asking the other finders.
        self._local.finding = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._local.finding = False
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        spec.loader = _Loader(loader, self, is_keras=name == "keras")
        return spec

    def ran(self, module, loader, is_keras):
        """Runs `module` with `loader`; registers once that is safe."""
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + (0 if is_keras else 1)
        try:
            loader.exec_module(module)
        finally:
            self._local.depth = depth
        self._keras_loaded = self._keras_loaded or is_keras
        if self._keras_loaded and depth == 0:
            self.leave()
            _register()

    def leave(self):
        with _lock, contextlib.suppress(ValueError):
            sys.meta_path.remove(self)


class _Loader(importlib.abc.Loader):
    """The loader the finder found, run through `_Finder.ran`."""

    def __init__(self, loader, finder, is_keras):
        self._loader, self._finder, self._is_keras = loader, finder, is_keras

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        # The module keeps its own loader, as if no finder had watched it.
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._finder.ran(module, self._loader, self._is_keras)

    def __getattr__(self, name):  # get_source, is_package, resources...
        return getattr(self._loader, name)


def install():
    """Registers kdpemb's classes now if Keras is imported, else on its import."""
    if registered():
        return
    if _fully_imported("keras"):
        _register()
        return
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
