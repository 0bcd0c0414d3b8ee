"""``CheckpointManager``: numbered checkpoints in one directory, pruning and resuming."""

from __future__ import annotations

import functools
import os
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any

from . import log
from .collective.agree import Agreement
from .collective.arrival import checked_in
from .collective.group import all_gather_object, get_rank
from .errors import CheckpointError, CheckpointFormatError, CheckpointLayoutError
from .layouts import TORCH_FILE
from .lifecycle import finish_pending
from .node import NodeMemory, Orphaned, checkpoint_names, file_name
from .owned.gradients import track
from .read import check_in_ranges, load, reads_in_ranges
from .saving import async_save_with_hooks, save_with_hooks
from .storage import PathLike, abandoned_tmps, fspath, join, list_files, remove, resolve, run_watched
from .training.process import ORPHANED_EXIT, leave
from .write import AsyncSave, pending, release_staging_buffers, skip_behind

__all__ = ["CheckpointManager"]


def _damage_on_some_rank(error: CheckpointError) -> bool:
    """Collective, after a load raised on every rank: whether some rank found the file damaged (the
    rank that read the damaged record raises its `CheckpointFormatError`, the others a message naming it)."""
    own = isinstance(error, CheckpointFormatError) and not isinstance(error, CheckpointLayoutError)
    return any(all_gather_object(own))


