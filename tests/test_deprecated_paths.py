"""Old import paths of the modules that moved keep working for one release:
each warns `DeprecationWarning` once, at the caller, and gives the new
object."""

import importlib
import warnings

import pytest

SHARDS = "kdpemb.datasets.user_shards"
MOVED = [
    ("kdpemb.data.inputs", "model_input_shape", "kdpemb.datasets.inputs"),
    ("kdpemb.data.sources", "open_source", "kdpemb.datasets.sources"),
    ("kdpemb.data.assignment", "mix64", "kdpemb.datasets.user_hash"),
    ("kdpemb.privacy.mechanisms", "dp_sgd", "kdpemb.privacy.mechanism_builders"),
    ("kdpemb.privacy.mechanisms", "GaussianRelease", "kdpemb.privacy.gaussian_release"),
    (SHARDS, "UserShards", "kdpemb.datasets.user_shards_reader"),
    (SHARDS, "write_user_shards", "kdpemb.datasets.user_shards_writer"),
]  # fmt: skip


@pytest.mark.parametrize(("old", "name", "new"), MOVED)
def test_an_old_path_warns_once_and_gives_the_new_object(old, name, new):
    module = importlib.import_module(old)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = getattr(module, name)
    deprecations = [w for w in caught if w.category is DeprecationWarning]
    assert len(deprecations) == 1, [str(w.message) for w in caught]
    assert new in str(deprecations[0].message)
    assert deprecations[0].filename == __file__
    assert value is getattr(importlib.import_module(new), name)
