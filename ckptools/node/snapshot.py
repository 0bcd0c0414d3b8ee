"""`CheckpointManager.snapshot`'s protocol: one whole snapshot per node, in that node's memory.

A snapshot is the file `ckptools.save` would write (the planned torch zip, a CRC-32 in every
record), in the node-memory folder (`ckptools.node.folder`). Every node writes its own copy, so
a relaunch finds one on every node that survived:

- **Who is a node.** The ranks that see the same folder (`node_token`); a node's *leader* is its
  lowest rank.
- **Who copies what.** What DDP keeps equal on every rank is split over each node's ranks (the
  ``writers="all"`` split, `ckptools.write.plan`), so every rank copies about
  1/LOCAL_WORLD_SIZE of the state; what only rank 0 holds as it is stored (buffers, scaler, RNG,
  plain values) rank 0's node writes from its payload, and every other node's leader receives it
  from rank 0 (one broadcast on the CPU-side group, usually small).
- **The stall is the copy** into the spare slot (`ckptools.node.slots`): `write_snapshot` returns
  once this rank's copy is whole. **The commit follows** in the background
  (`ckptools.node.commits`). The step counts once every rank's copy is whole: a kill before the
  commit leaves the copy to be sealed by the relaunch's restore or the keeper (`ckptools.node.sealing`),
  and a kill during a copy leaves the previous snapshot whole.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .. import log
from ..collective import agree
from ..collective.agree import Agreement, first_failure, outcome_of
from ..collective.group import all_gather_object, broadcast_bytes, get_rank, launcher_gone
from ..errors import CheckpointError, NodeMemoryError
from ..owned.gradients import has_gradients, owned_refusal
from ..owned.zero import has_partitions
from ..storage import resolve
from ..write import (
    FILE,
    Gathered,
    Plan,
    Stored,
    as_saved,
    build_payload,
    check_writers,
    checked_args,
    compare_replicas,
    finish,
    locate,
    make_plan,
    opening,
    what_to_compare,
    whole_storage,
    write_directory,
)
from . import sealing
from .commits import COMMITS, crc32s, finish_snapshot
from .folder import group_nodes, node_token, release_folders
from .slots import MappedSlot, NodeSlots, release_all

__all__ = ["Orphaned", "release", "settle", "write_snapshot"]

_SAID: list[bool] = []  # rank 0 said once that snapshots in a window are skipped over several nodes


class Orphaned(CheckpointError):
    """Raised on every rank by `write_snapshot` when some rank's torchrun agent is gone (killed):
    nobody will restart or stop the ranks any more, so the caller leaves. The snapshot just taken
    was committed first, where that could be done (``committed``); else the one before it is whole."""

    def __init__(self, message: str, *, committed: bool) -> None:
        super().__init__(message)
        self.committed = committed


def write_snapshot(
    slots: NodeSlots,
    name: str,
    state: Mapping[str, Any],
    *,
    metadata: Mapping[str, Any] | None = None,
    writers: str = "auto",
    blocking: bool = False,
    prepare: Callable[[], None] | None = None,
    cadence: list[int] | None = None,
    replicas: str = "auto",
    compare: Mapping[str, Any] | None = None,
) -> str | None:
    """Collective: copy ``state`` into every node's memory as the snapshot ``name`` in the folder of
    ``slots`` (this process's slots of it: the stager the copy goes into).

    Returns the path once this rank's copy is whole (``blocking``: once the snapshot is committed on every
    node, its failure raised on every rank); None, having copied nothing, inside a gradient-accumulation
    window over several nodes (`ckptools.owned.gradients`). ``prepare`` runs on every node's leader before the
    copy (the keeper's start). ``writers="rank0"``: each node's leader copies everything.
    ``cadence``: ``[n]``, this rank's proposal (calls to skip after this one), replaced by rank 0's,
    agreed in the opening exchange (`CheckpointManager.snapshot`'s budget). ``replicas``: how much of DDP's
    replicas is compared first (``"auto"``: a rotating sample, `ckptools.write.replicas`; ``compare``: the
    live objects compared instead of ``state``'s, `what_to_compare`); `ReplicaMismatchError` on every rank,
    nothing copied, when they differ.

    Examples:
        >>> from ckptools.node.slots import NodeSlots
        >>> slots = NodeSlots("/tmp/ckptools-doc-shm", "ckpt")
        >>> write_snapshot(slots, "ckpt-0000000001.pt", {"w": torch.ones(2)}, blocking=True)
        '/tmp/ckptools-doc-shm/ckpt-0000000001.pt'
    """
    check_writers(writers)
    started = time.monotonic()
    opened = _open(slots.folder, name, state, metadata, cadence, (replicas, compare))
    gathered, path, user_meta = opened.gathered, opened.path, opened.user_meta
    state = as_saved(state, gathered)
    split = writers != "rank0"
    nodes = _nodes(state, gathered, path, split)
    if nodes is None:
        return None
    rank = get_rank()
    node = next(ranks for ranks in nodes if rank in ranks)
    leader = node[0]
    location = resolve(path)

    def plan_it() -> tuple[Plan, dict[int, bytes]]:
        payload = build_payload(state, user_meta, [reply.part for reply in gathered])
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
    storages = _allocate(slots, name, plan, state, node, prepare, saving)
    mapped, copy_error = _copy(slots, plan, storages, node)
    if opened.orphaned:  # the job's last snapshot: committed here, without the store, then every rank leaves
        _commit_orphaned(plan, mapped, copy_error, location, (slots, path), node, opened.orphaned)
    _start_commit(slots, (path, location), plan, mapped, copy_error, node)
    if rank == leader:  # the file is renamed into place by the commit: its size is the plan's
        log.report("snapshot copied", location, started, plan.size)
    if blocking:
        finish_snapshot(slots.folder)
    return path


@dataclass
class _Opened:
    """What the opening exchange agreed: every rank's reply, the snapshot's path and metadata, and
    the ranks whose torchrun agent is gone."""

    gathered: list[Any]
    path: str
    user_meta: dict[str, Any]
    orphaned: list[int]


def _open(
    folder: str,
    name: str,
    state: Mapping[str, Any],
    metadata: Mapping[str, Any] | None,
    cadence: list[int] | None,
    replicas: tuple[str, Mapping[str, Any] | None],
) -> _Opened:
    """Collective, phase one: the opening exchange (node tokens, the previous commit's outcome, the
    cadence, the replicas' digests); a refusal raised on every rank, nothing copied."""
    previous = COMMITS.join(folder)
    path, user_meta = checked_args(os.path.join(folder, name), state, metadata)
    refused = None
    try:
        token = node_token(folder)
    except NodeMemoryError as err:  # not this user's alone: said on every rank, after the exchange
        token, refused = "", str(err)
    proposal = cadence[0] if cadence else 0
    digests = what_to_compare(state, *replicas)  # a snapshot's default: the sample
    brought = opening(state, token=token, previous=previous, orphaned=launcher_gone(), cadence=proposal,
                      folder=refused, digests=digests)  # fmt: skip
    gathered = all_gather_object(brought)
    unusable = first_failure(gathered, lambda reply: reply.folder)
    if unusable is not None:
        raise NodeMemoryError(f"the snapshot {path} was not taken: {unusable}")
    if cadence:
        cadence[0] = gathered[0].cadence  # rank 0's: the same calls are skipped everywhere
    orphaned = [r for r, reply in enumerate(gathered) if reply.orphaned]
    previous_commit = Agreement(f"the snapshot before {path}", failed="was not committed",
                                tail="; the one before it is whole (this snapshot was not taken)")  # fmt: skip
    # Orphaned, this snapshot is committed without the store (below): the previous one's commit may
    # have failed for want of it (the agent died during it), and does not stop the job's last snapshot.
    if not orphaned:
        previous_commit.raise_first(gathered, lambda reply: reply.previous)
    Agreement(f"the snapshot {path}", failed="was not taken").raise_first(gathered, lambda reply: reply.problem)
    if digests is not None:  # the same verdict on every rank: nothing copied, the previous snapshot the newest
        mismatch = compare_replicas([reply.digests for reply in gathered])
        if mismatch is not None:
            raise mismatch
    return _Opened(gathered, path, user_meta, orphaned)


def _nodes(state: Mapping[str, Any], gathered: list[Any], path: str, split: bool) -> list[list[int]] | None:
    """The nodes (each one's ranks, from the exchange), or None when this call is skipped: inside a
    gradient-accumulation window over several nodes. The same verdict on every rank."""
    owned = has_partitions(state) or has_gradients(state)
    if not split and len(gathered) > 1 and owned:
        fix, obstacle = "take it with writers='auto' (the default) or 'all'", "writers='rank0' does not allow"
        raise CheckpointError(f"the snapshot {path} was not taken: {owned_refusal(state, obstacle, fix)}")
    nodes = group_nodes([reply.token for reply in gathered])
    if len(nodes) > 1 and has_gradients(state):
        # A node's copy must be whole and holds only its own ranks' gradients: this call is skipped
        # (every rank saw the same replies), the next one after the window closes is taken.
        if get_rank() == 0 and not _SAID:
            _SAID.append(True)
            log.logger.info(
                "snapshots inside a gradient-accumulation window are skipped on more than one node (each rank's "
                "gradients summed so far live on its own node only): a kill loses at most the window's steps"
            )
        return None
    return nodes


def _allocate(
    slots: NodeSlots,
    name: str,
    plan: Plan,
    state: Mapping[str, Any],
    node: list[int],
    prepare: Callable[[], None] | None,
    saving: Agreement,
) -> list[Any]:
    """Collective, phase two: the node's leader allocates the spare slot (begun for sealing before any
    copy into it) and every rank locates its storages; a failure anywhere raised on every rank. This
    rank's storages, in `plan.mine()`'s order; ``plan.tmp`` set to the leader's slot."""
    rank, leader = get_rank(), node[0]
    slot, error, storages = None, None, []
    try:
        if rank == leader:
            if prepare is not None:
                prepare()
            slot = slots.prepare(plan.size)
            sealing.begin(slot, name, len(node))  # before any copy into it
        storages = locate(plan, state, plan.mine())
    except Exception as err:  # noqa: BLE001 - raised on every rank below
        error = err
    replies = all_gather_object((slot, outcome_of(error, rank)))
    failures = [outcome for _, outcome in replies if outcome is not None]
    if failures:
        if slot is not None:
            slots.keep_spare(slot)  # allocated: the next snapshot reuses it
        saving.raise_outcome(failures[0], error)
    plan.tmp = replies[leader][0]
    return storages


def _copy(
    slots: NodeSlots, plan: Plan, storages: list[Any], node: list[int]
) -> tuple[MappedSlot, BaseException | None]:
    """Local, phase three (the stall): this rank's share copied into the node's slot, the leader's
    container written, this rank's copy recorded as whole for sealing. The slot and the copy's failure
    (reported to the leader by the commit: the snapshot then does not count)."""
    rank, leader = get_rank(), node[0]
    mapped = slots.open(plan.tmp, plan.size)
    try:
        slots.stage(list(zip(plan.mine(), storages)))
        slots.wait()
        if rank == leader:  # the container, CRC-32s of storages as 0: a kill before the commit leaves it sealable
            write_directory(plan, None)
        sealing.copied(plan.tmp, node.index(rank))  # from here this step survives a kill (ckptools.node.sealing)
    except Exception as err:  # noqa: BLE001 - reported to the leader: the snapshot does not count
        return mapped, err
    return mapped, None


def _start_commit(
    slots: NodeSlots,
    where: tuple[str, Any],
    plan: Plan,
    mapped: MappedSlot,
    copy_error: BaseException | None,
    node: list[int],
) -> None:
    """Phase four, in the background: the one commit protocol (`ckptools.write.finish`), its reports
    through the store, from the commit thread, never a collective. A member that never reports is
    given up on at the group's timeout."""
    path, location = where
    rank, leader = get_rank(), node[0]
    reports = Stored(rank == leader, threading.Event(), node[1:])
    target = _Slot(slots)
    mine = plan.mine()

    def commit() -> None:
        crcs = {} if copy_error is not None else crc32s(mapped, mine)
        finish(plan, location, copy_error, crcs, reports, target)
        if rank != leader:
            if copy_error is not None:
                raise copy_error
            return
        slots.recycle(path)

    COMMITS.start(slots.folder, path, commit)


def _commit_orphaned(
    plan: Plan,
    mapped: MappedSlot,
    copy_error: BaseException | None,
    location: Any,
    where: tuple[NodeSlots, str],
    node: list[int],
    orphaned: list[int],
) -> None:
    """Collective, when torchrun's agent of some rank is gone: commit this snapshot in this thread and
    raise `Orphaned` on every rank. The commit's reports go through the store the agent held, gone
    with it: instead, once every rank's copy is whole (an exchange over the process group), each node's
    leader computes the CRC-32 of every record of its copy itself (the node holds a whole copy) and
    commits. Whatever became of the previous snapshot's commit, this one counts."""
    slots, path = where
    rank = get_rank()
    leader = rank == node[0]
    error: BaseException | None = None
    # Every rank of the node copies its share into the leader's slot: the leader checksums the whole
    # slot only once each has said its copy is done (checksummed earlier, a share still being copied
    # under load made a "committed" snapshot whose records fail their CRC-32s: the keeper then skipped it).
    done = all_gather_object(copy_error is None)
    whole = all(done[r] for r in node)
    try:  # the one commit protocol, its reports gathered by a collective; the leader checksums the node's copy
        crcs = crc32s(mapped, plan.shares) if leader and whole else {}
        finish(plan, location, copy_error, crcs, Gathered(node[0], node), _Slot(slots))
        if leader:
            slots.recycle(path)
    except Exception as err:  # noqa: BLE001 - raised on every rank below, in Orphaned's words
        error = err if leader else None
    outcomes = [o for o in all_gather_object(outcome_of(error, rank)) if o is not None]
    gone = f"torchrun's agent of rank(s) {', '.join(map(str, orphaned))} is gone"
    if outcomes:
        raise Orphaned(f"{gone}, and the snapshot {path} was not committed ({outcomes[0][1]}); the one before it "
                       "is whole", committed=False)  # fmt: skip
    raise Orphaned(f"{gone}; the snapshot {path} is committed", committed=True)


class _Slot:
    """A snapshot's target in the commit protocol: the node's spare slot, renamed into place (its copies'
    record forgotten: it is committed), or kept as the spare when the commit does not happen."""

    def __init__(self, slots: NodeSlots) -> None:
        self.slots = slots

    def commit(self, plan: Plan, location: Any, crcs: dict[str, int]) -> int:
        written = FILE.commit(plan, location, crcs)
        sealing.forget(plan.tmp)
        return written

    def discard(self, plan: Plan) -> None:
        self.slots.keep_spare(plan.tmp)  # not committed: still this node's spare slot


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


def settle(folder: str) -> None:
    """Local: wait for this rank's commit in ``folder`` (its failure is kept for `finish_snapshot`)."""
    COMMITS.settle(folder)


def release() -> list[str]:
    """The job's normal end on this rank: wait for its commits, unmap its slots, and remove the
    node-memory folders (one rank per node); the folders removed."""
    COMMITS.join_all()
    release_all()
    return release_folders()
