"""Every docstring example and every Python block of the docs runs."""

import doctest
import importlib
import pathlib
import pkgutil
import re

import pytest

import kdpemb

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
MODULES = sorted(
    name
    for _, name, _ in pkgutil.walk_packages(kdpemb.__path__, "kdpemb.")
    if not name.endswith("__main__")
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.failed == 0


# A block that builds on the one before it on its page says so on its
# first line; every other block runs on its own, as a reader pastes it.
CONTINUATION = "# Continues the previous block."


def python_blocks(page):
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


def block_chains(blocks):
    """Blocks grouped into chains: a block and the continuations after it."""
    chains = []
    for block in blocks:
        if block.startswith(CONTINUATION):
            assert chains, f"the first block of a page cannot continue: {block[:80]}"
            chains[-1].append(block)
        else:
            chains.append([block])
    return chains


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_python_blocks_of_the_docs_run(page, tmp_path, monkeypatch):
    # Each chain in a fresh namespace: a block that uses a name from an
    # earlier block without saying it continues it fails here.
    monkeypatch.chdir(tmp_path)
    for chain in block_chains(python_blocks(page)):
        namespace = {}
        for block in chain:
            exec(compile(block, str(page), "exec"), namespace)


def test_a_block_that_uses_an_earlier_blocks_names_fails_unless_it_continues():
    blocks = ["x = 1\n", "print(x)\n"]
    chains = block_chains(blocks)
    assert chains == [["x = 1\n"], ["print(x)\n"]]
    with pytest.raises(NameError):
        exec(chains[1][0], {})
    assert block_chains(["x = 1\n", f"{CONTINUATION}\nprint(x)\n"]) == [
        ["x = 1\n", f"{CONTINUATION}\nprint(x)\n"]
    ]


@pytest.mark.parametrize(
    ("module", "page"),
    [
        ("privacy", "privacy.md"),
        ("errors", "privacy.md"),
        ("data", "data.md"),
        ("datasets", "data.md"),
        ("metrics", "evaluation.md"),
        ("plots", "evaluation.md"),
        ("models", ("fedemb.md", "last_layer.md", "dp_sgd.md")),
        ("features", "last_layer.md"),
        ("audit", "audit.md"),
    ],
)
def test_every_public_name_is_documented(module, page):
    pages = (page,) if isinstance(page, str) else page
    text = "\n".join((ROOT / "docs" / p).read_text() for p in pages)
    module = importlib.import_module(f"kdpemb.{module}")
    names = getattr(module, "__all__", [])
    assert names, "the module lists its public names in __all__"
    assert [name for name in names if name not in text] == []
