"""What asynchronous saves need: a snapshot into reusable host buffers, a writer thread, and
the one slot for the save in flight.

The division of labour is fixed: the main thread takes the snapshot and runs every collective
(in the same order on every rank); the writer thread, on global rank 0 only, does file I/O and
nothing else. See `ckptools.async_save`.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from .. import log
from ..collective.agree import RankFailure
from ..collective.group import all_gather_object, broadcast_object, get_rank
from ..devices import keep_view_bits
from ..errors import CheckpointError

__all__ = ["AsyncSave", "release_snapshot_buffers"]


class SnapshotBuffers:
    """Host buffers, one per distinct storage of the last snapshot, reused while sizes match.

    A snapshot copies whole storages, not tensors, so tensors that share memory (tied weights,
    views) still share it in the snapshot and the file is laid out exactly as ``torch.save``
    would lay out the live state. CUDA storages land in pinned memory: the copies are issued
    non-blocking, back to back, and one synchronize per device waits for all of them.

    `ckptools.async_save` uses one set for the whole process (`release_snapshot_buffers` frees
    it); a writer of its own (the Lightning plugin) holds another, so that a snapshot still being
    written is never overwritten by the other's next save.
    """

    def __init__(self) -> None:
        self._storages: list[torch.UntypedStorage] = []
        self._pinned: list[bool] = []  # kept here: UntypedStorage.is_pinned() warns on some versions
        self.nbytes = 0

    def release(self) -> None:
        self._storages = []
        self._pinned = []
        self.nbytes = 0

    def take(self, payload: Any) -> Any:
        """A copy of ``payload`` whose tensors live in this object's buffers (or are clones)."""
        tensors: dict[int, torch.Tensor] = {}
        _collect(payload, tensors)
        copies: dict[tuple[str, int, int], torch.UntypedStorage] = {}
        memo: dict[int, Any] = {}
        used = 0
        devices: set[torch.device] = set()
        for tensor in tensors.values():
            if not _plain(tensor):
                # Sparse, quantized, nested, meta, subclasses: deepcopy clones them, and a clone
                # is not touched by training either; only the buffer reuse is lost.
                continue
            storage = tensor.untyped_storage()
            key = (str(storage.device), storage.data_ptr(), storage.nbytes())
            if key not in copies:
                copies[key] = self._copy(storage, used)
                used += 1
                if storage.device.type == "cuda":
                    devices.add(storage.device)
            view = torch.empty(0, dtype=tensor.dtype).set_(
                copies[key], tensor.storage_offset(), tensor.size(), tensor.stride()
            )
            keep_view_bits(tensor, view)
            if tensor.requires_grad:
                view.requires_grad_(True)
            if isinstance(tensor, torch.nn.Parameter):
                view = torch.nn.Parameter(view, requires_grad=tensor.requires_grad)
            memo[id(tensor)] = view
        for device in devices:
            # One wait for every copy issued on that device's current stream.
            torch.cuda.current_stream(device).synchronize()
        del self._storages[used:]
        del self._pinned[used:]
        self.nbytes = sum(s.nbytes() for s in self._storages)
        # deepcopy rebuilds every container as it was (OrderedDict with its _metadata, tuples,
        # namedtuples, ...) and takes the tensors copied above from the memo.
        return copy.deepcopy(payload, memo)

    def _copy(self, storage: torch.UntypedStorage, index: int) -> torch.UntypedStorage:
        nbytes = storage.nbytes()
        cuda = storage.device.type == "cuda"
        if index < len(self._storages):
            buffer = self._storages[index]
            if buffer.nbytes() != nbytes or self._pinned[index] != cuda:
                buffer = self._storages[index] = _allocate(nbytes, pinned=cuda)
                self._pinned[index] = cuda
        else:
            buffer = _allocate(nbytes, pinned=cuda)
            self._storages.append(buffer)
            self._pinned.append(cuda)
        source = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        target = torch.empty(0, dtype=torch.uint8).set_(buffer)
        target.copy_(source, non_blocking=cuda)
        return buffer


