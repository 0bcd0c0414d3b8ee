"""A snapshot's commit, in the background: after its copy, a thread per rank (at a lower CPU priority
than the step's) computes the CRC-32s of what this rank copied (ISA-L's: about 0.6 times the copy's
time; zlib's, where isal has no wheel: about four times; either way not in the stall) and reports
them to its node's leader through the process group's store (never a collective off the main
thread); the leader's thread writes the headers and the central directory and renames the
spare slot into place. `COMMITS` holds each folder's commit in flight; the next snapshot (or
`finish_snapshot`) waits for it and raises its failure, if any, on every rank.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable

from .. import log
from ..collective.agree import Agreement
from ..collective.group import all_gather_object
from ..storage import crc32, yield_to_the_step
from ..write import Share
from .slots import MappedSlot

__all__ = ["COMMITS", "Commits", "crc32s", "finish_snapshot", "said"]


class _Commit:
    """This rank's part of a snapshot after its copy: CRC-32s, report, and (leader) the commit,
    run by this process's commit thread."""

    def __init__(self, path: str, run: Callable[[], None]) -> None:
        self.path = path
        self.run = run
        self.error: BaseException | None = None
        self.done = threading.Event()

    def join(self) -> None:
        self.done.wait()


class Commits:
    """This process's commit thread and each folder's commit in flight."""

    def __init__(self) -> None:
        self._pending: dict[str, _Commit] = {}
        self._queue: tuple[int, queue.SimpleQueue[_Commit]] | None = None

    def start(self, folder: str, path: str, run: Callable[[], None]) -> None:
        """Run ``run`` (the commit of the snapshot at ``path`` in ``folder``) on the commit thread."""
        commit = self._pending[folder] = _Commit(path, run)
        self._commit_queue().put(commit)

    def join(self, folder: str) -> str | None:
        """Wait for this rank's commit in ``folder``; its failure as text, or None."""
        commit = self._pending.pop(folder, None)
        if commit is None:
            return None
        commit.join()
        return None if commit.error is None else said(commit.error)

    def settle(self, folder: str) -> None:
        """Wait for this rank's commit in ``folder``, keeping its failure for `finish_snapshot`."""
        commit = self._pending.get(folder)
        if commit is not None:
            commit.join()

    def join_all(self) -> None:
        for folder in list(self._pending):
            self.join(folder)

    def _commit_queue(self) -> queue.SimpleQueue[_Commit]:
        """The queue of this process's commit thread, started once: starting a thread per snapshot
        waits for it to run, up to the GIL's switch interval (5 ms) of the stall."""
        if self._queue is None or self._queue[0] != os.getpid():  # a forked child has no thread of its parent's
            commits: queue.SimpleQueue[_Commit] = queue.SimpleQueue()
            # File I/O and the store only: never a collective (see ckptools.collective).
            threading.Thread(target=_commit_thread, args=(commits,), name="ckptools-snapshot", daemon=True).start()
            self._queue = (os.getpid(), commits)
        return self._queue[1]


COMMITS = Commits()


COMMIT_NICENESS = 10


def _yield_to_the_step() -> None:
    """This commit thread behind the step, by `COMMIT_NICENESS` (`ckptools.storage.yield_to_the_step`): a commit
    that waits longer loses no step: a step counts once its copy is whole (ckptools.node.sealing); only the next
    snapshot's wait for it could grow (docs/benchmarks.md, "Inside the HF Trainer and Lightning")."""
    yield_to_the_step(COMMIT_NICENESS)


def _commit_thread(commits: queue.SimpleQueue[_Commit]) -> None:
    _yield_to_the_step()
    while True:
        commit = commits.get()
        try:
            commit.run()
        except BaseException as err:  # noqa: BLE001 - kept, raised on every rank by the next call
            commit.error = err
            log.warn(f"the snapshot {commit.path} was not committed: {said(err)}", all_ranks=True)
        finally:
            commit.run = _done  # what it held (the plan, the mapping's views) goes now
            commit.done.set()


def _done() -> None:
    pass


def said(error: BaseException) -> str:
    """An error in one line: torch's store errors carry C++ stack frames after the first."""
    return f"{type(error).__name__}: " + (str(error).strip().splitlines() or [""])[0][:300]


def finish_snapshot(folder: str) -> None:
    """Collective: wait for the snapshot being committed in ``folder``; its failure, if any,
    raised on every rank as `CheckpointError`."""
    agreement = Agreement(
        f"the last snapshot in {folder}", failed="was not committed", tail="; the one before it is whole"
    )
    agreement.raise_first(all_gather_object(COMMITS.join(folder)), lambda text: text)


def crc32s(mapped: MappedSlot, shares: list[Share]) -> dict[str, int]:
    """The CRC-32 of each of ``shares`` as copied into ``mapped``, by storage key."""
    crcs = {}
    for share in shares:
        data = mapped.bytes[share.offset : share.offset + share.nbytes].numpy()
        crcs[share.key] = crc32(data)
    return crcs
