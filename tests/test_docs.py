"""The documentation site (docs/, mkdocs.yml): every page in the nav, the Layout page names
the tree as it is, and every code block of the pages runs, or says why it cannot.

A code block runs as the reader would run it: the python blocks of a page one after the
other in one fresh interpreter (a later block may use what an earlier one defined), each
bash block on its own, both in an empty directory with this checkout on PYTHONPATH and the
interpreter's scripts (tfdist-launch, tfdist-plan, ...) on PATH; a json block must parse.
A block that cannot run here follows a comment `<!-- not-run: REASON -->`, REASON one of
NOT_RUN's keys; `text` blocks are printed output and never run. Where that output is
deterministic, the text block follows a comment `<!-- output -->` and must be exactly what
the python block before it printed.
"""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO, run_python

DOCS = REPO / "docs"

# Why a block may stay unrun, by the key its comment names.
NOT_RUN = {
    "installs": "creates a virtualenv and installs packages (CI runs the test command itself)",
    "trains": "starts worker processes and trains for tens of seconds or more; the output "
    "printed beside it is what it printed",
    "benchmark": "a benchmark or soak of minutes; its tables are on the benchmarks page",
    "hosts": "needs several hosts, a scheduler or a Ray cluster",
    "platform": "needs Kubernetes, a cloud platform or a TPU",
    "root": "changes the host's firewall (needs root)",
    "tests": "runs the test suite itself",
    "job": "runs in a task of a multi-worker or parameter-server job, which tfdist-launch "
    "starts (the guide gives the command)",
}
RUNS = {"python", "bash", "json"}
SHOWN = {"text", "toml", "yaml"}  # output, or a file's contents


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    code: str
    not_run: str | None
    checked: bool = False  # printed output, compared with what the block before prints

    def __str__(self) -> str:
        return f"{self.page}:{self.line} ({self.lang})"


FENCE = re.compile(
    r"^(?P<indent>[ ]*)```(?!`)(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
    re.S | re.M,
)
MARK = re.compile(r"<!--\s*not-run:\s*([\w-]+)\s*-->")
OUTPUT = re.compile(r"<!--\s*output\s*-->")


def pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip().splitlines()
        mark = MARK.search(before[-1]) if before else None
        found.append(
            Block(
                page=str(page.relative_to(DOCS)),
                line=text.count("\n", 0, m.start()) + 1,
                lang=m.group("lang"),
                code=textwrap.dedent(m.group("body")),
                not_run=mark.group(1) if mark else None,
                checked=bool(before and OUTPUT.search(before[-1])),
            )
        )
    return found


def all_blocks() -> list[Block]:
    return [b for page in pages() for b in blocks(page)]


# --- the fast checks: the site's shape ----------------------------------------------------------


@pytest.mark.fast
def test_every_page_is_in_the_nav_and_every_nav_entry_exists():
    nav = re.findall(r":\s*([\w/.-]+\.md)\s*$", (REPO / "mkdocs.yml").read_text(), flags=re.M)
    listed = set(nav)
    present = {str(p.relative_to(DOCS)) for p in pages()}
    assert listed - present == set(), "the nav names pages that do not exist"
    assert present - listed == set(), "pages that the nav leaves out"


@pytest.mark.fast
def test_the_site_builds_offline():
    config = (REPO / "mkdocs.yml").read_text()
    assert re.search(r"^\s+font: false\s*$", config, flags=re.M), "web fonts are fetched"
    assert "strict: true" in config


@pytest.mark.fast
def test_every_code_block_runs_or_says_why_not():
    bad = []
    for b in all_blocks():
        if b.lang not in RUNS | SHOWN:
            bad.append(f"{b}: give the fence a language ({', '.join(sorted(RUNS | SHOWN))})")
        elif b.not_run is not None and b.not_run not in NOT_RUN:
            bad.append(f"{b}: not-run reason {b.not_run!r} is not one of {sorted(NOT_RUN)}")
        elif b.not_run is not None and b.lang in SHOWN:
            bad.append(f"{b}: a {b.lang} block is never run; drop its not-run comment")
    assert not bad, "\n".join(bad)


@pytest.mark.fast
def test_the_getting_started_page_shows_the_readme_s_two_commands():
    from tests.test_readme import setup_commands

    page = (DOCS / "getting-started.md").read_text()
    for command in setup_commands():
        assert command in page


@pytest.mark.fast
def test_json_blocks_parse():
    for b in all_blocks():
        if b.lang == "json" and b.not_run is None:
            json.loads(b.code)


