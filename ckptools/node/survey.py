"""At a restore: which ranks are a node, which snapshot each node holds, and a chosen snapshot
brought to the nodes that lack it (`transfer.send_file`)."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

from .. import log
from ..collective.group import all_gather_object, get_rank
from ..errors import CheckpointError
from ..layouts import TORCH_FILE
from ..storage import join, list_files, resolve
from . import sealing
from .commits import COMMITS
from .folder import group_nodes, node_token, register, watch
from .names import discard, readable
from .transfer import send_file

__all__ = ["Survey", "newest_snapshot", "snapshots_in", "survey_nodes"]


@dataclass(frozen=True)
class Survey:
    """What every rank knows of the nodes' snapshots after `survey_nodes`."""

    folder: str
    nodes: list[list[int]]  # each node's ranks, lowest first; rank 0's node first
    newest: list[int | None]  # each node's newest whole snapshot's step (None: none)
    made_here: bool  # this rank's node had no folder before this restore made it (for the token)
    usable: bool = True  # False: some rank's folder is not its user's alone, and node memory is left aside

    def release_unused(self, used: bool) -> None:
        """This node's lowest rank removes the folder unless its snapshots are ``used`` (a folder
        made for the token only, or the snapshots of a run that was removed, hold nothing to keep)."""
        node = next(ranks for ranks in self.nodes if get_rank() in ranks)
        if self.usable and not used and get_rank() == node[0]:
            with contextlib.suppress(OSError):  # left for the keeper or the next job: nothing depends on it
                discard(self.folder)

    def bring(self, path: str, step: int) -> None:
        """Collective: the nodes without the snapshot ``path`` of ``step`` (replaced, or killed
        mid-copy) receive it from a node that has it, into their own memory."""
        leaders = [ranks[0] for ranks in self.nodes]
        if get_rank() in leaders:
            register(self.folder)
        lacking = [leader for leader, have in zip(leaders, self.newest) if have != step]
        if lacking:
            source = next(leader for leader, have in zip(leaders, self.newest) if have == step)
            if get_rank() == 0:
                log.logger.info("sending the snapshot of step %d from rank %d to rank %s", step, source, lacking)
            send_file(path, source, get_rank() in lacking)


def snapshots_in(folder: str, names: re.Pattern[str]) -> list[tuple[int, str]]:
    """``(step, path)`` of the snapshots in ``folder`` (named as ``names`` matches), oldest first
    (unverified; local: once this rank's part of a snapshot being committed is done). None of a folder
    that is not this user's alone."""
    COMMITS.settle(folder)
    if not readable(folder):  # absent, or not this user's alone (said once): nothing of it is read
        return []
    found = [(int(m.group(1)), name) for name in list_files(folder) if (m := names.fullmatch(name))]
    return [(step, join(folder, name)) for step, name in sorted(found)]


def newest_snapshot(folder: str, names: re.Pattern[str]) -> int | None:
    """The step of the newest snapshot in ``folder`` whose container is whole, or None; a damaged one
    is skipped with a warning. Not every record's CRC-32 (as `CheckpointManager.latest` does): a
    snapshot exists under its name only once committed with them, memory does not decay as a disk may,
    and reading it again would cost most of a restore (docs/development.md)."""
    for step, path in reversed(snapshots_in(folder, names)):
        try:
            TORCH_FILE.check(resolve(path).as_own(), records=False)
        except CheckpointError as err:
            log.warn(f"skipping damaged snapshot: {err}", all_ranks=True)
            continue
        return step
    return None


def survey_nodes(folder: str, newest_step: Callable[[], int | None], names: re.Pattern[str]) -> Survey:
    """Collective: the nodes (ranks sharing ``folder``) and each one's newest snapshot, as its
    lowest rank finds it with ``newest_step`` once it sealed a snapshot copied whole whose commit a
    kill cut short (`ckptools.node.sealing`; ``names``: the snapshots' file names)."""
    rank = get_rank()
    # Whether this node had a folder before anything here made one: asked of every rank before
    # any rank makes it (for the node token), or a rank could see its peer's. A folder that is not
    # this user's alone is never read nor written: then no rank reads node memory (said once).
    present = os.path.lexists(folder)
    found = all_gather_object((present and os.path.isdir(folder), present and not readable(folder)))
    existed = [here for here, _ in found]
    if any(refused for _, refused in found):
        refused = [r for r, (_, no) in enumerate(found) if no]
        if rank == 0 and 0 not in refused:  # rank 0's own warning says it where it is one of them
            log.warn(f"node memory {folder} is not this user's alone on rank(s) {refused}: this restore reads "
                     "no snapshot, and the next snapshot there is refused (those ranks' warning says why)")  # fmt: skip
        world = len(found)
        return Survey(folder, [[r] for r in range(world)], [None] * world, made_here=False, usable=False)
    if existed[rank]:
        watch(folder)  # first: the keeper of a job that died must not release it now
    nodes = group_nodes(all_gather_object(node_token(folder)))
    leaders = [ranks[0] for ranks in nodes]
    if rank in leaders:
        sealing.seal(folder, names, warn=lambda text: log.warn(text, all_ranks=True))
    steps = all_gather_object(newest_step() if rank in leaders else None)
    node = next(ranks for ranks in nodes if rank in ranks)
    return Survey(folder, nodes, [steps[leader] for leader in leaders], not any(existed[r] for r in node))
