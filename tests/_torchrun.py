"""Launch ``torchrun`` from a test: its own process group, and the stacks of a launch that hangs."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any


def torchrun(
    args: Sequence[str], *, cwd: str | os.PathLike[str], timeout: float = 150, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``python -m torch.distributed.run *args`` (``env``: extra variables).

    One intra-op thread per process, unbuffered output, no inherited restart count. A launch
    still running after ``timeout`` s is killed with all its workers and returns -9, with every
    process's Python stack in stderr.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", *args]
    variables = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    variables.pop("TORCHELASTIC_RESTART_COUNT", None)
    # Own process group, so that a launch that hangs is killed with all its workers and its
    # output so far still reaches the assertion message.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=variables, cwd=cwd,
                            start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stacks = _stacks_and_kill(proc.pid)
        stdout, stderr = proc.communicate(timeout=30)
        stderr += f"\n[test] launch killed after {timeout}s without finishing; stacks:\n{stacks}"
        return subprocess.CompletedProcess(cmd, -9, stdout, stderr)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def ok(proc: subprocess.CompletedProcess) -> str:
    """The launch's output, after asserting it exited 0 without a teardown crash."""
    # A launch killed as hung carries every process's stack: all of them, or the ranks' are cut.
    keep = 60000 if proc.returncode == -9 else 6000
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-keep:]}"
    # A clean exit, not a teardown crash of a restarted rank.
    assert "terminate called" not in proc.stderr, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        children = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout.split()
        found += [int(c) for c in children]
        todo += [int(c) for c in children]
    return found


def _proc_state(pid: int) -> str:
    """What the kernel says the process is doing: its state and the wait channel of each thread."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().split(") ", 1)[1].split()[0]
        waits = []
        for task in sorted(os.listdir(f"/proc/{pid}/task")):
            with open(f"/proc/{pid}/task/{task}/wchan") as f:
                waits.append(f"{task}:{f.read() or '-'}")
        return f"state {state}, threads waiting in {' '.join(waits)}"
    except OSError as err:
        return f"(no /proc entry: {err})"


def _stacks_and_kill(pid: int) -> str:
    """Python stacks of a hung launch and its workers (py-spy, where installed), then SIGKILL all.

    torchrun starts its workers in sessions of their own, so the whole tree is collected first; the kill
    is `kill_job`'s (a process forked while the stacks were taken is killed too).
    """
    pids = job_processes(pid)
    stacks = []
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    gdb = shutil.which("gdb")
    for p in pids:
        said = [f"--- pid {p}: {_proc_state(p)}"]
        if os.path.exists(spy):
            dump = subprocess.run(
                [spy, "dump", "--native", "--pid", str(p)], capture_output=True, text=True, timeout=60
            )
            if dump.returncode != 0:  # py-spy cannot unwind some native frames: the Python stack alone
                dump = subprocess.run([spy, "dump", "--pid", str(p)], capture_output=True, text=True, timeout=60)
            said.append(dump.stdout + dump.stderr)
            if dump.returncode != 0 and gdb:  # a process py-spy cannot read at all: its native threads
                native = subprocess.run([gdb, "-p", str(p), "-batch", "-ex", "thread apply all bt 30"],
                                        capture_output=True, text=True, timeout=60)  # fmt: skip
                said.append("\n".join(line for line in native.stdout.splitlines() if line.startswith(("#", "Thread"))))
        stacks.append("\n".join(said))
    kill_job(pid)
    return "\n".join(stacks)


def torchrun_signalled(
    args: Sequence[str],
    *,
    cwd: str | os.PathLike[str],
    when: str,
    send: Callable[[int], None],
    timeout: float = 150,
) -> tuple[subprocess.CompletedProcess, float]:
    """Run torchrun like :func:`torchrun`, and call ``send(torchrun_pid)`` once a line containing
    ``when`` is printed. Returns the launch (stdout and stderr merged) and the seconds from
    ``send`` to torchrun's exit (-1 if ``when`` never came)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", *args]
    variables = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    variables.pop("TORCHELASTIC_RESTART_COUNT", None)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=variables, cwd=cwd,
                            start_new_session=True)  # fmt: skip
    lines: list[str] = []
    sent: list[float] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if not sent and when in line:
                sent.append(time.monotonic())
                send(proc.pid)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stacks = _stacks_and_kill(proc.pid)
        proc.wait(30)
        reader.join(10)
        out = "".join(lines) + f"\n[test] launch killed after {timeout}s without finishing; stacks:\n{stacks}"
        return subprocess.CompletedProcess(cmd, -9, out, ""), -1.0
    exited = time.monotonic()
    reader.join(30)
    return subprocess.CompletedProcess(cmd, code, "".join(lines), ""), (exited - sent[0]) if sent else -1.0


