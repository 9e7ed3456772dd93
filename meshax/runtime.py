"""Setting up JAX: the embedded default (the local CPU with as many virtual devices as needed),
and joining a multi-process job (`jax.distributed`) so that one mesh spans many processes/hosts.

A multi-process run is the same SPMD program: every process builds the same graph and calls the
same functions; JAX's runtime joins the processes' devices into one global device set. Each
process feeds only the rows of a batch its own devices hold (`LoweredFunction.feed_rows`).
"""

from __future__ import annotations

import contextlib
import numbers
import os
import signal
import sys
from collections.abc import Callable

from meshax.core.errors import ConfigError
from meshax.layout.mesh_shape import MAX_DEVICES

# What `meshax launch` puts in each worker's environment (JAX itself reads JAX_COORDINATOR_ADDRESS).
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "MESHAX_NUM_PROCESSES"
ENV_PROCESS_ID = "MESHAX_PROCESS_ID"

# Failure bounds. A process that stops sending heartbeats for HEARTBEAT_TIMEOUT seconds is
# declared dead by the coordinator and every other process is terminated (JAX's error polling),
# so no survivor hangs in a collective. A checkpoint barrier or the final shutdown barrier waits
# at most BARRIER_TIMEOUT seconds. Joining waits at most JOIN_TIMEOUT for every process to start.
HEARTBEAT_TIMEOUT = 10
BARRIER_TIMEOUT = 60
JOIN_TIMEOUT = 120

_coordinator: str | None = None  # the address this process joined its job at (`initialize_distributed`)


def use_cpu_devices(n: int) -> None:
    """Ask JAX for `n` virtual CPU devices. Call before anything touches a JAX backend.

    If the backend is already up with fewer devices, say so plainly rather than fail later."""
    import jax

    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ConfigError(f"use_cpu_devices({n!r}): give a whole number of devices, 1 or more")
    if n > MAX_DEVICES:  # (JAX's count is a 32-bit int: more fails in its backend's setup, naming none of this)
        raise ConfigError(f"use_cpu_devices({n!r}): JAX makes at most 2**31 - 1 devices; give fewer")
    with contextlib.suppress(RuntimeError):  # the backend is already up: checked below
        jax.config.update("jax_num_cpu_devices", int(n))
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(n))
    try:
        have = len(jax.local_devices())
    except AssertionError:  # (JAX's own, bare, when no platform JAX_PLATFORMS names is there: cuda without a GPU)
        platforms = jax.config.jax_platforms
        raise ConfigError(
            f"JAX_PLATFORMS={platforms!r} names no platform this machine has (cuda needs a visible NVIDIA GPU): "
            "unset JAX_PLATFORMS, or add cpu (e.g. JAX_PLATFORMS=cuda,cpu)"
        ) from None
    if jax.devices()[0].platform == "cpu" and have < n:
        raise RuntimeError(
            f"JAX already started with {have} CPU device(s), but {n} are needed. Call "
            f"meshax.use_cpu_devices({n}) (or set JAX_NUM_CPU_DEVICES={n}) before any JAX computation"
        )


def env_int(name: str) -> int | None:
    """An environment variable's whole number (None if unset); a ValueError naming it if not one."""
    text = os.environ.get(name)
    if text in (None, ""):
        return None
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"environment variable {name}={text!r} is not a whole number") from None


