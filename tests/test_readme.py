"""The README's two set-up commands stay exactly two, CI runs the test one verbatim, and its
links into docs/ hold."""

import re

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.fast


def setup_commands() -> list[str]:
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    lines = [line.strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line.startswith("python3 -m venv")]


def test_readme_has_two_setup_commands():
    commands = setup_commands()
    assert len(commands) == 2, commands
    assert "experiments.train" in commands[0] and "pytest" in commands[1]


def test_ci_runs_the_readme_test_command():
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert setup_commands()[1] in [line.strip() for line in ci]


# --- the README is short and points into the docs ----------------------------------------------


def test_the_readme_s_links_reach_files_of_the_checkout():
    readme = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if "://" not in link]
    assert local, "the README links into docs/"
    missing = [link for link in local if not (REPO / link).exists()]
    assert not missing, missing


def test_the_readme_stays_short():
    """Guides, tables and the code layout live in docs/ (tests/test_docs.py checks them)."""
    assert len((REPO / "README.md").read_text().splitlines()) <= 120
