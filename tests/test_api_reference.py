"""Every public name is in the API reference, and its docstring has an example.

The reference (docs/reference/*.md) is a list of `::: dotted.name`
entries that mkdocstrings renders; this reads them without building the
site. A name is public when it is in the `__all__` of a module of kdpemb
whose dotted path has no part starting with "_". It counts as documented
when an entry names the same object, under any path (a package's
re-export or the module that defines it).
"""

import ast
import doctest
import importlib
import inspect
import itertools
import pathlib
import pkgutil
import re
import types

import pytest

import kdpemb

ROOT = pathlib.Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference"
ENTRY = re.compile(r"^::: *([\w.]+) *$", re.M)
# An "Example:" or "Examples:" line followed by an indented or fenced block.
EXAMPLE_SECTION = re.compile(r"^( *)Examples?:\n(?:\s*\n)*(?:\1 +\S|\1```)", re.M)


def public_modules():
    names = [
        name
        for _, name, _ in pkgutil.walk_packages(kdpemb.__path__, "kdpemb.")
        if not any(part.startswith("_") for part in name.split("."))
    ]
    return ["kdpemb", *sorted(names)]


def reference_entries():
    return {
        (page.name, identifier)
        for page in sorted(REFERENCE.glob("*.md"))
        for identifier in ENTRY.findall(page.read_text())
    }


def resolve(identifier):
    """The object of a dotted name: the longest importable module, then attributes.

    A function re-exported by a package over its submodule of the same name
    (`kdpemb.datasets.simulate_users`) is reached through the submodule,
    as mkdocstrings reads it: `kdpemb.datasets.simulate_users.simulate_users`.
    """
    parts = identifier.split(".")
    for end in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:end]))
        except ModuleNotFoundError:
            continue
        for part in parts[end:]:
            obj = getattr(obj, part)
        return obj
    raise ModuleNotFoundError(identifier)


def public_names():
    """(qualified name, object) for every name of every public `__all__`."""
    names = []
    for module_name in public_modules():
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", ()):
            names.append((f"{module_name}.{name}", getattr(module, name)))
    return names


def has_docstring_of_its_own(obj):
    return isinstance(obj, types.ModuleType | type) or inspect.isroutine(obj)


def attribute_docstring(qualified_name, value):
    """The string literal after the module-level assignment of a constant.

    mkdocstrings shows it as the constant's docstring; Python keeps none.
    """
    name = qualified_name.rsplit(".", 1)[1]
    for module_name in [*public_modules(), "kdpemb.version"]:
        module = importlib.import_module(module_name)
        if vars(module).get(name) is not value or not module.__file__:
            continue
        body = ast.parse(pathlib.Path(module.__file__).read_text()).body
        for statement, following in itertools.pairwise(body):
            targets = getattr(statement, "targets", [getattr(statement, "target", 0)])
            if (
                any(isinstance(t, ast.Name) and t.id == name for t in targets)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                return inspect.cleandoc(following.value.value), module
    return None, None


def docstring_of(qualified_name, obj):
    if has_docstring_of_its_own(obj):
        return obj.__doc__, None
    return attribute_docstring(qualified_name, obj)


def has_example(docstring):
    return bool(docstring) and (
        ">>>" in docstring or EXAMPLE_SECTION.search(docstring) is not None
    )


def test_every_reference_entry_names_an_object():
    unresolved = []
    for page, identifier in sorted(reference_entries()):
        try:
            resolve(identifier)
        except (ModuleNotFoundError, AttributeError):
            unresolved.append(f"docs/reference/{page}: ::: {identifier}")
    assert unresolved == []


def test_every_public_name_is_in_the_reference():
    documented = [resolve(identifier) for _, identifier in reference_entries()]
    missing = [
        name
        for name, obj in public_names()
        if not any(obj is entry for entry in documented)
    ]
    assert not missing, (
        f"Not in the API reference: {missing}. Add a `::: <name>` line for each "
        "to the page of its package in docs/reference/ (and a new page to "
        "mkdocs.yml's nav)."
    )


def test_every_public_name_has_a_docstring_example():
    without = [
        name
        for name, obj in public_names()
        if not has_example(docstring_of(name, obj)[0])
    ]
    assert not without, (
        f"No example in the docstring: {without}. Give each a short runnable "
        "example (`>>>` lines after 'Example:'); tests/test_docs.py runs it."
    )


@pytest.mark.parametrize(
    "name",
    sorted(
        {
            name
            for name, obj in public_names()
            if not has_docstring_of_its_own(obj)
            and ">>>" in (attribute_docstring(name, obj)[0] or "")
        }
    ),
)
def test_constant_docstring_examples_run(name):
    """doctest does not see a constant's docstring; run its example here."""
    docstring, module = attribute_docstring(name, resolve(name))
    test = doctest.DocTestParser().get_doctest(
        docstring, dict(vars(module)), name, module.__file__, 0
    )
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(test)
    assert runner.summarize(verbose=False).failed == 0
