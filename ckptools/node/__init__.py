"""The node-memory wing: `CheckpointManager.snapshot`'s snapshots, kept in each node's memory.

===================  ==========================================================================
module               its one job
===================  ==========================================================================
folder.py            where the snapshots live (``/dev/shm/ckptools-<user>-<key>``, this user's
                     alone: `claim`, `readable`), its space check for two slots, which ranks
                     share it (a node), the keeper's start and the pids it
                     watches, the folders' removal at the job's normal end
slots.py             the two slot files per node, mapped once per rank and reused (`SLOTS` owns
                     them), pinned for CUDA copies, preallocated
commits.py           the commit in the background: CRC-32s, reports to the node's leader, the
                     rename (`COMMITS` holds each folder's commit in flight)
snapshot.py          the collective protocol of one snapshot (`write_snapshot`), and the commit of
                     an orphaned job's last one
survey.py            at a restore: which ranks are a node, each node's newest snapshot, the
                     chosen one brought to the nodes that lack it
transfer.py          one file sent from a rank to others in chunks (`survey_nodes`)
cadence.py           how often snapshots are taken under a budget of the loop's time (`Cadence`)
===================  ==========================================================================

Everything else imports from this package, never from its modules; it writes through the write
wing's public face (`ckptools.write`). The keeper process itself is `ckptools.keeper`.
"""

from __future__ import annotations

from .cadence import Cadence
from .commits import COMMITS, finish_snapshot
from .folder import (
    claim,
    default_folder,
    group_nodes,
    node_token,
    readable,
    register,
    release_folders,
    start_keeper,
    watch,
)
from .slots import SLOTS
from .snapshot import Orphaned, write_snapshot
from .survey import Survey, survey_nodes

__all__ = [
    "Cadence",
    "Orphaned",
    "Survey",
    "claim",
    "close_slots",
    "default_folder",
    "finish_snapshot",
    "group_nodes",
    "node_token",
    "readable",
    "register",
    "release",
    "settle",
    "start_keeper",
    "survey_nodes",
    "watch",
    "write_snapshot",
]


def settle(folder: str) -> None:
    """Local: wait for this rank's commit in ``folder`` (its failure is kept for `finish_snapshot`)."""
    COMMITS.settle(folder)


def close_slots(folder: str) -> None:
    """Local: wait for this rank's commit in ``folder``, unmap its slots and remove its spare (the
    committed snapshot stays): `CheckpointManager.close`."""
    COMMITS.settle(folder)
    SLOTS.close(folder)


def release() -> list[str]:
    """The job's normal end on this rank: wait for its commits, unmap its slots, and remove the
    node-memory folders (one rank per node); the folders removed."""
    COMMITS.join_all()
    SLOTS.close_all()
    return release_folders()
