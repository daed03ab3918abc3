"""tfdist's log lines by default (tfdist.logs), and the launcher's one start-up block per task.

The rules run in small Python processes that import tfdist without TensorFlow (the default
handler is installed at import, before any user logging call, which pytest's own handlers
would hide in process). One job under tfdist-launch shows a user's script, with no logging
call at all, printing the waiting line and the step-time line.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO
from tfdist.launch.output import OncePerProcess, RuntimeLines
from tfdist.launch.preload import SERVER_ENV

pytestmark = pytest.mark.fast

LINE = re.compile(r"^\d\d:\d\d:\d\d (INFO|WARNING|ERROR) tfdist: (.*)$")


def run_script(source: str, env: dict[str, str] | None = None) -> str:
    """Standard output and error of `source`, merged as a terminal or a launcher sees them."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(source)],
        cwd=REPO, env={"PATH": "/usr/bin:/bin", **(env or {})},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60,
    )  # fmt: skip
    output = result.stdout.decode()  # as written: a progress bar's "\r" stays
    assert result.returncode == 0, output
    return output


SAYS = """
    import logging
    import tfdist
    log = logging.getLogger("tfdist.some.module")
    log.info("the strategy was built")
    log.warning("a warning")
"""


def two_workers(index: int) -> dict[str, str]:
    cluster = {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}
    return {
        "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
    }


def test_a_script_that_imports_tfdist_shows_its_lines_in_one_format():
    lines = run_script(SAYS).splitlines()
    assert [LINE.match(line).groups() for line in lines] == [
        ("INFO", "the strategy was built"),
        ("WARNING", "a warning"),
    ], lines


def test_only_the_chief_says_info_unless_asked():
    assert "the strategy was built" in run_script(SAYS, two_workers(0))
    says_what_it_waits_for = textwrap.dedent(SAYS) + (
        'log.info("Waiting for worker:0", extra=tfdist.logs.EVERY_TASK)\n'
    )
    quiet = run_script(says_what_it_waits_for, two_workers(1)).splitlines()
    assert [LINE.match(x).group(2) for x in quiet] == ["a warning", "Waiting for worker:0"], quiet
    everyone = run_script(SAYS, {**two_workers(1), "TFDIST_LOG_WORKERS": "all"})
    assert "the strategy was built" in everyone
    ps_job = {"chief": ["h:1"], "worker": ["h:2"], "ps": ["h:3"]}
    ps = {"TF_CONFIG": json.dumps({"cluster": ps_job, "task": {"type": "ps", "index": 0}})}
    assert "the strategy was built" in run_script(SAYS, ps)  # a role of its own: it says


def test_a_variable_turns_the_lines_down_and_a_bad_one_says_so():
    assert [LINE.match(x).group(2) for x in run_script(SAYS, {"TFDIST_LOG_LEVEL": "warning"})
            .splitlines()] == ["a warning"]  # fmt: skip
    bad = run_script(SAYS, {"TFDIST_LOG_LEVEL": "LOUD"}).splitlines()
    assert bad[0] == "tfdist: TFDIST_LOG_LEVEL='LOUD' is not a level; use DEBUG, INFO, WARNING " \
        "or ERROR. Using INFO."  # fmt: skip
    assert len(bad) == 3


def test_a_user_s_own_logging_set_up_gets_each_line_once_in_its_format():
    lines = run_script(
        """
        import logging
        import tfdist
        logging.basicConfig(format="%(levelname)s|%(name)s|%(message)s")
        logging.getLogger("tfdist.some.module").info("the strategy was built")
        """
    ).splitlines()
    assert lines == ["INFO|tfdist.some.module|the strategy was built"]


def test_the_root_handler_python_or_absl_add_on_their_own_prints_nothing_twice():
    """absl's logging.log() (TensorFlow calls it while connecting to a cluster) and Python's
    logging.info() give the root logger a default handler when none is set: no one's choice,
    so tfdist's lines keep their format and are said once."""
    lines = run_script(
        """
        import logging
        from absl import logging as absl_logging
        import tfdist
        absl_logging.warning("from absl, before anything was configured")
        logging.getLogger("tfdist.x").info("the strategy was built")
        """
    ).splitlines()
    assert lines[0] == "WARNING:absl:from absl, before anything was configured", lines
    assert [LINE.match(x).group(2) for x in lines[1:]] == ["the strategy was built"], lines


def test_setup_logging_and_absl_binaries_use_the_one_format():
    lines = run_script(
        """
        import logging
        from absl import app
        import tfdist

        def main(argv):
            tfdist.setup_logging()
            logging.getLogger("tfdist.x").info("from tfdist")
            logging.getLogger("mine").warning("from the user")

        app.run(main)
        """
    ).splitlines()
    assert [LINE.match(lines[0]).group(2), lines[1][8:]] == [
        "from tfdist",
        " WARNING mine: from the user",
    ], lines


