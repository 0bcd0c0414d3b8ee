"""``CheckpointManager``: numbered checkpoints in one directory, pruning and resuming."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from . import log
from .collective.agree import Agreement
from .collective.group import get_rank
from .errors import CheckpointError
from .layouts import TORCH_FILE
from .leftovers import abandoned_tmps
from .loading import load
from .saving import async_save_with_hooks, save_with_hooks
from .storage import PathLike, fspath, join, list_files, remove, resolve
from .write import AsyncSave, finish_pending, pending, release_snapshot_buffers

__all__ = ["CheckpointManager"]


class CheckpointManager:
    """Keep numbered checkpoints in one directory and resume from the newest good one.

    Each checkpoint is one file ``{prefix}-{step:010d}.pt`` (zero-padded so names sort by step).
    The manager only ever lists, verifies or deletes files whose names match that pattern, so it
    shares a directory safely with anything else (``final.safetensors``, logs, ...).

    - ``save(state, step)`` (collective) writes atomically through `ckptools.save`, then
      rank 0 deletes all but the newest ``keep_last`` checkpoints, only after the new one is
      complete. Checkpoints with a *higher* step than the one being saved belong to a timeline
      that was abandoned by resuming from an earlier checkpoint; they are deleted too (with a
      warning), or ``latest()`` would later resume the abandoned timeline. Leftover temporary
      files of a crashed save are removed (those whose writer process is gone; see
      `ckptools.leftovers.is_abandoned_tmp`).
    - ``latest()`` (local) returns the newest checkpoint whose every zip record passes its
      CRC-32 check, skipping damaged or truncated ones with a warning.
    - ``restore(state)`` (collective) loads the checkpoint rank 0's ``latest()`` chose on every
      rank, or returns None on a fresh start.

    Args:
        directory: a local path or an fsspec URL (``s3://bucket/run``, ``memory://run``).
        keep_last: how many checkpoints to keep (>= 1), or None to keep all.
        prefix: file name prefix (letters, digits, ``_`` and ``-``).

    Examples:
        >>> import torch, ckptools as ck
        >>> model = torch.nn.Linear(2, 2)
        >>> manager = ck.CheckpointManager("/tmp/run", keep_last=2)
        >>> manager.restore({"model": model}) is None or True  # None on a fresh start
        True
        >>> manager.save({"model": model}, step=100)
        '/tmp/run/ckpt-0000000100.pt'
    """

    def __init__(self, directory: PathLike, *, keep_last: int | None = 3, prefix: str = "ckpt") -> None:
        if keep_last is not None and (not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1):
            raise ValueError(f"keep_last must be an integer >= 1 (or None to keep all), got {keep_last!r}")
        if not re.fullmatch(r"[A-Za-z0-9_-]+", prefix):
            raise ValueError(f"prefix must use letters, digits, '_' and '-' only, got {prefix!r}")
        self.directory = fspath(directory)
        self.keep_last = keep_last
        self.prefix = prefix
        self._pattern = re.compile(rf"{re.escape(prefix)}-(\d+)\.pt")

    def __repr__(self) -> str:
        return f"CheckpointManager({self.directory!r}, keep_last={self.keep_last!r}, prefix={self.prefix!r})"

    def path_for(self, step: int) -> str:
        """The path of the checkpoint for ``step``."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        return join(self.directory, f"{self.prefix}-{step:010d}.pt")

    def checkpoints(self) -> list[tuple[int, str]]:
        """``(step, path)`` of every checkpoint file in the directory, oldest first (unverified)."""
        found = []
        for name in list_files(self.directory):
            match = self._pattern.fullmatch(name)
            if match:
                found.append((int(match.group(1)), join(self.directory, name)))
        return sorted(found)

    def _leftovers(self) -> list[str]:
        # Only files whose writer is gone: a second job saving into this directory (a
        # misconfiguration, but one that happens) must not have its file deleted mid-write.
        return abandoned_tmps(self.directory, f".{self.prefix}-")

    def save(self, state: Mapping[str, Any], step: int, *, blocking: bool = True, **save_kwargs: Any) -> str:
        """Save ``state`` as the checkpoint for ``step`` (collective), then prune.

        ``step`` is also recorded in the file's metadata (``__ckptools__["metadata"]["step"]``).
        With ``blocking=False`` the save goes through `ckptools.async_save`: the call
        returns once the state is snapshotted, rank 0 writes in the background, and pruning
        happens in that background writer only after the new file is committed. The next
        checkpoint call (any manager method but `checkpoints`, or ``ck.save``/``ck.load``)
        finishes it first, and raises on every rank if it failed; `wait` does so now.

        Args:
            state: as for `ckptools.save`.
            step: the training step (or any increasing counter).
            blocking: False to save in the background.
            **save_kwargs: passed to `ckptools.save` (``metadata=...``).

        Returns:
            The new checkpoint's path (where it will be, with ``blocking=False``).

        Raises:
            CheckpointError: the save failed (on every rank), or the async save before it did;
                older checkpoints are untouched.

        Examples:
            >>> manager.save({"model": model, "optimizer": opt}, step=200)  # doctest: +SKIP
            >>> manager.save({"model": model, "optimizer": opt}, step=300, blocking=False)  # doctest: +SKIP
        """
        path = self.path_for(step)
        metadata = {**dict(save_kwargs.pop("metadata", None) or {}), "step": step}

        # Temporary files of a save that was killed: never loadable, only taking space (perhaps
        # the space this save needs). Rank 0 removes them once the state passed save's checks,
        # right before it writes; an error there must not escape, or the other ranks would wait
        # in save() for a rank that left.
        def cleanup() -> None:
            self._housekeeping(self._remove_leftovers, "clean up")

        def prune() -> None:
            self._housekeeping(lambda: self._prune(step), "prune")

        if not blocking:
            async_save_with_hooks(
                path, state, metadata=metadata, before_write=cleanup, after_write=prune, **save_kwargs
            )
            return path
        save_with_hooks(path, state, metadata=metadata, before_write=cleanup, **save_kwargs)
        if get_rank() == 0:
            prune()
        return path

    def wait(self) -> str | None:
        """Finish the async save in flight, if any (collective); its path, or None if none was.

        Raises:
            CheckpointError: its background write failed (on every rank).

        Examples:
            >>> manager.wait()  # doctest: +SKIP
            'runs/x/ckpt-0000000300.pt'
        """
        return finish_pending()

    @property
    def pending(self) -> AsyncSave | None:
        """The async save in flight (its ``done()`` is a local poll), or None."""
        return pending()

    def close(self) -> None:
        """Finish the async save in flight (collective) and free the snapshot buffers it held.

        Examples:
            >>> manager.close()  # doctest: +SKIP
        """
        self.wait()
        release_snapshot_buffers()

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
            # The new checkpoint is safe on disk; failing to delete an old one must not fail
            # the training step, but must not go unnoticed either.
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

    def latest(self) -> str | None:
        """Path of the newest complete checkpoint that passes its integrity check, or None.

        Local (not collective). Temporary leftovers of a crashed save are never considered.
        The newest file is verified (every zip record's CRC-32, which ``torch.load`` does not
        check); a damaged one is skipped with a warning and the next newest is tried.

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

    def restore(self, state: Mapping[str, Any], **load_kwargs: Any) -> dict[str, Any] | None:
        """Restore ``state`` from the newest good checkpoint on every rank; None on a fresh start.

        Collective: rank 0 picks the checkpoint (so all ranks agree even if a save is racing
        the listing) and broadcasts its path; every rank then loads it with `ckptools.load`,
        restoring its own RNG states too (restoring is resuming; ``restore_rng=False`` opts out).

        Args:
            state: objects to restore in place, as for `ckptools.load`.
            **load_kwargs: passed to `ckptools.load` (``map_location``, ``strict``, ``broadcast``: rank 0
                reads, the others receive, for node-local disks; ...).

        Returns:
            The checkpoint dict, or None when there is no checkpoint yet.

        Raises:
            CheckpointError: choosing or loading failed (on every rank).

        Examples:
            >>> ckpt = manager.restore({"model": model, "optimizer": opt})  # doctest: +SKIP
            >>> step = 0 if ckpt is None else ckpt["step"]  # doctest: +SKIP
        """
        finish_pending()
        path = Agreement(f"choosing a checkpoint in {self.directory}").on_rank0(self.latest, send=True)
        if path is None:
            if get_rank() == 0:
                log.logger.info("no checkpoint in %s: starting fresh", self.directory)
            return None
        # Restoring is resuming: the RNG comes back whatever the state holds (see ck.load).
        return load(path, state, **{"restore_rng": True, **load_kwargs})