class CheckpointManager:
    """Keep numbered checkpoints in one directory and resume from the newest good one.

    Each checkpoint is one file ``{prefix}-{step:010d}.pt`` (zero-padded so names sort by step).
    The manager only ever lists, verifies or deletes files whose names match that pattern, so it
    shares a directory safely with anything else (``final.safetensors``, logs, ...).

    - ``save(state, step)`` (collective) writes through `ckptools.save`, then rank 0 prunes to the
      newest ``keep_last`` (and removes the steps above it: an abandoned timeline, with a warning).
    - ``latest()`` (local): the newest checkpoint whose every CRC-32 passes (damaged ones skipped).
    - ``snapshot(state, step)`` (collective) copies the state into this node's memory.
    - ``restore(state)`` (collective) loads the newest good checkpoint, durable or snapshot.

    Args:
        directory: a local path or an fsspec URL (``s3://bucket/run``, ``memory://run``).
        keep_last: how many checkpoints to keep (>= 1), or None to keep all.
        prefix: file name prefix (letters, digits, ``_`` and ``-``).
        snapshot_dir: the node-memory folder for `snapshot`; by default ``/dev/shm/ckptools-<key>``
            (``$CKPTOOLS_NODE_MEMORY`` instead of ``/dev/shm`` when set), ``<key>`` derived from
            ``directory`` and ``prefix`` so that a relaunch finds it.

    Examples:
        >>> import torch, ckptools as ck
        >>> model = torch.nn.Linear(2, 2)
        >>> manager = ck.CheckpointManager("/tmp/run", keep_last=2)
        >>> manager.restore({"model": model}) is None or True  # None on a fresh start
        True
        >>> manager.save({"model": model}, step=100)
        '/tmp/run/ckpt-0000000100.pt'
    """

    def __init__(
        self,
        directory: PathLike,
        *,
        keep_last: int | None = 3,
        prefix: str = "ckpt",
        snapshot_dir: PathLike | None = None,
    ) -> None:
        track()  # the optimizer steps watched from here: an open accumulation window's gradients
        if keep_last is not None and (not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1):
            raise ValueError(f"keep_last must be an integer >= 1 (or None to keep all), got {keep_last!r}")
        if not re.fullmatch(r"[A-Za-z0-9_-]+", prefix):
            raise ValueError(f"prefix must use letters, digits, '_' and '-' only, got {prefix!r}")
        self.directory = fspath(directory)
        self.keep_last = keep_last
        self.prefix = prefix
        self._pattern = checkpoint_names(prefix)
        folder = fspath(snapshot_dir) if snapshot_dir is not None else None
        self._node = NodeMemory(self.directory, prefix, keep_last, folder)  # its snapshots in this node's memory

    @property
    def snapshot_dir(self) -> str:
        """The node-memory folder of this run's snapshots on this node."""
        return self._node.folder

    def __repr__(self) -> str:
        return f"CheckpointManager({self.directory!r}, keep_last={self.keep_last!r}, prefix={self.prefix!r})"

    def path_for(self, step: int) -> str:
        """The path of the checkpoint for ``step``."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        return join(self.directory, file_name(self.prefix, step))

    def checkpoints(self) -> list[tuple[int, str]]:
        """``(step, path)`` of every checkpoint file in the directory, oldest first (unverified)."""
        found = []
        for name in list_files(self.directory):
            match = self._pattern.fullmatch(name)
            if match:
                found.append((int(match.group(1)), join(self.directory, name)))
        return sorted(found)

    def _leftovers(self) -> list[str]:
        # Only those whose writer is gone: a second job saving here must not lose its file mid-write.
        return abandoned_tmps(self.directory, f".{self.prefix}-")

    @checked_in("CheckpointManager.save")
    def save(self, state: Mapping[str, Any], step: int, *, blocking: bool = True, **save_kwargs: Any) -> str:
        """Save ``state`` as the checkpoint for ``step`` (collective), then prune.

        ``step`` is recorded in the file's metadata too. With ``blocking=False`` the save goes through
        `ckptools.async_save`, pruning after its commit; the next checkpoint call (or `wait`) finishes
        it, and raises on every rank if it failed; one still writing (and moving) after one more stall is
        skipped over with a warning, as slow storage must not hold the loop (docs/guarantees.md).

        Args:
            state: as for `ckptools.save`.
            step: the training step (or any increasing counter).
            blocking: False to save in the background.
            **save_kwargs: passed to `ckptools.save` (``metadata=...``, ``writers=...``, ``replicas=...``).

        Returns:
            The new checkpoint's path (where it will be, with ``blocking=False``; skipped: the one in flight).

        Raises:
            CheckpointError: the save failed (on every rank), or the async save before it did;
                older checkpoints are untouched.
            StorageStalledError: its write, or the one in flight, stalled (``CKPTOOLS_STALL_TIMEOUT``).

        Examples:
            >>> manager.save({"model": model, "optimizer": opt}, step=200)  # doctest: +SKIP
            >>> manager.save({"model": model, "optimizer": opt}, step=300, blocking=False)  # doctest: +SKIP
        """
        path = self.path_for(step)
        metadata = {**dict(save_kwargs.pop("metadata", None) or {}), "step": step}
        save_kwargs.setdefault("where", "CheckpointManager.save")  # what a deprecated name's warning says

        # A killed save's temporaries only take space (perhaps this save's): rank 0 removes them right before
        # it writes; an error there must not escape, or the other ranks would wait for a rank that left.
        def cleanup() -> None:
            self._housekeeping(self._remove_leftovers, "clean up")

        def prune() -> None:
            self._housekeeping(lambda: self._prune(step), "prune")

        if not blocking:
            behind = skip_behind(f"CheckpointManager.save(blocking=False) of step {step}")
            if behind is not None:
                return behind
            async_save_with_hooks(
                path, state, metadata=metadata, before_write=cleanup, after_write=prune, **save_kwargs
            )
            return path
        save_with_hooks(path, state, metadata=metadata, before_write=cleanup, **save_kwargs)
        if get_rank() == 0:
            prune()
        return path

    @checked_in("CheckpointManager.wait")
    def wait(self) -> str | None:
        """Finish the async save in flight and the snapshot being committed, if any (collective);
        the async save's path, or None if none was.

        Raises:
            CheckpointError: its background write, or the snapshot's commit, failed (on every rank).

        Examples:
            >>> manager.wait()  # doctest: +SKIP
            'runs/x/ckpt-0000000300.pt'
        """
        path = finish_pending()
        self._node.finish()
        return path

    @property
    def pending(self) -> AsyncSave | None:
        """The async save in flight (its ``done()`` is a local poll), or None."""
        return pending()

    @checked_in("CheckpointManager.close")
    def close(self) -> None:
        """Finish the async save in flight and the snapshot being committed (collective), free the
        host buffers the async save held, and unmap this node's snapshot slots (the newest
        snapshot stays in node memory; the spare slot goes).

        Examples:
            >>> manager.close()  # doctest: +SKIP
        """
        self.wait()
        release_staging_buffers()
        self._node.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:  # an exception on its way out must not turn into a collective hang
            self.close()

    def _remove_leftovers(self) -> None:
        for leftover in self._leftovers():
            self._remove_quietly(leftover)

    def _housekeeping(self, task: Callable[[], object], what: str) -> None:
        try:
            task()
        except OSError as err:
            log.warn(f"could not {what} {self.directory}: {err}")

    def _remove_quietly(self, path: str) -> None:
        try:
            remove(path)
        except OSError as err:
            # The new checkpoint is safe on disk: an old one left must not fail the step, nor go unnoticed.
            log.warn(f"could not delete old checkpoint {path}: {err}")

    def _prune(self, step: int) -> None:
        existing = self.checkpoints()
        newer = [path for s, path in existing if s > step]
        if newer:
            log.warn(
                f"deleting {newer}: their steps are above the step just saved ({step}), so they belong to a run "
                "that was abandoned by resuming from an earlier checkpoint",
            )
        older = [path for s, path in existing if s <= step]
        doomed = newer + (older[: -self.keep_last] if self.keep_last is not None else [])
        for path in doomed:
            self._remove_quietly(path)

    def snapshot(
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
        """Copy ``state`` into node memory as the snapshot of ``step`` (collective, like `save`).

        It survives kill -9 of every process of the job, and `restore` resumes from it when it is
        newer than every durable checkpoint, bit-identical. The stall is one memory copy split over
        the node's ranks; the commit follows in the background, and until it is done the previous
        snapshot stays whole (two slots). How, and what each failure leaves: docs/guides/snapshots.md.

        Args:
            state: as for `save`, the same on every rank.
            step: the training step.
            blocking: True to return only once the snapshot is committed on every node.
            metadata: as for `save`.
            writers: ``"auto"`` (or ``"all"``): a node's ranks split the copy; ``"rank0"``: each
                node's lowest rank copies everything.
            budget: the fraction of the loop's time snapshots may stall it (``0.02``: 2 %), or None
                (the default) to take every call. With a budget, rank 0 measures each snapshot's stall
                and the time per call, and the ranks agree, in the snapshot's own exchange, to skip
                the calls that would exceed it (no communication for a skipped call): a kill then
                loses at most the calls between two snapshots; each change of cadence is logged at
                INFO with that bound ("a kill loses at most N steps, about S s"). Without a budget, INFO
                says once when snapshots stall more than a tenth of the loop's time. The one default of
                every snapshot taker (NodeSnapshots, CkptoolsCallback too): None.
            replicas: how much of DDP's replicas to compare first: ``"auto"`` (the default) and ``"sample"`` a
                rotating 1/50 per call (every byte within 50 calls), ``"all"`` every byte, ``"off"`` none.
            compare: live objects compared instead of ``state``'s, each model a replica (for a state of
                state dicts: the integrations pass the model and its optimizers).
            check_replicas: deprecated (goes in 0.6): ``False`` is ``replicas="off"``.

        Returns:
            The snapshot's path (on this node), or None for a call the budget skipped.

        Raises:
            ReplicaMismatchError: DDP's replicas differ (every rank; nothing copied, the previous
                snapshot stays the newest and the keeper never persists this one).
            NodeMemoryError: a node's folder cannot hold two snapshots of ``state`` (on every
                rank, naming the sizes and the fixes); nothing was copied.
            CheckpointError: the previous snapshot's commit failed, or this one's failed with
                ``blocking`` (on every rank); the snapshot before it is whole.

        Examples:
            >>> manager.snapshot({"model": model, "optimizer": opt}, step=301)  # doctest: +SKIP
        """
        if budget is not None and not 0 < budget <= 1:
            raise ValueError(f"budget must be a fraction of the loop's time in (0, 1], or None; got {budget!r}")
        try:
            return self._node.take(state, step, blocking=blocking, metadata=metadata, writers=writers, budget=budget,
                                   replicas=replicas, compare=compare, check_replicas=check_replicas)  # fmt: skip
        except Orphaned as gone:
            # Training on alone would only fail later (the store the agent held is gone) or never end:
            # the ranks leave together now, and the keeper copies the newest snapshot into the folder.
            print(f"[rank{get_rank()}] ckptools: {gone}; every rank leaves now (exit code {ORPHANED_EXIT}), and "
                  f"the keeper copies the newest snapshot into {self.directory} once they are gone",
                  file=sys.stderr, flush=True)  # fmt: skip
            leave(ORPHANED_EXIT)

    def snapshots(self) -> list[tuple[int, str]]:
        """``(step, path)`` of this node's snapshots, oldest first (unverified; local: once this
        rank's part of a snapshot being committed is done)."""
        return self._node.snapshots()

    def _step_of(self, path: str) -> int:
        match = self._pattern.fullmatch(os.path.basename(path))
        assert match is not None  # every path a manager lists matches its pattern
        return int(match.group(1))

    def _choose_unless_removed(
        self, newest: list[int | None], damaged: frozenset[tuple[int, bool]] = frozenset()
    ) -> tuple[tuple[int, bool] | None, bool]:
        """Rank 0: `_choose`, unless node memory holds snapshots of a run whose (local) folder is gone:
        the folder exists from a run's first snapshot on, so it was removed (to start afresh), and those
        snapshots are stale. Then: no choice, and True (every node releases its snapshots)."""
        steps = [s for s in newest if s is not None]
        if "://" not in self.directory and not os.path.isdir(self.directory) and steps:
            log.warn(
                f"node memory holds snapshots of {self.directory} (up to step {max(steps)}) "
                "but that folder is gone: it was removed after they were taken, so this run starts afresh and the "
                "snapshots are released",
                once="run_folder_removed",
            )
            return None, True
        return self._choose(newest, damaged), False

    def _choose(
        self, newest: list[int | None], damaged: frozenset[tuple[int, bool]] = frozenset()
    ) -> tuple[int, bool] | None:
        """Rank 0: the step of the newest good checkpoint, durable or a node's snapshot (a tie:
        the snapshot, which reads from memory), and whether it is a snapshot; None for none.
        ``newest``: each node's newest whole snapshot (None for none); ``damaged``: the choices a
        load found damaged, ``(step, from node memory)``, skipped."""
        snapshot = max((step for step in newest if step is not None and (step, True) not in damaged), default=None)
        listed = [(step, path) for step, path in self.checkpoints() if (step, False) not in damaged]
        if snapshot is not None and (not listed or snapshot >= listed[-1][0]):
            return snapshot, True  # no durable file is newer: none is read to verify it
        durable = self._newest_good(damaged)
        if snapshot is not None and (durable is None or snapshot >= self._step_of(durable)):
            return snapshot, True  # the newer durable files were damaged
        return None if durable is None else (self._step_of(durable), False)

    def _newest_good(self, damaged: frozenset[tuple[int, bool]] = frozenset()) -> str | None:
        """Rank 0, choosing what a restore loads: `latest`, except in an object store read in ranges, where
        each checkpoint's container is checked in a few GETs and the load that follows checks every record
        as the rank that reads it gets it (``verify=True``): the object is downloaded once between the
        ranks, not once more by rank 0 to choose it. ``damaged``: as `_choose`'s (a local file is never
        one: `latest` checked every CRC-32 before its load)."""
        listed = [(step, path) for step, path in self.checkpoints() if (step, False) not in damaged]
        if not listed or not reads_in_ranges(resolve(listed[-1][1])):
            return self.latest()
        for _, path in reversed(listed):
            try:
                if not check_in_ranges(resolve(path)):
                    TORCH_FILE.check(resolve(path))  # not laid out for ranged reads: checked whole
            except CheckpointError as err:
                log.warn(f"skipping damaged checkpoint: {err}", all_ranks=True)
                continue
            return path
        return None

    def latest(self) -> str | None:
        """Path of the newest complete checkpoint whose every zip record passes its CRC-32, or None.

        Local. A damaged one is skipped with a warning; temporaries of a crashed save are never read.

        Examples:
            >>> ck.CheckpointManager("/tmp/empty-run").latest() is None  # doctest: +SKIP
            True
        """
        handle = pending()
        if handle is not None:
            handle.join_writer()  # local: this rank's write (and pruning) in flight ends first
        for _, path in reversed(self.checkpoints()):
            try:
                TORCH_FILE.check(resolve(path))
            except CheckpointError as err:
                log.warn(f"skipping damaged checkpoint: {err}", all_ranks=True)
                continue
            return path
        return None

    @checked_in("CheckpointManager.restore")
    def restore(self, state: Mapping[str, Any], **load_kwargs: Any) -> dict[str, Any] | None:
        """Restore ``state`` from the newest good checkpoint on every rank; None on a fresh start.

        Collective: rank 0 picks the newest of the durable checkpoints and the nodes' snapshots (a
        tie: the snapshot), every rank loads it with `ckptools.load`, its RNG states too
        (``restore_rng=False`` opts out); a node without that snapshot receives it from one that has it.

        Args:
            state: objects to restore in place, as for `ckptools.load`.
            **load_kwargs: passed to `ckptools.load` (``map_location``, ``strict``, ``read``, ...; a
                snapshot is read by every node from its own memory unless ``read="rank0"``).

        Returns: the checkpoint dict, or None when there is no checkpoint yet.

        Raises: CheckpointError: choosing or loading failed (on every rank).

        Examples:
            >>> ckpt = manager.restore({"model": model, "optimizer": opt})  # doctest: +SKIP
            >>> step = 0 if ckpt is None else ckpt["step"]  # doctest: +SKIP
        """
        finish_pending()
        nodes = self._node.survey()
        # Restoring is resuming: the RNG comes back whatever the state holds (see ck.load).
        load_kwargs = {"restore_rng": True, **load_kwargs}
        damaged: frozenset[tuple[int, bool]] = frozenset()  # (step, from node memory) a load found damaged
        while True:
            choose = functools.partial(self._choose_unless_removed, nodes.newest, damaged)
            if "://" not in self.directory:  # a stuck disk: an error within the stall bound, not a hang
                choose = functools.partial(run_watched, choose, self.directory, name="ckptools-choose", reading=True)
            chosen = Agreement(f"choosing a checkpoint in {self.directory}").on_rank0(choose, send=True)
            assert chosen is not None  # on_rank0 raised otherwise
            choice, removed = chosen
            if not damaged:
                nodes.release_unused(used=not removed and (not nodes.made_here or (choice is not None and choice[1])))
            if choice is None:
                if get_rank() == 0:
                    log.logger.info("no checkpoint in %s: starting fresh", self.directory)
                return None
            step, from_memory = choice
            if from_memory:
                path = self._node.path_for(step)
                nodes.bring(path, step)
                if get_rank() == 0:
                    log.logger.info("restoring from the snapshot in node memory: %s", path)
                where: Any = resolve(path).as_own()  # the job's own file: no link, no other's
                # (deprecated broadcast aside) every node reads its own memory: faster than any exchange
                kwargs = load_kwargs if load_kwargs.get("broadcast") else {"read": "each", **load_kwargs}
            else:
                where = self.path_for(step)
                kwargs = load_kwargs
                if not reads_in_ranges(resolve(where)):
                    return load(where, state, **kwargs)  # chosen by `latest`: every CRC-32 checked first
            # A snapshot (its container checked by the survey) or an object chosen by its container: every record
            # is checked as it is read; a damaged one means choosing again, as `latest` skips one on a local disk.
            try:
                return load(where, state, **{"verify": True, **kwargs})
            except CheckpointError as err:
                if not _damage_on_some_rank(err):
                    raise
                log.warn(f"skipping damaged {'snapshot' if from_memory else 'checkpoint'}: {err}", all_ranks=True)
                damaged |= {(step, from_memory)}
