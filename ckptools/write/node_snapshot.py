"""`CheckpointManager.snapshot`'s writer: one whole snapshot per node, in that node's memory.

A snapshot is the file `ckptools.save` would write (the planned torch zip, a CRC-32 in every
record), in the node-memory folder (`ckptools.write.node_memory`). Every node writes its own
copy, so a relaunch finds one on every node that survived:

- **Who is a node.** The ranks that see the same folder: the first to get there puts a random
  token in it (``.node``), and the ranks that read the same token share the folder (real nodes,
  and the simulated nodes of the tests, alike). A node's *leader* is its lowest rank.
- **Who copies what.** What DDP keeps equal on every rank is split over each node's ranks (the
  ``writers="all"`` split, `ckptools.write.plan`), so every rank copies about
  1/LOCAL_WORLD_SIZE of the state; what only rank 0 holds as it is stored (buffers, scaler, RNG,
  plain values) rank 0's node writes from its payload, and every other node's leader receives it
  from rank 0 (one broadcast on the CPU-side group, usually small).
- **The stall is the copy.** Each node keeps two slot files, each mapped once into every local
  rank's memory and reused: the newest committed snapshot and a spare under a temporary name.
  A snapshot copies into the spare (a CUDA tensor device-to-host, into the mapping registered
  with CUDA as pinned memory), and `write_snapshot` returns once this rank's copy is whole.
- **The commit follows.** A background thread per rank computes the CRC-32s of what this rank
  copied (about four times the copy's time here, which is why it is not in the stall) and
  reports them to its node's leader through the process group's store (never a collective off
  the main thread); the leader's thread writes the headers and the central directory and renames
  the spare into place. The snapshot counts from that rename, the commit record written last;
  the one it replaces becomes the spare. A kill before the rename leaves the previous snapshot
  whole. The next snapshot (or `finish_snapshot`) waits for the commit and raises its failure,
  if any, on every rank.
- **No SIGBUS.** The slot file is preallocated (``posix_fallocate``) before the copy: a node
  memory too small for it is a `NodeMemoryError` before anything is written, never a crash in the
  middle of the copy (what happens to a mapping of a tmpfs that runs out of pages).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import queue
import secrets
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .. import log
from ..collective import agree
from ..collective.agree import Agreement, RankFailure, outcome_of
from ..collective.group import all_gather_object, broadcast_bytes, broadcast_object, get_rank, launcher_gone
from ..errors import CheckpointError, NodeMemoryError
from ..keeper import checkpoint_names
from ..storage import resolve, tmp_name
from ..text import human_size
from . import node_memory, zip_writer
from .payload import build_payload, checked_args, rank_part
from .plan import Plan, Share, check_writers, make_plan
from .shares import collect_shares, first_error, locate, report_share
from .staging import copy_bytes, whole_storage
from .zero import describe_partitions, has_partitions, refusal, with_partitions

__all__ = [
    "Orphaned",
    "close_slots",
    "finish_snapshot",
    "group_nodes",
    "node_token",
    "release",
    "send_file",
    "settle",
    "write_snapshot",
]

NODE_FILE = ".node"  # the token that tells which ranks share this folder
SLOT = "snapshot-slot"  # the spare slot's name, under a temporary name of its writer
# How many mappings a rank keeps (two slots, and one to spare while a slot is replaced).
_MAPPED_MAX = 3


# --- nodes ----------------------------------------------------------------------------------------


def node_token(folder: str) -> str:
    """The token of the node-memory ``folder`` (made by the first rank to get here): ranks that
    read the same token share the folder, i.e. are one node."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, NODE_FILE)
    with contextlib.suppress(FileNotFoundError), open(path) as f:
        token = f.read()
        if token:
            return token
    # Written whole under a name of its own, then linked: a rank never reads a half-written token.
    mine = os.path.join(folder, f"{NODE_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
    with open(mine, "w") as f:
        f.write(secrets.token_hex(8))
    try:
        os.link(mine, path)
    except FileExistsError:
        pass  # another rank of this node was first
    finally:
        os.unlink(mine)
    with open(path) as f:
        return f.read()


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


# --- the slots: mapped once per rank, reused ----------------------------------------------------


class _Mapped:
    """One slot file mapped into this process (and, for CUDA copies, registered as pinned)."""

    def __init__(self, path: str, size: int) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            stat = os.fstat(fd)
            if stat.st_size != size:
                raise CheckpointError(f"the snapshot slot {path} holds {stat.st_size} bytes, not {size}")
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        if hasattr(mmap, "MADV_HUGEPAGE"):  # huge pages where shmem allows them: fewer TLB misses
            with contextlib.suppress(OSError):
                self.mm.madvise(mmap.MADV_HUGEPAGE)
        self.key = (stat.st_dev, stat.st_ino, size)
        self.folder = os.path.dirname(path)
        self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.registered = False

    def pin(self) -> None:
        """Register the mapping with CUDA once, so device-to-host copies into it run at full speed;
        when that fails the copies still work, at pageable memory's speed."""
        if self.registered:
            return
        try:
            # What torch's own helper does (torch.cuda._pin_memory_utils, used by DCP, private and
            # not in every release we support): cudaHostRegisterPortable (1), pinned for every device.
            cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            code = int(cudart.cudaHostRegister(self.bytes.data_ptr(), self.bytes.numel(), 1))
            if code != 0:
                raise RuntimeError(f"cudaHostRegister returned cudaError {code}")
            self.registered = True
        except Exception as err:  # noqa: BLE001 - a slower copy, not a failure
            log.warn(f"could not register the snapshot slot with CUDA ({err}): its copies run unpinned", once="pin")

    def close(self) -> None:
        if self.registered:
            with contextlib.suppress(Exception):
                torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())  # type: ignore[no-untyped-call]
        del self.bytes
        with contextlib.suppress(BufferError):  # a view still alive keeps the mapping: it goes with it
            self.mm.close()


