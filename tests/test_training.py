"""The trainer: synchronous data parallelism is exact, every strategy learns, runs resume.

In-process tests use the session's 4 logical CPUs; the multi-worker ones start real
processes through tools.launch and the training binary.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import tfdist
from tests.conftest import REPO, run_module, run_python
from tfdist.app import ConfigError, TrainConfig, Trainer
from tfdist.exit_codes import EXIT_PREEMPTED
from tfdist.training.callbacks import WarmupSchedule
from tfdist.training.checkpoints import CheckpointMismatchError
from tfdist.training.preemption import Preempted

# One worker runs this module: its tests share costly module fixtures.

# Plain SGD, no shuffle: the same global batches in the same order on every strategy.
EXACT = dict(
    model="cnn", optimizer="sgd", momentum=0.0, learning_rate=0.1, shuffle_buffer=0,
    global_batch_size=32, epochs=1, steps_per_epoch=6, eval_every=0,
)  # fmt: skip
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def data_dir(digits_dir):
    return digits_dir


def weights_after(name, data_dir, **kwargs):
    config = TrainConfig(data_dir=data_dir, **{**EXACT, **kwargs})
    trainer = Trainer(
        config,
        strategy=tfdist.build_strategy(
            name,
            cluster=None,
            **({"devices": kwargs.pop("devices")} if "devices" in kwargs else {}),
        ),
    )
    result = trainer.fit()
    return result, trainer.model.get_weights()


def max_diff(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def one_device(data_dir):
    return weights_after("one_device", data_dir)


@pytest.mark.xdist_group("training_one_device")
@pytest.mark.parametrize(
    "devices", [("/cpu:0", "/cpu:1"), ("/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3")]
)
def test_mirrored_matches_one_device(one_device, data_dir, devices):
    config = TrainConfig(data_dir=data_dir, **EXACT)
    trainer = Trainer(
        config, strategy=tfdist.build_strategy("mirrored", cluster=None, devices=devices)
    )
    result = trainer.fit()
    assert result.steps == 6 and result.replicas == len(devices)
    assert max_diff(trainer.model.get_weights(), one_device[1]) <= TOLERANCE
    assert result.train_loss == pytest.approx(one_device[0].train_loss, abs=TOLERANCE)


@pytest.mark.xdist_group("training_one_device")
def test_steps_per_execution_changes_nothing_but_speed(one_device, data_dir):
    config = TrainConfig(data_dir=data_dir, **{**EXACT, "steps_per_execution": 4})
    trainer = Trainer(config, strategy=tfdist.build_strategy("one_device", cluster=None))
    assert trainer.fit().steps == 6  # 4 + 2: the last call runs only what is left
    assert max_diff(trainer.model.get_weights(), one_device[1]) <= TOLERANCE


@pytest.mark.xdist_group("training_one_device")
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "exchange",
    [
        [],  # TensorFlow's collective all-reduce
        # tfdist's ring unfused, several steps per call: every gradient has a ring of its own,
        # all in flight at once in the step, and rings of one shape (the cnn's last
        # convolution and its Dense layer both have 128 biases) must not share instance keys.
        # (Fusion into buckets: tests/test_collective.py, in the workers and in one process.)
        ["--all_reduce=ring", "--fusion_mb=0", "--steps_per_execution=4"],
    ],
    ids=["builtin", "ring"],
)
def test_multi_worker_mirrored_matches_one_device_and_workers_agree(
    one_device, data_dir, tmp_path, exchange
):
    flags = [f"--{k}={v}" for k, v in EXACT.items()] + exchange
    model_dir = tmp_path / "run"
    result = run_module(
        "tools.launch", "--workers", "2", "--timeout", "300", "--",
        sys.executable, "-m", "experiments.train", "--strategy=multi_worker_mirrored",
        f"--data_dir={data_dir}", f"--save_weights_to={tmp_path}", f"--model_dir={model_dir}",
        *flags,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:]
    # What the binary writes and says, as test_every_strategy_learns_digits_through_the_binary
    # checks it for one process and parameter servers.
    assert read_summary(model_dir)["strategy"] == "multi_worker_mirrored"
    assert os.path.exists(model_dir / "export" / "model.keras")
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(model_dir / "logs"))
    assert "final: " in result.stdout and "test accuracy" in result.stdout
    assert ("Ring all-reduce: 10 tensor(s)" in result.stdout) == bool(exchange)  # the gradients
    assert ("fusion into no buckets" in result.stdout) == bool(exchange)
    workers = [np.load(tmp_path / f"worker_{i}.npz") for i in range(2)]
    weights = [[w[f"arr_{j}"] for j in range(len(w.files))] for w in workers]
    assert max_diff(weights[0], weights[1]) == 0.0  # every worker holds the same weights
    assert max_diff(weights[0], one_device[1]) <= TOLERANCE


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"optimizer": "rmsprop"},
            r"optimizer must be one of sgd, adam, lamb\. Received: optimizer='rmsprop'",
        ),
        ({"global_batch_size": 0}, r"global_batch_size must be a positive whole number"),
        (
            {"warmup_epochs": 20.0, "epochs": 10},
            r"warmup_epochs must be between 0 and epochs \(10\)",
        ),
        (
            {"mixed_precision": "float8"},
            r"mixed_precision must be one of mixed_float16, mixed_bfloat16",
        ),
        ({"shuffle_buffer": -5}, r"shuffle_buffer must be a whole number >= 0"),
    ],
)
def test_config_mistakes_are_explained(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**kwargs)


def test_linear_scaling_and_warmup_schedule():
    config = TrainConfig(
        learning_rate=0.1, lr_scaling="linear", base_batch_size=64, global_batch_size=512
    )
    assert config.peak_learning_rate == pytest.approx(0.8)
    schedule = WarmupSchedule(0.8, warmup_steps=10, total_steps=100, decay="cosine")
    rates = [float(schedule(s)) for s in (0, 4, 9, 10, 55, 99)]
    assert rates[0] == pytest.approx(0.08) and rates[1] == pytest.approx(0.4)
    assert rates[2] == pytest.approx(0.8, rel=1e-3) and rates[3] == pytest.approx(0.8)
    assert rates[4] == pytest.approx(0.4, rel=1e-2) and rates[5] < 0.001


@pytest.mark.parametrize("precision", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision_trains_with_float32_logits(data_dir, precision):
    config = TrainConfig(
        data_dir=data_dir, mixed_precision=precision, epochs=1, steps_per_epoch=3, eval_every=0
    )
    trainer = Trainer(config, strategy=tfdist.build_strategy("one_device", cluster=None))
    result = trainer.fit()
    assert np.isfinite(result.train_loss)
    assert trainer.model.layers[1].compute_dtype == precision.split("_")[1]
    assert trainer.model.output.dtype == "float32"
    import keras

    assert keras.mixed_precision.dtype_policy().name == "float32"  # the process is left as found


def read_summary(model_dir):
    with open(os.path.join(model_dir, "summary.json")) as f:
        return json.load(f)


# One process and parameter servers: two of the binary's three ways of running; worker
# processes in sync are test_multi_worker_mirrored_matches_one_device_and_workers_agree's
# (one device's weights, so its learning is this one_device run's). (mirrored and
# central_storage train what one device does: the tests above and tests/test_fit.py compare
# them weight for weight in this process.)
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "strategy, launch",
    [
        ("one_device", []),
        ("parameter_server", ["--chief", "--workers", "2", "--ps", "1"]),
    ],
)
def test_every_strategy_learns_digits_through_the_binary(strategy, launch, data_dir, tmp_path):
    train = [sys.executable, "-m", "experiments.train", "--config=digits_cnn", f"--strategy={strategy}",
             f"--data_dir={data_dir}", f"--model_dir={tmp_path}", "--eval_every=0"]  # fmt: skip
    if strategy in ("mirrored", "central_storage"):
        train.append("--num_cpu_devices=2")
    if launch:
        result = run_module("tools.launch", *launch, "--timeout", "400", "--", *train)
    else:
        result = run_module(*train[2:])
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    summary = read_summary(tmp_path)
    assert summary["strategy"] == strategy
    # Synchronous runs are one device's computation and land at 0.96-0.98. Asynchronous
    # parameter-server runs vary with the workers' timing: 0.81-0.93 seen with 2 workers on
    # this 2-core machine (chance is 0.1), so their bar only says that training learned.
    assert summary["eval_accuracy"] >= (0.75 if strategy == "parameter_server" else 0.9), summary
    assert os.path.exists(tmp_path / "export" / "model.keras")
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "logs"))
    assert "final: " in result.stdout and "test accuracy" in result.stdout


def train_command(model_dir, data_dir, weights_dir, *extra):
    return [
        sys.executable, "-m", "experiments.train", "--strategy=one_device", "--model=mlp",
        "--epochs=3", "--checkpoint_every=5", "--eval_every=0", "--shuffle_buffer=512", "--seed=3",
        f"--data_dir={data_dir}", f"--model_dir={model_dir}", f"--save_weights_to={weights_dir}", *extra,
    ]  # fmt: skip


def _binary_env() -> dict[str, str]:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("TF_CONFIG", None)
    return env


def _run_to_the_end(model_dir, data_dir, weights_dir):
    return run_python(train_command(model_dir, data_dir, weights_dir), env=_binary_env())


@pytest.fixture(scope="module")
def uninterrupted_run(data_dir, tmp_path_factory):
    """The binary's run that nothing stops: (its model_dir, the directory of its weights)."""
    here = tmp_path_factory.mktemp("uninterrupted")
    whole = _run_to_the_end(here / "whole", data_dir, here / "w1")
    assert whole.returncode == 0, whole.stderr[-2000:]
    return here / "whole", here / "w1"


