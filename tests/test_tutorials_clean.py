"""The tutorial notebooks are kept without outputs, and open as the docs say.

They are executed (at their small size) by `make tutorials`
(docs/tutorials/run_tutorials.py), not here; this test only reads their JSON.
Strip outputs before committing: Jupyter's "Clear All Outputs", or
`jupyter nbconvert --clear-output --inplace docs/tutorials/*.ipynb`.
"""

import json
import pathlib
import re
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TUTORIALS = ROOT / "docs" / "tutorials"
NOTEBOOKS = sorted(TUTORIALS.glob("*.ipynb"))
# The repository's address is written once, in pyproject.toml; the badges
# and the install cells must use it.
URL = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"][
    "Repository"
]
GITHUB = URL.removeprefix("https://github.com/")
COLAB = f"https://colab.research.google.com/github/{GITHUB}/blob/main/docs/tutorials/"
REPOSITORY = f'"git+{URL}"'


def load(path):
    notebook = json.loads(path.read_text(encoding="utf-8"))
    assert notebook["nbformat"] == 4
    return notebook


def source(cell):
    text = cell["source"]
    return text if isinstance(text, str) else "".join(text)


def test_there_are_tutorials():
    assert [path.stem for path in NOTEBOOKS] == [
        "dp_fedemb",
        "dp_sgd",
        "last_layer_dp",
        "privacy_accounting",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_outputs_are_stripped(path):
    for number, cell in enumerate(load(path)["cells"]):
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [], f"cell {number} has outputs"
            assert cell.get("execution_count") is None, f"cell {number} was run"
        # Run timings (Jupyter, nbclient) and Colab's ids live here.
        assert cell.get("metadata", {}) == {}, f"cell {number} has metadata"
        assert "attachments" not in cell, f"cell {number} has attachments"
    assert "widgets" not in load(path)["metadata"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_opens_in_colab_and_installs_kdpemb_first(path):
    cells = load(path)["cells"]
    assert cells[0]["cell_type"] == "markdown"
    assert f"]({COLAB}{path.name})" in source(cells[0]), "the Colab badge's link"
    first_code = next(source(cell) for cell in cells if cell["cell_type"] == "code")
    assert REPOSITORY in first_code and "KDPEMB_INSTALL_SOURCE" in first_code
    assert re.search(r"^%pip install .*\{KDPEMB_SOURCE\}", first_code, flags=re.M)
    setup = [source(cell) for cell in cells if cell["cell_type"] == "code"][1]
    assert 'os.environ.get("KDPEMB_TUTORIAL_SMALL", "0") == "1"' in setup
    backend = setup.index('os.environ.setdefault("KERAS_BACKEND", "jax")')
    imports = re.finditer(r"^(import|from) (keras|kdpemb)", setup, flags=re.M)
    imports = [match.start() for match in imports]
    assert all(backend < position for position in imports), "backend before keras"