_MAPPED: OrderedDict[tuple[int, int, int], _Mapped] = OrderedDict()


def _mapping(path: str, size: int) -> _Mapped:
    """``path`` mapped at ``size`` bytes, reused while the file (its inode) and size are the same."""
    stat = os.stat(path)
    key = (stat.st_dev, stat.st_ino, size)
    mapped = _MAPPED.get(key)
    if mapped is None:
        for other in [k for k in _MAPPED if k[:2] == key[:2]]:  # resized: the old mapping overhangs the file
            _MAPPED.pop(other).close()
        mapped = _MAPPED[key] = _Mapped(path, size)
        while len(_MAPPED) > _MAPPED_MAX:
            _MAPPED.popitem(last=False)[1].close()
    _MAPPED.move_to_end(key)
    return mapped


# Leaders: each folder's spare slot, and the slot files this process made (only those are
# reused: a file restored from may still back tensors the caller holds).
_SPARES: dict[str, str] = {}
_OURS: set[tuple[int, int]] = set()


def _inode(path: str) -> tuple[int, int]:
    stat = os.stat(path)
    return (stat.st_dev, stat.st_ino)


def _allocated(path: str | None) -> int:
    if path is None:
        return 0
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError:
        return 0


def _prepare_slot(folder: str, prefix: str, size: int) -> str:
    """Leader: the slot to copy into, ``size`` bytes, its pages allocated; the newest committed
    snapshot stays whole, older ones go."""
    names = checkpoint_names(prefix)
    committed = [os.path.join(folder, n) for n in sorted(os.listdir(folder)) if names.fullmatch(n)]
    for old in committed[:-1]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(old)
    newest = committed[-1] if committed else None
    spare = _SPARES.pop(folder, None)
    if spare is not None and not os.path.isfile(spare):
        spare = None
    try:
        node_memory.check_space(folder, size, _allocated(newest) + _allocated(spare))
    except BaseException:
        if spare is not None:
            _SPARES[folder] = spare  # still this node's spare: a later, smaller state reuses it
        raise
    path = spare or os.path.join(folder, tmp_name(f"{prefix}-{SLOT}"))
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, size)
        try:
            if os.fstat(fd).st_blocks * 512 < size:  # a reused slot has its pages: walking them costs ~35 ms/GiB
                os.posix_fallocate(fd, 0, size)
        except OSError as err:
            if err.errno == errno.ENOSPC:
                raise NodeMemoryError(
                    f"the node-memory folder {folder} ran out of space for a {human_size(size)} snapshot slot: "
                    f"{node_memory.FIXES}"
                ) from err
            if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise
    os.close(fd)
    _OURS.add(_inode(path))
    return path