@pytest.mark.fast
def test_benchmark_tables_live_on_the_benchmarks_page():
    """A guide links to a table; its numbers are printed in one place only."""
    tables = re.compile(r"^\s*(\|---|-{20,}|\S+\s+\d+ +(plain|zero\d)\b)", re.M)
    for page in pages():
        if page.name == "benchmarks.md" or page.parent.name == "api":
            continue
        for b in blocks(page):
            assert not (b.lang == "text" and tables.search(b.code) and "bench" in b.code), b


# --- the Layout page names the tree as it is ----------------------------------------------------

# Packages whose every module the Layout names (the layers of tfdist.fit).
LISTED_IN_FULL = ("tfdist/app", "tfdist/api", "tfdist/parallel", "tfdist/training")


def layout_entries() -> dict[str, str]:
    """The Layout page's entries: path -> its description (continuation lines included)."""
    page = (DOCS / "develop" / "layout.md").read_text()
    block = re.search(r"```text\n(.*?)```", page, flags=re.S).group(1)
    entries: dict[str, str] = {}
    path = None
    for line in block.splitlines():
        if line and not line[0].isspace():
            path, _, text = line.partition(" ")
            entries[path] = text
        elif path is not None:
            entries[path] += " " + line.strip()
    return entries


@pytest.mark.fast
def test_the_layout_names_paths_that_exist_and_every_part_of_the_tree():
    entries = layout_entries()
    missing = [path for path in entries if not (REPO / path).exists()]
    assert not missing, f"the Layout page names paths that do not exist: {missing}"
    tfdist = REPO / "tfdist"
    parts = {
        f"tfdist/{p.name}/" if p.is_dir() else f"tfdist/{p.name}"
        for p in tfdist.iterdir()
        if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").exists()
    }
    unnamed = sorted(parts - set(entries))
    assert not unnamed, f"the Layout page leaves out {unnamed}"
    for top in ("experiments/", "tools/", "tests/", "docs/"):
        assert top in entries, top


@pytest.mark.fast
def test_the_layout_names_files_that_exist_and_every_module_of_the_layers():
    entries = layout_entries()
    for path, text in entries.items():
        root = REPO / path
        for name in re.findall(r"\b([a-z_]+\.py)\b", text):
            assert root.is_dir() and any(root.rglob(name)), f"{path}: no {name}"
    for package in LISTED_IN_FULL:
        text = entries[f"{package}/"]
        for p in sorted((REPO / package).iterdir()):
            if p.name.startswith("_") and p.name != "__main__.py":
                continue
            name = f"{p.name}/" if p.is_dir() else p.name
            if p.is_dir() and not (p / "__init__.py").exists():
                continue
            assert name in text, f"the Layout entry for {package}/ leaves out {name}"
    for folder in ("tools", "experiments"):
        for p in sorted((REPO / folder).glob("*.py")):
            if p.stem in ("__init__", "common"):
                continue
            assert re.search(rf"\b{p.stem}\b", entries[f"{folder}/"]), f"{folder}/{p.name}"


# --- the blocks run -----------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["TFDIST_DATA_DIR"] = env.get("TFDIST_DATA_DIR") or str(Path.home() / ".cache/tfdist")
    return env


def _run(args: list[str], cwd: Path, what: str) -> str:
    result = run_python(args, env=_env(), cwd=cwd, timeout=600)
    assert result.returncode == 0, (
        f"{what} failed (exit {result.returncode}):\n{result.stdout[-3000:]}\n"
        f"{result.stderr[-5000:]}"
    )
    return result.stdout


PYTHON_PAGES = sorted({b.page for b in all_blocks() if b.lang == "python" and b.not_run is None})
BASH_BLOCKS = [b for b in all_blocks() if b.lang == "bash" and b.not_run is None]


SEPARATOR = "--- tfdist docs: the next block's output ---"


@pytest.mark.parametrize("page", PYTHON_PAGES)
def test_a_page_s_python_blocks_run_in_order(page, tmp_path):
    found = blocks(DOCS / page)
    runnable = [b for b in found if b.lang == "python" and b.not_run is None]
    script = "\n\n".join(f"# --- {b}\nprint({SEPARATOR!r}, flush=True)\n{b.code}" for b in runnable)
    (tmp_path / "page.py").write_text(script)
    printed = _run([sys.executable, "page.py"], tmp_path, f"the python blocks of {page}")
    outputs = dict(zip(runnable, printed.split(SEPARATOR + "\n")[1:], strict=True))
    for before, shown in zip(found, found[1:], strict=False):
        if shown.checked:
            assert before in outputs, f"{shown}: an output block after no python block that runs"
            assert outputs[before].strip() == shown.code.strip(), (
                f"{shown} is not what {before} prints:\n{outputs[before]}"
            )


@pytest.mark.parametrize("block", BASH_BLOCKS, ids=str)
def test_a_bash_block_runs(block, tmp_path):
    _run(["bash", "-euo", "pipefail", "-c", block.code], tmp_path, str(block))
