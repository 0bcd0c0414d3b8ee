"""The async save's state in one place: its handle (`AsyncSave`: the writer thread, whether
every rank wrote a share, the outcome ``wait()`` shares), and `SAVES`, which holds the stager its copies
go into (`ckptools.write.staging.StagingBuffers`); the save in flight is held where every checkpoint call
finishes it first (`ckptools.storage.finish_pending`).

The division of labour is fixed: the main thread stages the copy and runs every collective
(in the same order on every rank); the writer thread, on each rank that writes (global rank 0, or
every rank its share with ``writers="all"``), does file I/O and the store's reports, never a
collective. See `ckptools.async_save`.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import log
from ..collective import agree
from ..collective.arrival import entered
from ..collective.group import all_gather_object, get_rank
from ..storage import finish_pending, forget_pending, set_pending, stall_timeout
from ..storage import pending as held
from .staging import StagingBuffers
from .writer_thread import BackgroundWriter

__all__ = ["AsyncSave", "finish_pending", "pending", "release_staging_buffers", "set_pending", "stage"]


class Saves:
    """The async saves of this process: the stager their copies go into, one state's worth of host
    memory, held between saves so the next one only copies. The one in flight (at most one; every rank
    holds its own handle for it, only rank 0's has a thread, so every rank knows there is one to finish
    and the finishing collective matches) is `pending()`."""

    def __init__(self) -> None:
        self.stager = StagingBuffers()


SAVES = Saves()


def stage(payload: Any) -> Any:
    """A copy of ``payload`` whose tensors live in the async saves' reused staging buffers."""
    staged = SAVES.stager.stage(payload)
    SAVES.stager.wait()  # the caller may step the optimizer the moment the save returns
    return staged


def release_staging_buffers() -> int:
    """Free the host memory async saves keep for their staged copies; return how many bytes it was.

    `ckptools.async_save` keeps one state's worth of host memory (pinned when the
    state is on CUDA) so that the next save copies into it instead of allocating and faulting
    in fresh pages. Call this when no more async saves will come (``CheckpointManager.close()``
    does), after the save in flight has finished; the next async save allocates again.

    Examples:
        >>> import ckptools as ck
        >>> ck.release_staging_buffers()
        0
    """
    handle = pending()
    if handle is not None and not handle.done():
        raise RuntimeError("an async save is still writing from the staging buffers; wait() for it first")
    return SAVES.stager.release()


