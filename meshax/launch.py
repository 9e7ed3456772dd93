"""`meshax launch`: run one multi-process job on this machine (for one big machine, and for tests).

    meshax launch -n 2 --devices-per-process 4 -- meshax train mnist --mesh "rows:2;cols:4"

starts N copies of the command with the environment `meshax.initialize_distributed` reads (a
free coordinator port on localhost, the process count and each one's id; K virtual CPU devices
each, exchanging data with gloo), prefixes each line they print with "[i] " (dropping gloo's
line per connected device group), forwards SIGINT and SIGTERM to them, and exits non-zero if any
of them fails (after a SIGINT: 130, once they are gone). When one process fails (an exception,
killed, out of memory), the launcher names it and stops the others at once: SIGTERM, then SIGKILL
after `grace` seconds, so nothing is left running and nothing waits for a dead peer.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import TextIO

from meshax.core.errors import ConfigError
from meshax.runtime import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID

PREEMPTED = 128 + signal.SIGTERM  # what `meshax train` exits with after a preemption notice, its checkpoint saved
GRACE_SECONDS = 3.0  # between SIGTERM and SIGKILL when stopping the survivors (JAX takes SIGTERM as a
# preemption notice, so a process stuck in a collective with a dead peer goes only with SIGKILL)


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


def _free(port: int) -> bool:
    """Whether nothing on localhost holds TCP `port` now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("localhost", port))
        except OSError:
            return False
    return True


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


# What gloo (the CPU collectives) prints to stdout each time a group of devices connects: one
# message per device and collective group, nothing a user can act on. It is written piece by piece
# ("[Gloo] Rank ", the rank, " is connected to ", the count, " peer ranks. Expected number of
# connected peer ranks is : ", the count, a newline) by threads printing at once, so a line may hold
# several messages, pieces of several interleaved, or only the newline of one. The launcher drops
# each piece with the number written after it, from a line that holds gloo's own words (its head or
# its "Expected number ...") or that holds nothing else: a line with only numbers left is dropped
# whole (a number split from its message is all that is left of it there), and so is an empty line
# owed to a message whose pieces came earlier. A line of the user's own that merely has " is
# connected to " in it is kept as it is.
_HEAD = r"\[Gloo\] Rank "
_OWN = re.compile(rf"{_HEAD}|Expected number of connected peer ranks is :")
_PIECES = re.compile(
    rf"(?:{_HEAD}| *is connected to | *peer ranks\. *| *Expected number of connected peer ranks is : *)\d*"
)


# meshax's one line for an error: every process of a job checks the same flags and the same model,
# so each says the same line; the launcher writes the first and drops the others' copies of it.
_ERROR = "meshax: error: "
# What a process prints when it loses JAX's distributed service because the job failed (process 0,
# which hosts the service, ended: its error, or its exit after one): absl's lines from the
# coordination client (a preemption notice it could not fetch, an error it polled, the fatal one
# that ends the process), gRPC's details and a stack trace of the C++ code, dozens of lines that
# only say "another process ended". The launcher writes one line for them all. (Not the notice of
# a SIGTERM caught, "preemption_notifier.cc:90] SIGTERM caught at ...": no failure.)
_JAX_LOG = re.compile(
    r"^[IWEF]\d{4} [\d:.]+ +\d+ (?:coordination_\w+\.cc:\d+\] |preemption_sync_manager\.cc:\d+\] Failed "
    r"|client\.h:\d+\] Terminating )"
    r"|^Additional GRPC error information from remote target coordination_service"
    r"|^:UNKNOWN:Error received from peer"
)
_FATAL = "Terminating process because the JAX distributed service detected fatal errors"
_LOST_JAX = (
    "(this process lost JAX's distributed service: the job failed elsewhere, most likely another process "
    "ended; its lines say why)\n"
)


def _forward(
    stream,
    prefix: str,
    out: TextIO,
    lock: threading.Lock,
    said: set[str] | None = None,
    lost_by: set[int] | None = None,
    index: int = 0,
) -> None:
    """Write each line of `stream` to `out` after `prefix`, but gloo's connection notes, a copy of
    an error line another process wrote (`said`: the error lines written so far, shared by all
    streams), and JAX's lines on losing its distributed service (`_JAX_LOG`; after its fatal one,
    the rest of the stream: a stack trace), written as the one line `_LOST_JAX`; process `index`
    is then put in `lost_by` (its end is another's consequence: `_cause`)."""
    owed = 0  # newlines still to come of gloo messages whose heads shared a line
    said = set() if said is None else said
    lost = ended = False  # (JAX's service lost: said; the rest of this stream is JAX's fatal teardown)
    for line in iter(stream.readline, ""):
        if ended:
            continue
        if _JAX_LOG.search(line):
            ended = _FATAL in line
            if not lost:
                lost = True
                if lost_by is not None:
                    lost_by.add(index)
                with lock:
                    out.write(prefix + _LOST_JAX)
                    out.flush()
            continue
        if line.startswith(_ERROR):
            with lock:
                if line in said:
                    continue
                said.add(line)
        text = _PIECES.sub("", line)
        rest = text.strip(" \n0123456789")
        if text != line and (not rest or _OWN.search(line)):
            owed += max(len(re.findall(_HEAD, line)) - 1, 0)  # this line's own newline ends one of them
            if not rest:
                continue
        elif owed and not line.strip(" \n0123456789"):  # the rest of one: its count, or only its newline
            owed -= 1
            continue
        else:
            text = line
        with lock:
            out.write(prefix + text)
            out.flush()
    stream.close()


