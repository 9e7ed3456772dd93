"""Many processes (issue 16): `meshax launch`, per-process feeding, checkpoints across process
counts, and failures. The end-to-end runs start real 2-process jobs (gloo collectives between
processes of 4 virtual CPU devices each) and are marked slow; the rest run in the default suite."""

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import meshax as mx
from meshax.launch import launch
from meshax.train import loop
from meshax.train.checkpoint import restore_checkpoint
from tests import multiprocess_worker as worker

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "meshax.cli"]


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


# ------------------------------------------------------------------ the launcher (no JAX in it)


def test_launch_sets_each_process_environment_and_prefixes_its_lines():
    """...and drops gloo's line per connected group, whole or in pieces (split at its count, or
    after "Rank ", or interleaved with another's), keeping a line of the user's that only looks like
    a piece of it."""
    out, err = io.StringIO(), io.StringIO()
    code = _python(
        "import os, sys; e = os.environ; print(e['MESHAX_PROCESS_ID'], e['MESHAX_NUM_PROCESSES'], "
        "e['JAX_NUM_CPU_DEVICES'], e['JAX_COORDINATOR_ADDRESS']); print('to stderr', file=sys.stderr); "
        "g = '[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1'; "
        "print(g); print(g + g); print(); print('kept:' + g); print(g[:13]); print(g[13:]); "
        "print(g[13:30]); print(g[32:]); print(g[:12]); print(g[12:]); print(g[:30] + g); print(g[30:]); "
        "print('node a is connected to 3 peers')"
    )
    assert launch(code, 3, devices_per_process=4, port=23456, stdout=out, stderr=err) == 0
    lines = sorted(out.getvalue().splitlines())
    assert lines == sorted(
        [f"[{i}] {i} 3 4 localhost:23456" for i in range(3)]
        + [f"[{i}] kept:" for i in range(3)]
        + [f"[{i}] node a is connected to 3 peers" for i in range(3)]
    )
    assert sorted(line for line in err.getvalue().splitlines() if "to stderr" in line) == [
        f"[{i}] to stderr" for i in range(3)
    ]
    assert "3 processes, coordinator localhost:23456" in err.getvalue()


def test_launch_drops_a_gloo_count_left_alone_on_its_line():
    """A message whose count was cut off by another's head ends on a line of its own: its count
    (here "1") and newline. Seen as "[1] 7" after a 2-process lm job's layout table."""
    out, err = io.StringIO(), io.StringIO()
    g = "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"
    code = _python(f"g = {g!r}; print(g[:-1] + g); print('1'); print('user line'); print(g[:-1] + g); print()")
    assert launch(code, 1, stdout=out, stderr=err) == 0
    assert out.getvalue().splitlines() == ["[0] user line"]


def test_an_error_every_process_says_is_written_once():
    """Every process of a job checks the same flags (and model), so each says the same
    `meshax: error:` line: the launcher wrote one per process. It writes the first; an error
    line of another text is kept."""
    out, err = io.StringIO(), io.StringIO()
    code = _python(
        "import os, sys, time; i = os.environ['MESHAX_PROCESS_ID']\n"
        "time.sleep(0.2 * int(i))\n"
        "print('meshax: error: layout rule batch:nosuch names mesh dim nosuch', file=sys.stderr)\n"
        "if i == '2': print('meshax: error: only mine', file=sys.stderr)\n"
        "sys.exit(2 if i == '0' else 0)"
    )
    assert launch(code, 3, grace=1.0, stdout=out, stderr=err) == 2
    lines = [line for line in err.getvalue().splitlines() if "meshax: error:" in line]
    assert len(lines) in (1, 2) and lines[0].endswith("meshax: error: layout rule batch:nosuch names mesh dim nosuch")
    assert all("only mine" in line for line in lines[1:])  # (process 2's, when it came before the stop)


