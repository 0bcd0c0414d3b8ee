"""The one commit protocol of a file that writers fill at planned offsets: a save's (rank 0 alone, or
every rank its share), a background save's, a node-memory snapshot's.

The phases, in the order they are called (as DCP's ``StorageWriter`` documents its own):

1. **plan**, on the coordinator: the records at their offsets and the target, a temporary file beside
   the checkpoint (`ckptools.write.zip_writer.create_tmp`), a multipart upload, or a node's spare slot;
2. **write**, on every writer: its shares' bytes, then their CRC-32s; its `Reply` is its CRC-32s, or
   what failed (`reply`);
3. **report**, every writer's reply to the coordinator (`Reports`): gathered by a collective
   (`Gathered`: the sync save, from the main thread), through the process group's store (`Stored`: a
   background save's and a snapshot's commit, from a writer thread, which never runs a collective), or
   no one to report to (`Alone`);
4. **finish**, on the coordinator (`finish`): the first failure any writer reported (or its own) and the
   target is discarded; else the directory is written with every CRC-32 and the file published.

The variants differ only in how the reports travel (`Reports`) and in what committing and discarding
the target mean (`Target`: a file's rename, or a slot that stays the node's spare when it fails).
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Mapping
from typing import Any, Protocol

from .. import log
from ..collective.agree import RankFailure
from ..collective.group import all_gather_object, collective_timeout, default_store, get_rank, get_world_size
from ..errors import CheckpointError, StorageStalledError
from ..layouts.torch_io import save_file
from ..storage import Location, run_watched
from . import zip_writer
from .plan import Plan, make_plan

__all__ = [
    "FILE",
    "Alone",
    "Gathered",
    "Reply",
    "Reports",
    "Stored",
    "Target",
    "WatchedFile",
    "finish",
    "reply",
    "write_alone",
]

# A writer's reply: what failed (``"OSError: disk full"``), or None and the CRC-32 of each storage it wrote.
Reply = tuple[str | None, dict[str, int]]


def reply(error: BaseException | None, crcs: dict[str, int]) -> Reply:
    """A writer's reply after its write: its error, or its CRC-32s by storage key.

    Examples:
        >>> reply(OSError("disk full"), {})
        ('OSError: disk full', {})
    """
    return (None if error is None else f"{type(error).__name__}: {error}", crcs)


class Reports(Protocol):
    """How the writers' replies reach the coordinator."""

    @property
    def coordinator(self) -> bool:
        """Whether this rank is the one that finishes."""

    def exchange(self, plan: Plan, mine: Reply) -> list[tuple[int, Reply]] | None:
        """Every writer's rank and reply, the coordinator's own first, on the coordinator; None on a
        writer whose part ends with its report."""


class Alone:
    """One writer, the coordinator itself: nothing travels."""

    coordinator = True

    def exchange(self, plan: Plan, mine: Reply) -> list[tuple[int, Reply]] | None:
        return [(get_rank(), mine)]


class Gathered:
    """Collective (the main thread of every rank): every rank's reply gathered; ``coordinator`` takes
    those of ``writers`` (every rank's by default)."""

    def __init__(self, coordinator: int = 0, writers: list[int] | None = None) -> None:
        self.rank, self.writers = coordinator, writers

    @property
    def coordinator(self) -> bool:
        return get_rank() == self.rank

    def exchange(self, plan: Plan, mine: Reply) -> list[tuple[int, Reply]] | None:
        replies = all_gather_object(mine)
        if not self.coordinator:
            return None
        ranks = self.writers if self.writers is not None else range(len(replies))
        return [(self.rank, mine), *((r, replies[r]) for r in ranks if r != self.rank)]


class Stored:
    """From a writer thread (never a collective): each writer of ``members`` (every rank but 0 by
    default) sets its reply in the process group's store; the coordinator polls for them, and gives up
    when ``abandoned`` is set (the main thread found a peer dead) or after the group's timeout."""

    def __init__(self, coordinator: bool, abandoned: threading.Event, members: list[int] | None = None) -> None:
        self.coordinator, self.abandoned, self.members = coordinator, abandoned, members

    def exchange(self, plan: Plan, mine: Reply) -> list[tuple[int, Reply]] | None:
        if not self.coordinator:
            default_store().set(_key(plan, get_rank()), pickle.dumps(mine))
            return None
        members = list(range(1, get_world_size())) if self.members is None else self.members
        return [(get_rank(), mine), *zip(members, _collect(plan, self.abandoned, members) if members else [])]


def _key(plan: Plan, rank: int) -> str:
    return f"ckptools/share/{plan.token.hex()}/{rank}"


