"""``writers="all"``, the writing: every rank's part of the collective save `ckptools.write.plan` plans.

`plan_shares` (rank 0 plans, every rank checks it sees the temporary file), then every rank
`write_shares` its records and `commit_shares` gathers the CRC-32s and has rank 0 commit. The async
save's writer threads use `write_share_in_background` instead, which reports through the process
group's store (`report_share`, `collect_shares`) since a background thread never runs a collective.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .. import log
from ..codecs.torchzip import ZipPlan
from ..collective.agree import RankFailure, outcome_of, raise_outcome, share_outcome
from ..collective.group import (
    all_gather_object,
    broadcast_object,
    collective_timeout,
    default_store,
    get_rank,
    get_world_size,
)
from ..errors import CheckpointError
from ..layouts.torch_io import save_file
from ..storage import Location, fsync_dir
from .async_save import AsyncSave
from .plan import PREFIX, TOKEN_BYTES, Plan, Share, describe, host_bytes, make_plan, state_entry

__all__ = [
    "commit_shares",
    "plan_shares",
    "write_alone",
    "write_and_commit",
    "write_share_in_background",
    "write_shares",
]


# --- every rank: see, locate, write ----------------------------------------------------------------


def adopt(plan: Plan, location: Location) -> Plan:
    """The plan as this rank sees it: the temporary file in the directory *this* rank resolves
    the path to (a relative path, or a node-local one, may name another directory than rank 0's)."""
    directory = os.path.dirname(os.path.abspath(location.path))
    plan.tmp = os.path.join(directory, os.path.basename(plan.tmp))
    return plan


def sees(plan: Plan) -> bool:
    """Whether this rank sees rank 0's temporary file (the same directory)."""
    try:
        with open(plan.tmp, "rb") as f:
            return f.read(TOKEN_BYTES) == plan.token
    except OSError:
        return False


def locate(plan: Plan, state: Mapping[str, Any], shares: list[Share]) -> list[torch.UntypedStorage]:
    """This rank's storages for ``shares``, found where the plan says they sit in ``state``."""
    entries: dict[str, Any] = {}
    found = []
    for share in shares:
        if share.where is None:
            found.append(plan.storages[share.key])
            continue
        name, *keys = share.where
        try:
            if name not in entries:
                entries[name] = state_entry(state[name])
            node = entries[name]
            for key in keys:
                node = node[key]
            storage = node.untyped_storage()
        except (KeyError, IndexError, TypeError, AttributeError) as err:
            raise CheckpointError(
                f"rank {get_rank()} has no tensor at {describe(share.where)}, which rank 0 has ({err!r}): "
                "the ranks passed different state to save(); pass the same entries on every rank"
            ) from err
        if storage.nbytes() != share.nbytes:
            raise CheckpointError(
                f"rank {get_rank()}'s {describe(share.where)} holds {storage.nbytes()} bytes, rank 0's "
                f"{share.nbytes}: the ranks' models differ; pass the same model on every rank"
            )
        found.append(storage)
    return found


def write_shares(plan: Plan, chunks: list[tuple[Share, torch.UntypedStorage]]) -> dict[str, int]:
    """Write each share's bytes at its offset in the temporary file, fsync; CRC-32 by key.

    ``chunks`` pairs each share with its storage (or a snapshot of it). Every byte is written
    first; then a helper thread waits in ``fsync`` for the disk while this thread computes the
    CRC-32s from the same memory (nothing changes it meanwhile: the caller's save holds it, or
    it is the save's own snapshot). The checksums (~4 GiB/s here, a quarter second per GiB) so
    hide behind the disk's flush instead of adding to it: 1 GiB as 128 tensors, 9 rounds in
    rotating order with 10 s of rest before each run, median 2.36 s against 2.68 s with each
    CRC-32 computed before its write and 2.85 s for ``cp`` + ``sync`` of the file
    (benchmarks/bench_save.py measures the same). A helper computing them *beside the writes*
    was slower (it takes the CPU that copying into the page cache needs), and asking the kernel
    to start writeback piece by piece (``sync_file_range``) three times slower on this disk.
    """
    crcs: dict[str, int] = {}
    views: list[tuple[Share, memoryview]] = []
    fd = os.open(plan.tmp, os.O_WRONLY)
    try:
        for share, storage in chunks:
            data = host_bytes(storage)
            if storage.device.type != "cpu":
                # A host copy made for this write (a GPU tensor): checksummed now and let go,
                # so that host memory holds one storage at a time, not the whole share.
                crcs[share.key] = zlib.crc32(data)
            else:
                views.append((share, data))
            _pwrite_all(fd, data, share.offset)
        failed: list[BaseException] = []

        def flush() -> None:
            try:
                os.fsync(fd)
            except BaseException as err:  # noqa: BLE001 - raised below, in the caller's thread
                failed.append(err)

        # File I/O only, never a collective: the thread blocks in fsync with the GIL released. A
        # plain thread, not an executor: an async save still writing when the script ends runs
        # during interpreter shutdown, where executors refuse new work ("cannot schedule new
        # futures after interpreter shutdown"; test_a_script_that_ends_with_a_save_in_flight_...).
        flusher = threading.Thread(target=flush, name="ckptools-fsync", daemon=True)
        flusher.start()
        try:
            crcs.update((share.key, zlib.crc32(data)) for share, data in views)
        finally:
            flusher.join()
        if failed:
            raise failed[0]
    finally:
        os.close(fd)
    return crcs


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    # One pwrite moves at most ~2 GiB on Linux; the rest goes in further calls.
    data = data.cast("B")
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done : done + (1 << 30)], offset + done)


