"""Old import paths that keep working for one release, with a warning.

Two kinds of move, one warning:

- a whole module moved (`MOVED_MODULES`): the old path is served by a
  finder on `sys.meta_path`, installed by `import kdpemb`, whose module
  reads every name from the new module;
- some names of a module moved (`moved_names`): the old module's
  `__getattr__` reads them from their new modules.

Either way, the first read of a name through an old path warns
`DeprecationWarning` at the caller and gives the new object; nothing is
copied, so a test that patches the new module patches what the old path
gives.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

NEXT = "the old path goes in the next release."

_MODELS = "kdpemb.models"
MOVED_MODULES = {
    "kdpemb.data.inputs": "kdpemb.datasets.inputs",
    "kdpemb.data.sources": "kdpemb.datasets.sources",
    **{
        f"{_MODELS}.{old}": f"{_MODELS}.{new}"
        for old, new in {
            "fedemb_checks": "fedemb.fedemb_checks",
            "fedemb_config": "fedemb.fedemb_config",
            "fedemb_fit": "fedemb.fedemb_fit",
            "fedemb_privacy": "fedemb.fedemb_privacy",
            "fedemb_round": "fedemb.fedemb_round",
            "fedemb_step": "fedemb.fedemb_step",
            "multi_host": "fedemb.fedemb_multi_host",
            "dp_model": "dp_sgd.dp_model",
            "clipped_gradients": "dp_sgd.clipped_gradients",
            "ghost_norms": "dp_sgd.ghost_norms",
            "last_layer_inputs": "last_layer.last_layer_inputs",
            "last_layer_plan": "last_layer.last_layer_plan",
            "last_layer_solvers": "last_layer.last_layer_solvers",
            "last_layer_stats": "last_layer.last_layer_stats",
            "dp_sgd_head": "last_layer.last_layer_dp_sgd_head",
            "backends": "_shared.backends",
            "backends.jax_backend": "_shared.backends.jax_backend",
            "backends.tensorflow_backend": "_shared.backends.tensorflow_backend",
            "layer_taps": "_shared.layer_taps",
            "device_rows": "_shared.device_rows",
            "frozen_settings": "_shared.frozen_settings",
            "optimizer_restore": "_shared.optimizer_restore",
            "privacy_plan": "_shared.privacy_plan",
            "private_state": "_shared.private_state",
        }.items()
    },
}


# Names of a moved module that went elsewhere than the module itself.
MOVED_ELSEWHERE = {
    "kdpemb.data.sources": {"read_source": "kdpemb.data.virtual_clients"},
}


def warn_moved(old, new):
    """Warns, at the caller of the caller, that `old` is now `new`."""
    warnings.warn(f"{old} is now {new}; {NEXT}", DeprecationWarning, stacklevel=3)


def moved_names(module_name, moves):
    """A module `__getattr__` serving names that moved to other modules.

    Args:
        module_name: str. The old module (its `__name__`).
        moves: dict. Each moved name to the module that holds it now.

    Example:

    >>> getter = moved_names("old", {"sqrt": "math"})
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     value = getter("sqrt")
    >>> value(4.0), str(caught[0].message)
    (2.0, 'old.sqrt is now math.sqrt; the old path goes in the next release.')
    """

    def __getattr__(name):
        if name not in moves:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        warn_moved(f"{module_name}.{name}", f"{moves[name]}.{name}")
        # Imported when read, not when the old module loads: no import circle.
        return getattr(importlib.import_module(moves[name]), name)

    return __getattr__


class _OldPath(types.ModuleType):
    """A module at an old path: every name is read from the new module."""

    def __getattr__(self, name):
        new = MOVED_ELSEWHERE.get(self.__name__, {}).get(name)
        new = new or MOVED_MODULES[self.__name__]
        if name == "__all__":  # `from old import *` gives the new names.
            module = importlib.import_module(new)
            return getattr(
                module, "__all__", [n for n in vars(module) if not n.startswith("_")]
            )
        if name.startswith("__"):
            raise AttributeError(name)
        module = importlib.import_module(new)
        if not hasattr(module, name):
            raise AttributeError(f"module {new!r} has no attribute {name!r}")
        # `from package import name` asks the import system first (hasattr):
        # only the caller's own read warns.
        if "importlib._bootstrap" not in sys._getframe(1).f_code.co_filename:
            warnings.warn(
                f"{self.__name__}.{name} is now {new}.{name}; {NEXT}",
                DeprecationWarning,
                stacklevel=2,
            )
        return getattr(module, name)

    def __setattr__(self, name, value):
        # Patching an old path would change nothing that runs: refused.
        # (An old submodule is bound here by the import system: kept here.)
        if name.startswith("__") or isinstance(value, _OldPath):
            super().__setattr__(name, value)
            return
        new = MOVED_ELSEWHERE.get(self.__name__, {}).get(name)
        raise AttributeError(
            f"{self.__name__} is an old path, read from "
            f"{new or MOVED_MODULES[self.__name__]}: set {name} there (that "
            "module is the one that runs)."
        )

    def __dir__(self):
        return dir(importlib.import_module(MOVED_MODULES[self.__name__]))


class OldPathFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths of `MOVED_MODULES` (after every real module)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED_MODULES:
            return None
        new = importlib.util.find_spec(MOVED_MODULES[fullname])
        is_package = new is not None and new.submodule_search_locations is not None
        return importlib.util.spec_from_loader(fullname, self, is_package=is_package)

    def create_module(self, spec):
        module = _OldPath(spec.name)
        if spec.submodule_search_locations is not None:
            module.__path__ = []  # Its old submodules are old paths too.
        return module

    def exec_module(self, module):
        pass


def install():
    """Serves the old paths of `MOVED_MODULES` (once per process)."""
    if not any(isinstance(f, OldPathFinder) for f in sys.meta_path):
        sys.meta_path.append(OldPathFinder())