def test_jax_ending_a_process_after_the_job_failed_is_one_line():
    """A process that loses JAX's distributed service when process 0 (its host) is gone printed
    absl's lines, gRPC's details and a C++ stack trace, ~40 lines saying that another process
    ended: one line, saying so."""
    out, err = io.StringIO(), io.StringIO()
    fatal = [
        "W1128 15:28:17.817413    9297 preemption_sync_manager.cc:147] Failed to retrieve preemption notice from "
        "coordination service: UNAVAILABLE: Socket closed",
        "Additional GRPC error information from remote target coordination_service while calling /x/GetKeyValue:",
        ":UNKNOWN:Error received from peer  {grpc_status:14}. This is only expected if one of the tasks is unhealthy.",
        "E1128 15:25:21.155787    6337 coordination_service_agent.cc:289] Polled an error from coordination "
        "service (this can be an error from this or another task).",
        "F1128 15:25:21.155824    6337 client.h:80] Terminating process because the JAX distributed service "
        "detected fatal errors. This most likely indicates that another task died; see the other task logs",
        "Additional GRPC error information from remote target coordination_service while calling /x/PollForError:",
        ':UNKNOWN:Error received from peer  {grpc_message:"Socket closed", grpc_status:14}',
        "*** Check failure stack trace: ***",
        "    @     0x7f715dc40634  absl::lts_20260107::log_internal::LogMessage::SendToLog()",
    ]
    sigterm = "W1128 16:10:54.895909   29832 preemption_notifier.cc:90] SIGTERM caught at 2026-11-28T16:10:54"
    code = _python(f"import sys; print({sigterm!r}, file=sys.stderr); print('\\n'.join({fatal!r}), file=sys.stderr)")
    assert launch(code, 1, stdout=out, stderr=err) == 0
    lines = [line for line in err.getvalue().splitlines() if line.startswith("[0] ")]
    # (a SIGTERM's notice is no failure: kept)
    assert lines == ["[0] " + sigterm, "[0] " + __import__("meshax.launch").launch._LOST_JAX.strip()]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--layout", "batch:nosuch"], "names mesh dim 'nosuch'"),  # (before the job is joined)
        (["--resume", "no-such-folder"], "--resume 'no-such-folder': no checkpoint there"),  # (after)
    ],
)
def test_a_bad_flag_in_a_job_is_one_error(flags, said):
    """`meshax launch -n 2 -- meshax train ...` with a flag every process refuses: one line says
    so (each process said it; and a process that JAX's distributed service ended once process 0
    had, after its error, printed a C++ stack trace), and the launcher exits 2 at once."""
    start = time.monotonic()
    result = _launch([*CLI, "train", "mnist", "--steps", "2", *flags], timeout=120)
    assert time.monotonic() - start < 30
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and said in errors[0], result.stderr[-3000:]
    assert "stack trace" not in result.stderr and "\n[1]     @ " not in result.stderr


def test_a_one_process_command_under_launch_runs_once():
    """`meshax launch -n 2 -- meshax plan ...`: process 0 prints the plan, the other exits quietly
    (each printed it)."""
    out, err = io.StringIO(), io.StringIO()
    plan = [*CLI, "plan", "mlp", "--mesh", "all:8", "--layout", "batch:all", "--json"]
    assert launch(plan, 2, stdout=out, stderr=err) == 0, err.getvalue()
    lines = out.getvalue().splitlines()
    assert lines and all(line.startswith("[0] ") for line in lines)
    assert json.loads("\n".join(line[4:] for line in lines))["parameters"] == 8320


def test_of_failures_seen_at_once_a_process_killed_by_a_signal_is_named():
    """kill -9 of process 1, and process 0's collective failing a millisecond later: the order in
    which the launcher sees their exits is up to its threads; the killed one is the cause."""
    import queue

    from meshax.launch import _cause

    exits: queue.Queue = queue.Queue()
    exits.put((1, -9))
    assert _cause(exits, 0, 2, set()) == (1, -9)
    assert _cause(exits, 1, 3, set()) == (1, 3)  # (none killed: the first seen)


def test_a_process_that_lost_jaxs_service_is_not_named_the_cause():
    """Process 0 exits 2 on a bad flag; process 1, which then lost JAX's distributed service,
    aborts (SIGABRT) within the same 50 ms: the launcher named the abort and exited 134 (a CI run
    of test_a_bad_flag_in_a_job_is_one_error failed so). The process that ended first is the cause."""
    import io
    import queue
    import threading

    from meshax.launch import _LOST_JAX, _cause, _forward

    lost_by: set[int] = set()
    log = io.StringIO("E0101 00:00:00.000000   12 coordination_service_agent.cc:1] Failed to ...\n")
    out = io.StringIO()
    _forward(log, "[1] ", out, threading.Lock(), lost_by=lost_by, index=1)
    assert out.getvalue() == "[1] " + _LOST_JAX and lost_by == {1}
    exits: queue.Queue = queue.Queue()
    exits.put((1, -6))
    assert _cause(exits, 0, 2, lost_by) == (0, 2)
    exits.put((0, 2))
    assert _cause(exits, 1, -6, lost_by) == (0, 2)
    exits.put((1, -6))
    assert _cause(exits, 1, -6, lost_by) == (1, -6)  # (nothing else seen: named as it is)


def test_a_process_stopped_by_a_preemption_notice_has_not_failed(tmp_path):
    """Exit code 143 is `meshax train`'s after a preemption notice, its checkpoint saved: the
    launcher waits for the others (still saving theirs) instead of killing them after its grace
    time, says they stopped on the notice, and exits 143."""
    out, err = io.StringIO(), io.StringIO()
    saved = tmp_path / "saved"
    code = _python(
        "import os, sys, time\n"
        "if os.environ['MESHAX_PROCESS_ID'] == '1':\n"
        "    time.sleep(1.5)\n"
        f"    open({str(saved)!r}, 'w').close()\n"
        "sys.exit(143)\n"
    )
    assert launch(code, 2, grace=0.2, stdout=out, stderr=err) == 143
    assert saved.exists(), err.getvalue()  # (process 1 was not killed while it saved)
    assert "stopped on a preemption notice" in err.getvalue() and "stopping the other" not in err.getvalue()