def _recycle(folder: str, prefix: str, kept: str) -> None:
    """Leader, after a commit: every other committed snapshot goes; one of this process's own
    slot files becomes the spare (renamed to a temporary name), the rest are removed."""
    names = checkpoint_names(prefix)
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if path == kept or not names.fullmatch(name):
            continue
        with contextlib.suppress(FileNotFoundError):
            if folder not in _SPARES and _inode(path) in _OURS:
                spare = os.path.join(folder, tmp_name(f"{prefix}-{SLOT}"))
                os.rename(path, spare)
                _SPARES[folder] = spare
            else:
                os.unlink(path)


# --- the commit in the background ---------------------------------------------------------------


class _Commit:
    """This rank's part of a snapshot after its copy: CRC-32s, report, and (leader) the commit,
    run by this process's commit thread."""

    def __init__(self, path: str, run: Callable[[], None]) -> None:
        self.path = path
        self.run = run
        self.error: BaseException | None = None
        self.done = threading.Event()
        _commit_queue().put(self)

    def join(self) -> None:
        self.done.wait()


_QUEUE: tuple[int, queue.SimpleQueue[_Commit]] | None = None


def _commit_queue() -> queue.SimpleQueue[_Commit]:
    """The queue of this process's commit thread, started once: starting a thread per snapshot
    waits for it to run, up to the GIL's switch interval (5 ms) of the stall."""
    global _QUEUE
    if _QUEUE is None or _QUEUE[0] != os.getpid():  # a forked child has no thread of its parent's
        commits: queue.SimpleQueue[_Commit] = queue.SimpleQueue()
        # File I/O and the store only: never a collective (see ckptools.collective).
        threading.Thread(target=_commit_thread, args=(commits,), name="ckptools-snapshot", daemon=True).start()
        _QUEUE = (os.getpid(), commits)
    return _QUEUE[1]


def _commit_thread(commits: queue.SimpleQueue[_Commit]) -> None:
    while True:
        commit = commits.get()
        try:
            commit.run()
        except BaseException as err:  # noqa: BLE001 - kept, raised on every rank by the next call
            commit.error = err
            log.warn(f"the snapshot {commit.path} was not committed: {_said(err)}", all_ranks=True)
        finally:
            commit.run = _done  # what it held (the plan, the mapping's views) goes now
            commit.done.set()


def _done() -> None:
    pass


_PENDING: dict[str, _Commit] = {}


def _join(folder: str) -> str | None:
    """Wait for this rank's commit in ``folder``; its failure as text, or None."""
    commit = _PENDING.pop(folder, None)
    if commit is None:
        return None
    commit.join()
    if commit.error is None:
        return None
    return _said(commit.error)


def _said(error: BaseException) -> str:
    """An error in one line: torch's store errors carry C++ stack frames after the first."""
    return f"{type(error).__name__}: " + (str(error).strip().splitlines() or [""])[0][:300]


def settle(folder: str) -> None:
    """Local: wait for this rank's commit in ``folder`` (its failure is kept for `finish_snapshot`)."""
    commit = _PENDING.get(folder)
    if commit is not None:
        commit.join()


def finish_snapshot(folder: str) -> None:
    """Collective: wait for the snapshot being committed in ``folder``; its failure, if any,
    raised on every rank as `CheckpointError`."""
    failure = first_error(all_gather_object(_join(folder)), lambda text: text)
    if failure is not None:
        raise CheckpointError(
            f"the last snapshot in {folder} was not committed on {failure}; the one before it is whole"
        )


