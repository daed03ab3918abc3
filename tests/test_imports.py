"""tfdist's modules import one another without circles, and its layers import downwards only.

A circle works only while every module in it imports the others lazily or late enough, and
breaks as soon as one of them moves an import to the top; it also means the modules cannot
be understood apart. The walk reads the source (no TensorFlow import): every `import tfdist...`
and `from tfdist... import` anywhere in a module counts, at module level, inside functions and
under `if TYPE_CHECKING:` alike. Importing `tfdist.a.b` also runs the package `tfdist.a`'s
`__init__`, so that counts as an import of `tfdist.a` too (unless the importer is inside it).
The packages' public-API tables name modules as strings and import them on first use, so
they are no import.

The layers, top down: the binary's application (tfdist.app), the facade (tfdist.api), the
parallel modes (tfdist.parallel), the engine (tfdist.training), and the rest of tfdist.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

PACKAGE = "tfdist"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

# Circles that are known and have an owner. Each entry is the set of modules of one circle.
KNOWN_CIRCLES: set[frozenset[str]] = set()


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package under `root`, by dotted name."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imported_modules(name: str, path: Path, known: Iterable[str]) -> set[str]:
    """The package's modules that module `name` (at `path`) imports anywhere in its source."""
    known = set(known)
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(_nearest_module(alias.name, known) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module, node.level, name, is_package=is_package)
            for alias in node.names:
                # `from tfdist import signals` imports the module tfdist.signals; `from
                # tfdist.cluster import ClusterInfo` imports tfdist.cluster.
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in known else _nearest_module(base, known))
    found.discard(None)
    # Importing a module runs its packages' __init__ first: those the importer is not inside.
    found |= {package for module in found for package in _packages(module)} - _packages(name)
    found.discard(name)
    return found


def _packages(module: str) -> set[str]:
    """The packages above `module` ("tfdist.a.b" -> {"tfdist", "tfdist.a"}), and itself."""
    parts = module.split(".")
    return {".".join(parts[:end]) for end in range(1, len(parts) + 1)}


def _absolute(module: str | None, level: int, importer: str, *, is_package: bool) -> str:
    if level == 0:
        return module or ""
    anchor = importer.split(".")
    anchor = anchor[: len(anchor) - level + int(is_package)]
    return ".".join([*anchor, module] if module else anchor)


def _nearest_module(dotted: str, known: set[str]) -> str | None:
    # `import tfdist.data.datasets` names a module; a name past one (an attribute) falls back
    # to the longest prefix that is a module.
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in known:
            return candidate
    return None


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    modules = module_files(root, package)
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def circles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """One circle (a list of modules, the first repeated at the end) per strongly connected
    group of modules, in a stable order."""
    found = []
    for group in _strongly_connected(graph):
        if len(group) > 1 or next(iter(group)) in graph[next(iter(group))]:
            found.append(_circle_through(min(group), graph, group))
    return sorted(found)


def _strongly_connected(graph: Mapping[str, set[str]]) -> list[set[str]]:
    # Tarjan's algorithm, iterative so a deep package cannot hit the recursion limit.
    index, low, on_stack, stack, groups = {}, {}, set(), [], []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for succ in successors:
                if succ not in graph:
                    continue
                if succ not in index:
                    index[succ] = low[succ] = counter
                    counter += 1
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    advanced = True
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                groups.append(group)
    return groups


def _circle_through(start: str, graph: Mapping[str, set[str]], group: set[str]) -> list[str]:
    # The shortest path from `start` back to itself inside its group: a circle to name.
    previous = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(graph[node] & group):
                if succ == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if succ not in previous:
                    previous[succ] = node
                    following.append(succ)
        frontier = following
    raise AssertionError(f"{start} is in a strongly connected group but on no circle")


def test_tfdist_has_no_import_circles():
    graph = import_graph(ROOT, PACKAGE)
    assert "tfdist.strategies" in graph and graph["tfdist"], "the walk found no tfdist modules"
    unknown = [c for c in circles(graph) if frozenset(c) not in KNOWN_CIRCLES]
    assert not unknown, "tfdist's modules import one another in circles:\n" + "\n".join(
        " -> ".join(c) for c in unknown
    )


def package_graph(graph: Mapping[str, set[str]], root: Path = ROOT) -> dict[str, set[str]]:
    """The import graph between tfdist's packages (tfdist.data, tfdist.strategies, ...) and
    its top-level modules (tfdist.cluster, ...): each module counted as its package."""

    def unit(module: str) -> str:
        parts = module.split(".")
        if len(parts) > 1 and (root / parts[1]).is_dir():
            return ".".join(parts[:2])
        return module

    packages: dict[str, set[str]] = {}
    for module, imported in graph.items():
        if module == PACKAGE:
            continue  # the facade's lazy table imports nothing
        own = unit(module)
        packages.setdefault(own, set()).update(
            unit(other) for other in imported if unit(other) not in (own, PACKAGE)
        )
    return packages


def test_tfdist_s_packages_import_one_another_without_circles():
    # A package in a circle with another cannot be read, tested or moved apart from it.
    packages = package_graph(import_graph(ROOT, PACKAGE))
    assert {"tfdist.strategies", "tfdist.collective", "tfdist.layout"} <= set(packages)
    found = circles(packages)
    assert not found, "tfdist's packages import one another in circles:\n" + "\n".join(
        " -> ".join(c) for c in found
    )


