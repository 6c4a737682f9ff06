"""`import kdpemb` is cheap, adds no backend, and refuses unsupported backends.

Cheap is checked by what the import loads, not by a clock (a loaded machine
must not fail the suite): only kdpemb's own core and the standard library.
"""

import json
import os
import subprocess
import sys

import keras
import pytest

BACKEND_PACKAGES = ("tensorflow", "jax", "torch")


def run_python(code, backend=None, keras_home=None):
    env = dict(os.environ)
    if backend is None:
        env.pop("KERAS_BACKEND", None)
    else:
        env["KERAS_BACKEND"] = backend
    if keras_home is not None:
        env["KERAS_HOME"] = str(keras_home)
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
    )  # No timeout: the child imports, prints and exits; it waits on nothing.


IMPORT_COST = """
import json, sys
base = set(sys.modules)
import kdpemb
print(json.dumps(sorted(set(sys.modules) - base)))
"""

NEW_BACKEND_MODULES = """
import json, sys
import keras
base = set(sys.modules)
import kdpemb, kdpemb.callbacks, kdpemb.privacy, kdpemb.testing, kdpemb.cli
new = sorted(m for m in set(sys.modules) - base if m.split(".")[0] in PACKAGES)
print(json.dumps([keras.backend.backend(), new]))
"""


def last_json_line(result):
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_import_is_quick_and_loads_neither_keras_nor_a_backend():
    import kdpemb

    new = last_json_line(run_python(IMPORT_COST))
    packages = {name.split(".")[0] for name in new}
    assert packages & {"keras", *BACKEND_PACKAGES} == set()
    # Quick: nothing but the standard library and kdpemb's core; every
    # submodule (privacy, data, models, ...) loads on first use.
    assert packages - {"kdpemb"} <= set(sys.stdlib_module_names), sorted(packages)
    eager = {f"kdpemb.{name}" for name in kdpemb._SUBMODULES} & {
        ".".join(name.split(".")[:2]) for name in new
    }
    assert eager == set()


def test_the_full_api_imports_no_backend_beyond_what_keras_imports():
    # The backend of this run: `make test` runs the suite under each one.
    backend = keras.backend.backend()
    code = NEW_BACKEND_MODULES.replace("PACKAGES", repr(BACKEND_PACKAGES))
    active, new_backend_modules = last_json_line(run_python(code, backend))
    assert active == backend
    assert new_backend_modules == []


@pytest.mark.parametrize("backend", ["torch", "numpy"])
def test_unsupported_backends_get_an_error_naming_the_supported_ones(backend):
    result = run_python("import kdpemb", backend)
    assert result.returncode != 0
    assert "UnsupportedBackendError" in result.stderr
    assert f"set to use '{backend}'" in result.stderr
    assert "'tensorflow' and 'jax'" in result.stderr


def test_the_backend_in_keras_json_is_checked_too(tmp_path):
    (tmp_path / "keras.json").write_text(json.dumps({"backend": "torch"}))
    result = run_python("import kdpemb", backend=None, keras_home=tmp_path)
    assert "UnsupportedBackendError" in result.stderr
    assert "keras.json" in result.stderr


def test_version_is_exposed():
    import kdpemb

    assert kdpemb.__version__.count(".") == 2


def test_version_is_the_changelogs_newest_heading():
    # The version under development is the newest heading of CHANGELOG.md
    # ("## 0.2.0 (unreleased)"): a release bumps both or neither.
    import pathlib
    import re

    import kdpemb

    changelog = pathlib.Path(__file__).parents[1] / "CHANGELOG.md"
    newest = re.search(r"^## (\S+)", changelog.read_text(), re.MULTILINE)
    assert newest is not None
    assert kdpemb.__version__ == newest.group(1)


def test_models_are_reachable_from_the_top_level():
    import kdpemb
    import kdpemb.models

    assert {"DPModel", "FedEmbModel", "LastLayerDPClassifier"} <= set(kdpemb._MODELS)
    for name in kdpemb._MODELS:
        assert getattr(kdpemb, name) is getattr(kdpemb.models, name)
        assert name in dir(kdpemb)
    with pytest.raises(AttributeError, match="no attribute 'NotAModel'"):
        kdpemb.NotAModel  # noqa: B018