@pytest.mark.parametrize(
    ("failure", "code", "said"),
    [("sys.exit(3)", 3, "exited with code 3"), ("os.kill(os.getpid(), 9)", 128 + 9, "was killed by SIGKILL")],
)
def test_launch_stops_everyone_when_one_process_fails(failure, code, said, tmp_path, monkeypatch):
    """Process 1 fails once process 0 is up; process 0 would sleep a minute (as one stuck in a
    collective with a dead peer would, ignoring SIGTERM): the launcher names process 1, kills
    process 0 after the grace period, and returns the failure's code."""
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setenv("READY", str(tmp_path / "ready"))
    script = (
        "import os, pathlib, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "ready = pathlib.Path(os.environ['READY'])\n"
        "if os.environ['MESHAX_PROCESS_ID'] == '1':\n"
        "    while not ready.exists(): time.sleep(0.01)\n"
        f"    {failure}\n"
        "print(os.getpid(), flush=True); ready.touch(); time.sleep(60)"
    )
    start = time.monotonic()
    assert launch(_python(script), 2, grace=1.0, stdout=out, stderr=err) == code
    assert time.monotonic() - start < 15  # the grace period, the start of two interpreters, and slack
    assert "process 1 (pid" in err.getvalue() and said in err.getvalue()
    survivor = int(out.getvalue().split()[-1])
    with pytest.raises(ProcessLookupError):  # reaped: nothing left running
        os.kill(survivor, 0)


def test_launch_names_the_process_that_failed_first(tmp_path, monkeypatch):
    """Process 1 fails; process 0 fails 10 ms after process 1 is gone, as a process whose
    collective loses its peer does: the launcher names process 1 (it named the lowest id of those
    gone at one look). Process 0 learns that process 1 is gone as gloo does, from the kernel:
    process 1 holds a lock that is released when the process ends (its files closed), not a file
    it touched before its exit, which left the order to the scheduler: on a loaded machine process
    1's exit (its interpreter's teardown) could take more than 10 ms, and process 0 end first."""
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setenv("LOCK", str(tmp_path / "lock"))
    script = (
        "import fcntl, os, sys, time; lock = os.environ['LOCK']\n"
        "if os.environ['MESHAX_PROCESS_ID'] == '1':\n"
        "    fd = os.open(lock + '.new', os.O_CREAT | os.O_WRONLY); fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "    os.rename(lock + '.new', lock); time.sleep(0.5); sys.exit(3)\n"
        "while not os.path.exists(lock): time.sleep(0.001)\n"
        "fcntl.flock(os.open(lock, os.O_WRONLY), fcntl.LOCK_EX)  # (once process 1 is gone)\n"
        "time.sleep(0.01); sys.exit(4)"
    )
    assert launch(_python(script), 2, grace=1.0, stdout=out, stderr=err) == 3
    assert "process 1 (pid" in err.getvalue() and "exited with code 3" in err.getvalue()


def test_launch_forwards_sigterm_to_its_processes(tmp_path):
    """SIGTERM to the launcher reaches each process, which exits: the launcher reports it."""
    script = (
        "import os, pathlib, time\n"
        "pathlib.Path(os.environ['READY'] + os.environ['MESHAX_PROCESS_ID']).touch(); time.sleep(60)"
    )
    proc, err, _ = _launch_and_signal(tmp_path, script, signal.SIGTERM)
    assert proc.returncode == 128 + signal.SIGTERM
    assert b"was killed by SIGTERM" in err