def test_the_parallel_modes_packages_import_one_another_without_circles():
    # Inside tfdist.parallel, its packages (pipeline/, zero/, tensor/) and its modules as
    # rooms of their own: a feature's package in a circle with another cannot move apart.
    parallel = ROOT / "parallel"

    def unit(module: str) -> str:
        parts = module.split(".")
        if parts[:2] == [PACKAGE, "parallel"] and len(parts) > 3 and (parallel / parts[2]).is_dir():
            return ".".join(parts[:3])
        return module

    graph: dict[str, set[str]] = {}
    for module, imported in import_graph(ROOT, PACKAGE).items():
        if module.startswith(f"{PACKAGE}.parallel."):
            graph.setdefault(unit(module), set()).update(
                unit(m)
                for m in imported
                if m.startswith(f"{PACKAGE}.parallel.") and unit(m) != unit(module)
            )
    assert {"tfdist.parallel.pipeline", "tfdist.parallel.zero", "tfdist.parallel.tensor"} <= set(
        graph
    )
    found = circles(graph)
    assert not found, "tfdist.parallel's packages import one another in circles:\n" + "\n".join(
        " -> ".join(c) for c in found
    )


def absolute_imports(root: Path) -> list[tuple[str, str]]:
    """("file:line", the module named) for each absolute import of every file under root."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and node.level == 0
                else []
            )
            found += [(f"{path.relative_to(root.parent)}:{node.lineno}", name) for name in names]
    return found


@pytest.mark.parametrize(
    "package, users",
    [
        # experiments/ and tools/ are tfdist's users: the library works without them.
        ("tfdist", ("experiments", "tools", "tests")),
        # The binaries and the tools (the benchmarks, the shared models users bring) run
        # from a checkout without the test suite: the tests import them, not the reverse.
        ("tools", ("tests",)),
        ("experiments", ("tests",)),
    ],
)
def test_nothing_imports_what_is_built_on_it(package, users):
    found = [
        f"{where}: {name}"
        for where, name in absolute_imports(ROOT.parent / package)
        if name.split(".")[0] in users
    ]
    assert not found, f"{package} imports its users:\n" + "\n".join(found)


# Each layer imports only layers below it (lower number). A module not listed is in the
# base layer (0): cluster, strategies, data, collective, compat, ... A package and its
# modules share a layer.
LAYERS = {
    "tfdist.training": 1,
    "tfdist.parallel": 2,
    "tfdist.api": 3,
    "tfdist.app": 4,
    "tfdist.ray": 4,  # an engine users scale out on: a client of tfdist.fit, like the binary
}


def layer_of(module: str) -> int:
    found = [LAYERS[p] for p in sorted(_packages(module)) if p in LAYERS]
    return found[-1] if found else 0


def test_layers_import_downwards_only():
    graph = import_graph(ROOT, PACKAGE)
    upwards = sorted(
        f"{module} (layer {layer_of(module)}) imports {imported} (layer {layer_of(imported)})"
        for module, imported_set in graph.items()
        for imported in imported_set
        if module != PACKAGE and layer_of(imported) > layer_of(module)
    )
    assert {layer_of(m) for m in graph} == {0, 1, 2, 3, 4}, "a layer has no modules"
    assert not upwards, "imports run back up the layers:\n" + "\n".join(upwards)


def test_the_engine_package_imports_nothing_eagerly():
    # Importing any tfdist.training.X runs tfdist/training/__init__.py first: it must not
    # pull the engine (let alone what sits above it) in with it.
    graph = import_graph(ROOT, PACKAGE)
    for package in ("tfdist.training", "tfdist.parallel", "tfdist.app"):
        assert graph[package] <= {"tfdist", "tfdist.lazy"}, (
            f"{package}/__init__.py imports {graph[package]}"
        )


def _write_package(root: Path, files: Mapping[str, str]) -> Path:
    for relative, text in files.items():
        path = root / "pkg" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


@pytest.mark.parametrize(
    "files, expected",
    [
        (  # module level, one way round; a function-level import the other
            {
                "__init__.py": "",
                "a.py": "from pkg.b import thing\n",
                "b.py": "def f():\n    from pkg import a\n",
            },
            [["pkg.a", "pkg.b", "pkg.a"]],
        ),
        (  # TYPE_CHECKING and relative imports count too, through a subpackage
            {
                "__init__.py": "",
                "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                "    from .sub.c import C\n",
                "sub/__init__.py": "",
                "sub/c.py": "import pkg.a\n",
            },
            [["pkg.a", "pkg.sub.c", "pkg.a"]],
        ),
        (  # a lazy table of module names is no import; neither is a sibling's attribute
            {
                "__init__.py": "_EXPORTS = {'x': 'pkg.a'}\n",
                "a.py": "import pkg\nfrom pkg.b import b_name\n",
                "b.py": "VALUE = 1\nb_name = 2\n",
            },
            [],
        ),
        (  # importing pkg.sub.c runs pkg/sub/__init__.py, which imports back
            {
                "__init__.py": "",
                "a.py": "from pkg.sub.c import C\n",
                "sub/__init__.py": "from pkg.sub.d import D\n",
                "sub/c.py": "C = 1\n",
                "sub/d.py": "from pkg.a import thing\n",
            },
            [["pkg.a", "pkg.sub", "pkg.sub.d", "pkg.a"]],
        ),
    ],
    ids=["function_level", "type_checking_relative", "no_circle", "through_a_package_init"],
)
def test_the_walk_finds_circles(tmp_path, files, expected):
    package = _write_package(tmp_path, files)
    assert circles(import_graph(package, "pkg")) == expected