def _collect(plan: Plan, abandoned: threading.Event, ranks: list[int]) -> list[Reply]:
    """The coordinator's writer thread: the replies of ``ranks`` from the store (file I/O's pace: polled)."""
    store = default_store()
    keys = [_key(plan, rank) for rank in ranks]
    started = time.monotonic()
    deadline = started + collective_timeout().total_seconds()
    pause = 0.001
    orphaned: float | None = None
    while not store.check(keys):
        now = time.monotonic()
        if orphaned is None and not threading.main_thread().is_alive():
            # The program ended without wait(): the other ranks' writers still get as long as
            # this one took (at least a minute), then the interpreter may exit.
            orphaned = now + max(60.0, 3 * (now - started))
        if abandoned.is_set() or now > deadline or (orphaned is not None and now > orphaned):
            missing = [k.rsplit("/", 1)[1] for k in keys if not store.check([k])]
            raise CheckpointError(f"rank {', '.join(missing)} never reported its share of the checkpoint")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    replies = []
    for key in keys:
        replies.append(pickle.loads(store.get(key)))  # written by a rank of this job
        store.delete_key(key)
    return replies


class Target(Protocol):
    """What committing and discarding the planned target mean."""

    def commit(self, plan: Plan, location: Location, crcs: dict[str, int]) -> int:
        """Write the directory with ``crcs`` and publish the file; its size."""

    def discard(self, plan: Plan) -> None:
        """The commit will not happen: let the target go."""


class _File:
    """A checkpoint's temporary file (or multipart upload): renamed into place, or removed (aborted)."""

    def commit(self, plan: Plan, location: Location, crcs: dict[str, int]) -> int:
        return zip_writer.commit(plan, location, crcs)

    def discard(self, plan: Plan) -> None:
        zip_writer.discard(plan)


FILE = _File()


class WatchedFile:
    """`FILE` for one save, committed or discarded in a thread the caller watches (`run_watched`): a rank 0
    whose storage is stuck in the commit's fsync or rename raises StorageStalledError within the bound while
    the other ranks wait for its word. A commit given up on discards its file itself, when it comes back; a
    discard waits for its storage in a thread of its own."""

    def __init__(self) -> None:
        self._given_up = False

    def commit(self, plan: Plan, location: Location, crcs: dict[str, int]) -> int:
        def commit_or_discard() -> int:
            try:
                return FILE.commit(plan, location, crcs)
            except BaseException:
                FILE.discard(plan)
                raise

        try:
            return run_watched(commit_or_discard, location.url, name="ckptools-commit")
        except StorageStalledError:
            self._given_up = True
            raise

    def discard(self, plan: Plan) -> None:
        if self._given_up:
            return  # the commit's own thread discards it
        # Not waited for past a second: on a stuck storage the unlink waits behind the write the storage holds,
        # and the error every rank raises must not wait a second bound for it.
        remover = threading.Thread(target=FILE.discard, args=(plan,), name="ckptools-discard", daemon=True)
        remover.start()
        remover.join(1.0)
        if remover.is_alive():
            log.logger.error("removing %s waits for its storage; it goes once the storage answers", plan.tmp)


def finish(
    plan: Plan,
    location: Location,
    error: BaseException | None,
    crcs: dict[str, int],
    reports: Reports,
    target: Target = FILE,
) -> int | None:
    """Report and finish (phases 3 and 4) after this writer's write (``error``, or its ``crcs``): on
    the coordinator, commit ``target`` with every writer's CRC-32s, or discard it and raise its own
    ``error`` as it was, or the first failure another writer reported (`RankFailure`, ``rank N: ...``);
    the file's size. On another writer: its report, and None (its own error travelled in it: the
    caller raises it, or learns the outcome from the coordinator)."""
    try:
        replies = reports.exchange(plan, reply(error, crcs))
    except BaseException:
        if reports.coordinator:
            target.discard(plan)  # the exchange broke (a peer is gone): nothing will commit
        raise
    if replies is None:
        return None
    try:
        if error is not None:
            raise error
        failed = next(((rank, r[0]) for rank, r in replies if r[0]), None)
        if failed is not None:  # a stall stays one on every rank (the fix differs: the storage, not the state)
            rank, text = failed
            stalled = text.startswith(f"{StorageStalledError.__name__}: ")  # as `reply` wrote it
            raise (StorageStalledError if stalled else RankFailure)(f"rank {rank}: {text}")
        return target.commit(plan, location, {k: v for _, r in replies for k, v in r[1].items()})
    except BaseException:
        target.discard(plan)
        raise


def write_alone(location: Location, payload: Mapping[str, Any]) -> int:
    """Rank 0 writes all of ``payload``, no exchange, atomically; returns the size.

    A local file goes through the protocol with one writer: the same file ``torch.save`` would write
    (temporary name, fsync, rename, directory fsync), but each storage goes to disk with one ``pwrite``
    straight from the tensor's memory. Anything else streams through ``torch.save``
    (`ckptools.layouts.torch_io.save_file`: a multipart upload on S3).
    """
    if not location.local:
        return save_file(location, payload)
    plan = zip_writer.create_tmp(location, make_plan(location, payload, payload, alone=True))
    error: BaseException | None = None
    crcs: dict[str, int] = {}
    try:
        crcs = zip_writer.write_shares(plan, [(share, plan.storages[share.key]) for share in plan.shares])
    except BaseException as err:  # noqa: BLE001 - finish discards the file and raises it as it was
        error = err
    written = finish(plan, location, error, crcs, Alone())
    assert written is not None  # the one writer is the coordinator
    return written
