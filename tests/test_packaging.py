"""The installed package stands alone: a wheel in a fresh virtualenv, with no checkout on the
path, brings the `tfdist-launch` and `tfdist-k8s` commands.

The fresh virtualenv gets the wheel without its dependencies (TensorFlow would cost minutes):
the launcher imports no TensorFlow, so its command runs a real 2-task job there; the task is a
script that reports the TF_CONFIG it was given.
"""

import json
import os
import subprocess
import sys
import venv
import zipfile

import pytest

# One worker runs this module: its tests share costly module fixtures.

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), REPO],
        check=True,
        capture_output=True,
    )
    (path,) = out.glob("tfdist-*.whl")
    return path


@pytest.fixture(scope="module")
def fresh_env(wheel, tmp_path_factory):
    """A new virtualenv holding only the wheel (and PyYAML, which tfdist-k8s writes with)."""
    root = tmp_path_factory.mktemp("fresh")
    venv.create(root / "venv", with_pip=False)
    python = root / "venv" / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q"]
    subprocess.run([*pip, "--no-deps", str(wheel)], check=True, capture_output=True)
    subprocess.run([*pip, "pyyaml>=6"], check=True, capture_output=True)
    return root


@pytest.mark.xdist_group("packaging_fresh_env")
def test_the_wheel_declares_both_commands_and_holds_no_checkout_code(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        scripts = archive.read(entry_points).decode()
    assert "tfdist-launch = tfdist.launch.cli:main" in scripts
    assert "tfdist-k8s = tfdist.k8s.cli:main" in scripts
    assert "tfdist/launch/supervisor.py" in names and "tfdist/k8s/jobset.py" in names
    assert not [n for n in names if n.startswith(("experiments/", "tools/", "tests/"))]


@pytest.mark.xdist_group("packaging_fresh_env")
def test_installed_launcher_runs_a_two_worker_job_outside_the_checkout(fresh_env):
    script = fresh_env / "my_train.py"
    script.write_text(
        "import json, os\n"
        "task = json.loads(os.environ['TF_CONFIG'])['task']\n"
        "print('role', json.dumps(task))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TF_CONFIG")}
    result = subprocess.run(
        [str(fresh_env / "venv" / "bin" / "tfdist-launch"), "--workers", "2", "--timeout", "60",
         "--", "python", str(script)],
        cwd=fresh_env, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    said = [line.split(" role ", 1)[1] for line in result.stdout.splitlines() if " role " in line]
    roles = sorted((json.loads(task) for task in said), key=lambda task: task["index"])
    assert roles == [{"type": "worker", "index": 0}, {"type": "worker", "index": 1}]
    assert "[launch] worker:1 exit 0" in result.stdout


@pytest.mark.xdist_group("packaging_fresh_env")
def test_installed_launcher_explains_a_bad_layout_with_its_own_name(fresh_env):
    result = subprocess.run(
        [str(fresh_env / "venv" / "bin" / "tfdist-launch"), "--ps", "1", "--", "python", "x.py"],
        cwd=fresh_env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.startswith("tfdist-launch: error: parameter-server training needs a chief")
    assert "Traceback" not in result.stderr


@pytest.mark.xdist_group("packaging_fresh_env")
def test_installed_k8s_command_writes_a_jobset_and_a_tfjob(fresh_env):
    venv_bin = fresh_env / "venv" / "bin"
    for engine, kind in (("jobset", "JobSet"), ("tfjob", "TFJob")):
        result = subprocess.run(
            [str(venv_bin / "tfdist-k8s"), engine, "--name", "demo", "--image", "example.com/t:1",
             "--workers", "2", "--", "python", "my_train.py"],
            cwd=fresh_env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        # Read back by the fresh environment's own PyYAML: the manifest is plain YAML.
        check = subprocess.run(
            [str(venv_bin / "python"), "-c",
             "import sys, yaml\n"
             "for m in yaml.safe_load_all(sys.stdin): print(m['kind'], m['metadata']['name'])"],
            input=result.stdout, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        # The job, then the NetworkPolicy that admits only its own pods.
        assert check.stdout.split() == [kind, "demo", "NetworkPolicy", "demo"], check.stderr
