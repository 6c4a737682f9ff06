"""The package's layout, read from its source (ast): what imports what.

- no import circle between kdpemb's modules (lazy imports inside
  functions count: a circle is a circle whenever it closes);
- no module imports another module's underscore name (a package-private
  module such as `kdpemb._validation` may be imported; its names are
  public to the package);
- no module above 800 lines, no class above 500;
- `kdpemb.datasets` and `kdpemb.privacy` load no Keras and no backend.
"""

import ast
import json
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "kdpemb"
MAX_MODULE_LINES = 800
MAX_CLASS_LINES = 500


def module_name(path):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def resolve(name, node):
    """The absolute module of an `ImportFrom` in module `name`."""
    if not node.level:
        return node.module
    base = name.split(".")
    if MODULES[name].name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(name):
    """`(module, imported name or None, line)` for every import in `name`,
    at any depth (functions included)."""
    found = []
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = resolve(name, node)
            for alias in node.names:
                found.append((module, alias.name, node.lineno))
    return found


def internal_target(module, imported):
    """The kdpemb module an import depends on (`from kdpemb.x import y` is
    module `kdpemb.x.y` when that is a module), or None."""
    if not module or not module.startswith("kdpemb"):
        return None
    if imported and f"{module}.{imported}" in MODULES:
        return f"{module}.{imported}"
    return module if module in MODULES else None


def graph():
    edges = {}
    for name in MODULES:
        targets = set()
        for module, imported, _ in imports(name):
            target = internal_target(module, imported)
            if target and target != name:
                targets.add(target)
        edges[name] = targets
    return edges


def package_edges(edges):
    """A module's import also runs its packages' `__init__`s: an edge to
    `a.b.c` is an edge to `a.b` and `a`, except from inside that package
    (an `__init__` that imports its own submodules is no circle)."""
    full = {}
    for name, targets in edges.items():
        extended = set(targets)
        for target in targets:
            parts = target.split(".")
            for k in range(1, len(parts)):
                parent = ".".join(parts[:k])
                if parent in MODULES and not (
                    name == parent or name.startswith(parent + ".")
                ):
                    extended.add(parent)
        full[name] = extended
    return full


def find_cycles(edges):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []
    counter = [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(edges):
        if node not in index:
            visit(node)
    return cycles


def test_the_cycle_finder_finds_a_circle_and_the_package_rule():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
        ["a", "b", "c"]
    ]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_is_in_an_import_circle():
    cycles = find_cycles(package_edges(graph()))
    assert cycles == [], "\n".join(" <-> ".join(c) for c in cycles)


def test_no_module_imports_another_modules_underscore_name():
    found = []
    for name in MODULES:
        for module, imported, line in imports(name):
            if not module or not module.startswith("kdpemb"):
                continue
            private = imported and imported.startswith("_") and imported[1] != "_"
            # A package-private module (`_validation`) is fine; its names are not.
            if private and f"{module}.{imported}" not in MODULES:
                found.append(f"{name}:{line} imports {module}.{imported}")
        # `other_module._name` read off an imported kdpemb module.
        aliases = {}
        for node in ast.walk(TREES[name]):
            if isinstance(node, ast.ImportFrom):
                module = resolve(name, node)
                for alias in node.names:
                    target = internal_target(module, alias.name)
                    if target and target == f"{module}.{alias.name}":
                        aliases[alias.asname or alias.name] = target
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("kdpemb") and alias.asname:
                        aliases[alias.asname] = alias.name
        for node in ast.walk(TREES[name]):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and aliases[node.value.id] != name
            ):
                found.append(
                    f"{name}:{node.lineno} reads {aliases[node.value.id]}.{node.attr}"
                )
    assert found == [], "\n".join(found)


def test_no_module_above_800_lines_and_no_class_above_500():
    long_modules = {
        name: count
        for name, path in MODULES.items()
        if (count := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    long_classes = {
        f"{name}.{node.name}": node.end_lineno - node.lineno + 1
        for name, tree in TREES.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES
    }
    assert long_modules == {}, long_modules
    assert long_classes == {}, long_classes


USE_DATASETS = """
import json, sys, tempfile, os
import numpy as np
import kdpemb.datasets
from kdpemb.datasets import UserShards, write_user_shards
images = np.zeros((6, 4, 4, 1), "uint8")
labels, users = np.arange(6) % 3, np.arange(6) % 2
target = os.path.join(tempfile.mkdtemp(), "shards")
write_user_shards(target, images, labels, users)
assert len(UserShards(target).labels) == 6
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
"""

USE_PRIVACY = """
import json, sys
import kdpemb.privacy
from kdpemb import privacy
mechanism = privacy.dp_sgd(1.0, num_examples=1000, batch_size=10)
privacy.epsilon(mechanism, 10, 1e-5)
privacy.Schedule.virtual_clients(num_users=100, clients_per_round=10)
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
"""


@pytest.mark.parametrize(
    "code", [USE_DATASETS, USE_PRIVACY], ids=["kdpemb.datasets", "kdpemb.privacy"]
)
def test_the_keras_free_packages_load_no_keras(code):
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True
    )  # No timeout: the child computes a little and exits; it waits on nothing.
    assert result.returncode == 0, result.stderr
    loaded = set(json.loads(result.stdout.strip().splitlines()[-1]))
    assert loaded & {"keras", "tensorflow", "jax", "torch"} == set()
