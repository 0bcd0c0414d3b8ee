"""A run's newest snapshot in node memory, written out as a framework's own checkpoint folder on a relaunch.

The HF Trainer's snapshots become ``checkpoint-N/`` (`ckptools.integrations.transformers.latest_complete_checkpoint`),
an Accelerator's ``step_N/`` (`ckptools.integrations.accelerate_snapshots.Snapshots.latest`): when node memory
holds a step newer than every whole folder of the run, that snapshot is written out as the folder the
framework's own load reads, and the resume is at most one step behind a kill -9. Collective where a process
group exists: every rank gets the same folder (rank 0 chooses, as `ckptools.CheckpointManager.restore` does,
and a node without the chosen snapshot receives it first).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from .. import log
from ..collective.agree import Agreement
from ..collective.group import all_gather_object, get_rank, get_world_size
from ..layouts import check_folder
from ..manager import CheckpointManager
from ..node import checkpoint_names, readable, seal, survey_nodes, watch

__all__ = ["FolderKind", "from_node_memory", "newest_snapshot"]

_WAIT_FOR_FOLDER = 600.0  # seconds a node's other ranks wait for its local rank 0 to write a snapshot out


@dataclass(frozen=True)
class FolderKind:
    """How one framework's snapshots become its folders.

    Attributes:
        prefix: the snapshots' file prefix (`ckptools.node.names`).
        folder: the folder's name for a step (``checkpoint-17``).
        write_out: writes the snapshot at a path into the output folder; the folder written, or None
            when a folder of that step (or a newer one) is there already.
        caller: the function users call, for the warnings.
    """

    prefix: str
    folder: Callable[[int], str]
    write_out: Callable[[str, str], str | None]
    caller: str


def from_node_memory(output_dir: str, kind: FolderKind, newer_than: int) -> str | None:
    """The folder written from the newest snapshot of ``output_dir``'s run when it is newer than step
    ``newer_than`` (this rank's newest whole folder), or None; collective where a process group exists.

    Examples:
        >>> kind = FolderKind("ckpt", "step_{}".format, lambda path, out: None, "latest")
        >>> from_node_memory("/tmp/no-such-run", kind, -1) is None
        True
    """
    if get_world_size() > 1:  # a process group: every rank resumes from the same step
        return _agreed(output_dir, kind, newer_than)
    if not os.path.isdir(output_dir):
        return None
    _warn_if_nodes_cannot_agree(kind)
    return _this_node(output_dir, kind, newer_than)


def _warn_if_nodes_cannot_agree(kind: FolderKind) -> None:
    """Several nodes but no process group yet: each node can only decide from its own memory."""
    try:
        world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    except ValueError:
        return
    if 0 < local < world:
        log.warn(
            f"{kind.caller} was called before the process group exists, on several nodes: each node decides from "
            "its own node memory, and after a kill between two nodes' copies they could resume from different "
            "steps. Call it once the process group exists",
            once=f"nodes_without_group:{kind.prefix}",
        )


def _agreed(output_dir: str, kind: FolderKind, newer_than: int) -> str | None:
    """Collective: the folder written from the newest snapshot of any node when it is newer than every
    rank's newest whole folder, else None on every rank. Rank 0 writes it out first (once, where the
    nodes share ``output_dir``), then each other node's lowest rank where its ``output_dir`` does not
    show it (a node-local folder)."""
    manager = CheckpointManager(output_dir, prefix=kind.prefix)
    names = checkpoint_names(manager.prefix)

    def newest_step() -> int | None:
        found = manager.snapshots()  # sealed first by the survey
        return found[-1][0] if found else None

    nodes = survey_nodes(manager.snapshot_dir, newest_step, names)
    disk = max(all_gather_object(newer_than))
    snapshot = max((step for step in nodes.newest if step is not None), default=None)

    def choose() -> int | None:
        if snapshot is not None and not os.path.isdir(output_dir):  # the run's folder was removed: stale
            log.warn(f"node memory holds snapshots of {output_dir} (up to step {snapshot}) but that folder is gone: "
                     "they are not resumed from, and are released",
                     once=f"run_folder_removed:{kind.prefix}")  # fmt: skip
            return -1
        return snapshot if snapshot is not None and snapshot > disk else None

    chosen = Agreement(f"choosing a checkpoint in {output_dir}").on_rank0(choose, send=True)
    nodes.release_unused(used=chosen != -1 and (not nodes.made_here or chosen is not None))
    if chosen is None or chosen == -1:
        return None
    step, rank = chosen, get_rank()
    # Named in node memory as in the run's folder: the same name on every node.
    path = os.path.join(manager.snapshot_dir, os.path.basename(manager.path_for(step)))
    nodes.bring(path, step)
    folder = os.path.join(output_dir, kind.folder(step))
    writing = Agreement(f"writing the snapshot of step {step} out as {folder}")
    writing.on_rank0(lambda: kind.write_out(path, output_dir))
    error: BaseException | None = None
    if rank != 0 and rank == next(ranks for ranks in nodes.nodes if rank in ranks)[0]:
        try:
            if _incomplete(folder) is not None:
                kind.write_out(path, output_dir)
        except Exception as err:  # noqa: BLE001 - raised on every rank by on_every_rank
            error = err
    writing.on_every_rank(error)
    missing = [r for r, ok in enumerate(all_gather_object(_incomplete(folder) is None)) if not ok]
    if missing:  # a folder of that step was there before, not whole: every rank takes its newest folder
        log.warn(f"the snapshot of step {step} in node memory was not written out: {folder} exists and is not "
                 f"complete on rank(s) {missing}; remove it to resume from the snapshot")  # fmt: skip
        return None
    if rank == 0:
        log.logger.info("wrote the snapshot of step %d in node memory out as %s", step, folder)
    return folder


def _this_node(output_dir: str, kind: FolderKind, newer_than: int) -> str | None:
    """The folder written from this node's newest snapshot when it is newer than step ``newer_than``, or
    None (one process, or no process group yet)."""
    manager = CheckpointManager(output_dir, prefix=kind.prefix)
    if not readable(manager.snapshot_dir):  # absent, or not this user's alone (said once)
        return None
    watch(manager.snapshot_dir)  # first: the keeper of a job that died must not release it while this process reads it
    found = newest_snapshot(manager)
    if found is None or found[0] <= newer_than:
        return None
    step, path = found
    folder = os.path.join(output_dir, kind.folder(step))
    if os.environ.get("LOCAL_RANK", "0") != "0":  # the node's local rank 0 writes it: wait for it
        deadline = time.monotonic() + _WAIT_FOR_FOLDER
        while time.monotonic() < deadline and _incomplete(folder) is not None:
            time.sleep(0.1)
    if not os.path.isdir(folder):
        kind.write_out(path, output_dir)
    if _incomplete(folder) is not None:  # a folder of that step was there before, not whole
        log.warn(f"the snapshot of step {step} in node memory was not written out: {folder} exists and is not "
                 "complete; remove it to resume from the snapshot", all_ranks=True)  # fmt: skip
        return None
    if get_rank() == 0:
        log.logger.info("wrote the snapshot of step %d in node memory out as %s", step, folder)
    return folder


def newest_snapshot(manager: CheckpointManager) -> tuple[int, str] | None:
    """``(step, path)`` of the newest of ``manager``'s snapshots in this node's memory (a copy every rank
    finished whose commit a kill cut short is sealed first), or None."""
    seal(manager.snapshot_dir, checkpoint_names(manager.prefix))
    found = manager.snapshots()
    return found[-1] if found else None


def _incomplete(folder: str) -> str | None:
    return check_folder(folder, verify=False).problem