def _launch_and_signal(tmp_path, script: str, signum=signal.SIGINT) -> tuple[subprocess.Popen, bytes, float]:
    """`meshax launch -n 2` of `script` (its processes touch READY<i> when ready), `signum` to the
    launcher once both are ready: (the launcher, its stderr, seconds from the signal to its exit)."""
    env = dict(os.environ, READY=str(tmp_path / "ready"))
    proc = subprocess.Popen(
        [*CLI, "launch", "-n", "2", "--", *_python(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready{i}").exists() for i in range(2)) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signum)
    sent = time.monotonic()
    _, err = proc.communicate(timeout=60)
    return proc, err, time.monotonic() - sent


def test_launch_ctrl_c_exits_130_whatever_the_processes_end_with(tmp_path):
    """After a SIGINT, a process whose collective lost a peer that stopped first ends with that
    error before it sees its own SIGINT: no failure of the job's to name. The launcher named
    process 1's code 1 and exited with it."""
    script = (
        "import os, pathlib, signal, sys, time; i = os.environ['MESHAX_PROCESS_ID']\n"
        "signal.signal(signal.SIGINT, lambda *a: os._exit(1 if i == '1' else 130) if i == '1' else "
        "(time.sleep(0.3), os._exit(130)))\n"
        "pathlib.Path(os.environ['READY'] + i).touch(); time.sleep(30)"
    )
    proc, err, took = _launch_and_signal(tmp_path, script)
    assert proc.returncode == 130 and took < 10, err
    assert b"stopping" not in err and b"exited with code" not in err, err


def test_launch_ctrl_c_stops_a_process_that_does_not_end(tmp_path):
    """A process still running `grace` seconds after the SIGINT (in a collective that never
    ends) is stopped and named; the launcher exits 130. It waited for them (here 30 s) and exited 0."""
    script = (
        "import os, pathlib, signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "pathlib.Path(os.environ['READY'] + os.environ['MESHAX_PROCESS_ID']).touch(); time.sleep(30)"
    )
    proc, err, took = _launch_and_signal(tmp_path, script)
    assert proc.returncode == 130 and took < 15, err
    assert b"meshax launch: interrupted; process 0 (pid" in err and b"still running 3 s after SIGINT" in err, err


def test_ctrl_c_in_a_process_of_a_job_ends_it_at_once_after_one_line():
    """exit_at_once_on_interrupt: the first SIGINT's line (in process 0 only), exit status 130,
    at once; a second SIGINT while it says it (the terminal's, then the launcher's) changes nothing."""
    script = (
        "import os, signal, sys, time; from meshax.runtime import exit_at_once_on_interrupt\n"
        "def say(): os.kill(os.getpid(), signal.SIGINT); return 'meshax: interrupted'\n"
        "exit_at_once_on_interrupt(say, first=sys.argv[1] == '0')\n"
        "os.kill(os.getpid(), signal.SIGINT); time.sleep(30); print('still here')"
    )
    for process, said in (("0", "meshax: interrupted\n"), ("1", "")):
        start = time.monotonic()
        done = subprocess.run([*_python(script), process], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert (done.returncode, done.stdout, done.stderr) == (130, "", said)
        assert time.monotonic() - start < 20


def test_launch_bad_input_is_one_clear_line():
    with pytest.raises(ValueError, match="needs a command"):
        launch([], 2)
    with pytest.raises(ValueError, match="cannot start 'no-such-program-here'"):
        launch(["no-such-program-here"], 2, stderr=io.StringIO())
    result = subprocess.run([*CLI, "launch", "-n", "0", "--", "true"], capture_output=True, text=True)
    assert result.returncode == 2 and "-n" in result.stderr
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:  # (JAX said "Failed to start RPC server")
        busy.bind(("localhost", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            [*CLI, "launch", "-n", "2", "--port", str(port), "--", "true"], capture_output=True, text=True
        )
    assert result.returncode == 2 and f"--port {port}: something on this machine listens on it already" in result.stderr


def test_launch_that_cannot_start_a_thread_stops_the_processes_it_started(monkeypatch):
    """A thread to forward a process's output that cannot start (`-n 99999`: the system's thread
    limit) ended launch with 'can't start new thread', leaving the processes started so far
    running (a job's processes wait for the rest for good); now they are stopped, and the error
    says how many started and what to change."""
    import threading

    import meshax.launch

    procs, threads = [], []
    popen, start = subprocess.Popen, threading.Thread.start

    def recorded(*args, **kwargs):
        procs.append(popen(*args, **kwargs))
        return procs[-1]

    def start_or_fail(self):
        if len(threads) == 3:  # (process 1's stderr)
            raise RuntimeError("can't start new thread")
        threads.append(self)
        start(self)

    monkeypatch.setattr(meshax.launch.subprocess, "Popen", recorded)
    monkeypatch.setattr(threading.Thread, "start", start_or_fail)
    with pytest.raises(ValueError, match=r"meshax launch: 2 of 3 processes started, then: can't start new thread"):
        launch(_python("import time; time.sleep(60)"), 3, stderr=io.StringIO(), grace=1.0)
    assert len(procs) == 2 and all(p.poll() is not None for p in procs)  # (stopped, not left running)


def test_train_refuses_processes_that_cannot_share_the_mesh(capsys):
    from meshax.cli import main

    args = ["train", "mlp", "--mesh", "all:8", "--layout", "", "--steps", "1", "--num-processes", "3"]
    assert main([*args, "--process-id", "0", "--coordinator", "localhost:1"]) == 2
    assert "8 devices, which 3 processes cannot share evenly" in capsys.readouterr().err
    assert main([*args, "--coordinator", "localhost:1"]) == 2
    assert "--process-id missing: give --coordinator, --num-processes and --process-id together" in (
        capsys.readouterr().err
    )


def test_distributed_without_a_job_says_how_to_give_one():
    """In a fresh process (this one's JAX backend is up, and joining must come before that)."""
    env = {k: v for k, v in os.environ.items() if k not in ("KUBERNETES_SERVICE_HOST", "SLURM_JOB_ID")}
    env = {k: v for k, v in env.items() if not k.startswith(("MESHAX_", "JAX_COORDINATOR"))}
    result = subprocess.run(
        [*CLI, "train", "mlp", "--mesh", "all:2", "--layout", "", "--steps", "1", "--distributed"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "no multi-process job to join" in result.stderr and "meshax launch" in result.stderr


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"coordinator": "localhost"}, "must be HOST:PORT"),
        ({"num_processes": 2, "process_id": 2}, "process id 2 is not in 0..1"),
        ({"num_processes": 0}, "at least 1"),
        # (a process other than the coordinator would wait 2 minutes for it, then abort)
        ({"coordinator": "localhost:abc", "num_processes": 2, "process_id": 1}, "a port from 1 to 65535"),
        ({"coordinator": "localhost:99999", "num_processes": 2, "process_id": 0}, "a port from 1 to 65535"),
        ({"coordinator": ":1234", "num_processes": 2, "process_id": 0}, "must be HOST:PORT"),
    ],
)
def test_initialize_distributed_bad_input(kwargs, message, monkeypatch):
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
    for name in ("MESHAX_NUM_PROCESSES", "KUBERNETES_SERVICE_HOST", "SLURM_JOB_ID"):  # no job to find
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=message):
        mx.initialize_distributed(**kwargs)


def test_initialize_distributed_bad_coordinator_in_the_environment(monkeypatch):
    """JAX_COORDINATOR_ADDRESS without a port: one line naming it (JAX raised an IndexError)."""
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "garbage")
    monkeypatch.setenv("MESHAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("MESHAX_PROCESS_ID", "0")
    with pytest.raises(ValueError, match="environment variable JAX_COORDINATOR_ADDRESS 'garbage' must be HOST:PORT"):
        mx.initialize_distributed()


# ------------------------------------------------------- feeding rows (one process: all of them)


@pytest.mark.parametrize("layout", ["", "b:rows", "b:cols", "b:rows;b:cols", "d:cols"])
def test_feed_rows_and_put_rows_in_one_process(layout):
    """In one process every row is this process's; put_rows of all of them is `put`, padding
    included (b:rows;b:cols splits 10 rows into 8 slices of 2, padded at two levels)."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    b, d = mx.Dimension("b", 10), mx.Dimension("d", 8)
    x = mx.placeholder(mesh, "x", [b, d])
    lowering = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", layout)})
    fn = lowering.function(mx.reduce_sum(x * 2.0, reduced_dim=d))
    assert fn.feed_rows() == (0, 10)
    xv = np.arange(80, dtype=np.float32).reshape(10, 8)
    spec = lowering._spec(x)
    np.testing.assert_array_equal(np.asarray(lowering.impl.put_rows(xv, 0, spec)), lowering.impl.put(xv, spec))
    np.testing.assert_array_equal(fn({x: xv}, rows=(0, 10)), (2 * xv).sum(1))
    with pytest.raises(ValueError, match=r"expects shape \[4, 8\] \(rows 2..5 of b\)"):
        fn({x: xv}, rows=(2, 6))
    with pytest.raises(ValueError, match="feed the rows feed_rows"):
        lowering.impl.put_rows(xv[2:6], 2, spec)


def test_rows_that_are_no_rows_of_the_batch_are_named():
    """rows past the dim were asked for as the array's shape ('expects shape [100, 8] (rows
    0..99 of b)' for a dim of 10); rows that are no (lo, hi) pair were an IndexError ('a') or a
    TypeError from slicing (1.5) from inside."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    x = mx.placeholder(mesh, "x", "b:10;d:8")
    fn = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "b:rows")}).function(mx.reduce_sum(x))
    xv = np.ones((10, 8), np.float32)
    for rows in ((0, 100), (-1, 9), (6, 4)):
        with pytest.raises(ValueError, match=r"rows .* are not rows of Dimension\('b', 10\) \(placeholder 'x'\)"):
            fn({x: xv}, rows=rows)
    for rows in ("a", (1.5, 3), (0,)):
        with pytest.raises(ValueError, match=r"rows are \(lo, hi\), whole numbers, as feed_rows\(\) gives them"):
            fn({x: xv}, rows=rows)
    assert float(fn({x: xv}, rows=[np.int64(0), 10])) == 80.0