# A preemption is sent inside a call of 8 steps (the harder case: the call ends before the
# save); one a step a call, saved and resumed, is in tests/test_fit_multiworker.py (two
# workers, BackupAndRestore).
@pytest.mark.xdist_group("training_uninterrupted")  # the uninterrupted run runs once
@pytest.mark.parametrize(
    "stop, per_call",
    [(signal.SIGKILL, "1"), (signal.SIGTERM, "8")],
    ids=["crash", "preemption in a call of 8 steps"],
)
def test_a_stopped_run_resumes_to_the_same_step_and_weights(
    data_dir, tmp_path, stop, per_call, uninterrupted_run
):
    env = _binary_env()
    whole, whole_weights = uninterrupted_run
    interrupted = tmp_path / "interrupted"
    # 8 steps a call (cut at the checkpoints every 5 steps): the signal lands inside a call,
    # which ends before the save; the uninterrupted run took one step a call.
    flags = [f"--steps_per_execution={per_call}"]
    proc = subprocess.Popen(
        train_command(interrupted, data_dir, tmp_path / "w2", *flags),
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 240
    while not (interrupted / "checkpoints" / "checkpoint").exists():
        assert proc.poll() is None and time.monotonic() < deadline, (
            "no checkpoint before the run ended"
        )
        time.sleep(0.05)
    # SIGKILL: a crash, no chance to save anything more. SIGTERM: a preemption notice; the
    # binary saves at the next step boundary and exits with the code launchers restart.
    proc.send_signal(stop)
    _, stderr = proc.communicate(timeout=120)
    if stop == signal.SIGTERM:
        assert proc.returncode == EXIT_PREEMPTED, stderr[-2000:]
        assert re.search(r"preempted: SIGTERM at step \d+; checkpoint saved", stderr)
    assert not (interrupted / "summary.json").exists()
    resumed = run_python(train_command(interrupted, data_dir, tmp_path / "w2", *flags), env=env)
    assert resumed.returncode == 0, resumed.stderr[-2000:]

    first, second = read_summary(whole), read_summary(interrupted)
    assert second["resumed_from_step"] > 0 and second["steps"] == first["steps"] == 66
    # Every step counted: those the stopped session trained after its last epoch's line too.
    assert second["steps_trained"] == first["steps_trained"] == 66
    # The history holds every epoch, those the stopped session ended too.
    assert [(h["epoch"], h["step"]) for h in second["history"]] == [(1, 22), (2, 44), (3, 66)]
    assert second["resume_points"] == [second["resumed_from_step"]]
    a, b = np.load(whole_weights / "local.npz"), np.load(tmp_path / "w2" / "local.npz")
    # Same data position after the restart: the weights agree to float rounding.
    assert max_diff([a[k] for k in a.files], [b[k] for k in b.files]) <= TOLERANCE


# Clusters whose other tasks never start: each mistake below is caught before they matter.
TWO_WORKERS = json.dumps(
    {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "worker", "index": 0}}
)
PS_CHIEF = json.dumps(
    {"cluster": {"chief": ["127.0.0.1:3"], "worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]},
     "task": {"type": "chief", "index": 0}}
)  # fmt: skip


def error_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith(("error:", "FATAL"))]


