"""The strategies' names are spelled once, in tfdist/strategies/kinds.py: the library and
the binaries name a strategy through its constants, so a new strategy, or a renamed one, is
one edit there (and its builder and runner).

The walk reads the source (no import): a string constant in code that equals a strategy's
name counts; docstrings, comments and messages that name a strategy in prose do not.
tools/ is left out: its scripts build strategies by name as a user's script does. 'tpu' is
left out too, being also the option and flag that name a TPU's address, and 'auto' and
'default', which are words of their own in many places.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tfdist import strategy_kinds as kinds

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]
SPELLED = set(kinds.NAMES) - {kinds.TPU}


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def stray_names(paths, root: Path = ROOT) -> list[str]:
    """'path:line: name' for each strategy name spelled in code in `paths`."""
    found = []
    for path in paths:
        tree = ast.parse(path.read_text(), filename=str(path))
        docstrings = _docstrings(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and node.value in SPELLED
                and id(node) not in docstrings
            ):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {node.value}")
    return sorted(found)


def test_no_file_outside_strategies_and_the_names_spells_a_strategy_name():
    paths = [
        path
        for folder in ("tfdist", "experiments")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if (ROOT / "tfdist" / "strategies") not in path.parents and path.name != "strategy_kinds.py"
    ]
    assert len(paths) > 100
    assert stray_names(paths) == []


def test_the_walk_finds_a_stray_name(tmp_path):
    (tmp_path / "mode.py").write_text(
        '"""Trains under parameter_server."""\nif kind == "parameter_server":\n    pass\n'
    )
    assert stray_names([tmp_path / "mode.py"], root=tmp_path) == ["mode.py:2: parameter_server"]


def test_the_names_are_the_builders_and_the_runners():
    import tfdist
    from tfdist.training.runners import RUNNERS

    assert set(tfdist.strategy_names()) == {kinds.AUTO, *kinds.NAMES, *kinds.ALIASES}
    assert set(kinds.NAMES) | {kinds.DEFAULT} <= set(RUNNERS)