def test_task_rows_are_the_batch_rows():
    """Each row of a batch is drawn alone, so the rows one process draws are the batch's."""
    for task in (worker.make_task("lm-2d"), worker.make_task("mnist-2d"), mx_task("seq2seq"), mx_task("unet")):
        whole = task.train_batch(3)
        part = task.train_batch(3, (2, 5))
        for name, value in whole.items():
            np.testing.assert_array_equal(part[name], value[2:5], err_msg=f"{task.name} {name}")
        whole, part = next(iter(task.eval_batches())), next(iter(task.eval_batches((1, 4))))
        for name, value in whole.items():
            np.testing.assert_array_equal(part[name], value[1:4], err_msg=f"{task.name} eval {name}")


def mx_task(name):
    from meshax.train.tasks import TASKS

    return TASKS[name](batch_size=8) if name != "seq2seq" else TASKS[name](batch_size=8, length=4)


# ------------------------------------------------------ end to end: 2 processes x 4 CPU devices


def _launch(args, timeout=600):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    return subprocess.run(
        [*CLI, "launch", "-n", "2", "--devices-per-process", "4", "--", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """One 2-process job running tests/multiprocess_worker.py; it restores a checkpoint this
    (single) process wrote first, in the run of the checkpoint case kept for comparison."""
    out = tmp_path_factory.mktemp("job")
    single = {worker.CHECKPOINT_CASE: worker.run_case(worker.CHECKPOINT_CASE, checkpoint_dir=str(out / "single"))}
    result = _launch([sys.executable, str(ROOT / "tests" / "multiprocess_worker.py"), str(out), str(out / "single")])
    assert result.returncode == 0, result.stderr[-4000:]
    return out, json.loads((out / "result.json").read_text()), single


@pytest.mark.slow
def test_job_spans_two_processes(job):
    _, result, _ = job
    assert result["processes"] == 2 and result["local_devices"] == 4


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["allreduce", "reduce_scatter", "allgather", "alltoall", "permute"])
def test_collective_across_processes_equals_numpy(job, kind):
    got = job[1]["collectives"][kind]
    assert got["count"] >= 1  # the program really has one of this kind, between the processes
    assert got["error"] < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("case", list(worker.CASES))
def test_two_processes_train_as_one(job, case):
    """2 processes x 4 devices give one process x 8 devices' losses, step for step (to float32
    rounding: gloo adds in another order), and the same evaluation."""
    got = job[1]["cases"][case]
    want = job[2][case] if case in job[2] else worker.run_case(case)  # (the checkpoint case: run once)
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=2e-6)
    assert got["eval"] == pytest.approx(want["eval"], rel=1e-5)


