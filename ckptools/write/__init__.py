"""The write wing: everything that puts a checkpoint's bytes on disk.

===================  ==========================================================================
module               what it holds
===================  ==========================================================================
payload.py           what a save puts into the file (each entry's state, ckptools' metadata) and
                     the check that it all loads back with ``weights_only=True``
plan.py              ``writers="all"``'s plan: the pickle, the records at planned offsets, who
                     writes which storage, what is replicated
zip_writer.py        the temporary file, each storage's ``pwrite``, the commit; rank 0 alone
                     (`write_alone`) or every rank its share
shares.py            the collective steps of ``writers="all"`` (plan, check, write, commit) and
                     the async variant's reports through the process group's store
snapshot.py          `StagingBuffers`: a copy of the state in reused host buffers
writer_thread.py     `BackgroundWriter`: one write in a background thread, its error kept
async_save.py        the async save's state in one place: `AsyncSave`, the save in flight
node_memory.py       where `CheckpointManager.snapshot` keeps snapshots: the node-memory folder,
                     its space check for two slots, its release at the job's normal end
node_snapshot.py     the snapshot's writer: one whole copy per node, split over the node's ranks,
                     into reused mapped slots (the stall is the copy), committed in the background;
                     a node's snapshot sent to a node that lacks it
zero.py              a ``ZeroRedundancyOptimizer`` saved without consolidation: each rank's
                     partition described (metadata only), the consolidated dict with
                     placeholders, each partition written by its owner
===================  ==========================================================================

The operations (`ckptools.save`, `ckptools.async_save`, `CheckpointManager`) and a writer of
one's own import from this package, never from its modules: a Lightning ``CheckpointIO`` (called
on rank 0 alone, so no collective) writes with `write_file` from a `StagingBuffers` copy in a
`BackgroundWriter`. A new target (node memory, a ZeRO partition) is one more module here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..storage import Location, PathLike, resolve
from .async_save import AsyncSave, finish_pending, pending, release_staging_buffers, set_pending, stage
from .node_memory import default_folder, register, start_keeper, watch
from .node_snapshot import (
    Orphaned,
    close_slots,
    finish_snapshot,
    group_nodes,
    node_token,
    release,
    send_file,
    settle,
    write_snapshot,
)
from .payload import build_payload, checked_args, rank_part
from .plan import check_writers, choose, compare_replicas, replica_digests
from .shares import first_error, plan_shares, write_and_commit, write_share_in_background
from .staging import StagingBuffers, whole_storage
from .writer_thread import BackgroundWriter
from .zero import describe_partitions, with_partitions
from .zip_writer import write_alone

__all__ = [
    "AsyncSave",
    "BackgroundWriter",
    "Orphaned",
    "StagingBuffers",
    "build_payload",
    "check_writers",
    "checked_args",
    "choose",
    "close_slots",
    "compare_replicas",
    "default_folder",
    "describe_partitions",
    "finish_pending",
    "finish_snapshot",
    "first_error",
    "group_nodes",
    "node_token",
    "pending",
    "plan_shares",
    "rank_part",
    "register",
    "release",
    "release_staging_buffers",
    "replica_digests",
    "send_file",
    "set_pending",
    "settle",
    "start_keeper",
    "stage",
    "watch",
    "whole_storage",
    "with_partitions",
    "write_alone",
    "write_and_commit",
    "write_file",
    "write_share_in_background",
    "write_snapshot",
]


def write_file(path: PathLike | Location, payload: Mapping[str, Any]) -> int:
    """Write ``payload`` as one torch checkpoint file, atomically, from this process alone (no
    collective); the bytes written. A local file gets each storage with one ``pwrite`` from the
    tensors' memory, an object store a streamed multipart upload: the file ``torch.save`` writes.

    Examples:
        >>> import torch
        >>> write_file("/tmp/ckptools-doc-write.pt", {"w": torch.ones(2)}) > 0
        True
    """
    return write_alone(resolve(path), payload)