# --- rank 0: the commit ----------------------------------------------------------------------------


def commit(plan: Plan, path: str, crcs: dict[str, int]) -> int:
    """Rank 0: headers, small records and central directory, fsync, rename, fsync the directory.

    Returns the file's size.
    """
    zplan = ZipPlan(plan.records, force_zip64=plan.force_zip64)
    by_key = {f"{PREFIX}data/{k}": c for k, c in crcs.items()}
    all_crcs = []
    fd = os.open(plan.tmp, os.O_WRONLY)
    try:
        for index, (name, _) in enumerate(plan.records):
            data = plan.small.get(index)
            crc = zlib.crc32(data) if data is not None else by_key[name]
            all_crcs.append(crc)
            _pwrite_all(fd, memoryview(zplan.header(index, crc)), zplan.header_offsets[index])
            if data is not None:
                _pwrite_all(fd, memoryview(data), zplan.data_offsets[index])
        _pwrite_all(fd, memoryview(zplan.directory(all_crcs)), zplan.directory_offset)
        os.fsync(fd)
    finally:
        os.close(fd)
    directory, name = os.path.split(os.path.abspath(path))
    os.replace(plan.tmp, os.path.join(directory, name))
    fsync_dir(directory)
    return zplan.size


def write_alone(location: Location, payload: Mapping[str, Any]) -> int:
    """Rank 0 writes all of ``payload``, no exchange, atomically; returns the size.

    A local file goes through the planned writer: the same file ``torch.save`` would write
    (temporary name, fsync, rename, directory fsync), but each storage goes to disk with one
    ``pwrite`` straight from the tensor's memory. Anything else streams through ``torch.save``
    (`ckptools.layouts.torch_io.save_file`: a multipart upload on S3).
    """
    if not location.local:
        return save_file(location, payload)
    plan = make_plan(location, payload, payload, alone=True)
    try:
        crcs = write_shares(plan, [(share, plan.storages[share.key]) for share in plan.shares])
        return commit(plan, location.path, crcs)
    except BaseException:
        discard(plan)
        raise


def discard(plan: Plan | None) -> None:
    """Rank 0: remove the temporary file of a save that failed."""
    if plan is not None:
        with contextlib.suppress(OSError):
            os.unlink(plan.tmp)


# --- async: each rank's share reported to rank 0's writer thread, through the group's store ---------


def _share_key(plan: Plan, rank: int) -> str:
    return f"ckptools/share/{plan.token.hex()}/{rank}"


def report_share(plan: Plan, error: BaseException | None, crcs: dict[str, int]) -> None:
    """A rank's writer thread: tell rank 0 its share is on disk (its CRC-32s) or what failed."""
    text = None if error is None else f"{type(error).__name__}: {error}"
    default_store().set(_share_key(plan, get_rank()), pickle.dumps((text, crcs)))


def collect_shares(plan: Plan, abandoned: threading.Event) -> list[tuple[str | None, dict[str, int]]]:
    """Rank 0's writer thread: every other rank's report, by rank (file I/O's pace: polled).

    Gives up (raising `CheckpointError`) when ``abandoned`` is set, i.e. the main thread found a
    peer dead, or after the process group's timeout.
    """
    store = default_store()
    keys = [_share_key(plan, rank) for rank in range(1, get_world_size())]
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


def first_error(gathered: list[Any], what: Callable[[Any], str | None]) -> str | None:
    """The first rank's complaint among gathered replies, prefixed with its rank."""
    for rank, reply in enumerate(gathered):
        text = what(reply)
        if text:
            return f"rank {rank}: {text}"
    return None


# --- the collective steps ------------------------------------------------------------------------


