"""The README's two set-up commands stay exactly two, and CI runs the test one verbatim."""

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


# --- the Layout section names the tree as it is ---------------------------------------------------

# Packages whose every module the Layout section names (the layers of tfdist.fit).
LISTED_IN_FULL = ("tfdist/app", "tfdist/api", "tfdist/parallel", "tfdist/training")


def layout_entries() -> dict[str, str]:
    """The Layout section's entries: path -> its description (continuation lines included)."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Layout\n") :]
    block = re.search(r"```\n(.*?)```", section, flags=re.S).group(1)
    entries: dict[str, str] = {}
    path = None
    for line in block.splitlines():
        if line and not line[0].isspace():
            path, _, text = line.partition(" ")
            entries[path] = text
        elif path is not None:
            entries[path] += " " + line.strip()
    return entries


def test_the_layout_names_paths_that_exist_and_every_part_of_the_tree():
    entries = layout_entries()
    missing = [path for path in entries if not (REPO / path).exists()]
    assert not missing, f"the README's Layout names paths that do not exist: {missing}"
    tfdist = REPO / "tfdist"
    parts = {
        f"tfdist/{p.name}/" if p.is_dir() else f"tfdist/{p.name}"
        for p in tfdist.iterdir()
        if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").exists()
    }
    unnamed = sorted(parts - set(entries))
    assert not unnamed, f"the README's Layout leaves out {unnamed}"
    for top in ("experiments/", "tools/", "tests/"):
        assert top in entries, top


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
            assert name in text, f"the README's Layout entry for {package}/ leaves out {name}"
    for folder in ("tools", "experiments"):
        for p in sorted((REPO / folder).glob("*.py")):
            if p.stem in ("__init__", "common"):
                continue
            assert re.search(rf"\b{p.stem}\b", entries[f"{folder}/"]), f"{folder}/{p.name}"
