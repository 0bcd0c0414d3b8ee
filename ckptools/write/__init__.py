"""The write wing: everything that puts a checkpoint's bytes on disk.

===================  ==========================================================================
module               what it holds
===================  ==========================================================================
payload.py           what a save puts into the file (each entry's state, ckptools' metadata) and
                     the check that it all loads back with ``weights_only=True``
pickling.py          ``data.pkl`` as ``torch.save`` pickles it, its storages named in order
plan.py              ``writers="all"``'s plan: the records at planned offsets, who writes which
                     storage, what is replicated
replicas.py          the replicas compared before anything is written: digests (a rotating
                     sample for a snapshot, all for a durable save), one verdict on every rank
buckets.py           DDP's rebuilt gradient buckets: recorded in a save, adopted by a restore
zip_writer.py        the temporary file, each storage's ``pwrite``, the directory and the rename
commit.py            the one commit protocol (plan, write, report, finish) every writer follows:
                     rank 0 alone (`write_alone`), every rank its share, a snapshot's commit
upload.py            the same on S3: every rank's share as parts of one multipart upload
shares.py            the collective steps of ``writers="all"`` (plan, check, write, commit), from the
                     main thread or, for the async save, a writer thread
staging.py           `Stager` (stage, wait, release: DCP's AsyncStager's shape); `StagingBuffers`,
                     an async save's copy of the state in reused host buffers
writer_thread.py     `BackgroundWriter`: one write in a background thread, its error kept
async_save.py        the async save's state in one place: `AsyncSave`, the save in flight
===================  ==========================================================================

The operations (`ckptools.save`, `ckptools.async_save`, `CheckpointManager`) and a writer of
one's own import from this package, never from its modules: a Lightning ``CheckpointIO`` (called
on rank 0 alone, so no collective) writes with `write_file` from a `StagingBuffers` copy in a
`BackgroundWriter`. Node memory (`ckptools.node`) writes its snapshots through this face too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..storage import Location, PathLike, resolve
from .async_save import (
    AsyncSave,
    finish_pending,
    pending,
    release_staging_buffers,
    set_pending,
    skip_behind,
    stage,
)
from .buckets import adopt_layout
from .commit import FILE, Gathered, Stored, Target, finish, write_alone
from .payload import Opening, as_saved, build_payload, checked_args, opening, rank_part
from .plan import Plan, Share, check_writers, choose, make_plan, plain_optimizer, replica_module, settle_cuda
from .replicas import compare_now, compare_replicas, replica_digests, replicas_switch, what_to_compare
from .shares import locate, plan_shares, write_and_commit, write_share_in_background
from .staging import Stager, StagingBuffers, copy_bytes, whole_storage
from .writer_thread import BackgroundWriter, yield_to_the_step
from .zip_writer import write_directory

__all__ = [
    "FILE",
    "AsyncSave",
    "BackgroundWriter",
    "Gathered",
    "Opening",
    "Plan",
    "Share",
    "Stager",
    "StagingBuffers",
    "Stored",
    "Target",
    "adopt_layout",
    "as_saved",
    "build_payload",
    "check_writers",
    "checked_args",
    "choose",
    "compare_now",
    "compare_replicas",
    "copy_bytes",
    "finish",
    "finish_pending",
    "locate",
    "make_plan",
    "opening",
    "pending",
    "plain_optimizer",
    "plan_shares",
    "rank_part",
    "release_staging_buffers",
    "replica_digests",
    "replica_module",
    "replicas_switch",
    "set_pending",
    "settle_cuda",
    "skip_behind",
    "stage",
    "what_to_compare",
    "whole_storage",
    "write_alone",
    "write_and_commit",
    "write_directory",
    "write_file",
    "write_share_in_background",
    "yield_to_the_step",
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
