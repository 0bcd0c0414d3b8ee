"""Process-group helpers that also work with no process group at all.

A single process without ``torch.distributed`` initialised is treated as rank 0 of a world
of 1, so every collective in ckptools degrades to a local call.

The *global* rank decides who writes: on two nodes both node-local rank-0 processes have
``LOCAL_RANK == 0``, and letting both write would interleave two writers on a shared disk.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import datetime
import os
import pickle
import sys
import time
from typing import Any

import torch

from .. import log
from ..errors import CheckpointError

__all__ = [
    "barrier",
    "dist_ready",
    "found_node",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "is_main_process",
    "local_world_size",
    "node_of",
    "set_timeout",
]

# torchrun's agent: the parent that started this process (None when torchrun did not). Read once, at
# import, by the process itself: once the agent is gone, getppid() names whoever adopted the process
# (PID 1, a subreaper), and a forked DataLoader worker's parent is its rank.
_LAUNCHED = (os.getpid(), os.getppid() if os.environ.get("TORCHELASTIC_RUN_ID") else None)


def launcher() -> int | None:
    """The pid of the torchrun agent that started this process, or None (not under torchrun).

    Examples:
        >>> launcher() is None  # run without torchrun
        True
    """
    pid, parent = _LAUNCHED
    return parent if pid == os.getpid() else None


def launcher_gone() -> bool:
    """Whether torchrun's agent started this process and is gone (killed: nobody will restart or
    stop this rank any more).

    Examples:
        >>> launcher_gone()
        False
    """
    parent = launcher()
    return parent is not None and os.getppid() != parent


def dist_ready() -> bool:
    # torch.distributed is missing from some builds (e.g. older macOS wheels): is_available().
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def get_rank() -> int:
    """Return this process's global rank (0 without a process group).

    Examples:
        >>> import ckptools as ck
        >>> ck.get_rank()
        0
    """
    return torch.distributed.get_rank() if dist_ready() else 0


def get_world_size() -> int:
    """Return the number of processes in the default group (1 without a process group).

    Examples:
        >>> import ckptools as ck
        >>> ck.get_world_size()
        1
    """
    return torch.distributed.get_world_size() if dist_ready() else 1


def get_local_rank() -> int:
    """Return this process's rank on its node, from ``LOCAL_RANK`` (set by torchrun); without it (``mp.spawn``)
    as found from the ranks' host names at ckptools' first collective call, else 0.

    Use it to pick the GPU (``cuda:LOCAL_RANK``), never to decide who writes.

    Examples:
        >>> import ckptools as ck
        >>> ck.get_local_rank()
        0
    """
    value = os.environ.get("LOCAL_RANK")
    if value is None:  # mp.spawn and other launchers: as found from the ranks' hosts, once known
        return _NODE[0][0] if _NODE else 0
    try:
        return int(value)
    except ValueError as err:
        raise ValueError(f"LOCAL_RANK={value!r} is not an integer; unset it or let torchrun set it") from err


def local_world_size(default: int) -> int:
    """How many ranks run on this node: torchrun's ``LOCAL_WORLD_SIZE``, else as found from the ranks'
    hosts (`found_node`), else ``default`` (not yet known, or not an integer).

    Examples:
        >>> import os
        >>> local_world_size(3) if "LOCAL_WORLD_SIZE" not in os.environ else 3
        3
    """
    if "LOCAL_WORLD_SIZE" not in os.environ and _NODE:
        return _NODE[0][1]
    try:
        return int(os.environ.get("LOCAL_WORLD_SIZE", ""))
    except ValueError:
        return default


# (local rank, ranks on this node) as found from every rank's host (`found_node`), where the launcher
# did not say (no LOCAL_RANK: mp.spawn, a hand-written launcher).
_NODE: list[tuple[int, int]] = []


def node_of(hosts: list[str], rank: int) -> tuple[int, int]:
    """``rank``'s place among the ranks of its host, and their number (``hosts``: every rank's, by rank).

    Examples:
        >>> node_of(["a", "b", "a"], 2)
        (1, 2)
    """
    same = [r for r, host in enumerate(hosts) if host == hosts[rank]]
    return same.index(rank), len(same)


def found_node(hosts: list[str]) -> tuple[int, int] | None:
    """Take this rank's node from every rank's host name (by rank) where ``LOCAL_RANK`` is unset
    (`node_of`); what `get_local_rank` and `local_world_size` give from then on; None (nothing changed)
    where the launcher said it or it is known already. Rank 0 warns once that it had to guess."""
    if "LOCAL_RANK" in os.environ or _NODE:
        return None
    rank = get_rank()
    _NODE.append(node_of(hosts, rank))
    same = _NODE[0][1]
    if rank == 0 and len(hosts) > 1:
        log.warn(
            f"LOCAL_RANK is not set (a launcher other than torchrun: mp.spawn?), so ckptools took each rank's node "
            f"from its host name: {len(set(hosts))} node(s), {same} rank(s) on rank 0's. Set LOCAL_RANK and "
            "LOCAL_WORLD_SIZE in each process to say it yourself",
            once="node-guessed",
        )
    return _NODE[0]


def is_main_process() -> bool:
    """Return True on global rank 0 (the one process that writes checkpoints).

    Examples:
        >>> import ckptools as ck
        >>> ck.is_main_process()
        True
    """
    return get_rank() == 0


def barrier() -> None:
    """Wait for every rank of the default group; a no-op without a process group.

    On NCCL the barrier runs on this rank's GPU (``device_ids``), which avoids NCCL guessing a
    device and hanging when ranks guessed differently.

    Examples:
        >>> import ckptools as ck
        >>> ck.barrier()  # no process group: returns at once
    """
    if not dist_ready():
        return
    if torch.distributed.get_backend() == "nccl" and torch.cuda.is_available():
        run_collective(torch.distributed.barrier, device_ids=[torch.cuda.current_device()])
    else:
        run_collective(torch.distributed.barrier)


def set_timeout(timeout: datetime.timedelta | None) -> None:
    """Record the collective timeout the default group was made with (`init_distributed`), for the
    gloo side group ckptools makes beside an nccl one (torch keeps no public record of it)."""
    global _TIMEOUT
    _TIMEOUT = timeout


# The timeout init_distributed was given, for the gloo side group (torch keeps no public record).
_TIMEOUT: datetime.timedelta | None = None
# (default group, gloo group made for it): ckptools' CPU-side exchanges when training uses nccl.
_SIDE: tuple[Any, Any] | None = None


def _object_group() -> Any:
    """The group ckptools' own exchanges (objects, flags) run on: None for the default group.

    When the default group has no gloo backend (nccl), a gloo group over the same ranks is made
    once (collectively: the first ckptools collective is reached by every rank in the same
    order) and reused. An exchange of Python objects or a preemption flag then stays on the CPU:
    it never interleaves with the training's NCCL kernels, never waits for the GPU stream to
    drain, and never needs a device synchronize to read the answer.
    """
    global _SIDE
    if "gloo" in str(torch.distributed.get_backend()):
        return None
    default = torch.distributed.distributed_c10d._get_default_group()
    if _SIDE is None or _SIDE[0] is not default:
        kwargs: dict[str, Any] = {"backend": "gloo"}
        if _TIMEOUT is not None:
            kwargs["timeout"] = _TIMEOUT
        _SIDE = (default, torch.distributed.new_group(**kwargs))
    return _SIDE[1]


# The Work of ckptools' last few collectives, held by the calling thread. A gloo worker thread
# drops its reference to a collective a moment after wait() returned; were it the last one, the
# tensors would be released on that thread, and a tensor with a Python object hands it back when its C++
# references fall from two to one (torch 2.13's c10/util/intrusive_ptr.h, ``decref_pyobject``):
# the gloo thread takes the GIL, first creating a Python thread state under the runtime's HEAD_LOCK. On
# CPython before 3.11.10 (gh-112275) a DataLoader worker forked at that moment inherits the lock held
# and deadlocks for good in the fork's cleanup: seen as a launch hung at an epoch's start, right
# after the exchange that chose the checkpoint to resume from. Held here, every collective's tensors
# are released on this thread (which has the GIL anyway) once it finished `_HOLD_SECONDS` ago and
# `_HOLD_COUNT` newer ones exist; by then the gloo thread has long let go. A count alone was not
# enough: eight collectives in a row (a broadcast load's buckets, the preemption check's 1-byte
# all-reduces) can take less time than a gloo thread descheduled on a loaded machine takes to let go
# (seen once in `make compat`, torch 2.6, tests/test_dist.py's shim). Memory held: the tensors of the
# last second's collectives and of the last 8 (a broadcast load's buckets are views of one buffer).
# DDP's own collectives still do it; ours no longer add to it.
_HELD: collections.deque[list[Any]] = collections.deque()  # [finished at (monotonic; None while running), Work]
_HOLD_COUNT = 8
_HOLD_SECONDS = 1.0


# A gloo worker thread releases a finished collective's Work a moment after its future completed; the
# Work's thread-local state holds Python objects, so the release takes the GIL. At interpreter exit
# (a script that ends with destroy_process_group() while DDP or ZeroRedundancyOptimizer still hold the
# backend, as every tutorial does) that moment can fall into Py_Finalize: the thread is made to exit
# while inside a noexcept destructor, and the rank dies with SIGABRT ("terminate called without an
# active exception"; seen in 6 of 10 such runs here, torch alone; pytorch#179291, #190489). Before
# the interpreter finalizes, this handler lets go of the GIL for a moment so that those threads finish.
_SETTLE_SECONDS = 0.1
_settling = False


def _let_collective_threads_settle() -> None:
    with contextlib.suppress(KeyboardInterrupt):  # mp.spawn's workers get SIGINT when their parent dies
        time.sleep(_SETTLE_SECONDS)


# The same moment, seen from a fork (see ``_HELD``): a collective that is not ckptools' (Lightning's
# ``has_len_all_ranks`` all-reduces a temporary tensor right before its fit loop makes the DataLoader's
# iterator; a user's logging all-reduce; DDP's) is let go by a gloo thread a moment after wait()
# returned, and a DataLoader worker forked while that thread creates its Python thread state (under
# the runtime's HEAD_LOCK) deadlocks for good on CPython before 3.11.10 (seen: a resumed Lightning fit
# at 2 ranks hung in its worker's fork, once in `make compat`). Nobody can hold that lock
# across a fork from Python; a fork's before-hook can let go of the GIL for a moment, as the exit
# handler does, so that a thread about to take it gets past that point first. Once per burst of forks
# (a loader starting its workers): a fork within `_FORK_BURST_SECONDS` of the last one does not wait.
_FORK_CAN_DEADLOCK = sys.version_info < (3, 11, 10)
_FORK_BURST_SECONDS = 0.05
_last_fork = -1.0


def _settle_before_fork() -> None:
    global _last_fork
    if _FORK_CAN_DEADLOCK and time.monotonic() - _last_fork > _FORK_BURST_SECONDS and dist_ready():
        with contextlib.suppress(KeyboardInterrupt):
            time.sleep(_SETTLE_SECONDS)
    _last_fork = time.monotonic()


def settle_at_exit() -> None:
    """Register, once per process, the exit handler that lets gloo's threads release their last
    collectives' Work while the interpreter still runs (see ``_SETTLE_SECONDS``), and the fork
    before-hook that does the same before a DataLoader forks a worker on CPython before 3.11.10."""
    global _settling
    if not _settling:
        atexit.register(_let_collective_threads_settle)
        os.register_at_fork(before=_settle_before_fork)
        _settling = True


def run_collective(collective: Any, *args: Any, **kwargs: Any) -> None:
    """``collective(*args, **kwargs)`` to completion, its Work held (see ``_HELD``)."""
    settle_at_exit()
    work = collective(*args, async_op=True, **kwargs)
    held = [None, work]
    _HELD.append(held)
    work.wait()
    held[0] = now = time.monotonic()
    while len(_HELD) > _HOLD_COUNT and _HELD[0][0] is not None and now - _HELD[0][0] >= _HOLD_SECONDS:
        _HELD.popleft()


def default_store() -> Any:
    """The default process group's key-value store (None without a group).

    Not a collective: a background thread may use it (``writers="all"`` async saves report each
    rank's share to rank 0's writer through it), as torch's own watchdog threads do.
    """
    if not dist_ready():
        return None
    return torch.distributed.distributed_c10d._get_default_store()


def collective_timeout() -> datetime.timedelta:
    """How long ckptools waits for another rank: the process group's timeout (30 min by default)."""
    if _TIMEOUT is not None:
        return _TIMEOUT
    if dist_ready():  # a group made without init_distributed: its backend's own (torch keeps it there)
        group = torch.distributed.distributed_c10d._get_default_group()
        for device in ("cpu", "cuda"):
            try:
                timeout = group._get_backend(torch.device(device)).options._timeout
            except Exception:  # noqa: BLE001 - no such backend, or another torch's layout
                continue
            if isinstance(timeout, datetime.timedelta):
                return timeout
    return datetime.timedelta(minutes=30)