def test_a_line_never_lands_inside_a_progress_bar_and_repeats_are_said_once():
    output = run_script(
        """
        import logging, sys
        import tfdist
        from tfdist import logs
        log = logging.getLogger("tfdist.x")
        sys.stdout.write("\\r3/8 - loss: 0.7034")  # a bar drawn in place, its line open
        sys.stdout.flush()
        logs.progress_bar_open(True)
        for _ in range(3):
            logs.once(log, logging.INFO, "Input pipeline %d of %d", 0, 2)
        sys.stdout.write("\\r8/8 - loss: 0.5\\n")
        """
    )
    lines = output.split("\n")  # the bar's carriage returns are not line ends
    assert lines[0] == "\r3/8 - loss: 0.7034", lines
    assert LINE.match(lines[1]).group(2) == "Input pipeline 0 of 2", lines
    assert lines[2:] == ["\r8/8 - loss: 0.5", ""], lines


def test_the_launcher_passes_tensorflow_s_start_up_block_once_per_process():
    block = [
        b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
        b"I0000 00:00:1795753085.320249    2450 port.cc:153] oneDNN custom operations are on.",
        b"I0000 00:00:1795753085.320801    2450 cudart_stub.cc:31] Could not find cuda drivers",
    ]
    again = [
        block[0],
        block[1].replace(b"085.320249", b"087.425833"),
        block[2].replace(b"085.320801", b"087.426511"),
    ]
    other = [b"E0000 00:00:1795753089.58 2450 cuda_platform.cc:52] failed call to cuInit",
             b"I1127 04:18:09.582033 1402 peers.py:315] Waiting for worker:1",
             b"10:00:00 INFO tfdist: epoch 1"]  # fmt: skip
    filtered = OncePerProcess()
    kept = [line for line in block + again + other + other if not filtered.repeats(line)]
    assert kept == block + other + other, kept  # the block once; every other line as it came


USER_SCRIPT = """
import os, time
import numpy as np
import keras
import tfdist

if tfdist.this_task().index == 1:
    time.sleep(3)  # a peer that starts late: the chief waits for it, and says so
strategy = tfdist.build_strategy("multi_worker_mirrored")
with strategy.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
x = np.random.default_rng(0).random((256, 8), dtype=np.float32)
tfdist.fit(model, x, (x.sum(axis=1) > 4).astype("int32"), epochs=2, batch_size=32)
"""