def _allocate(nbytes: int, *, pinned: bool) -> torch.UntypedStorage:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned).untyped_storage()


def _plain(tensor: torch.Tensor) -> bool:
    return (
        type(tensor) in (torch.Tensor, torch.nn.Parameter)
        and tensor.layout == torch.strided
        and not tensor.is_quantized
        and not tensor.is_nested
        and tensor.device.type in ("cpu", "cuda")
    )


def _collect(node: Any, found: dict[int, torch.Tensor]) -> None:
    if isinstance(node, torch.Tensor):
        found.setdefault(id(node), node)
    elif isinstance(node, dict):
        for value in node.values():
            _collect(value, found)
    elif isinstance(node, (list, tuple, set, frozenset)):
        for value in node:
            _collect(value, found)


# One snapshot's worth of host memory, held between saves so the next one only copies.
_BUFFERS = SnapshotBuffers()


def release_snapshot_buffers() -> int:
    """Free the host memory async saves keep for their snapshots; return how many bytes it was.

    `ckptools.async_save` keeps one snapshot's worth of host memory (pinned when the
    state is on CUDA) so that the next save copies into it instead of allocating and faulting
    in fresh pages. Call this when no more async saves will come (``CheckpointManager.close()``
    does), after the save in flight has finished; the next async save allocates again.

    Examples:
        >>> import ckptools as ck
        >>> ck.release_snapshot_buffers()
        0
    """
    if _PENDING is not None and not _PENDING.done():
        raise RuntimeError("an async save is still writing from the snapshot buffers; wait() for it first")
    held = _BUFFERS.nbytes
    _BUFFERS.release()
    return held


class AsyncSave:
    """The handle of one `ckptools.async_save`: ``wait()`` (collective), ``done()`` (local).

    Attributes:
        path: where the checkpoint will be.
        snapshot_seconds: how long the call held the caller (checks, snapshot, collectives).
    """

    def __init__(self, path: str, started: float) -> None:
        self.path = path
        self.snapshot_seconds = time.monotonic() - started
        self._started = started
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._outcome: str | None = None  # rank 0's failure text, shared by wait()
        self._finished = False
        # writers="all": every rank writes a share and reports it to rank 0's writer (`reported`);
        # `abandoned` is set when wait() gave up on the save (a peer died or never reported), so
        # rank 0's writer stops waiting for the other ranks' shares and removes its temporary file.
        self.shared = False
        self.reported = False
        self.abandoned = threading.Event()

    def __repr__(self) -> str:
        state = "finished" if self._finished else ("writing" if not self.done() else "written, not waited for")
        return f"AsyncSave({self.path!r}, {state})"

    def _start_thread(self, write: Callable[[], int | None], after: Callable[[], None] | None) -> None:
        """Run ``write`` (then ``after``) in a writer thread. ``write`` returns the bytes of the
        file it committed, or None on a rank whose share rank 0 commits (``writers="all"``)."""

        def run() -> None:
            try:
                written = write()
            except Exception as err:  # noqa: BLE001 - kept for wait(), which raises it on every rank
                self._error = err
                # Said now as well, in case the process ends before anything waits for it.
                log.logger.error(
                    "background save of %s failed: %s: %s (raised on every rank at the next checkpoint call)",
                    self.path,
                    type(err).__name__,
                    err,
                )
                return
            if written is None:
                return  # another rank's share: rank 0 commits the file and reports it
            log.report("saved", self.path, self._started, written)
            if after is not None:
                after()  # housekeeping that must come after the commit (the manager's pruning)

        # Not a daemon: a script that returns with a save in flight still gets its file, as the
        # interpreter joins non-daemon threads before it exits.
        self._thread = threading.Thread(target=run, name="ckptools-async-save", daemon=False)
        self._thread.start()

    def _meet(self) -> None:
        """``writers="all"``: before rank 0 joins its writer, which waits for every other rank's
        report, every rank meets once. The other ranks have joined their writers (so their reports
        are in the store); a dead rank breaks this exchange (raised, and rank 0's writer told to
        give up) instead of leaving rank 0 joined to a writer that waits for it."""
        if get_rank() != 0:
            self._join_thread()
        unreported = all_gather_object(not self.reported)
        if any(unreported):
            self.abandoned.set()  # that rank's report will never come: rank 0's writer stops now

    def done(self) -> bool:
        """Whether this rank's part is finished: local, never blocks, never communicates.

        On a rank that writes (global rank 0; every rank with ``writers="all"``) True once its
        background write ended, successfully or not (rank 0's after it committed the file);
        on every other rank always True. Never decide whether
        to call `wait` (a collective) from ``done()``: ranks would disagree and hang.
        """
        return self._thread is None or not self._thread.is_alive()

    def _join_thread(self) -> None:
        """Local: block until this rank's background write (if any) ended."""
        if self._thread is not None:
            self._thread.join()

    def wait(self) -> str:
        """Wait for the write to be complete on disk; collective: every rank calls it.

        Returns:
            The checkpoint's path, on every rank.

        Raises:
            CheckpointError: a writer's write failed (on every rank, naming the rank; rank 0
                chains the original exception). The file at ``path`` is then untouched (an earlier one stays).
                Raised again by a later ``wait()`` of this handle.

        Examples:
            >>> handle = ck.async_save("/tmp/ckpt.pt", {"model": model})  # doctest: +SKIP
            >>> handle.wait()  # doctest: +SKIP
            '/tmp/ckpt.pt'
        """
        global _PENDING
        if not self._finished:
            try:
                if self.shared:
                    self._meet()
                self._join_thread()
                failure = None if self._error is None else _failure_text(self._error)
                self._outcome = broadcast_object(failure if get_rank() == 0 else None)
                self._finished = True
            finally:
                if not self._finished:
                    self.abandoned.set()
                    self._join_thread()  # rank 0's writer gives up at once and removes its file
                # Even when the exchange itself broke (a peer died): the group is gone then, and
                # every later call must not try to finish this save again.
                if _PENDING is self:
                    _PENDING = None
        if self._outcome is not None:
            text = f"saving checkpoint {self.path} in the background failed on {self._outcome}"
            raise CheckpointError(f"{text}; earlier checkpoints are untouched") from self._error
        return self.path


