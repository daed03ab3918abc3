"""The smoke binary: a mistake tfdist can detect ends with one 'error:' line and exit code 2."""

import json

import pytest

from tests.conftest import run_module


def last_lines(stderr: str) -> list[str]:
    # TensorFlow's C++ runtime prints a few start-up lines of its own before any Python runs,
    # and absl follows a flag error with a hint to --helpshort.
    return [
        line
        for line in stderr.splitlines()
        if line
        and not line.startswith(("I0000", "E0000", "W0000", "WARNING: All", "Pass --helpshort"))
    ]


@pytest.mark.parametrize(
    "args, env, message",
    [
        (
            ["--strategy=bogus"],
            {},
            "error: flag --strategy=bogus: value should be one of",
        ),
        (
            ["--strategy=multi_worker_mirrored"],
            {"TF_CONFIG": json.dumps({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:1"]}})},
            "error: Invalid TF_CONFIG (from the TF_CONFIG environment variable): worker:0 and "
            "worker:1 both use the address 127.0.0.1:1.",
        ),
    ],
)
def test_mistakes_end_with_one_error_line(args, env, message):
    result = run_module("experiments.smoke", *args, env=env, timeout=120)
    assert result.returncode == 2  # a usage mistake
    assert "Traceback" not in result.stderr
    lines = last_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith(message), result.stderr