def _payload(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Return rank ``src``'s ``obj`` on every rank (identity without a process group).

    Like ``torch.distributed.broadcast_object_list`` (pickled, CPU tensors on the gloo group, see
    ``_object_group``), its Work held by this thread (see ``_HELD``).
    """
    if not dist_ready() or get_world_size() == 1:
        return obj
    try:
        group = _object_group()
        mine = get_rank() == src
        data = _payload(obj) if mine else torch.empty(0, dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        run_collective(torch.distributed.broadcast, size, src=src, group=group)
        if not mine:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        run_collective(torch.distributed.broadcast, data, src=src, group=group)
    except RuntimeError as err:  # DistBackendError and friends
        raise peer_error(err) from err
    # Pickled by a rank of this job, as torch's own object collectives do.
    return obj if mine else pickle.loads(data.numpy().tobytes())


def broadcast_bytes(data: torch.Tensor, src: int) -> None:
    """Broadcast the CPU uint8 tensor ``data`` from rank ``src`` into every rank's ``data`` (in
    place; the same size everywhere) on the CPU-side group (see ``_object_group``): what is
    sent is bytes in host memory, never a training tensor."""
    if not dist_ready() or get_world_size() == 1:
        return
    try:
        run_collective(torch.distributed.broadcast, data, src=src, group=_object_group())
    except RuntimeError as err:
        raise peer_error(err) from err


def all_gather_object(obj: Any) -> list[Any]:
    """Return every rank's ``obj``, indexed by rank (``[obj]`` without a process group).

    Like ``torch.distributed.all_gather_object``, its Work held by this thread (see ``_HELD``).
    """
    if not dist_ready() or get_world_size() == 1:
        return [obj]
    world = get_world_size()
    try:
        group = _object_group()
        data = _payload(obj)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        run_collective(torch.distributed.all_gather, sizes, size, group=group)
        longest = max(int(s.item()) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: data.numel()] = data
        gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
        run_collective(torch.distributed.all_gather, gathered, padded, group=group)
    except RuntimeError as err:
        raise peer_error(err) from err
    return [pickle.loads(t[: int(n.item())].numpy().tobytes()) for t, n in zip(gathered, sizes)]


# The preemption check's 1-byte tensor, made once: nothing is allocated per step.
_FLAG = torch.zeros(1, dtype=torch.uint8)


def max_over_ranks(value: int) -> int:
    """The largest ``value`` (0-255) of all ranks: one 1-byte all-reduce on the CPU-side group."""
    if not dist_ready() or get_world_size() == 1:
        return value
    box = _FLAG
    box.fill_(value)
    try:
        run_collective(torch.distributed.all_reduce, box, op=torch.distributed.ReduceOp.MAX, group=_object_group())
    except RuntimeError as err:
        raise peer_error(err) from err
    return int(box.item())


def peer_error(err: BaseException) -> CheckpointError:
    """The error every surviving rank raises when a collective inside ckptools breaks.

    A peer that died breaks the connection at once (gloo); a peer that hangs (or an NCCL
    collective) is given up on after the process group's timeout (``init_distributed(timeout=)``).
    Either way the group cannot be trusted afterwards: the job has to restart and resume.
    """
    first = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
    return CheckpointError(
        f"rank {get_rank()}: a checkpoint collective with the other ranks failed ({type(err).__name__}: {first}); "
        "another rank died, hung past the process group's timeout, or skipped the call. Restart the job: "
        "it resumes from the last complete checkpoint"
    )