def launch(
    command: Sequence[str],
    num_processes: int,
    devices_per_process: int | None = None,
    port: int | None = None,
    grace: float = GRACE_SECONDS,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """Run `command` as `num_processes` processes of one job; returns 0 if all succeed, else the
    first failure's exit code (128 + the signal for a killed process)."""
    if not command:
        raise ConfigError("meshax launch needs a command after --, e.g. -- meshax train mnist")
    if num_processes < 1:
        raise ConfigError(f"-n must be at least 1, got {num_processes}")
    stdout, stderr = stdout or sys.stdout, stderr or sys.stderr
    if port is not None and not _free(port):  # (process 0's coordinator would fail to start, not naming it)
        raise ConfigError(
            f"--port {port}: something on this machine listens on it already; give another, or leave --port out"
        )
    address = f"localhost:{port or free_port()}"
    lock = threading.Lock()
    said: set[str] = set()  # (the error lines written: `_forward`)
    lost_by: set[int] = set()  # (the processes that lost JAX's distributed service: `_forward`)
    procs: list[subprocess.Popen] = []
    threads: list[threading.Thread] = []
    for i in range(num_processes):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.update({ENV_COORDINATOR: address, ENV_NUM_PROCESSES: str(num_processes), ENV_PROCESS_ID: str(i)})
        if devices_per_process is not None:
            env["JAX_NUM_CPU_DEVICES"] = str(devices_per_process)
        try:
            proc = subprocess.Popen(
                list(command), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace"
            )
        except OSError as e:
            _stop(procs, grace)
            raise ConfigError(f"meshax launch: cannot start {command[0]!r}: {e.strerror or e}") from None
        procs.append(proc)
        for stream, out in ((proc.stdout, stdout), (proc.stderr, stderr)):
            t = threading.Thread(target=_forward, args=(stream, f"[{i}] ", out, lock, said, lost_by, i), daemon=True)
            try:
                t.start()
            except RuntimeError as e:  # (the system's limit of threads: -n 99999; those started wait for the rest)
                _stop(procs, grace)
                raise ConfigError(
                    f"meshax launch: {len(procs)} of {num_processes} processes started, then: {e}; they are "
                    "stopped: give a smaller -n"
                ) from None
            threads.append(t)
    with lock:
        stderr.write(
            f"meshax launch: {num_processes} processes, coordinator {address}, pids "
            + " ".join(str(p.pid) for p in procs)
            + "\n"
        )
        stderr.flush()

    interrupted = threading.Event()

    def forward_signal(signum, frame):
        if signum == signal.SIGINT:
            interrupted.set()
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    exits: queue.Queue = queue.Queue()  # (i, code) in the order the processes end
    _watch_exits(procs, exits)
    previous = {s: signal.signal(s, forward_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = _wait(procs, exits, grace, stderr, lock, interrupted, lost_by)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for t in threads:
            t.join(timeout=5)
    return code


def _watch_exits(procs: list[subprocess.Popen], exits: queue.Queue) -> None:
    """Put (i, exit code) on `exits` for each process, in the order the processes end.

    On Linux the order is the kernel's: one thread waits on a pidfd per process with epoll, which
    reports them in the order they became ready (each when its process ended). A thread waiting
    on each process puts them in the order the threads run after their waits return: on a loaded
    machine, one woken first may run tens of milliseconds after one woken later, so a process
    that ended 10 ms after another could be named as the first to fail. Elsewhere (no pidfd) it
    is so still."""
    pidfds = _pidfds(procs)
    if pidfds is None:
        for i, p in enumerate(procs):
            threading.Thread(target=lambda i=i, p=p: exits.put((i, p.wait())), daemon=True).start()
        return

    def watch(poller) -> None:
        with poller:
            for fd in pidfds:
                poller.register(fd, select.EPOLLIN)
            while pidfds:
                for fd, _ in poller.poll():
                    i = pidfds.pop(fd)
                    poller.unregister(fd)
                    os.close(fd)
                    exits.put((i, procs[i].wait()))

    threading.Thread(target=watch, args=(select.epoll(),), daemon=True).start()


def _pidfds(procs: list[subprocess.Popen]) -> dict[int, int] | None:
    """{a pidfd of each process: its index}; None where this system has no pidfds or epoll. (Opened
    before anything reaps a process: the pidfd of a process that ended already is ready.)"""
    if not hasattr(os, "pidfd_open") or not hasattr(select, "epoll"):
        return None
    pidfds: dict[int, int] = {}
    try:
        for i, p in enumerate(procs):
            pidfds[os.pidfd_open(p.pid)] = i
    except OSError:  # (a kernel before 5.3)
        for fd in pidfds:
            os.close(fd)
        return None
    return pidfds


def _wait(
    procs: list[subprocess.Popen],
    exits: queue.Queue,
    grace: float,
    stderr: TextIO,
    lock: threading.Lock,
    interrupted: threading.Event,
    lost_by: set[int] | None = None,
) -> int:
    """0 once every process has exited with 0; else, at the first that fails (the first to end: the
    others' collectives may fail right after it, once it is gone), name it and stop the rest. A
    process that stopped on a preemption notice (`PREEMPTED`: its checkpoint saved) has not
    failed: the others stop at the same step and save theirs, so they are waited for, not
    killed, and the launcher exits with that code. Once the launcher got SIGINT (`interrupted`,
    passed on to the processes), see `_wind_down`."""
    done, preempted = 0, False
    while True:
        if interrupted.is_set():
            return _wind_down(procs, grace, stderr, lock)
        try:
            i, c = exits.get(timeout=0.05)  # (a timeout: signals are handled meanwhile)
        except queue.Empty:
            continue
        done += 1
        preempted = preempted or c == PREEMPTED
        if c not in (0, PREEMPTED):
            i, c = _cause(exits, i, c, lost_by or set())
            if interrupted.is_set():  # (the SIGINT came while this exit was waited for, or just after)
                return _wind_down(procs, grace, stderr, lock)
            with lock:
                stderr.write(
                    f"meshax launch: process {i} (pid {procs[i].pid}) {_describe(c)}; stopping the other "
                    f"processes (SIGTERM, then SIGKILL after {grace:g} s)\n"
                )
                stderr.flush()
            _stop(procs, grace)
            return c if c > 0 else 128 - c
        if done == len(procs):
            if preempted:
                with lock:
                    stderr.write("meshax launch: the processes stopped on a preemption notice (SIGTERM)\n")
                    stderr.flush()
            return PREEMPTED if preempted else 0


def _wind_down(procs: list[subprocess.Popen], grace: float, stderr: TextIO, lock: threading.Lock) -> int:
    """After a Ctrl-C (SIGINT, passed on to every process): 130 once every process has ended, each
    on its own within `grace` seconds, or stopped after that (`_stop`, named). How each ended is
    not named: a process whose collective lost a peer that stopped first may end with its error
    before it sees its own SIGINT, and that is no failure of the job's."""
    deadline = time.monotonic() + grace
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
    left = [(i, p) for i, p in enumerate(procs) if p.poll() is None]
    if left:
        with lock:
            stderr.write(
                "meshax launch: interrupted; "
                + ", ".join(f"process {i} (pid {p.pid})" for i, p in left)
                + f" still running {grace:g} s after SIGINT: stopping (SIGTERM, then SIGKILL after {grace:g} s)\n"
            )
            stderr.flush()
        _stop(procs, grace)
    return 128 + signal.SIGINT


def _cause(exits: queue.Queue, i: int, c: int, lost_by: set[int]) -> tuple[int, int]:
    """The failure to name, given the first seen (process i, code c): the others' collectives fail
    within milliseconds once a peer is gone, and which exit is seen first is up to the threads'
    scheduling; so of the exits seen within 50 ms, a process killed by a signal (a crash, kill -9)
    is named before one that exited with an error, and otherwise the first seen. A process that
    lost JAX's distributed service (`lost_by`) aborts (SIGABRT) because another one ended: its
    end is named only where no other process's was seen (a bad flag's exit 2 was named SIGABRT)."""
    time.sleep(0.05)
    seen = [(i, c)]
    while not exits.empty():
        seen.append(exits.get())
    causes = [(j, k) for j, k in seen if j not in lost_by] or seen
    return next(((j, k) for j, k in causes if k < 0), causes[0])


def _stop(procs: list[subprocess.Popen], grace: float) -> None:
    """Every process still running: SIGTERM, then SIGKILL after `grace` seconds; wait for all."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