# How each binary mistake below is run: as a process of its own (the flags, the exit code and
# the error line end to end), or in this process through the same path (common.parse_flags,
# then common.friendly_errors around the binary's main), where the mistake is caught before
# anything changes the process (a process start costs seconds of TensorFlow start-up).
PROCESS, IN_PROCESS = "process", "in-process"


@pytest.mark.parametrize(
    "args, env, message, how",
    [
        (
            ["--strategy=bogus"],
            {},
            "error: flag --strategy=bogus: value should be one of",
            IN_PROCESS,
        ),
        (
            # A process of its own: the CPU is split into 2 devices before the mistake shows.
            ["--strategy=mirrored", "--num_cpu_devices=2", "--global_batch_size=33"],
            {},
            "error: The global batch size 33 does not split evenly over the 2 replicas",
            PROCESS,
        ),
        (["--strategy=tpu"], {}, "error: No TPU found", IN_PROCESS),
        (
            ["--model_dir=/dev/null"],
            {},
            "error: model_dir /dev/null is a file, not a directory.",
            IN_PROCESS,
        ),
        # /sys is not writable, even by root: PermissionDenied or a read-only filesystem.
        (
            ["--model_dir=/sys/tfdist-run"],
            {},
            "error: model_dir /sys/tfdist-run cannot be written (",
            IN_PROCESS,
        ),
        (["extra_arg"], {}, "error: Unexpected arguments: extra_arg.", IN_PROCESS),
        (
            ["--data_dir=/dev/null/data"],
            {},
            "error: data_dir /dev/null/data/digits cannot be written (FailedPreconditionError: "
            "/dev/null is not a directory)",
            IN_PROCESS,
        ),
        (
            ["--data_dir=s3://bucket/data"],
            {},
            "error: The dataset 'digits' cannot be read from s3://bucket/data (UnimplementedError",
            IN_PROCESS,
        ),
        (
            ["--all_reduce=ring", "--compression=bfloat16"],
            {},
            "error: Option all_reduce does not apply to 'one_device', the strategy 'auto' chose",
            IN_PROCESS,
        ),
        (
            ["--strategy=mirrored"],
            {"TF_CONFIG": TWO_WORKERS},
            "error: 'mirrored' trains within one process, but TF_CONFIG describes 2 training tasks",
            IN_PROCESS,
        ),
        (
            ["--num_cpu_devices=2"],
            {"TF_CONFIG": TWO_WORKERS},
            "error: --num_cpu_devices=2 splits this host's CPU into replicas for mirrored and "
            "central_storage, but this job runs multi_worker_mirrored ('auto' asked)",
            IN_PROCESS,
        ),
        (
            ["--strategy=parameter_server", "--num_cpu_devices=2"],
            {"TF_CONFIG": PS_CHIEF},
            "error: --num_cpu_devices=2 splits this host's CPU into replicas for mirrored and "
            "central_storage, but this job runs parameter_server",
            IN_PROCESS,
        ),
        (
            ["--strategy=multi_worker_mirrored", "--collective=nccl"],
            {"TF_CONFIG": TWO_WORKERS},
            "error: collective='nccl' runs the all-reduce on GPUs with NCCL, and this host has "
            "none.",
            PROCESS,
        ),
        (
            ["--model_dir=s3://bucket/run"],
            {},
            "error: model_dir s3://bucket/run cannot be written (UnimplementedError: File "
            "system scheme 's3' not implemented",
            IN_PROCESS,
        ),
        (
            ["--strategy=parameter_server"],
            {},
            "error: The 'parameter_server' strategy needs a cluster",
            IN_PROCESS,
        ),
    ],
)
def test_bad_flags_end_with_one_error_line(args, env, message, how, data_dir, in_process_binary):
    env = {"TPU_NAME": "", "COLAB_TPU_ADDR": "", **env}
    if how == PROCESS:
        result = run_module(
            "experiments.train", f"--data_dir={data_dir}", *args, env=env, timeout=120
        )
        code, stderr = result.returncode, result.stderr
    else:
        code, stderr = in_process_binary(f"--data_dir={data_dir}", *args, env=env)
    assert code == 2, stderr[-2000:]  # a usage mistake
    assert "Traceback" not in stderr
    lines = error_lines(stderr)
    assert len(lines) == 1 and lines[0].startswith(message), stderr[-2000:]


