"""Old import paths of the modules that moved keep working for one release:
each warns `DeprecationWarning` once, at the caller, and gives the new
object (the same object, so patching the new module patches the old path)."""

import importlib
import warnings

import pytest

from kdpemb._moved import MOVED_MODULES, OldPathFinder

SHARDS = "kdpemb.datasets.user_shards"
MOVED_NAMES = [
    ("kdpemb.data.assignment", "mix64", "kdpemb.datasets.user_hash"),
    ("kdpemb.privacy.mechanisms", "dp_sgd", "kdpemb.privacy.mechanism_builders"),
    ("kdpemb.privacy.mechanisms", "GaussianRelease", "kdpemb.privacy.gaussian_release"),
    (SHARDS, "UserShards", "kdpemb.datasets.user_shards_reader"),
    (SHARDS, "write_user_shards", "kdpemb.datasets.user_shards_writer"),
    ("kdpemb.data.sources", "read_source", "kdpemb.data.virtual_clients"),
]  # fmt: skip


def a_public_name(module_name):
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None) or [
        n for n in vars(module) if not n.startswith("_")
    ]
    return sorted(names)[0]


MOVED = MOVED_NAMES + [
    (old, a_public_name(new), new) for old, new in sorted(MOVED_MODULES.items())
]


def read_with_warnings(module, name):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = getattr(module, name)
    return value, [w for w in caught if w.category is DeprecationWarning]


@pytest.mark.parametrize(("old", "name", "new"), MOVED)
def test_an_old_path_warns_once_and_gives_the_new_object(old, name, new):
    module = importlib.import_module(old)
    value, deprecations = read_with_warnings(module, name)
    assert len(deprecations) == 1, [str(w.message) for w in deprecations]
    assert f"{new}.{name}" in str(deprecations[0].message)
    assert deprecations[0].filename == __file__
    assert value is getattr(importlib.import_module(new), name)


def test_from_import_of_an_old_package_warns_once_at_the_caller():
    # The import system asks the old package first (hasattr): only the
    # caller's own read warns.
    namespace = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(
            compile("from kdpemb.models.backends import current\n", "<caller>", "exec"),
            namespace,
        )
    deprecations = [w for w in caught if w.category is DeprecationWarning]
    assert [w.filename for w in deprecations] == ["<caller>"], deprecations
    from kdpemb.models._shared import backends

    assert namespace["current"] is backends.current


def test_an_old_path_refuses_a_name_the_new_module_lacks():
    module = importlib.import_module("kdpemb.models.dp_model")
    with pytest.raises(AttributeError, match="no_such_name"):
        module.no_such_name  # noqa: B018
    with pytest.raises(AttributeError, match="no_such_name"):
        importlib.import_module("kdpemb.datasets.user_shards").no_such_name  # noqa: B018


def test_every_old_path_is_served_by_the_finder_and_every_new_path_exists():
    for old, new in MOVED_MODULES.items():
        assert importlib.util.find_spec(new) is not None, new
        # No file is left at an old path (it would hide the redirect).
        assert isinstance(importlib.util.find_spec(old).loader, OldPathFinder), old


def test_patching_an_old_path_is_refused_with_the_module_that_runs(monkeypatch):
    # Setting a name on an old path would change nothing that runs.
    old = importlib.import_module("kdpemb.models.privacy_plan")
    new = importlib.import_module("kdpemb.models._shared.privacy_plan")
    rtol = new.PLAN_RTOL
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(AttributeError, match=r"kdpemb\.models\._shared\."):
            monkeypatch.setattr(old, "PLAN_RTOL", 0.5)
    assert rtol == new.PLAN_RTOL


def test_a_star_import_of_an_old_path_gives_the_new_public_names():
    namespace = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        exec("from kdpemb.models.dp_model import *", namespace)
    from kdpemb.models.dp_sgd import DPModel

    assert namespace["DPModel"] is DPModel
