"""The keeper: persists a dead job's newest node-memory snapshot, then releases the memory.

`CheckpointManager.snapshot` starts one keeper per node-memory folder, the first time it writes
there: a small process of its own (no torch, no process group), started outside the job's
process tree and session, so that a kill -9 of torchrun, of every rank and of their workers
does not reach it. It watches the processes the job registered in the folder (``.pids/``: the
rank that writes the snapshots, and its torchrun agent when there is one). While any of them
lives (or a relaunch registers new ones), it does nothing. Once all are gone for ``--grace``
seconds (a torchrun restart re-registers well within it), it:

1. takes the newest snapshot whose every record's CRC-32 matches (one whose every rank had copied
   it whole when the job died, but whose commit had not run yet, is sealed first: `ckptools.node.sealing`);
2. copies it into the manager's folder under the name `save` would have given it (atomically:
   a temporary name and a rename, or one multipart upload on S3), when it is newer than every
   checkpoint there; then prunes to ``keep_last`` as the manager would. The HF Trainer's snapshots
   (prefix ``trainer-snapshot``) are written out instead as the ``checkpoint-N/`` folder the Trainer
   resumes from, when no folder of that step or a newer one is there (the only time torch is imported);
3. removes the node-memory folder (unless a relaunch registered meanwhile) and exits. No process
   of ckptools remains. If the copy fails (the store unreachable), the snapshot stays in node
   memory for a relaunch, and the keeper says so and exits.

A job that ends normally removes the folder itself (`ckptools.exit_process`): the keeper sees it
gone and exits at once. Run by hand: ``python -m ckptools.node.keeper FOLDER DIRECTORY --prefix ckpt``.
What it does and why (its start, what it persisted or skipped, a relaunch seen) goes to its stderr:
nowhere when the job started it, unless ``$CKPTOOLS_KEEPER_LOG`` names a file (``--log``) to append it to.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import sys
import time
from collections.abc import Callable
from typing import IO, TypeVar

from ..errors import CheckpointError
from ..layouts import framework_of, verify_torch_file
from ..storage import (
    STALL_ENV,
    InThread,
    atomic_write,
    join,
    list_files,
    open_local,
    private_problem,
    process_of_mine,
    remove,
    resolve,
    stall_timeout,
)
from . import sealing
from .names import checkpoint_names, discard

__all__ = ["PIDS", "main", "persist"]

PIDS = ".pids"  # one empty file per watched process, named by its pid
LOCK = ".keeper"  # the keeper's own pid: one keeper per folder
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _watched(folder: str) -> list[tuple[int, str]]:
    """The processes the job registered in ``folder`` (`ckptools.node.folder.watch`): pid and start time."""
    try:
        names = [name for name in os.listdir(os.path.join(folder, PIDS)) if name.isdigit()]
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        try:
            with open_local(os.path.join(folder, PIDS, name), own=True) as f:
                found.append((int(name), f.read(64).decode("ascii", errors="replace").strip()))
        except (CheckpointError, OSError):
            continue  # gone meanwhile, or nothing ckptools wrote
    return found


def _job_alive(folder: str) -> bool:
    """Whether a process the job registered still runs: this user's, and the very process registered
    (its start time: a pid given since to another process is not it; ``?`` where the system does not
    tell it). A registration without one was written by no ckptools and counts for nothing."""
    return any(
        started and process_of_mine(pid, None if started == "?" else started) for pid, started in _watched(folder)
    )


def _not_ours(folder: str) -> bool:
    """Whether ``folder`` is not this user's alone (said on stderr): then nothing of it is read, copied
    or removed, whatever it holds. A folder of this user's keeps its inode, so this is one ``lstat``."""
    problem = private_problem(folder)
    if problem is not None:
        _say(f"{folder} is not this user's alone ({problem}): nothing is persisted from it")
    return problem is not None


def persist(folder: str, directory: str, prefix: str, keep_last: int | None) -> str | None:
    """Copy the newest whole snapshot of ``folder`` into ``directory`` when it is newer than every
    checkpoint there, then prune to ``keep_last``; the path written, or None."""
    if "://" not in directory and not os.path.isdir(directory):
        # The manager makes its folder at the first snapshot: gone now, it was removed (to start afresh).
        _say(f"the run folder {directory} was removed: nothing persisted, the snapshots in {folder} are released")
        return None
    pattern = checkpoint_names(prefix)
    sealing.seal(folder, pattern, warn=_say)
    snapshots = sorted((int(m.group(1)), n) for n in os.listdir(folder) if (m := pattern.fullmatch(n)))
    framework = framework_of(prefix)
    write_out = framework.write_out if framework is not None else None
    folders = write_out is not None  # written out as the framework's folders: their writer compares
    listed = [] if folders else list_files(directory)
    durable = sorted((int(m.group(1)), n) for n in listed if (m := pattern.fullmatch(n)))
    newest = durable[-1][0] if durable else -1
    for step, name in reversed(snapshots):
        if step <= newest:
            return None
        source = os.path.join(folder, name)
        try:
            verify_torch_file(resolve(source).as_own())
        except CheckpointError as err:
            _say(f"skipping snapshot {source}: {err}")
            continue
        writer = framework.writer() if framework is not None else None  # torch is imported only now
        if writer is not None:  # as the framework's own folder
            return _waiting_out_a_stall(functools.partial(writer, source, directory), source, directory)
        target = join(directory, name)
        taken: list[int] = []

        def copy(out: IO[bytes], source: str = source, taken: list[int] = taken) -> None:
            with open_local(source, own=True) as f:
                taken.append(os.fstat(f.fileno()).st_mtime_ns)
                shutil.copyfileobj(f, out, 16 << 20)

        _waiting_out_a_stall(functools.partial(atomic_write, target, copy, streamable=True), source, target)
        if "://" not in directory and taken:
            # Dated when the snapshot was taken, not now: whoever orders a folder's files by time (Lightning's
            # ckpt_path="last" takes the newest last*.ckpt) puts a checkpoint saved after it first.
            os.utime(target, ns=(taken[0], taken[0]))
        if keep_last is not None:
            kept = sorted([*durable, (step, name)])
            for _, old in kept[:-keep_last]:
                remove(join(directory, old))
        return target
    return None