def _crc32s(mapped: _Mapped, shares: list[Share]) -> dict[str, int]:
    crcs = {}
    for share in shares:
        data = mapped.bytes[share.offset : share.offset + share.nbytes].numpy()
        crcs[share.key] = zlib.crc32(data)  # type: ignore[arg-type]  # an ndarray is a buffer
    return crcs


# --- the snapshot ---------------------------------------------------------------------------------


class Orphaned(CheckpointError):
    """Raised on every rank by `write_snapshot` when some rank's torchrun agent is gone (killed):
    nobody will restart or stop the ranks any more, so the caller leaves. The snapshot just taken
    was committed first, where that could be done (``committed``); else the one before it is whole."""

    def __init__(self, message: str, *, committed: bool) -> None:
        super().__init__(message)
        self.committed = committed


def write_snapshot(
    folder: str,
    prefix: str,
    name: str,
    state: Mapping[str, Any],
    *,
    metadata: Mapping[str, Any] | None = None,
    writers: str = "auto",
    blocking: bool = False,
    prepare: Callable[[], None] | None = None,
    cadence: list[int] | None = None,
) -> str:
    """Collective: copy ``state`` into every node's memory as the snapshot ``name`` in ``folder``.

    Returns once this rank's copy is whole (``blocking``: once the snapshot is committed on every
    node, its failure raised on every rank). ``prepare`` runs on every node's leader before the
    copy (the keeper's start). ``writers="rank0"``: each node's leader copies everything.
    ``cadence``: ``[n]``, this rank's proposal (calls to skip after this one), replaced by rank 0's,
    agreed in the opening exchange (`CheckpointManager.snapshot`'s budget).

    Examples:
        >>> write_snapshot("/tmp/ckptools-doc-shm", "ckpt", "ckpt-0000000001.pt", {"w": torch.ones(2)}, blocking=True)
        '/tmp/ckptools-doc-shm/ckpt-0000000001.pt'
    """
    check_writers(writers)
    previous = _join(folder)
    started = time.monotonic()
    path, user_meta = checked_args(os.path.join(folder, name), state, metadata)
    token = node_token(folder)
    partitions, problem = describe_partitions(state)  # a ZeRO optimizer's, metadata only
    proposal = cadence[0] if cadence else 0
    gathered = all_gather_object((rank_part(state), token, previous, partitions, problem, launcher_gone(), proposal))
    if cadence:
        cadence[0] = gathered[0][6]  # rank 0's: the same calls are skipped everywhere
    orphaned = [r for r, reply in enumerate(gathered) if reply[5]]
    failed = first_error(gathered, lambda reply: reply[2])
    if failed is not None:
        raise CheckpointError(
            f"the snapshot before {path} was not committed on {failed}; the one before it is whole "
            "(this snapshot was not taken)"
        )
    failed = first_error(gathered, lambda reply: reply[4])
    if failed is not None:
        raise CheckpointError(f"the snapshot {path} was not taken: {failed}")
    state = with_partitions(state, [reply[3] for reply in gathered])
    split = writers != "rank0"
    if not split and len(gathered) > 1 and has_partitions(state):  # the same verdict on every rank
        fix, obstacle = "take it with writers='auto' (the default) or 'all'", "writers='rank0' does not allow"
        raise CheckpointError(f"the snapshot {path} was not taken: {refusal(obstacle, fix)}")
    nodes = group_nodes([reply[1] for reply in gathered])
    rank = get_rank()
    node = next(ranks for ranks in nodes if rank in ranks)
    leader = node[0]
    location = resolve(path)

    def plan_it() -> tuple[Plan, dict[int, bytes]]:
        payload = build_payload(state, user_meta, [reply[0] for reply in gathered])
        plan = make_plan(location, state, payload, nodes=nodes if split else [[n[0]] for n in nodes])
        plan.token = secrets.token_bytes(16)  # names this snapshot's reports in the store
        return plan, plan.small if len(nodes) > 1 else {}

    saving = agree.saving(path)
    sent = saving.on_rank0(plan_it, send=True)
    assert sent is not None  # on_rank0 raised otherwise
    plan, small = sent
    if rank == leader and rank != 0:
        plan.small = small
    _receive_rank0_part(plan, nodes, leader)

    slot, error, storages = None, None, []
    try:
        if rank == leader:
            if prepare is not None:
                prepare()
            slot = _prepare_slot(folder, prefix, plan.size)
        storages = locate(plan, state, plan.mine())
    except Exception as err:  # noqa: BLE001 - raised on every rank below
        error = err
    replies = all_gather_object((slot, outcome_of(error, rank)))
    failures = [outcome for _, outcome in replies if outcome is not None]
    if failures:
        if slot is not None:
            _SPARES[folder] = slot  # allocated: the next snapshot reuses it
        saving.raise_outcome(failures[0], error)
    plan.tmp = replies[leader][0]

    mine = plan.mine()
    mapped = _mapping(plan.tmp, plan.size)
    copy_error: BaseException | None = None
    try:
        _copy(mapped, mine, storages)
    except Exception as err:  # noqa: BLE001 - reported to the leader: the snapshot does not count
        copy_error = err
    if orphaned:  # the job's last snapshot: committed here, without the store, then every rank leaves
        _commit_orphaned(plan, mapped, copy_error, location, (folder, prefix, path), node, orphaned)
    members = node[1:]
    abandoned = threading.Event()  # never set: a member that never reports is given up on at the timeout

    def commit() -> None:
        crcs = {} if copy_error is not None else _crc32s(mapped, mine)
        if rank != leader:
            report_share(plan, copy_error, crcs)
            if copy_error is not None:
                raise copy_error
            return
        try:
            replies = [(None, crcs), *(collect_shares(plan, abandoned, members) if members else [])]
            if copy_error is not None:
                raise copy_error
            text = first_error(replies, lambda reply: reply[0])
            if text is not None:
                raise RankFailure(text)
            zip_writer.commit(plan, location, {k: v for reply in replies for k, v in reply[1].items()})
        except BaseException:
            _SPARES[folder] = plan.tmp  # not committed: still this node's spare slot
            raise
        _recycle(folder, prefix, path)

    _PENDING[folder] = _Commit(path, commit)
    if rank == leader:  # the file is renamed into place by the commit: its size is the plan's
        log.report("snapshot copied", location, started, plan.size)
    if blocking:
        finish_snapshot(folder)
    return path


