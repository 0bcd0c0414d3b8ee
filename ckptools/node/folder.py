"""The node-memory folder: where `CheckpointManager.snapshot` keeps the newest state, outside
every process, and which ranks share it (a node).

A snapshot is an ordinary ckptools checkpoint file (the planned writer's torch zip, CRC-32s in
every record, committed by an atomic rename) in a folder on a memory-backed filesystem of this
node: ``/dev/shm`` by default. Files there outlive every process of the job (kill -9 of
torchrun, of every rank and of their DataLoader workers), so a relaunch on the same node finds
the newest snapshot and resumes from it; they do not outlive the node (a reboot, a replaced node).

Two slots: before a snapshot is written, every snapshot but the newest is removed, and the new
one is written beside it under a temporary name; only its rename makes it count. A kill in the
middle of a copy leaves the newest snapshot whole, so the memory held is at most two snapshots
(one between snapshots). Before a write the folder's free space is checked for both slots: too
little is a `NodeMemoryError` naming the sizes and the fixes, never a crash later.

A keeper process (`ckptools.node.keeper`, started with the first snapshot, outside the job's process
tree) persists the newest snapshot into the manager's folder when the job dies and is not
relaunched within its grace time, then releases the memory.

The folder: ``snapshot_dir=`` of the manager, else ``$CKPTOOLS_NODE_MEMORY/ckptools-<user>-<key>``,
else ``/dev/shm/ckptools-<user>-<key>`` (the system's temporary folder where there is no
``/dev/shm``); ``<key>`` is derived from the manager's directory and prefix, so a relaunch of the
same job finds it and another job's snapshots never mix with it. A job that ends normally
(`ckptools.exit_process`, `Preemption.exit`) removes its folders (`release`); a job that died
leaves them for its relaunch, and its keeper.

The folder is this user's alone (`ckptools.storage.make_private`): made with mode 0700, or used
only when it belongs to this user, no one else may write into it, and no one else can replace it.
``/dev/shm`` is shared by every user of the node, and the folder's name can be computed: a folder
of that name someone else made is never written into nor read from (`claim` says so and refuses;
a restore leaves it aside with a warning, `readable`). The threat model: docs/guarantees.md.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import sys

from .. import log
from ..collective.group import launcher
from ..collective.launch import spawn_parent
from ..errors import NodeMemoryError
from ..storage import NODE_MARK, abandoned_tmps, open_local, process_start, remove
from ..text import human_size
from .keeper import PIDS
from .names import ENV, claim, discard, sweep_released

__all__ = [
    "ENV",
    "check_space",
    "group_nodes",
    "huge_pages",
    "node_token",
    "note_pages",
    "register",
    "release_folders",
    "start_keeper",
    "watch",
]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
NODE_FILE = NODE_MARK  # the token that tells which ranks share this folder (and that it is node memory)
# Seconds the keeper waits, once every process of the job is gone, for a relaunch (default 10).
GRACE_ENV = "CKPTOOLS_KEEPER_GRACE"
KEEPER_LOG_ENV = "CKPTOOLS_KEEPER_LOG"  # a file the keepers append what they did to (else nowhere)

# What to do when the node memory is too small (every NodeMemoryError ends with it).
FIXES = (
    "give the node more shared memory (docker run --shm-size=..., a Kubernetes emptyDir with medium: Memory "
    f"and a sizeLimit), or point CheckpointManager(snapshot_dir=...) or ${ENV} at a larger memory-backed folder"
)

# Folders this process wrote snapshots into; removed when the job ends normally.
_REGISTERED: set[str] = set()  # the folders this rank, its node's lowest, releases at the job's end
# Folders this process started a keeper for.
_KEEPERS: set[str] = set()
# Folders whose pages this process has told about (`note_pages`).
_NOTED: set[str] = set()


def check_space(folder: str, needed: int, held: int) -> None:
    """Raise `NodeMemoryError` unless ``folder`` can hold two snapshots of ``needed`` bytes,
    counting the ``held`` bytes of snapshots already there (they are replaced, not added to)."""
    free = shutil.disk_usage(folder).free
    if free + held >= 2 * needed:
        return
    raise NodeMemoryError(
        f"the node-memory folder {folder} has {human_size(free)} free (and {human_size(held)} of snapshots), but "
        f"two snapshot slots of this state need {human_size(2 * needed)}: {FIXES}"
    )


HUGE_PAGES_HINT = (
    "a restore from it maps 4 KiB pages (1.6x the copy's time on the CI machine, markedly less with huge pages: "
    "docs/guides/snapshots.md); for huge pages mount a tmpfs with huge=within_size (or remount /dev/shm so) "
    f"and point snapshot_dir or ${ENV} there"
)
_SHMEM_ENABLED = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


def huge_pages(folder: str, mounts: str = "/proc/self/mounts") -> bool | None:
    """Whether a snapshot in ``folder`` is read back through huge pages: True on a tmpfs mounted with
    ``huge=always`` or ``huge=within_size`` (or where the kernel forces them), False on any other
    tmpfs (``huge=advise`` too: the restore's mapping does not ask), None elsewhere or where
    ``mounts`` cannot be read (not Linux).

    Example: ``huge_pages("/dev/shm")`` is False on most hosts (``/dev/shm`` has no ``huge=``).
    """
    try:
        with open(mounts) as f:
            table = [line.split() for line in f]
    except OSError:
        return None
    where = os.path.realpath(folder)
    best: tuple[str, str, str] | None = None  # (mount point, type, options)
    for fields in table:  # the longest mount point above the folder is the one it lives on (the last, if shadowed)
        if len(fields) < 4:
            continue
        point = fields[1].replace("\\040", " ")
        inside = where == point or where.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):
            best = (point, fields[2], fields[3])
    if best is None or best[1] != "tmpfs":
        return None
    try:
        with open(_SHMEM_ENABLED) as f:
            forced = f.read()
    except OSError:
        forced = ""
    if "[force]" in forced or "[deny]" in forced:  # the kernel's override of every tmpfs's own option
        return "[force]" in forced
    options = dict(opt.partition("=")[::2] for opt in best[2].split(","))
    return options.get("huge", "never") in ("always", "within_size")


def note_pages(folder: str) -> None:
    """Say once per process, at INFO on the ``ckptools`` logger, that snapshots in ``folder`` (a
    tmpfs without huge pages) are restored more slowly than they could be, and how to change that."""
    if folder in _NOTED:
        return
    _NOTED.add(folder)
    if huge_pages(folder) is False:
        log.logger.info("node memory %s is a tmpfs without huge pages: %s", folder, HUGE_PAGES_HINT)


def watch(folder: str) -> None:
    """Register this process (and its torchrun agent) as the job the keeper of ``folder`` watches.

    The agent is the one that started this process (`ckptools.collective.group.launcher`), never
    ``getppid()`` now: after the agent is killed that names PID 1, which the keeper would wait on forever."""
    claim(folder)
    pids = os.path.join(folder, PIDS)
    with contextlib.suppress(FileExistsError):
        os.mkdir(pids, 0o700)
    watched = [os.getpid()]
    agent = launcher() or spawn_parent()  # torchrun's agent, or mp.spawn's parent
    if agent is not None:  # the agent outlives a failed attempt and restarts it
        watched.append(agent)
    for pid in watched:
        # The process's start time inside: a pid the system gave to another process since is not this one.
        started = (process_start(pid) or "?").encode()  # "?": no /proc to tell (the keeper then trusts the pid)
        fd = os.open(os.path.join(pids, str(pid)), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(started)


def start_keeper(folder: str, directory: str, prefix: str, keep_last: int | None) -> None:
    """Start the keeper of ``folder`` (`ckptools.node.keeper`) once per process, outside the job.

    A double fork in a session of its own: the keeper is no descendant of torchrun or of a rank,
    so a kill -9 of the job's process group, or of every process under torchrun, leaves it; it
    exits by itself once the folder is released or persisted.
    """
    if folder in _KEEPERS:
        return
    grace = os.environ.get(GRACE_ENV, "10")
    cmd = [sys.executable, "-m", "ckptools.node.keeper", folder, directory, "--prefix", prefix, "--grace", grace]
    if keep_last is not None:
        cmd += ["--keep-last", str(keep_last)]
    if os.environ.get(KEEPER_LOG_ENV):
        cmd += ["--log", os.path.abspath(os.environ[KEEPER_LOG_ENV])]
    detach = (
        "import subprocess, sys; subprocess.Popen(sys.argv[1:], start_new_session=True, close_fds=True, "
        "stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)"
    )
    subprocess.run([sys.executable, "-c", detach, *cmd], check=True, timeout=60)
    _KEEPERS.add(folder)


def prepare(folder: str, prefix: str, directory: str, keep_last: int | None) -> None:
    """Every node's lowest rank, before its copy of a snapshot: the folder remembered for the job's end,
    a killed snapshot's temporaries removed, the run folder made (it exists from the first snapshot on: a
    restore tells a removed run by it), the job registered for the keeper, and the keeper started."""
    register(folder)
    sweep_released(folder)
    for leftover in abandoned_tmps(folder, f".{prefix}-"):
        try:
            remove(leftover)
        except OSError as err:
            log.warn(f"could not delete {leftover}: {err}")
    if "://" not in directory:
        os.makedirs(directory, exist_ok=True)
    watch(folder)
    start_keeper(folder, directory, prefix, keep_last)


def register(folder: str) -> None:
    """Remember ``folder`` for `release` at the job's normal end: this rank is its node's lowest (the
    ranks that share the folder are a node: `group_nodes`), so it removes it."""
    _REGISTERED.add(folder)


def release_folders() -> list[str]:
    """Remove the node-memory folders this process wrote snapshots into; the folders removed.

    Called by `ckptools.exit_process` and `Preemption.exit` on every rank, after every rank's last
    checkpoint call: each folder goes by the hand of the node's lowest rank that shares it, who
    registered it (never ``LOCAL_RANK``, which a launcher other than torchrun does not set): a job that
    ended normally leaves no memory behind.
    """
    removed: list[str] = []
    for folder in sorted(_REGISTERED):
        if discard(folder):
            removed.append(folder)
    _REGISTERED.clear()
    return removed


def node_token(folder: str) -> str:
    """The token of the node-memory ``folder`` (made by the first rank to get here): ranks that
    read the same token share the folder, i.e. are one node."""
    claim(folder)
    path = os.path.join(folder, NODE_FILE)
    with contextlib.suppress(FileNotFoundError):
        token = _read_token(path)
        if token:
            return token
    # Written whole under a name of its own, then linked: a rank never reads a half-written token.
    mine = os.path.join(folder, f"{NODE_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(mine, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(8))
    try:
        os.link(mine, path)
    except FileExistsError:
        pass  # another rank of this node was first
    finally:
        os.unlink(mine)
    return _read_token(path)


def _read_token(path: str) -> str:
    with open_local(path, own=True) as f:
        return f.read(64).decode("ascii", errors="replace")


def group_nodes(tokens: list[str]) -> list[list[int]]:
    """Each node's ranks (lowest first), the nodes ordered by their lowest rank (rank 0's first).

    Examples:
        >>> group_nodes(["a", "b", "a", "b"])
        [[0, 2], [1, 3]]
    """
    nodes: dict[str, list[int]] = {}
    for rank, token in enumerate(tokens):
        nodes.setdefault(token, []).append(rank)
    return sorted(nodes.values())