T = TypeVar("T")


def _waiting_out_a_stall(write: Callable[[], T], source: str, target: str) -> T:
    """``write`` (a snapshot's write-out) in a thread of its own; not done within the stall bound, the keeper
    says where the snapshot stays and goes on waiting: a stuck storage that comes back takes the write where it
    stopped, and the snapshot is the job's newest state (given up, it would be lost with the node's memory)."""
    job = InThread(write, "ckptools-keeper-write")
    bound = stall_timeout()
    job.thread.join(bound if bound > 0 else None)
    if job.thread.is_alive():
        _say(f"the write of {target} has not ended after {bound:g} s ({STALL_ENV}): its storage is slow or stuck. "
             f"The snapshot stays in node memory ({source}) until it is written; waiting for the storage")  # fmt: skip
        job.thread.join()
    return job.result()


def _say(text: str) -> None:
    print(f"ckptools keeper {time.strftime('%H:%M:%S')}: {text}", file=sys.stderr, flush=True)


def _log_to(path: str) -> None:
    """Append this process's stderr to ``path`` (made 0600, never through a link)."""
    with contextlib.suppress(OSError):  # no log is no reason not to keep the snapshots
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW, 0o600)
        os.dup2(fd, 2)
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    """Watch, persist at the breakpoint, release; see the module docstring."""
    p = argparse.ArgumentParser(prog="python -m ckptools.node.keeper", description=__doc__.splitlines()[0])
    p.add_argument("folder", help="the node-memory folder")
    p.add_argument("directory", help="the manager's folder (path or URL)")
    p.add_argument("--prefix", default="ckpt")
    p.add_argument("--keep-last", type=int, default=None)
    p.add_argument("--grace", type=float, default=10.0, help="seconds every watched process must stay gone")
    p.add_argument("--poll", type=float, default=0.2)
    p.add_argument("--log", default=None, help="a file to append what the keeper says to (else its stderr)")
    args = p.parse_args(argv)
    if args.log:
        _log_to(args.log)
    if _not_ours(args.folder):
        return 1
    lock = os.path.join(args.folder, LOCK)
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY | _NOFOLLOW, 0o600)
    except FileExistsError:
        try:
            with open_local(lock, own=True) as f:
                other = f.read(32).decode("ascii", errors="replace").strip()
        except (CheckpointError, OSError):
            other = ""
        if other.isdigit() and process_of_mine(int(other)) and int(other) != os.getpid():
            return 0  # this folder has its keeper
        fd = os.open(lock, os.O_WRONLY | os.O_TRUNC | _NOFOLLOW)
    except FileNotFoundError:
        return 0  # released before the keeper started
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    _say(f"keeping {args.folder} for {args.directory} (pid {os.getpid()}, grace {args.grace:g} s)")
    gone_since: float | None = None
    while os.path.isdir(args.folder):
        if _not_ours(args.folder):  # gone and made again by someone else: nothing of it is read
            return 1
        if _job_alive(args.folder):
            gone_since = None
        elif gone_since is None:
            gone_since = time.monotonic()
        elif time.monotonic() - gone_since >= args.grace:
            try:
                written = persist(args.folder, args.directory, args.prefix, args.keep_last)
            except Exception as err:  # noqa: BLE001 - said, and the snapshot kept: it is the newest state
                if _job_alive(args.folder):  # a relaunch's snapshot may have recycled the file being copied
                    _say(f"could not persist {args.folder} into {args.directory} ({err}); a relaunch registered "
                         "meanwhile: kept for it, and watched")  # fmt: skip
                    gone_since = None
                    continue
                _say(f"could not persist {args.folder} into {args.directory}: {err}; the snapshot stays in node "
                     "memory for a relaunch")  # fmt: skip
                return 1
            if written is not None:
                _say(f"the job is gone; persisted {written}")
            else:
                _say(f"the job is gone; nothing in {args.folder} is newer than {args.directory}'s checkpoints")
            if _job_alive(args.folder):
                # A relaunch registered while this persisted: its own keeper found this one alive and
                # left, so this one watches on (and persists the relaunch's newer snapshots in turn).
                _say(f"a relaunch registered in {args.folder} meanwhile: kept for it, and watched")
                gone_since = None
                continue
            with contextlib.suppress(OSError):  # said by nobody: the keeper has no one to tell
                discard(args.folder)
                _say(f"released {args.folder}")
            return 0
        time.sleep(args.poll)
    return 0


if __name__ == "__main__":
    sys.exit(main())