def _commit_orphaned(
    plan: Plan,
    mapped: _Mapped,
    copy_error: BaseException | None,
    location: Any,
    where: tuple[str, str, str],
    node: list[int],
    orphaned: list[int],
) -> None:
    """Collective, when torchrun's agent of some rank is gone: commit this snapshot in this thread and
    raise `Orphaned` on every rank. The commit's reports go through the store the agent held, gone
    with it: instead, once every rank's copy is whole (an exchange over the process group), each node's
    leader computes the CRC-32 of every record of its copy itself (the node holds a whole copy) and
    commits. Whatever became of the previous snapshot's commit, this one counts."""
    folder, prefix, path = where
    rank = get_rank()
    copies = all_gather_object(outcome_of(copy_error, rank))
    error: BaseException | None = None
    if rank == node[0]:
        try:
            failed = [copies[r] for r in node if copies[r] is not None]
            if failed:
                raise RankFailure(failed[0][1])
            zip_writer.commit(plan, location, _crc32s(mapped, plan.shares))
            _recycle(folder, prefix, path)
        except Exception as err:  # noqa: BLE001 - raised on every rank below, in Orphaned's words
            error = err
            _SPARES[folder] = plan.tmp  # not committed: still this node's spare slot
    outcomes = [o for o in all_gather_object(outcome_of(error, rank)) if o is not None]
    gone = f"torchrun's agent of rank(s) {', '.join(map(str, orphaned))} is gone"
    if outcomes:
        raise Orphaned(f"{gone}, and the snapshot {path} was not committed ({outcomes[0][1]}); the one before it "
                       "is whole", committed=False)  # fmt: skip
    raise Orphaned(f"{gone}; the snapshot {path} is committed", committed=True)