# The save in flight: at most one. Every rank holds its own handle for it (only rank 0's has a
# thread), so every rank knows there is one to finish and the finishing collective matches.
_PENDING: AsyncSave | None = None


def pending() -> AsyncSave | None:
    """The async save in flight (not yet waited for), or None."""
    return _PENDING


def set_pending(handle: AsyncSave) -> None:
    global _PENDING
    if _PENDING is not None:
        raise RuntimeError("an async save is already in flight; finish_pending() first")
    _PENDING = handle


def finish_pending() -> str | None:
    """Collective: wait for the async save in flight, if any; its path (None if there was none).

    Every checkpoint call (save, async_save, load, the manager's) calls this first, so at most
    one save is ever in flight and a failed background write is raised on every rank at the
    next checkpoint call at the latest.
    """
    handle = _PENDING
    if handle is None:
        return None
    waited = time.monotonic()
    path = handle.wait()
    if time.monotonic() - waited > 1.0:
        log.logger.debug("waited %.1f s for the background save of %s", time.monotonic() - waited, path)
    return path


def take_snapshot(payload: Any) -> Any:
    """A copy of ``payload`` whose tensors live in the reused snapshot buffers (or are clones)."""
    return _BUFFERS.take(payload)


def start_writing(handle: AsyncSave, write: Callable[[], int | None], after: Callable[[], None] | None = None) -> None:
    """Run ``write`` (then ``after``, housekeeping after the commit) in ``handle``'s writer thread."""
    handle._start_thread(write, after)


def _failure_text(error: BaseException) -> str:
    """``rank N: what failed``, for the message every rank raises."""
    if isinstance(error, RankFailure):  # another rank's, reported to rank 0's writer
        return str(error)
    return f"rank 0: {type(error).__name__}: {error}"


def join_writer(handle: AsyncSave) -> None:
    """Local: block until this rank's background write of ``handle`` (if any) ended."""
    handle._join_thread()