class AsyncSave:
    """The handle of one `ckptools.async_save`: ``wait()`` (collective), ``done()`` (local).

    Every rank holds one; a rank that writes (global rank 0; every rank with ``writers="all"``,
    ``shared``) runs its write in a `BackgroundWriter` (`start`).

    Attributes:
        path: where the checkpoint will be.
        stall_seconds: how long the call held the caller (checks, staging, collectives);
            ``snapshot_seconds`` is its old name (deprecated, goes in 0.5).
    """

    @property
    def snapshot_seconds(self) -> float:
        """Deprecated: `stall_seconds`."""
        import warnings

        warnings.warn("AsyncSave.snapshot_seconds is deprecated and goes in 0.5: use stall_seconds", DeprecationWarning,
                      stacklevel=2)  # fmt: skip
        return self.stall_seconds

    def __init__(self, path: str, started: float, *, shared: bool = False) -> None:
        self.path = path
        self.stall_seconds = time.monotonic() - started
        self._started = started
        self._writer = BackgroundWriter(
            "ckptools-async-save", raised_at=" (raised on every rank at the next checkpoint call)"
        )
        self._agreement = agree.saving(path, how=" in the background")
        self._outcome: agree.Outcome | None = None  # rank 0's failure, shared by wait()
        self._finished = False
        # writers="all": every rank writes a share and reports it to rank 0's writer (`reported`:
        # rank 0 reports nothing, it collects); `abandoned` is set when wait() gave up on the save
        # (a peer died or never reported), so rank 0's writer stops waiting for the other ranks'
        # shares and removes its temporary file.
        self.shared = shared
        self.expected = 0
        self.reported = shared and get_rank() == 0
        self.abandoned = threading.Event()

    def __repr__(self) -> str:
        state = "finished" if self._finished else ("writing" if not self.done() else "written, not waited for")
        return f"AsyncSave({self.path!r}, {state})"

    def start(self, write: Callable[[], int | None], after: Callable[[], None] | None = None) -> None:
        """Run ``write`` (then ``after``, housekeeping after the commit: the manager's pruning) in
        this rank's writer thread. ``write`` returns the bytes of the file it committed, or None on
        a rank whose share rank 0 commits (``writers="all"``)."""
        self.expected = SAVES.stager.nbytes  # what this rank's write hands the storage, about (its staged copy)
        self._writer.start(self.path, write, after=after, started=self._started)

    def mark_reported(self) -> None:
        """This rank's writer told rank 0 its share is on disk (or what failed)."""
        self.reported = True

    def _meet(self) -> None:
        """``writers="all"``: before rank 0 joins its writer, which waits for every other rank's
        report, every rank meets once. The other ranks have joined their writers (so their reports
        are in the store); a dead rank breaks this exchange (raised, and rank 0's writer told to
        give up) instead of leaving rank 0 joined to a writer that waits for it."""
        if get_rank() != 0:
            self.join_writer()
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
        return self._writer.done()

    def behind(self, grace: float) -> str | None:
        """Collective: whether a rank's background write of this save is still running, and moving (within the
        stall bound), and will not end within ``grace`` seconds: then a line naming the target and how fast it
        writes, the same on every rank; None when every rank's write ended (waited for up to ``grace`` where
        its speed says it ends by then), or one made no progress for the bound (`wait` then raises at once)."""
        bound = stall_timeout()
        seen = self._writer.progress()
        if seen is not None and _remaining(seen, self.expected, grace) <= grace:
            self._writer.join_for(grace)  # about to end (or no speed seen yet): a storage that keeps up
            seen = self._writer.progress()
        stuck = seen is not None and bound > 0 and self._writer.idle() > bound  # as `wait` would judge it
        gathered = all_gather_object((seen, stuck))
        running = [(rank, mine) for rank, (mine, _) in enumerate(gathered) if mine is not None]
        if not running or any(stuck for _, stuck in gathered):
            return None
        # The slowest first (with writers="all" rank 0's writer also waits for the others' reports: it is not
        # the one to blame when its own bytes went fast).
        running.sort(key=lambda item: item[1][2] / item[1][0] if item[1][0] > 0 else 0.0)
        said = [f"rank {rank} ({nbytes / 1e6:.3g} MB in {elapsed:.1f} s, {nbytes / max(elapsed, 1e-9) / 1e6:.3g} MB/s)"
                for rank, (elapsed, _, nbytes, _) in running[:4]]  # fmt: skip
        more = f" and {len(running) - 4} more ranks" if len(running) > 4 else ""
        return f"{', '.join(said)}{more} still writing {self.path}"

    def join_writer(self) -> None:
        """Local: block until this rank's background write (if any) ended."""
        self._writer.join()

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
        if not self._finished:
            try:
                with entered("AsyncSave.wait"):  # in here: a rank that never comes abandons the write too
                    if self.shared:
                        self._meet()
                    self.join_writer()
                    self._outcome = self._agreement.broadcast(self._writer.error)
                    self._finished = True
            finally:
                if not self._finished:
                    self.abandoned.set()
                    self.join_writer()  # rank 0's writer gives up at once and removes its file
                # Even when the exchange itself broke (a peer died): the group is gone then, and
                # every later call must not try to finish this save again.
                forget_pending(self)
        self._agreement.raise_outcome(self._outcome, self._writer.error)
        return self.path


def _remaining(seen: tuple[float, float, int, bool], expected: int, grace: float) -> float:
    """Seconds a running write should still take at the speed it has shown: 0 (wait for it up to the grace)
    while it just began or its final sync just began, whose speed is the storage's own; without end when it
    went on that way for longer than the grace (a storage that writes nothing or syncs slowly)."""
    elapsed, idle, nbytes, syncing = seen
    if syncing or nbytes <= 0:
        return 0.0 if (idle if syncing else elapsed) < grace else float("inf")
    return max(0, expected - nbytes) / (nbytes / elapsed)


def pending() -> AsyncSave | None:
    """The async save in flight (not yet waited for), or None."""
    handle = held()
    return handle if isinstance(handle, AsyncSave) else None


SKIP_GRACE = 1.0  # seconds `skip_behind` waits for the save in flight, at least, before it skips


def skip_behind(what: str) -> str | None:
    """Collective: the path of the async save still in flight and moving, that will not end within one more
    stall of its own (`SKIP_GRACE` at least), when ``what`` (a save) would queue behind it and is skipped
    instead, with one warning (a run's first skip) naming the target and how fast it writes; None to save (the
    one in flight ended, or is stuck).

    Examples:
        >>> skip_behind("the save of step 8") is None  # no save in flight
        True
    """
    handle = pending()
    # Waiting for the save in flight at most as long as a save holds the loop anyway (its stall, at least
    # SKIP_GRACE): a storage that keeps up takes every save; one slower than the loop costs no more.
    grace = max(SKIP_GRACE, handle.stall_seconds) if handle is not None else 0.0
    behind = handle.behind(grace) if handle is not None else None  # every rank holds the handle, or none does
    if handle is None or behind is None:
        return None
    log.warn(
        f"{what} was skipped, as is every save while the one before it is still being written: {behind}. "
        "The storage writes slower than the loop saves; the node-memory snapshots (CheckpointManager.snapshot) "
        "keep the newest steps meanwhile. Save less often, or to faster storage",
        once=f"behind {os.path.dirname(handle.path)}",  # once per run's directory; each skip at info level
    )
    log.logger.info("skipped %s: %s", what, behind)
    return handle.path