def _copy(mapped: _Mapped, shares: list[Share], sources: list[Any]) -> None:
    """This rank's shares into the mapped slot at their offsets; CUDA copies are issued back to
    back, non-blocking, and one synchronize per device waits for them."""
    devices = set()
    for share, source in zip(shares, sources):
        data = source if isinstance(source, torch.Tensor) else whole_storage(source)
        target = mapped.bytes[share.offset : share.offset + share.nbytes]
        if data.device.type == "cuda":
            mapped.pin()
            devices.add(data.device)
            copy_bytes(target, data, non_blocking=mapped.registered)
        else:
            copy_bytes(target, data)
    for device in devices:
        torch.cuda.current_stream(device).synchronize()


def _receive_rank0_part(plan: Plan, nodes: list[list[int]], leader: int) -> None:
    """Collective, several nodes only: rank 0 sends the storages only it holds as they are stored
    (buffers, RNG, plain values) to every other node's leader, as one CPU byte tensor."""
    if len(nodes) == 1:
        return
    keys = sorted({s.key for s in plan.shares if s.where is None and s.writer != 0}, key=int)
    sizes = {s.key: s.nbytes for s in plan.shares}
    total = sum(sizes[k] for k in keys)
    if not keys or total == 0:
        return
    rank = get_rank()
    buffer = torch.empty(total, dtype=torch.uint8)
    offset = 0
    for key in keys:
        if rank == 0:
            buffer[offset : offset + sizes[key]].copy_(whole_storage(plan.storages[key]))
        offset += sizes[key]
    broadcast_bytes(buffer, 0)
    if rank != 0 and rank == leader:
        offset = 0
        for key in keys:
            plan.storages[key] = buffer[offset : offset + sizes[key]]  # type: ignore[assignment]
            offset += sizes[key]


# --- a node's snapshot sent to the nodes that lack it (restore) -----------------------------------


def send_file(path: str, src: int, receive: bool, chunk: int = 64 << 20) -> None:
    """Collective: rank ``src`` sends the file ``path`` to the ranks with ``receive``, which write
    it at ``path`` in their own folder (atomically); every rank takes part in the broadcasts. A
    failure on any rank is raised on every rank, and nothing is left half-written."""
    rank = get_rank()
    size = broadcast_object(os.path.getsize(path) if rank == src else None, src=src)
    error: BaseException | None = None
    source = target = None
    tmp = os.path.join(os.path.dirname(path), tmp_name(os.path.basename(path)))
    try:
        if rank == src:
            source = open(path, "rb")  # noqa: SIM115 - closed below, after the last broadcast
        elif receive:
            target = open(tmp, "wb")  # noqa: SIM115
    except OSError as err:
        error = err
    buffer = torch.empty(min(chunk, max(size, 1)), dtype=torch.uint8)
    done = 0
    while done < size:
        n = min(chunk, size - done)
        piece = buffer[:n]
        if source is not None and error is None:
            try:
                source.readinto(piece.numpy())  # type: ignore[arg-type]
            except OSError as err:
                error = err
        broadcast_bytes(piece, src)  # every rank, even one that failed: no one is left waiting
        if target is not None and error is None:
            try:
                target.write(piece.numpy().tobytes())
            except OSError as err:
                error = err
        done += n
    for f in (source, target):
        if f is not None:
            f.close()
    if target is not None:
        try:
            if error is None:
                os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    Agreement(f"sending the snapshot {path} from rank {src}").on_every_rank(error)


def close_slots(folder: str) -> None:
    """Local: wait for this rank's commit in ``folder``, unmap its slots and remove its spare (the
    committed snapshot stays): `CheckpointManager.close`."""
    settle(folder)
    for key in [k for k, mapped in _MAPPED.items() if mapped.folder == folder]:
        _MAPPED.pop(key).close()
    spare = _SPARES.pop(folder, None)
    if spare is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(spare)


def release() -> list[str]:
    """The job's normal end on this rank: wait for its commits, unmap its slots, and remove the
    node-memory folders (one rank per node; `ckptools.write.node_memory.release`)."""
    for folder in list(_PENDING):
        _join(folder)
    while _MAPPED:
        _MAPPED.popitem()[1].close()
    _SPARES.clear()
    _OURS.clear()
    return node_memory.release()