def distributed_requested(
    coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> bool:
    """Whether arguments or the environment `meshax launch` sets ask for a multi-process run."""
    return any(v is not None for v in (coordinator, num_processes, process_id)) or ENV_NUM_PROCESSES in os.environ


def initialize_distributed(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    cpu_devices_per_process: int | None = None,
    heartbeat_timeout: int = HEARTBEAT_TIMEOUT,
) -> None:
    """Join this process to a multi-process JAX job; call before anything touches a JAX backend.

    Arguments left None come from the environment: `meshax launch` sets JAX_COORDINATOR_ADDRESS,
    MESHAX_NUM_PROCESSES and MESHAX_PROCESS_ID; otherwise JAX's cluster auto-detection (SLURM,
    Open MPI, Kubernetes, Cloud TPU) fills them in. On the CPU, processes exchange data with
    gloo, and `cpu_devices_per_process` (default: JAX_NUM_CPU_DEVICES, or 1) virtual devices
    each. A process that dies makes every other one exit within about `heartbeat_timeout`
    seconds (JAX's coordinator stops them), instead of hanging in a collective."""
    import jax

    if jax.distributed.is_initialized():
        raise RuntimeError("this process already joined a multi-process job (jax.distributed is initialized)")
    num_processes = num_processes if num_processes is not None else env_int(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else env_int(ENV_PROCESS_ID)
    if num_processes is not None and num_processes < 1:
        raise ConfigError(f"the number of processes must be at least 1, got {num_processes}")
    if process_id is not None and num_processes is not None and not 0 <= process_id < num_processes:
        raise ConfigError(f"process id {process_id} is not in 0..{num_processes - 1} (ids count from 0)")
    _check_coordinator(coordinator, "coordinator")
    if coordinator is None:
        _check_coordinator(os.environ.get(ENV_COORDINATOR) or None, f"environment variable {ENV_COORDINATOR}")
    global _coordinator
    _coordinator = coordinator or os.environ.get(ENV_COORDINATOR) or None
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=num_processes,
            process_id=process_id,
            initialization_timeout=JOIN_TIMEOUT,
            heartbeat_timeout_seconds=heartbeat_timeout,
            shutdown_timeout_seconds=BARRIER_TIMEOUT,
        )
    except ValueError as e:  # JAX found no job in the environment: say how to give one
        raise ConfigError(
            f"no multi-process job to join ({e}): give the coordinator's HOST:PORT, the number of "
            "processes and this process's id (--coordinator, --num-processes, --process-id), start "
            "the processes with meshax launch, or run under a cluster JAX detects (SLURM, Open MPI, "
            "Kubernetes)"
        ) from None
    _exit_at_once_on_uncaught_exceptions()
    # Read when the CPU backend starts (after this): processes exchange data with gloo.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if cpu_devices_per_process is not None:
        jax.config.update("jax_num_cpu_devices", int(cpu_devices_per_process))


def processes_on_this_host() -> int:
    """How many processes of this job share this machine (and its memory): all of them where the
    job's coordinator is at this machine's loopback address (`meshax launch`, or processes started
    with --coordinator localhost:PORT: no process elsewhere could reach it), else this one alone,
    as far as this process knows."""
    import jax

    if jax.process_count() == 1 or _coordinator is None:
        return 1
    host = _coordinator.rpartition(":")[0].strip("[]")
    return jax.process_count() if host in ("localhost", "::1") or host.startswith("127.") else 1


def _check_coordinator(address: str | None, what: str) -> None:
    """A ValueError naming `what` unless `address` (None: not given) is HOST:PORT with a port from
    1 to 65535 (else a process that is not the coordinator waits for one that never starts)."""
    if address is None:
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"{what} {address!r} must be HOST:PORT with a port from 1 to 65535, e.g. localhost:12345")


def exit_at_once(code: int) -> None:
    """End this process of a multi-process job now, with `code`, after flushing its output.

    A normal exit waits in JAX's shutdown barrier (up to BARRIER_TIMEOUT seconds) for every other
    process to exit too; where this process fails alone, the others are in a collective waiting
    for it and never come, so it would hang there and then abort, hiding its failure from
    `meshax launch`. Exiting at once, the launcher (or, without it, JAX's heartbeat check) stops
    the others."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def exit_at_once_on_interrupt(say: Callable[[], str] | None = None, first: bool | None = None) -> None:
    """Ctrl-C (SIGINT) ends this process of a multi-process job at once with 130 (`exit_at_once`),
    after `say()`'s line on stderr if `first` (default: in process 0; the others say nothing: one
    line for the job).

    A KeyboardInterrupt unwinds into code that waits for the other processes (the step queued
    before it, a checkpoint's syncs, JAX's shutdown barrier), which got the interrupt at another
    point of the program or are gone: the processes could wait for each other in collectives
    that never match, for good. Ending at the first Python instruction after the signal, no
    process waits for another: one still in a collective with a process that ended gets an
    error from it, and then ends here too. A checkpoint being written is left as a temporary
    folder, which is no checkpoint (the last complete one is the latest), and the next save
    clears it; a process that never gets back to Python is stopped by `meshax launch`. `say`
    must not wait for the other processes either (no collective, no Orbax manager). A
    KeyboardInterrupt could also be lost: raised in a garbage collector's callback (JAX has one),
    it is printed as "Exception ignored" and the run goes on."""
    if first is None:
        import jax

        first = jax.process_index() == 0
    said: list[int] = []

    def interrupted(signum, frame):
        if said:  # (a second SIGINT while saying the line: Ctrl-C reaches the launcher's processes
            return  # from the terminal, and again from the launcher)
        said.append(signum)
        if first and say is not None:
            with contextlib.suppress(Exception):
                print(say(), file=sys.stderr)
        exit_at_once(128 + signum)

    signal.signal(signal.SIGINT, interrupted)


def _exit_at_once_on_uncaught_exceptions() -> None:
    """An exception no one catches ends this process at once (`exit_at_once`), after its traceback."""
    previous = sys.excepthook

    def excepthook(kind, value, traceback):
        previous(kind, value, traceback)
        exit_at_once(128 + 2 if issubclass(kind, KeyboardInterrupt) else 1)

    sys.excepthook = excepthook


def in_a_job() -> bool:
    """Whether this process joined a multi-process job (`initialize_distributed`)."""
    import jax

    return jax.distributed.is_initialized()


def is_main_process() -> bool:
    """True in process 0 (and in a single-process run): the one that prints, logs and plots."""
    import jax

    return jax.process_index() == 0
