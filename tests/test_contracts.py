"""tfdist's classes extend one another only through interfaces, and the engine's is narrow.

A class of one package that subclasses a working class of another (a pipeline's runner built
on the synchronous one) ties the two together through every private detail of the base: a
change there breaks the other package without a word. The walk reads the source (no
TensorFlow import) and allows a base of another package only where that base is written to
be extended: an abstract interface (`abc.ABC`, a `Protocol`), a published extension point
(`EXTENSION_POINTS`), or an error class. Within a package, a class may build on another, but
no class overrides an underscored method that another module defines: such a method is the
other module's detail, not a hook (a hook has a public name).

The engine's contract (tfdist.training.engine.Engine) has at most ten members.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

from tests.test_imports import PACKAGE, ROOT, module_files

pytestmark = pytest.mark.fast

# Concrete classes written to be subclassed across packages: users' own hooks build on
# StepHook, tfdist's ring all-reduce on TensorFlow's CrossDeviceOps (compat's shim of it), and
# every error of tfdist derives from TfdistError.
EXTENSION_POINTS = {
    ("tfdist.training.hooks", "StepHook"),
    ("tfdist.compat", "CrossDeviceOps"),
    ("tfdist.errors", "TfdistError"),
    ("tfdist.errors", "FitError"),
    ("tfdist.storage", "StorageError"),
}
ENGINE = ("tfdist.training.engine", "Engine")
ENGINE_MEMBERS = 10


@functools.cache
def tfdist_walk() -> Walk:
    return Walk(ROOT, PACKAGE)


class Walk:
    """The classes of a package's source, with their bases resolved to (module, class)."""

    def __init__(self, root: Path, package: str):
        self.modules = module_files(root, package)
        self.classes: dict[tuple[str, str], ast.ClassDef] = {}
        self.names: dict[str, dict[str, tuple[str, str]]] = {}  # module -> name -> target
        for module, path in self.modules.items():
            tree = ast.parse(path.read_text(), filename=str(path))
            self.names[module] = self._imports(module, path, tree)
            for node in tree.body:
                if isinstance(node, ast.ClassDef):
                    self.classes[module, node.name] = node
                    self.names[module][node.name] = (module, node.name)

    def _imports(self, module: str, path: Path, tree: ast.Module) -> dict[str, tuple[str, str]]:
        names = {}
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")
                    parent = parent[: len(parent) - node.level + 1]
                    base = ".".join([*parent, *([base] if base else [])])
                for alias in node.names:
                    names[alias.asname or alias.name] = (base, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        names[alias.asname] = (alias.name, "")
        return names

    def resolve(self, module: str, base: ast.expr) -> tuple[str, str] | None:
        """(module, class) a base expression names, where it is a class of the package."""
        if isinstance(base, ast.Subscript):  # Generic[T], Protocol[T]
            base = base.value
        if isinstance(base, ast.Name):
            target = self.names[module].get(base.id)
        elif isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name):
            owner = self.names[module].get(base.value.id)
            target = None if owner is None else (".".join(filter(None, owner)), base.attr)
        else:
            target = None
        while target is not None and target not in self.classes:
            # A name re-exported by a package's __init__: follow it there.
            module_of, name = target
            following = self.names.get(module_of, {}).get(name)
            if following is None or following == target:
                return None
            target = following
        return target

    def bases(self, cls: tuple[str, str]) -> list[tuple[str, str]]:
        return [
            b for b in (self.resolve(cls[0], e) for e in self.classes[cls].bases) if b is not None
        ]

    def ancestors(self, cls: tuple[str, str]) -> list[tuple[str, str]]:
        seen, todo = [], self.bases(cls)
        while todo:
            b = todo.pop(0)
            if b not in seen:
                seen.append(b)
                todo.extend(self.bases(b))
        return seen

    def is_interface(self, cls: tuple[str, str]) -> bool:
        """An abstract class (an ABC, or one that leaves a method abstract) or a Protocol."""
        node = self.classes[cls]
        written = {ast.unparse(b).partition("[")[0] for b in node.bases}
        abstract = any(
            ast.unparse(d) in {"abc.abstractmethod", "abstractmethod"}
            for f in node.body
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            for d in f.decorator_list
        )
        return abstract or bool(written & {"abc.ABC", "ABC", "Protocol"})

    def methods(self, cls: tuple[str, str]) -> set[str]:
        return {
            n.name
            for n in self.classes[cls].body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        }

    def members(self, cls: tuple[str, str]) -> set[str]:
        found = self.methods(cls)
        for node in self.classes[cls].body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                found.add(node.target.id)
            elif isinstance(node, ast.Assign):
                found.update(t.id for t in node.targets if isinstance(t, ast.Name))
        return found


def _package(module: str) -> str:
    return module.rpartition(".")[0]


def subclasses_across_packages(walk: Walk) -> list[str]:
    found = []
    for cls in walk.classes:
        for base in walk.bases(cls):
            if _package(base[0]) == _package(cls[0]):
                continue
            if base in EXTENSION_POINTS or walk.is_interface(base):
                continue
            if any(a in EXTENSION_POINTS for a in walk.ancestors(base)):
                continue  # an error class: TfdistError's family
            found.append(f"{cls[0]}.{cls[1]} subclasses {base[0]}.{base[1]}")
    return found


def private_overrides(walk: Walk) -> list[str]:
    found = []
    for cls in walk.classes:
        own = {m for m in walk.methods(cls) if m.startswith("_") and not m.startswith("__")}
        for ancestor in walk.ancestors(cls):
            if ancestor[0] == cls[0]:
                continue
            for name in sorted(own & walk.methods(ancestor)):
                found.append(f"{cls[0]}.{cls[1]}.{name} overrides {ancestor[0]}.{ancestor[1]}")
    return found


def test_no_class_builds_on_a_working_class_of_another_package():
    assert subclasses_across_packages(tfdist_walk()) == []


def test_no_class_overrides_another_module_s_underscored_method():
    assert private_overrides(tfdist_walk()) == []


def test_the_engine_s_contract_has_at_most_ten_members():
    walk = tfdist_walk()
    members = walk.members(ENGINE) - {"__init__"}
    assert len(members) <= ENGINE_MEMBERS, sorted(members)
    assert walk.is_interface(ENGINE)


def _write(root: Path, files: dict[str, str]) -> Path:
    package = root / "pkg"
    for name, text in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for directory in [package, *package.rglob("*")]:
        if directory.is_dir() and not (directory / "__init__.py").exists():
            (directory / "__init__.py").write_text("")
    return package


def test_the_walk_finds_what_it_forbids(tmp_path):
    root = _write(
        tmp_path,
        {
            "a/base.py": (
                "import abc\n"
                "class Working:\n    def _detail(self): pass\n"
                "class Interface(abc.ABC):\n    def run(self): pass\n"
            ),
            "a/near.py": (
                "from pkg.a.base import Working\n"
                "class Near(Working):\n    def _detail(self): pass\n"
            ),
            "b/far.py": (
                "from pkg.a import base\nfrom pkg.a.base import Interface\n"
                "class Far(base.Working): pass\n"
                "class Fine(Interface):\n    def run(self): pass\n"
            ),
        },
    )
    walk = Walk(root, "pkg")
    assert subclasses_across_packages(walk) == ["pkg.b.far.Far subclasses pkg.a.base.Working"]
    assert private_overrides(walk) == ["pkg.a.near.Near._detail overrides pkg.a.base.Working"]
