"""``writers="all"``, the writing: every rank's part of the collective save `ckptools.write.plan` plans.

`plan_shares` (rank 0 plans, every rank checks it sees the temporary file), then every rank writes its
records (`ckptools.write.zip_writer.write_shares`) and reports to rank 0, which commits
(`ckptools.write.commit`: the one protocol): gathered by a collective in `write_and_commit`, through the
process group's store in the async save's writer threads (`write_share_in_background`), since a
background thread never runs a collective.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .. import log
from ..collective import agree
from ..collective.agree import first_failure
from ..collective.group import (
    all_gather_object,
    get_rank,
)
from ..errors import CheckpointError
from ..owned.gradients import has_gradients, owned_refusal
from ..owned.zero import has_partitions
from ..storage import Location, run_watched
from . import upload, zip_writer
from .async_save import AsyncSave
from .commit import Gathered, Stored, WatchedFile, finish
from .payload import state_entry
from .plan import TOKEN_BYTES, Plan, Share, describe, make_plan, settle_cuda

__all__ = ["locate", "plan_shares", "write_and_commit", "write_share_in_background"]


# --- every rank: see, locate, write ----------------------------------------------------------------


def adopt(plan: Plan, location: Location) -> Plan:
    """The plan as this rank sees it: the temporary file in the directory *this* rank resolves
    the path to (a relative path, or a node-local one, may name another directory than rank 0's)."""
    directory = os.path.dirname(os.path.abspath(location.path))
    plan.tmp = os.path.join(directory, os.path.basename(plan.tmp))
    return plan


def sees(plan: Plan) -> bool:
    """Whether this rank sees rank 0's temporary file (the same directory); an upload, every rank."""
    if plan.upload:
        return True
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

    def planned() -> Plan:
        payload = build_payload()
        if before_write is not None:
            before_write()
        if not location.local:  # S3 (`choose`): one multipart upload
            plan = make_plan(location, state, payload, on_cpu=on_cpu, upload=True)
            return run_watched(lambda: upload.create(location, plan), path)  # stuck: every rank told, in bound
        plan = make_plan(location, state, payload, on_cpu=on_cpu)
        return run_watched(lambda: zip_writer.create_tmp(location, plan), path)

    sent = agree.saving(path).on_rank0(planned, send=True)
    assert sent is not None  # on_rank0 raised otherwise
    plan = sent if get_rank() == 0 or sent.upload else adopt(sent, location)
    try:
        seen, storages, problem = sees(plan), locate(plan, state, plan.mine()), None
    except CheckpointError as err:
        seen, storages, problem = False, [], str(err)
    replies = _gathered(plan, (seen, problem))
    failure = first_failure(replies, lambda reply: reply[1])
    blind = [rank for rank, reply in enumerate(replies) if not reply[0] and reply[1] is None]
    if failure is None and blind and (has_partitions(state) or has_gradients(state)):
        failure = owned_refusal(
            state,
            f"rank {', '.join(map(str, blind))} cannot do: it cannot see the temporary file rank 0 created in "
            f"{os.path.dirname(plan.tmp)} (node-local directory?)",
            "save to a directory every rank shares",
        )
    if failure is None and blind and writers == "all":
        failure = (
            f"rank {', '.join(map(str, blind))} cannot see the temporary file rank 0 created in "
            f"{os.path.dirname(plan.tmp)}, so not every rank can write into the one file (node-local "
            "directory?); save to a directory every rank shares, or pass writers='auto' (rank 0 writes when "
            "they do not share it) or writers='rank0'"
        )
    if (failure is not None or blind) and get_rank() == 0:
        zip_writer.discard(plan)
    if failure is not None:
        raise agree.saving(path).failure(failure)
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
            zip_writer.discard(plan)
        raise


def write_and_commit(location: Location, plan: Plan, storages: list[Any]) -> int | None:
    """The sync save: this rank writes its share, every rank's reply is gathered (a collective), rank 0
    commits or discards (`ckptools.write.commit.finish`), and the outcome is raised on every rank.
    Rank 0's file size."""
    error: BaseException | None = None
    crcs: dict[str, int] = {}
    pairs = list(zip(plan.mine(), storages))
    settle_cuda(storages)  # the write's thread copies from CUDA on its own stream: this thread's work first
    try:
        # In a watched thread: a stuck storage is a StorageStalledError in this rank's reply within the bound
        crcs = run_watched(lambda: zip_writer.write_shares(plan, pairs), location.url)
    except Exception as err:  # noqa: BLE001 - reported, and raised on every rank below
        error = err
    failure: BaseException | None = None
    written = None
    try:
        written = finish(plan, location, error, crcs, Gathered(), WatchedFile())
    except Exception as err:  # noqa: BLE001 - rank 0's: shared with every rank below, then raised
        failure = err
    agree.saving(location.url).share(failure)
    return written


def write_share_in_background(location: Location, plan: Plan, pairs: list[Any], handle: AsyncSave) -> int | None:
    """A writer thread, ``writers="all"``: write this rank's share; every rank but 0 reports it
    through the store, rank 0 collects the reports and commits the file (or removes it).

    No collective: the outcome reaches every rank at ``wait()``, from rank 0, as with one writer.
    """
    error: BaseException | None = None
    crcs: dict[str, int] = {}
    try:
        crcs = zip_writer.write_shares(plan, pairs)
    except Exception as err:  # noqa: BLE001 - reported below, raised on every rank by wait()
        error = err
    coordinator = get_rank() == 0
    written = finish(plan, location, error, crcs, Stored(coordinator, handle.abandoned))
    if not coordinator:
        handle.mark_reported()
        if error is not None:
            raise error
    return written