def job_processes(pid: int) -> list[int]:
    """torchrun's pid, its ranks' and their DataLoader workers' (every process of the job)."""
    return [pid, *_descendants(pid)]


def kill_job(pid: int, signum: int = signal.SIGKILL) -> list[int]:
    """Send ``signum`` to every process of the job at one moment, as a scheduler's kill of the job does;
    the processes signalled.

    The tree is stopped (SIGSTOP) and listed again until no process is new, then signalled (and let run
    on for a signal other than SIGKILL): a process forked between a listing and its parent's kill would
    outlive the job. A DataLoader worker forked so would run forever, holding the launch's output pipe
    (CI hung 900 s on one): torch's worker notes its parent's pid after its set-up, so a parent gone by
    then is never missed.
    """
    stopped: list[int] = []
    while True:
        new = [p for p in job_processes(pid) if p not in stopped]
        if not new:
            break
        for p in new:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGSTOP)
        stopped += new
    for p in stopped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signum)
    if signum != signal.SIGKILL:
        for p in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGCONT)
    return stopped


def read_rest(stream: Any, within: float = 120.0) -> str:
    """What is left to read of a launch's output pipe once its processes are gone (``within`` s at most).

    A process still holding the pipe open (one that outlived a kill of the job) would block a plain
    ``read()`` until the test's timeout; this fails at once and names it.
    """
    rest: list[str] = []
    reader = threading.Thread(target=lambda: rest.append(stream.read()), daemon=True)
    reader.start()
    reader.join(within)
    if reader.is_alive():
        raise AssertionError(f"the launch's output is still open {within:.0f} s after it ended, held by: "
                             f"{_holders(stream.fileno())}")  # fmt: skip
    return rest[0]


def _holders(fd: int) -> str:
    """The processes with the pipe ``fd`` reads open (pid, state and command line)."""
    target = f"pipe:[{os.fstat(fd).st_ino}]"
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if any(os.readlink(f"/proc/{pid}/fd/{n}") == target for n in os.listdir(f"/proc/{pid}/fd")):
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{pid} ({_proc_state(int(pid))}) {cmd}")
    return "; ".join(found) or "no process found"


def rank_processes(pid: int) -> list[int]:
    """The rank processes torchrun started (its direct children)."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return sorted(int(p) for p in out)


def computed_once(tmp_path_factory: Any, name: str, compute: Callable[[Path], None]) -> Path:
    """The folder ``compute(folder)`` filled, computed once per test session even when pytest-xdist
    runs the tests that need it in several worker processes (the first takes a lock and computes,
    the others wait for it and reuse the folder). A computation that fails is retried by the next."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the session's own folder
    folder = shared / f"shared-{name}"
    with FileLock(str(folder) + ".lock"):
        if not (folder / ".complete").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            compute(folder)
            (folder / ".complete").touch()
    return folder


def keepers_left(folder: str | os.PathLike[str], within: float = 10.0) -> list[str]:
    """The keepers of node-memory ``folder`` still running ``within`` s from now (waited for).

    A keeper removes the folder and then exits; the interpreter's exit takes a moment (more under
    load), so a look taken the instant the folder vanished can still see it: wait, bounded.
    """
    deadline = time.monotonic() + within
    while True:
        found = subprocess.run(["pgrep", "-f", f"ckptools.node.keeper {folder}"], capture_output=True, text=True)
        if not found.stdout.split() or time.monotonic() > deadline:
            return found.stdout.split()
        time.sleep(0.1)