@pytest.mark.multiprocess
def test_a_script_without_a_logging_call_shows_the_waiting_and_step_time_lines(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(USER_SCRIPT)
    result = subprocess.run(
        [sys.executable, "-m", "tfdist.launch", "--workers", "2", "--", "python", str(script)],
        cwd=REPO, capture_output=True, timeout=240,
        env={k: v for k, v in os.environ.items() if k != SERVER_ENV},  # fresh interpreters
    )  # fmt: skip
    output = result.stdout.decode()
    assert result.returncode == 0, output[-3000:]
    lines = output.split("\n")
    chief = [LINE.match(x[11:]) for x in lines if x.startswith("[worker:0] ")]
    said = [m.group(2) for m in chief if m]
    assert any(re.fullmatch(r"Waiting for worker:1 \(127\.0\.0\.1:\d+\) to start \(\d+ s left\)",
                            x) for x in said), said  # fmt: skip
    assert [x.split(":")[0] for x in said if x.startswith("Epoch ")] == ["Epoch 1", "Epoch 2"]
    # The other worker is quiet below WARNING; nobody's line lands inside a progress bar.
    assert not [x for x in lines if x.startswith("[worker:1] ") and LINE.match(x[11:])]
    assert not [x for x in lines if "loss:" in x and " tfdist: " in x], output[-3000:]
    # A clean finish: the coordination service's complaints that the chief left first (when
    # worker:1 outlives it) are not shown.
    assert "coordination service" not in output, output[-3000:]
    # TensorFlow's start-up notice once per process, where it came twice.
    for task in ("worker:0", "worker:1"):
        notices = [x for x in lines if x.startswith(f"[{task}] WARNING: All log messages")]
        assert len(notices) == 1, output[:3000]


ABORT = [
    b"E1127 04:29:09.929320   16692 ring_alg.cc:291] Aborting RingReduce with UNAVAILABLE: recvmsg",
    b"Additional GRPC error information from remote target /job:worker/replica:0/task:1 while",
    b':UNKNOWN:Error received from peer  {grpc_message:"recvmsg:Connection reset by peer"}',
    b"E0000 00:00:1795753749.929388   16692 base_collective_executor.cc:252] StartAbort: "
    b"The following tasks are unhealthy (stopped sending heartbeats):",
    b"/job:worker/replica:0/task:1",
    b"The tasks have crashed. Check the task logs for an earlier error, or scheduler events",
]
LOST = b"error: Lost worker:1 (127.0.0.1:43417) during training: it closed its connection"
GOODBYE = b"E0000 00:00:1795758328.815576   19151 base_collective_executor.cc:252] " \
    b"BaseCollectiveExecutor::StartAbort UNAVAILABLE: Failed to send RPC to coordination " \
    b"service. Either the leader task was preempted/died/restarted"  # fmt: skip


def relayed(lines: list[bytes], returncode: int, later=(b"epoch", LOST)) -> tuple[list, int]:
    """What the launcher prints of `lines`: those starting with `later` come a second after
    the line before (a new write), the others with it (a message of several lines)."""
    runtime, now, out = RuntimeLines(), 0.0, []
    for line in lines:
        now += 1.0 if line.startswith(later) else 0.001
        out += runtime.passed(line, now)
    return out + runtime.at_exit(returncode), runtime.dropped


def test_a_lost_peer_s_line_comes_first_without_the_runtime_s_abort_lines():
    assert relayed([b"epoch 1", *ABORT, LOST], 1) == ([b"epoch 1", LOST], 6)
    # After its own line, the teardown's complaints are counted too.
    assert relayed([b"epoch 1", LOST, GOODBYE], 1) == ([b"epoch 1", LOST], 1)
    # Without a line of tfdist's to explain them, they are all there is: shown.
    assert relayed([b"epoch 1", *ABORT], 1) == ([b"epoch 1", *ABORT], 0)
    # Followed by ordinary output, they are shown where they came.
    assert relayed([*ABORT[:1], b"epoch 2"], 0) == ([*ABORT[:1], b"epoch 2"], 0)
    # A clean finish drops only the coordination service's goodbyes.
    assert relayed([b"final: done", GOODBYE, *ABORT[1:3], ABORT[0]], 0) == (
        [b"final: done", ABORT[0]], 0,
    )  # fmt: skip
    everything = RuntimeLines(show_all=True)
    assert [x for line in [*ABORT, LOST] for x in everything.passed(line)] == [*ABORT, LOST]


# What a parameter-server job's coordinator printed for each function it registered or
# removed on a worker that was killed (TensorFlow 2.21; 192 lines in one run).
UNREACHABLE = [
    b"E0000 00:00:1795868095.725634   32161 context.cc:873] Failed to register function "
    b"remotely due to failed to connect to all addresses; last error: UNKNOWN: "
    b"ipv4:127.0.0.1:36379: Failed to connect to remote host:",
    b"Additional GRPC error information from remote target /job:worker/replica:0/task:1 "
    b"while calling /tensorflow.eager.EagerService/Enqueue:",
    b':UNKNOWN:Error received from peer  {grpc_message:"failed to connect to all addresses; '
    b'last error: UNKNOWN: ipv4:127.0.0.1:36379: Connection refused", grpc_status:14}',
    b"This could happen if the remote target has been disconnected from the client.",
]


def test_a_lost_peer_s_connection_refused_repeats_are_one_line():
    lines = [b"epoch 1", *UNREACHABLE * 40, b"epoch 2", *UNREACHABLE * 8, b"final: done"]
    out, dropped = relayed(lines, 0, later=(b"epoch", b"final"))
    said = [line for line in out if b"cannot reach" in line]
    assert len(said) == 1 and b"/job:worker/replica:0/task:1" in said[0], out
    assert out == [b"epoch 1", said[0], b"epoch 2", b"final: done"]
    assert dropped == 48 * 4 - 1
    # Another peer's is said too; any other runtime line passes as before.
    other = [UNREACHABLE[0], UNREACHABLE[1].replace(b"task:1", b"task:2"), *UNREACHABLE[2:]]
    out, _ = relayed([*UNREACHABLE, b"epoch 1", *other, ABORT[0], b"epoch 2"], 0)
    assert [b"task:2" in line for line in out if b"cannot reach" in line] == [False, True]
    assert ABORT[0] in out


def test_after_a_clean_finish_a_peer_that_finished_first_is_no_news():
    # Worker 1's runtime, as worker 0 exits first (2 workers, the main job).
    out, dropped = relayed([b"final: done", *UNREACHABLE], 0, later=(b"final",))
    assert out == [b"final: done"] and dropped == len(UNREACHABLE)
    # A task that failed says it: its last word may be why.
    out, _ = relayed([b"epoch 1", *UNREACHABLE], 1)
    assert any(b"cannot reach" in line for line in out), out