def plan_shares(
    location: Location,
    state: Mapping[str, Any],
    build_payload: Callable[[], dict[str, Any]],
    before_write: Callable[[], None] | None,
    writers: str,
    *,
    on_cpu: bool = False,
) -> tuple[Plan, list[Any]] | None:
    """``writers="all"``: rank 0 plans and every rank checks it can take part (two collectives).

    Rank 0 builds the payload (``build_payload``), runs ``before_write`` and creates the
    temporary file. Returns the plan and this rank's storages to write, or None when rank 0 is
    to write alone (``"auto"`` and a directory some rank does not see; ``before_write`` has run
    then). Raises on every rank otherwise.
    """
    path = str(location)
    plan: Plan | None = None
    error: BaseException | None = None
    if get_rank() == 0:
        try:
            payload = build_payload()
            if before_write is not None:
                before_write()
            plan = make_plan(location, state, payload, on_cpu=on_cpu)
        except Exception as err:  # noqa: BLE001 - shared with every rank below, then re-raised
            error = err
    outcome, sent = broadcast_object((outcome_of(error), plan))
    raise_outcome(outcome, error, path)
    plan = plan if plan is not None else adopt(sent, location)
    try:
        seen, storages, problem = sees(plan), locate(plan, state, plan.mine()), None
    except CheckpointError as err:
        seen, storages, problem = False, [], str(err)
    replies = _gathered(plan, (seen, problem))
    failure = first_error(replies, lambda reply: reply[1])
    blind = [rank for rank, reply in enumerate(replies) if not reply[0] and reply[1] is None]
    if failure is None and blind and writers == "all":
        failure = (
            f"rank {', '.join(map(str, blind))} cannot see the temporary file rank 0 created in "
            f"{os.path.dirname(plan.tmp)}, so not every rank can write into the one file (node-local "
            "directory?); save to a directory every rank shares, or pass writers='auto' (rank 0 writes when "
            "they do not share it) or writers='rank0'"
        )
    if (failure is not None or blind) and get_rank() == 0:
        discard(plan)
    if failure is not None:
        raise CheckpointError(f"saving checkpoint {path} failed: {failure}; earlier checkpoints are untouched")
    if blind:
        log.warn(
            f"rank {', '.join(map(str, blind))} cannot see {os.path.dirname(plan.tmp)}, where rank 0 saves: rank 0 "
            "writes the checkpoint alone (writers='auto')",
            once="writers-blind",
        )
        return None
    return plan, storages


def _gathered(plan: Plan | None, reply: Any) -> list[Any]:
    """all_gather_object; rank 0 removes the temporary file first if the exchange breaks."""
    try:
        return all_gather_object(reply)
    except BaseException:
        if get_rank() == 0:
            discard(plan)
        raise


def write_and_commit(path: str, plan: Plan, storages: list[Any]) -> int | None:
    """The sync save: this rank writes its share, then `commit_shares` (collective). Rank 0's file size."""
    error: BaseException | None = None
    crcs: dict[str, int] = {}
    try:
        crcs = write_shares(plan, list(zip(plan.mine(), storages)))
    except Exception as err:  # noqa: BLE001 - gathered by commit_shares and raised on every rank
        error = err
    return commit_shares(path, plan, error, crcs)


def commit_shares(path: str, plan: Plan, error: BaseException | None, crcs: dict[str, int]) -> int | None:
    """Every rank's write done (or failed): gather the CRC-32s, rank 0 commits or discards,
    the outcome is raised on every rank (collective). Rank 0's file size."""
    replies = _gathered(plan, (None if error is None else f"{type(error).__name__}: {error}", crcs))
    failure: BaseException | None = None
    written = None
    if get_rank() == 0:
        text = first_error(replies, lambda reply: reply[0])
        if text is not None:
            failure = RankFailure(text)
            discard(plan)
        else:
            try:
                written = commit(plan, path, {k: v for reply in replies for k, v in reply[1].items()})
            except Exception as err:  # noqa: BLE001 - shared with every rank below, then re-raised
                discard(plan)
                failure = err
    share_outcome(failure, path)
    return written


def write_share_in_background(path: str, plan: Plan, pairs: list[Any], handle: AsyncSave) -> int | None:
    """A writer thread, ``writers="all"``: write this rank's share; every rank but 0 reports it
    through the store, rank 0 collects the reports and commits the file (or removes it).

    No collective: the outcome reaches every rank at ``wait()``, from rank 0, as with one writer.
    """
    error: BaseException | None = None
    crcs: dict[str, int] = {}
    try:
        crcs = write_shares(plan, pairs)
    except Exception as err:  # noqa: BLE001 - reported below, raised on every rank by wait()
        error = err
    if get_rank() != 0:
        report_share(plan, error, crcs)
        handle.reported = True
        if error is not None:
            raise error
        return None
    try:
        replies = [(None, crcs), *collect_shares(plan, handle.abandoned)]
        if error is not None:
            raise error
        failure = first_error(replies, lambda reply: reply[0])
        if failure is not None:
            raise RankFailure(failure)
        return commit(plan, path, {k: v for reply in replies for k, v in reply[1].items()})
    except BaseException:
        discard(plan)
        raise


def whole_storage(storage: Any) -> torch.Tensor:
    """A uint8 tensor over all of ``storage`` (so a snapshot copies the whole storage)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
