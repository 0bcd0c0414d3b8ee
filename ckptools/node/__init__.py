"""The node-memory wing: `CheckpointManager.snapshot`'s snapshots, kept in each node's memory.

===================  ==========================================================================
module               its one job
===================  ==========================================================================
folder.py            where the snapshots live (``/dev/shm/ckptools-<user>-<key>``, this user's
                     alone: `claim`, `readable`), its space check for two slots, which ranks
                     share it (a node), the keeper's start and the pids it
                     watches, the folders' removal at the job's normal end
slots.py             the two slot files per node, mapped once per rank and reused (`NodeSlots`, a
                     stager: held by its `NodeMemory`), pinned for CUDA copies, preallocated
commits.py           the commit in the background: CRC-32s, reports to the node's leader, the
                     rename (`COMMITS` holds each folder's commit in flight)
snapshot.py          the collective protocol of one snapshot (`write_snapshot`), and the commit of
                     an orphaned job's last one
survey.py            at a restore: which ranks are a node, each node's newest snapshot, the
                     chosen one brought to the nodes that lack it
transfer.py          one file sent from a rank to others in chunks (`survey_nodes`)
cadence.py           how often snapshots are taken under a budget of the loop's time (`Cadence`)
sealing.py           a copy every rank finished whose commit a kill cut short, sealed (no torch)
keeper.py            the keeper process: a dead job's newest snapshot persisted (no torch)
names.py             the numbered files' names, the folder's default name (no torch)
write_outs.py        each framework's snapshot written out as the folder it writes itself (the
                     HF Trainer's ``checkpoint-N/``, Accelerate's ``save_state`` folder)
memory.py            `NodeMemory`: a manager's snapshots as one object (take, list, survey)
===================  ==========================================================================

Everything else imports from this package, never from its modules; it writes through the write
wing's public face (`ckptools.write`). Its names are imported on first use (PEP 562): the keeper
(``python -m ckptools.node.keeper``) and a run folder's listing import no torch through it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the lazy names resolve to, for type checkers
    from .cadence import Cadence
    from .commits import finish_snapshot
    from .folder import group_nodes, node_token, register, start_keeper, watch
    from .memory import NodeMemory
    from .names import checkpoint_names, claim, default_folder, file_name, readable
    from .sealing import seal, sealable
    from .snapshot import Orphaned, release, settle, write_snapshot
    from .survey import Survey, survey_nodes
    from .write_outs import newest_folder_step, newest_whole_state, snapshot_to_folder, snapshot_to_state_folder

_LAZY = {
    "newest_whole_state": ".write_outs",
    "snapshot_to_state_folder": ".write_outs",
    "Cadence": ".cadence",
    "Orphaned": ".snapshot",
    "Survey": ".survey",
    "checkpoint_names": ".names",
    "claim": ".names",
    "default_folder": ".names",
    "file_name": ".names",
    "NodeMemory": ".memory",
    "finish_snapshot": ".commits",
    "group_nodes": ".folder",
    "newest_folder_step": ".write_outs",
    "node_token": ".folder",
    "readable": ".names",
    "register": ".folder",
    "release": ".snapshot",
    "seal": ".sealing",
    "sealable": ".sealing",
    "settle": ".snapshot",
    "snapshot_to_folder": ".write_outs",
    "start_keeper": ".folder",
    "survey_nodes": ".survey",
    "watch": ".folder",
    "write_snapshot": ".snapshot",
}

__all__ = [
    "Cadence",
    "NodeMemory",
    "Orphaned",
    "Survey",
    "checkpoint_names",
    "claim",
    "default_folder",
    "file_name",
    "finish_snapshot",
    "group_nodes",
    "newest_folder_step",
    "newest_whole_state",
    "node_token",
    "readable",
    "register",
    "release",
    "seal",
    "sealable",
    "settle",
    "snapshot_to_folder",
    "snapshot_to_state_folder",
    "start_keeper",
    "survey_nodes",
    "watch",
    "write_snapshot",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptools.node' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value
