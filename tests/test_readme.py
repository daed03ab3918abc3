"""The README's two set-up commands stay exactly two, and CI runs the test one verbatim."""

import re

from tests.conftest import REPO


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