@pytest.mark.slow
def test_checkpoints_move_between_process_counts(job):
    """Written by one process, restored by two; written by two, restored by one."""
    out, result, _ = job
    task = worker.make_task(worker.CHECKPOINT_CASE)
    _, _, mesh, layout = worker.CASES[worker.CHECKPOINT_CASE]
    single = loop.build(task, mesh, layout)
    assert restore_checkpoint(str(out / "single"), single.lowering)["step"] == worker.STEPS
    assert result["restored_step"] == worker.STEPS
    restored = np.load(out / "restored.npz")
    for var in single.lowering.graph.all_variables:
        np.testing.assert_array_equal(restored[var.name.replace("/", ".")], single.lowering.variable_value(var))

    other = loop.build(task, "all:8", "hidden:all")  # and onto another mesh and layout
    assert restore_checkpoint(str(out / "written"), other.lowering)["step"] == worker.STEPS
    others = {v.name: v for v in other.lowering.graph.all_variables}
    for var in single.lowering.graph.all_variables:
        np.testing.assert_allclose(
            other.lowering.variable_value(others[var.name]), single.lowering.variable_value(var), rtol=1e-5, atol=1e-6
        )


def _losses(path):
    out = {}
    for line in Path(path).read_text().splitlines():
        entry = json.loads(line)
        if "loss" in entry:
            out[entry["step"]] = entry["loss"]
    return out


TRAIN = ["mnist", "--hidden", "64", "--mesh", "rows:2;cols:4", "--eval-every", "0", "--no-progress"]