@pytest.fixture
def in_process_binary(monkeypatch, capsys):
    """Runs experiments.train's flags and main in this process, as common.run does:
    returns (exit code, stderr). The flags, the environment and the loggers' levels are
    put back afterwards."""
    from experiments import common
    from experiments import train as train_binary

    loggers = {name: logging.getLogger(name).level for name in ("tfdist", "tensorflow")}

    def run(*args: str, env: dict[str, str]) -> tuple[int, str]:
        monkeypatch.delenv("TF_CONFIG", raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        capsys.readouterr()
        try:
            argv = common.parse_flags(["train", *args])
            common.friendly_errors(train_binary.main)(argv)
            code = 0
        except SystemExit as e:
            code = e.code
        return code, capsys.readouterr().err

    yield run
    train_binary.FLAGS.unparse_flags()
    for name, level in loggers.items():
        logging.getLogger(name).setLevel(level)


@pytest.mark.parametrize("damage", ["truncated", "bytes flipped"])
def test_a_damaged_latest_checkpoint_is_passed_over_for_the_one_before(
    data_dir, tmp_path, caplog, damage
):
    settings = dict(EXACT, model="mlp", checkpoint_every=2, model_dir=str(tmp_path))
    strategy = tfdist.build_strategy("one_device", cluster=None)
    Trainer(TrainConfig(data_dir=data_dir, **settings), strategy=strategy).fit()  # ckpt-2, 4, 6
    (shard,) = (tmp_path / "checkpoints").glob("ckpt-6.data-*")
    content = shard.read_bytes()
    if damage == "truncated":
        shard.write_bytes(content[: len(content) // 2])
    else:
        middle = len(content) // 2
        shard.write_bytes(
            content[:middle]
            + bytes(b ^ 0xFF for b in content[middle : middle + 64])
            + content[middle + 64 :]
        )
    caplog.set_level("INFO", logger="tfdist")
    resumed = Trainer(
        TrainConfig(data_dir=data_dir, **{**settings, "epochs": 2}), strategy=strategy
    ).fit()
    assert resumed.resumed_from_step == 4 and resumed.steps == 12
    assert re.search(r"ckpt-6 is incomplete or corrupt: \w+Error", caplog.text), caplog.text
    assert (
        "Resuming from" in caplog.text
        and "ckpt-4, the newest complete checkpoint (skipped ckpt-6)" in caplog.text
    )


@pytest.mark.xdist_group("training_one_device")
def test_a_run_on_a_non_local_filesystem_resumes_at_its_saved_step(data_dir, one_device):
    # ram:// is one of TensorFlow's own filesystems, as gs:// is (a TPU Node's only choice
    # of model_dir): the local glob or open would find nothing there and start from step 0.
    import tensorflow as tf

    model_dir = f"ram://tfdist-test-{os.getpid()}/run"
    strategy = tfdist.build_strategy("one_device", cluster=None)
    first = dict(EXACT, steps_per_epoch=3, model_dir=model_dir)
    assert Trainer(TrainConfig(data_dir=data_dir, **first), strategy=strategy).fit().steps == 3
    assert tf.io.gfile.exists(f"{model_dir}/checkpoints/ckpt-3.index")

    resumed = Trainer(TrainConfig(data_dir=data_dir, **dict(first, epochs=2)), strategy=strategy)
    result = resumed.fit()
    assert result.resumed_from_step == 3 and result.steps == 6
    # Steps 4-6 ran on from the saved weights and data position: the unbroken run's 6 steps.
    assert max_diff(resumed.model.get_weights(), one_device[1]) <= TOLERANCE
    with tf.io.gfile.GFile(f"{model_dir}/summary.json") as f:
        assert json.load(f)["steps"] == 6
    assert tf.io.gfile.exists(f"{model_dir}/export/model.keras")
    assert tf.io.gfile.glob(f"{model_dir}/logs/events.out.tfevents.*")


def test_a_rerun_keeps_the_record_and_a_resume_extends_it(data_dir, tmp_path):
    strategy = tfdist.build_strategy("one_device", cluster=None)
    config = dict(EXACT, epochs=2, steps_per_epoch=3, model_dir=str(tmp_path))
    Trainer(TrainConfig(data_dir=data_dir, **config), strategy=strategy).fit()
    first = read_summary(tmp_path)
    assert [h["epoch"] for h in first["history"]] == [1, 2] and first["steps_trained"] == 6

    # The same command again: nothing left to train, and the record stays as it was.
    again = Trainer(TrainConfig(data_dir=data_dir, **config), strategy=strategy).fit()
    second = read_summary(tmp_path)
    assert again.steps == 6 and again.resumed_from_step == 6
    for key in ("history", "steps_trained", "train_seconds", "examples_per_second",
                "train_loss", "train_accuracy", "resume_points", "sessions"):  # fmt: skip
        assert second[key] == first[key], key
    # Evaluated again where the run stands: the same model on the same test examples.
    for key in ("eval_loss", "eval_accuracy"):
        assert first[key] is not None and second[key] == pytest.approx(first[key]), key

    # Two more epochs: resumed at step 6, the history runs on from the first session's.
    Trainer(TrainConfig(data_dir=data_dir, **dict(config, epochs=4)), strategy=strategy).fit()
    third = read_summary(tmp_path)
    assert [h["epoch"] for h in third["history"]] == [1, 2, 3, 4]
    assert third["history"][:2] == first["history"]
    assert third["resume_points"] == [6] and third["steps_trained"] == 12
    assert [s["resumed_from_step"] for s in third["sessions"]] == [0, 6]
    assert third["train_loss"] == third["history"][-1]["train_loss"]


def test_a_resume_with_other_settings_is_refused_or_explained(data_dir, tmp_path, caplog):
    strategy = tfdist.build_strategy("one_device", cluster=None)
    config = dict(EXACT, model="mlp", steps_per_epoch=2, model_dir=str(tmp_path))
    Trainer(TrainConfig(data_dir=data_dir, **config), strategy=strategy).fit()
    for change, message in [
        ({"optimizer": "adam"}, "saved with optimizer='sgd'; this job has optimizer='adam'."),
        (
            {"global_batch_size": 16},
            "saved with global_batch_size=32; this job has global_batch_size=16. Its step 2 "
            "counts batches of 32 examples; with 16 it would stand for another data position",
        ),
        ({"model": "cnn"}, "saved with model='mlp'; this job has model='cnn'."),
    ]:
        with pytest.raises(CheckpointMismatchError, match=re.escape(message)):
            Trainer(TrainConfig(data_dir=data_dir, **{**config, **change}), strategy=strategy)
    # Other epochs: the step keeps its meaning, and the run goes on from it with a warning.
    longer = Trainer(
        TrainConfig(data_dir=data_dir, **{**config, "steps_per_epoch": 3, "epochs": 2}),
        strategy=strategy,
    )
    assert "under steps_per_epoch=3: epochs now end every 3 steps" in caplog.text
    assert longer.fit().resumed_from_step == 2
    # A checkpoint without run.json (another tool's) that does not fit: one error, naming
    # the variable, and none of TensorFlow's lines about what it did not restore.
    os.remove(tmp_path / "run.json")
    tensorflow_lines = []
    handler = logging.Handler()
    handler.emit = lambda record: tensorflow_lines.append(record.getMessage())
    logging.getLogger("tensorflow").addHandler(handler)
    try:
        other = Trainer(
            TrainConfig(data_dir=data_dir, **{**config, "model": "cnn"}), strategy=strategy
        )
        with pytest.raises(CheckpointMismatchError, match=r"restore variable with shape .* conv2d"):
            other.fit()
        del other
        gc.collect()  # TensorFlow reports unrestored values when the restore's state goes
    finally:
        logging.getLogger("tensorflow").removeHandler(handler)
    assert not [line for line in tensorflow_lines if "restored" in line], tensorflow_lines


def test_help_is_printed_and_exits_0():
    """--help lists the binary's own flags, then the strategy and cluster flags in a group of
    their own (absl alone showed only the first group)."""
    result = run_module("experiments.train", "--help", timeout=120)
    assert result.returncode == 0 and "the tfdist training binary" in result.stdout
    own, _, shared = result.stdout.partition("Strategy and cluster flags")
    assert "--epochs:" in own and "--strategy:" not in own
    for flag in ("--strategy:", "--num_cpu_devices:", "--all_reduce:", "--startup_timeout:"):
        assert flag in shared, flag


def test_the_binary_refuses_a_model_dir_of_another_model_in_one_line(data_dir, tmp_path):
    strategy = tfdist.build_strategy("one_device", cluster=None)
    config = dict(EXACT, model="mlp", steps_per_epoch=2, model_dir=str(tmp_path))
    Trainer(TrainConfig(data_dir=data_dir, **config), strategy=strategy).fit()
    result = run_module(
        "experiments.train", "--model=cnn", "--optimizer=sgd", "--global_batch_size=32",
        f"--data_dir={data_dir}", f"--model_dir={tmp_path}", "--epochs=2", timeout=120,
    )  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert error_lines(result.stderr) == [
        f"error: {tmp_path} holds a run saved with model='mlp'; this job has model='cnn'. "
        "Resume with the settings it was saved with, or start afresh in a new model_dir."
    ]
    assert "restored" not in result.stderr  # none of TensorFlow's checkpoint warnings


def test_a_global_batch_larger_than_the_data_is_a_warning(caplog):
    strategy = tfdist.build_strategy("one_device", cluster=None)
    config = TrainConfig(dataset="synthetic", dataset_options={"image_shape": (4, 4, 1),
                         "num_examples": 40}, model="mlp", global_batch_size=64, epochs=1)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="tfdist"):
        Trainer(config, strategy=strategy)
    assert "The global batch of 64 is larger than the 40 training examples" in caplog.text


def test_the_run_record_keeps_this_runs_epochs():
    from tfdist.training.report import read_run_history

    def line(epoch, session, resumed_from):
        return {"epoch": epoch, "step": 3 * epoch, "train_loss": 1.0 / epoch, "session": session,
                "resumed_from_step": resumed_from, "steps_trained": 3, "train_seconds": 1.0}  # fmt: skip

    # Session b resumed at step 6 and trained epoch 3 again: b's epoch 3 is the run's.
    record = read_run_history([line(1, "a", 0), line(2, "a", 0), line(3, "a", 0),
                              {**line(3, "b", 6), "train_loss": 0.25}, line(4, "b", 6)])  # fmt: skip
    assert [h["epoch"] for h in record.history] == [1, 2, 3, 4]
    assert record.history[2]["train_loss"] == 0.25 and record.resume_points == [6]
    assert record.steps_trained == 15  # every step trained, the redone ones too
    # Session a was stopped at step 7, inside epoch 3 (a checkpoint, but no line for it):
    # its 7th step counts too.
    record = read_run_history([line(1, "a", 0), line(2, "a", 0),
                              {**line(3, "b", 7), "steps_trained": 2}, line(4, "b", 7)])  # fmt: skip
    assert [s["steps_trained"] for s in record.sessions] == [7, 5]
    assert record.steps_trained == 12 == record.history[-1]["step"]
    # Session c started from step 0 (the checkpoints were removed): a new run.
    record = read_run_history([line(1, "a", 0), line(2, "a", 0), line(1, "c", 0)])
    assert [h["epoch"] for h in record.history] == [1] and len(record.sessions) == 1


def test_json_files_hold_no_nan(tmp_path, caplog):
    from tfdist.storage import strict_json

    text = strict_json({"loss": float("nan"), "h": [{"acc": np.float32("inf")}, 1.5]}, what="x")
    assert json.loads(text, parse_constant=pytest.fail) == {"loss": None, "h": [{"acc": None}, 1.5]}
    assert "x: loss (nan), h[0].acc (inf) not a finite number; written as null" in caplog.text


def test_sigterm_saves_and_stops_and_the_rerun_ends_with_uninterrupted_weights(data_dir, tmp_path):
    settings = dict(EXACT, model="mlp", epochs=3, checkpoint_every=2)
    strategy = tfdist.build_strategy("one_device", cluster=None)
    uninterrupted = Trainer(TrainConfig(data_dir=data_dir, **settings), strategy=strategy)
    uninterrupted.fit()

    config = TrainConfig(data_dir=data_dir, model_dir=str(tmp_path), **settings)
    first_checkpoint = tmp_path / "checkpoints" / "ckpt-2.index"

    def preempt_after_first_checkpoint():
        deadline = time.monotonic() + 60
        while not first_checkpoint.exists() and time.monotonic() < deadline:
            time.sleep(0.005)
        os.kill(os.getpid(), signal.SIGTERM)  # what a scheduler sends before it kills

    handler_before = signal.getsignal(signal.SIGTERM)
    threading.Thread(target=preempt_after_first_checkpoint, daemon=True).start()
    with pytest.raises(Preempted, match=r"SIGTERM at step (\d+); checkpoint saved") as stop:
        Trainer(config, strategy=strategy).fit()
    assert 2 <= stop.value.step < 18
    assert (tmp_path / "checkpoints" / f"ckpt-{stop.value.step}.index").exists()
    assert signal.getsignal(signal.SIGTERM) is handler_before  # its own handler is gone again

    resumed = Trainer(config, strategy=strategy)
    result = resumed.fit()
    assert result.resumed_from_step == stop.value.step and result.steps == 18
    assert max_diff(resumed.model.get_weights(), uninterrupted.model.get_weights()) <= TOLERANCE


def test_static_shape_evaluation_counts_every_test_example_once(data_dir):
    # TPU evaluation pads the last batches to full ones and masks the padding out; on 4 CPU
    # replicas it must give exactly the figures of plain evaluation (359 test examples do not
    # fill 64-example steps, so padding is needed at the end).
    config = TrainConfig(
        data_dir=data_dir, **{**EXACT, "global_batch_size": 64, "steps_per_epoch": 2}
    )
    results = {}
    for static_shapes in (False, True):
        trainer = Trainer(config, strategy=tfdist.build_strategy("mirrored", cluster=None))
        assert trainer.data.info.num_examples["test"] % 64
        trainer.static_shapes = static_shapes
        results[static_shapes] = trainer.fit()
    plain, padded = results[False], results[True]
    assert padded.eval_loss == pytest.approx(plain.eval_loss, abs=TOLERANCE)
    assert padded.eval_accuracy == pytest.approx(plain.eval_accuracy, abs=TOLERANCE)
    # The per-epoch history (the notebook's learning curve) agrees with the final figures.
    assert [(h["epoch"], h["step"]) for h in padded.history] == [(1, 2)]
    assert padded.history[-1]["eval_accuracy"] == padded.eval_accuracy
    assert padded.history[-1]["train_loss"] == padded.train_loss


def test_a_run_stopped_between_its_last_checkpoint_and_its_last_record_ends_at_its_step(
    data_dir, tmp_path
):
    """Killed after the final checkpoint was saved but before the last epoch's line reached
    history.jsonl, a re-run has nothing to train: its summary stands at the checkpoint's
    step, not at the last recorded epoch's."""
    config = TrainConfig(
        data_dir=data_dir, model_dir=str(tmp_path), **{**EXACT, "model": "mlp", "epochs": 3}
    )
    strategy = tfdist.build_strategy("one_device", cluster=None)
    assert Trainer(config, strategy=strategy).fit().steps == 18
    history = tmp_path / "history.jsonl"
    lines = history.read_text().splitlines()
    history.write_text("\n".join(lines[:-1]) + "\n")  # the last epoch's line never written
    result = Trainer(config, strategy=strategy).fit()
    assert result.steps == 18 and result.resumed_from_step == 18
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 18
