"""A manager's snapshots in this node's memory, as one object: `CheckpointManager` holds one.

`NodeMemory` takes the snapshots (the budget's cadence, the keeper's start, the collective protocol of
`ckptools.node.snapshot`), lists them, and surveys every node's newest at a restore; the manager
chooses between them and its durable checkpoints, and loads the one it chose.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from typing import Any

from ..collective.arrival import arrive
from ..storage import join
from ..write import replicas_switch
from .cadence import Cadence
from .commits import finish_snapshot
from .folder import prepare
from .names import checkpoint_names, default_folder, file_name
from .slots import NodeSlots
from .snapshot import settle, write_snapshot
from .survey import Survey, newest_snapshot, snapshots_in, survey_nodes

__all__ = ["NodeMemory"]


class NodeMemory:
    """The snapshots of the run in ``directory`` (its checkpoints named ``{prefix}-{step:010d}.pt``),
    kept in ``folder`` on this node (by default ``/dev/shm/ckptools-<user>-<key>``: `default_folder`).

    Examples:
        >>> memory = NodeMemory("/tmp/ckptools-doc-memory-run", "ckpt", 3)
        >>> memory.path_for(7).endswith("/ckpt-0000000007.pt")
        True
    """

    def __init__(self, directory: str, prefix: str, keep_last: int | None, folder: str | None = None) -> None:
        self.directory, self.prefix, self.keep_last = directory, prefix, keep_last
        self.folder = folder if folder is not None else default_folder(directory, prefix)
        self._names = checkpoint_names(prefix)
        self._cadence = Cadence()
        self.slots = NodeSlots(self.folder, prefix)  # the stager a snapshot's copy goes into

    def path_for(self, step: int) -> str:
        """The path of the snapshot of ``step`` on this node."""
        return join(self.folder, file_name(self.prefix, step))

    def snapshots(self) -> list[tuple[int, str]]:
        """``(step, path)`` of this node's snapshots, oldest first (`ckptools.node.survey.snapshots_in`)."""
        return snapshots_in(self.folder, self._names)

    def newest_committed(self) -> int | None:
        """The step of this node's newest snapshot whose container is whole, or None
        (`ckptools.node.survey.newest_snapshot`)."""
        return newest_snapshot(self.folder, self._names)

    def take(
        self,
        state: Mapping[str, Any],
        step: int,
        *,
        blocking: bool = False,
        metadata: Mapping[str, Any] | None = None,
        writers: str = "auto",
        budget: float | None = None,
        replicas: str = "auto",
        compare: Mapping[str, Any] | None = None,
        check_replicas: bool | Mapping[str, Any] | None = None,
    ) -> str | None:
        """Collective: `CheckpointManager.snapshot` (see there); `ckptools.node.Orphaned` on every rank
        when some rank's torchrun agent is gone."""
        if isinstance(check_replicas, Mapping):  # the objects to compare, as the integrations passed them before
            compare, check_replicas = check_replicas, True
        replicas = replicas_switch(replicas, "CheckpointManager.snapshot", check_replicas=check_replicas)
        called = time.monotonic()
        cadence = self._cadence
        cadence.calls += 1
        if budget is None:  # without a budget every call is taken (budget is the same on every rank)
            cadence.skip = 0
        if cadence.skip > 0:  # every rank skips the same calls: agreed at the last snapshot taken
            cadence.skip -= 1
            return None
        if not cadence.checked_in:  # called every step: the first call tells (as Preemption.should_stop)
            arrive("CheckpointManager.snapshot")
            cadence.checked_in = True
        proposal = [cadence.propose(called, budget)] if budget is not None else None
        metadata = {**dict(metadata or {}), "step": step}
        path = write_snapshot(
            self.slots, file_name(self.prefix, step), state, metadata=metadata, writers=writers, blocking=blocking,
            prepare=functools.partial(prepare, self.folder, self.prefix, self.directory, self.keep_last),
            cadence=proposal, replicas=replicas, compare=compare,
        )  # fmt: skip
        if path is None:  # inside an accumulation window over several nodes (`write_snapshot`): skipped
            return None
        cadence.taken(called, time.monotonic() - called, proposal[0] if proposal else 0, step, budget)
        return path

    def survey(self) -> Survey:
        """Collective, at a restore: the snapshot being committed finished, then which ranks are a node
        and each node's newest committed snapshot (`ckptools.node.survey_nodes`)."""
        finish_snapshot(self.folder)
        return survey_nodes(self.folder, functools.partial(newest_snapshot, self.folder, self._names), self._names)

    def finish(self) -> None:
        """Collective: wait for the snapshot being committed; its failure raised on every rank."""
        finish_snapshot(self.folder)

    def close(self) -> None:
        """Local: this rank's commit waited for, its slots unmapped, the spare removed (the newest stays)."""
        settle(self.folder)
        self.slots.release()