@pytest.mark.slow
def test_kill_one_process_then_resume(tmp_path):
    """kill -9 of one of two processes mid-training: the launcher exits non-zero within its grace
    period, naming the process; nothing is left running; resuming from the last checkpoint (in two
    processes) gives the losses of an uninterrupted run."""
    ckpt, log, full = tmp_path / "ckpt", tmp_path / "killed.jsonl", tmp_path / "full.jsonl"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    args = [*CLI, "train", *TRAIN, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "5", "--metrics", str(log)]
    proc = subprocess.Popen(
        [*CLI, "launch", "-n", "2", "--devices-per-process", "4", "--", *args, "--steps", "400"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if log.exists() and len(_losses(log)) >= 12:
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read()
    first = proc.stderr.readline()
    while "pids" not in first:
        first = proc.stderr.readline()
    survivor, victim = (int(pid) for pid in first.split()[-2:])
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    proc.wait(timeout=60)
    assert time.monotonic() - killed_at < 10  # 3 s grace + polling + reaping
    assert proc.returncode != 0
    assert f"process 1 (pid {victim}) was killed by SIGKILL" in proc.stderr.read()
    with pytest.raises(ProcessLookupError):  # stopped and reaped: nothing left running
        os.kill(survivor, 0)
    done = len(_losses(log))
    assert 12 <= done < 400
    steps = done + 10

    resumed = _launch([*CLI, "train", *TRAIN, "--resume", str(ckpt), "--steps", str(steps), "--metrics", str(log)])
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    printed = resumed.stdout.splitlines()  # process 0 speaks for both
    assert any(line.startswith("[0] eval after step") for line in printed)
    assert [line for line in printed if line.startswith("[1] ") and line.strip() != "[1]"] == []
    resumed_at = int(re.search(r"\[0\] resuming from step (\d+) of", resumed.stdout)[1])
    assert resumed_at % 5 == 0 and 5 <= resumed_at <= done  # the last complete checkpoint
    whole = subprocess.run([*CLI, "train", *TRAIN, "--steps", str(steps), "--metrics", str(full)], env=env, timeout=600)
    assert whole.returncode == 0
    got, want = _losses(log), _losses(full)
    steps = list(range(1, steps + 1))
    np.testing.assert_allclose([got[s] for s in steps], [want[s] for s in steps], rtol=2e-6)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a disk that is full)")
def test_a_process_that_fails_alone_is_named_at_once():
    """Process 0 alone fails (its --metrics file cannot be written) while process 1 goes on to
    the next step's collectives: process 0 exits with its error's code at once, and the launcher
    names it (it waited 60 s in JAX's shutdown barrier for process 1, then both aborted: SIGABRT)."""
    command = [*CLI, "train", *TRAIN, "--steps", "100000", "--metrics", "/dev/full"]
    _ends_at_once(command, 0, 2, "[0] meshax: error: [Errno 28] No space left on device")


def _ends_at_once(command: list[str], process: int, code: int, said: str) -> None:
    """The job of `command` ends within 45 s with `code`, having printed `said`, the launcher
    naming `process` as the one that failed."""
    start = time.monotonic()
    result = _launch(command, timeout=300)
    assert time.monotonic() - start < 45, result.stderr[-3000:]
    assert result.returncode == code, result.stderr[-3000:]
    assert said in result.stderr
    assert re.search(rf"meshax launch: process {process} \(pid \d+\) exited with code {code}", result.stderr)


@pytest.mark.slow
def test_an_uncaught_exception_in_one_process_ends_it_at_once(tmp_path):
    """The same from Python: process 1 raises mid-training, process 0 goes on; process 1 exits
    with code 1 after its traceback, not after the shutdown barrier's 60 s."""
    script = tmp_path / "fail.py"
    script.write_text(
        "import jax, meshax as mx\n"
        "mx.initialize_distributed()\n"
        "from meshax.train import loop\n"
        "from tests import multiprocess_worker as worker\n"
        "def on_step(step, loss, seconds):\n"
        "    if jax.process_index() == 1 and step == 2:\n"
        "        raise RuntimeError('boom in process 1')\n"
        "task = worker.make_task('mnist-2d')\n"
        "loop.train(task, 'rows:2;cols:4', 'batch:rows;hidden:cols', steps=100000, on_step=on_step)\n"
    )
    _ends_at_once([sys.executable, str(script)], 1, 1, "[1] RuntimeError: boom in process 1")


@pytest.mark.slow
def test_sigterm_stops_every_process_at_one_step_with_a_checkpoint(tmp_path):
    """A preemption notice (SIGTERM, here to the launcher, which passes it on): JAX agrees on a
    step, every process stops after it, and the checkpoint of that step is saved."""
    from meshax.train.checkpoint import latest_step

    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    args = [*CLI, "train", *TRAIN, "--steps", "100000", "--checkpoint-dir", str(ckpt), "--metrics", str(log)]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(
        [*CLI, "launch", "-n", "2", "--devices-per-process", "4", "--", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None and not (log.exists() and len(_losses(log)) >= 5):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    stopped = int(re.search(r"\[0\] meshax: stopped after step (\d+) on a preemption notice", out)[1])
    assert stopped >= 5 and latest_step(str(ckpt)) == stopped
    assert f"continue with --resume {ckpt}" in out


@pytest.mark.slow
def test_without_the_launcher_a_dead_process_stops_the_other(tmp_path):
    """Two processes joined by flags alone (as under SLURM): kill -9 of process 1 ends process 0
    within JAX's heartbeat timeout, with an error that says a task stopped sending heartbeats (or, where
    the dead peer's connection closes, that process 0's collective failed)."""
    from meshax.launch import free_port
    from meshax.runtime import HEARTBEAT_TIMEOUT

    port, log = free_port(), tmp_path / "log.jsonl"
    procs = []
    for i in range(2):
        env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="4")
        metrics = ["--metrics", str(log)] if i == 0 else []
        flags = ["--coordinator", f"localhost:{port}", "--num-processes", "2", "--process-id", str(i)]
        procs.append(
            subprocess.Popen(
                [*CLI, "train", *TRAIN, "--steps", "100000", *flags, *metrics],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not (log.exists() and len(_losses(log)) >= 5):
            assert all(p.poll() is None for p in procs)
            time.sleep(0.05)
        procs[1].kill()
        killed_at = time.monotonic()
        _, err = procs[0].communicate(timeout=HEARTBEAT_TIMEOUT + 30)
        assert time.monotonic() - killed_at < HEARTBEAT_TIMEOUT + 10
        assert procs[0].returncode != 0
        # JAX's heartbeat check names the task; where the peer's connection closes first (this machine),
        # process 0's collective fails at once and it exits then, not waiting in the shutdown barrier
        assert "stopped sending heartbeats" in err or "Gloo all-reduce failed" in err, err[-3000:]
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.slow
def test_a_platform_dependent_branch_is_chosen_in_every_process_of_a_job(tmp_path):
    """mx.partition asks `lax.platform_dependent` which branch runs on the mesh's platform, on a
    device of that platform: the first of the job's (`jax.devices`), which in process 1 is
    process 0's, so that asking failed there ("Fetching value for `jax.Array` that spans
    non-addressable ... devices"). It asks on one of the process's own devices."""
    script = tmp_path / "branch.py"
    script.write_text(
        "import jax, jax.numpy as jnp, numpy as np, meshax as mx\n"
        "mx.initialize_distributed()\n"
        "from jax.sharding import PartitionSpec as P\n"
        "def f(a):\n"
        "    return jax.lax.platform_dependent(a, cpu=jnp.sin, cuda=jnp.cos, rocm=jnp.cos, default=jnp.tanh) * 2.0\n"
        "g = mx.partition(f, 'x:2;y:4', in_shardings=(P('x', 'y'),))\n"
        "program = g.lower(np.zeros((4, 8), np.float32))\n"
        "ops = [op.name for op in program.graph.operations]\n"
        "print('process', jax.process_index(), 'lowered', ops, flush=True)\n"
    )
    result = _launch([sys.executable, str(script)], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = sorted(line for line in result.stdout.splitlines() if "lowered" in line)
    assert len(lines) == 2 and lines[0].startswith("[0] process 0") and lines[1].startswith("[1] process 1")
    assert all("'sin'" in line for line in lines), lines  # (the CPU's branch)


@pytest.mark.slow
def test_a_warning_in_a_job_is_written_once(tmp_path):
    """Restoring a checkpoint with variables the graph lacks (here a loss scale's: a float16 run's
    checkpoint resumed without one) warns; every process of `meshax train` warned, one copy per
    process. Process 0 speaks for all, as it does for the rest of the output."""
    from meshax.optimize import AdamWeightDecayOptimizer, LossScaleOptimizer

    ckpt = tmp_path / "ckpt"
    scaled = LossScaleOptimizer(AdamWeightDecayOptimizer(1e-3))
    loop.train(
        worker.make_task("mnist-2d"),
        "rows:2;cols:4",
        "batch:rows;hidden:cols",
        steps=1,
        optimizer=scaled,
        checkpoint_dir=str(ckpt),
    )
    result = _launch([*CLI, "train", *TRAIN, "--resume", str(ckpt), "--steps", "2"], timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    warned = [line for line in result.stderr.splitlines() if "has variables the graph lacks" in line]
    assert len(warned) == 1 and warned[0].startswith("[0] "), result.stderr[-3000:]


@pytest.mark.slow
def test_feeding_rows_where_one_process_holds_the_first_and_the_last(tmp_path):
    """10 rows split over cols (4) and then rows (2) of "rows:2;cols:4": process 0's slices hold
    rows 0-1, 3-4, 6-7 and 9, so its feed_rows() is every row (0..10), process 1's only 2..9. Fed
    every row, process 0 took the whole array's path, JAX's check that every process passed the
    same (a collective), which process 1, feeding a part, never joined: the job hung until gloo's
    30 s timeout."""
    script = tmp_path / "rows.py"
    script.write_text(
        "import jax, numpy as np, meshax as mx\n"
        "mx.initialize_distributed()\n"
        "graph = mx.Graph(); mesh = mx.Mesh(graph, 'mesh')\n"
        "b, d = mx.Dimension('b', 10), mx.Dimension('d', 8)\n"
        "x = mx.placeholder(mesh, 'x', [b, d])\n"
        "lowering = mx.Lowering(graph, {mesh: mx.SimdMeshImpl('rows:2;cols:4', 'b:cols;b:rows')})\n"
        "fn = lowering.function([mx.reduce_sum(x * 2.0, reduced_dim=d), x + 1.0])\n"
        "lo, hi = fn.feed_rows()\n"
        "xv = np.arange(80, dtype=np.float32).reshape(10, 8)\n"
        "total, plus = fn({x: xv[lo:hi]}, rows=(lo, hi))\n"
        "np.testing.assert_array_equal(total, (2 * xv).sum(1)); np.testing.assert_array_equal(plus, xv + 1)\n"
        "print('process', jax.process_index(), 'rows', lo, hi, 'ok', flush=True)\n"
    )
    start = time.monotonic()
    result = _launch([sys.executable, str(script)], timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert time.monotonic() - start < 25
    lines = sorted(line for line in result.stdout.splitlines() if " ok" in line)
    assert lines == ["[0] process 0 rows 0 10 ok", "[1] process 1 rows 2 9 ok"], result.stdout


@pytest.mark.slow
def test_train_search_measured_in_a_job_trains_process_0s_choice(tmp_path):
    """`meshax train --search --measure K` in a job: each process times the K best itself, and
    their rankings may differ (here made to: process 1's times are reversed), so that processes
    would build different programs and wait for each other in collectives that never match.
    Every process trains process 0's choice."""
    script = tmp_path / "searched.py"
    script.write_text(
        "import sys, jax\n"
        "import meshax.search.measure as measure\n"
        "real = measure.in_blocks\n"
        "def in_blocks(fns, rounds, block):\n"
        "    got = real(fns, 1, 1)\n"  # (every process runs the same steps, in the same order)
        "    flip = -1 if jax.process_index() else 1\n"
        "    return {i: 1.0 + flip * i for i in got}\n"
        "measure.in_blocks = in_blocks\n"
        "from meshax.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    args = ["mnist", "--mesh", "rows:2;cols:4", "--steps", "2", "--no-progress", "--search", "--measure", "2"]
    result = _launch([sys.executable, str(script), "train", *args], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    table = [line for line in result.stdout.splitlines() if line.startswith("[0] 1 ")]
    trained = re.search(r"layout '([^']*)'", result.stdout)
    assert len(table) == 1 and trained and table[0].split()[2] == trained.group(1)
    assert "[1] layout search" not in result.stdout  # (process 0 speaks for all)


@pytest.mark.parametrize(
    ("coordinator", "processes", "sharing"),
    [
        ("localhost:1234", 2, 2),
        ("127.0.0.1:1234", 4, 4),
        ("[::1]:1234", 2, 2),
        ("node7:1234", 2, 1),  # (others may be elsewhere: each host has its own memory)
        (None, 2, 1),  # (a cluster JAX detected)
        ("localhost:1234", 1, 1),
    ],
)
def test_processes_on_this_host_are_all_of_a_job_coordinated_at_its_loopback(
    coordinator, processes, sharing, monkeypatch
):
    import jax

    from meshax import runtime

    monkeypatch.setattr(runtime, "_coordinator", coordinator)
    monkeypatch.setattr(jax, "process_count", lambda: processes)
    assert runtime.processes_on_this_host() == sharing
