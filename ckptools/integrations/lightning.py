"""Lightning writes and reads its checkpoints through ckptools: one line in the ``Trainer``.

    >>> from ckptools.integrations.lightning import CkptoolsCheckpointIO  # doctest: +SKIP
    >>> trainer = Trainer(strategy="ddp", plugins=[CkptoolsCheckpointIO()])  # doctest: +SKIP

What changes against Lightning's own ``TorchCheckpointIO`` (``torch.save`` straight into the
final name): the file is written under a temporary name, fsynced and renamed, so a kill at any
moment leaves the previous ``last.ckpt`` (or whichever name) whole, never a torn one; it is the
same torch zip ``torch.load`` and Lightning read, with every record's CRC-32; on S3 and other
fsspec URLs it streams as one multipart upload that appears only when complete; loading checks
every CRC-32 first (``verify=True``) and memory-maps local files; `remove_checkpoint` never
removes the newest checkpoint of its folder. `AsyncCkptoolsCheckpointIO` stages the
checkpoint into reused host buffers at the call (the file holds the state as of the call while
training goes on) and writes it in a background thread; Lightning's teardown waits for it.

Lightning calls a ``CheckpointIO`` on global rank 0 only (``Strategy.save_checkpoint``), so
nothing here is a collective: this is ckptools' single-writer path, not `ckptools.save`.
Works with ``pytorch_lightning`` / ``lightning_fabric`` and with the unified ``lightning``
package (the plugin is registered as a ``CheckpointIO`` of each one installed).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import sys
import threading
import time
import types
from typing import Any

import torch

from .. import log
from ..collective.arrival import arrive
from ..collective.group import get_world_size
from ..errors import CheckpointError, UnsafeCheckpointError, weights_only_switch
from ..layouts import TORCH_FILE
from ..owned.gradients import track
from ..read import ReadAnotherWay, once_pays, read_once
from ..storage import TMP_MARKER, Location, abandoned_tmps, remove, resolve, wait_for_write
from ..write import BackgroundWriter, StagingBuffers, write_file
from . import NEEDS_LIGHTNING, lightning_classes
from .lightning_resume import ExactResume
from .lightning_snapshots import NodeSnapshots

__all__ = ["AsyncCkptoolsCheckpointIO", "CkptoolsCheckpointIO", "ExactResume", "NodeSnapshots"]

_BASES = lightning_classes(
    "CheckpointIO", "lightning_fabric.plugins.io.checkpoint_io", "lightning.fabric.plugins.io.checkpoint_io"
)
if not _BASES:
    raise ImportError(NEEDS_LIGHTNING)


class CkptoolsCheckpointIO(_BASES[0]):  # type: ignore[misc,valid-type,unused-ignore]  # an ABC from a list: Any to mypy
    """A Lightning ``CheckpointIO`` that saves atomically with CRC-32s and loads verified.

    Args:
        verify: check every record's CRC-32 before loading (one extra read of the file).
            Lightning's own loader does not: ``torch.load`` ignores CRC-32s.
        mmap: memory-map local files when loading (tensors are read when touched).
        weights_only: False loads every checkpoint as ``torch.load(weights_only=False)`` does (it may run
            the file's code): for checkpoints you wrote yourself, where Lightning (before 2.6) has no
            ``trainer.fit(..., weights_only=False)`` to say it per call.
        trust_code: deprecated (goes in 0.6): ``trust_code=True`` is ``weights_only=False``.
        read: who reads a checkpoint Lightning loads on every rank (a resume, ``fabric.load``):
            ``"auto"`` reads it once between the ranks where that pays (as `ckptools.load`'s
            ``read="auto"``: ranks on several nodes sharing a filesystem, or an object in S3), each
            rank about 1/N, the rest received; ``"once"`` always with a process group; ``"each"``
            every rank the whole file (Lightning's way). Reading once is collective: a load Lightning
            makes on rank 0 alone is not read once (it would raise after ``CKPTOOLS_ARRIVAL_TIMEOUT``).

    Examples:
        >>> from ckptools.integrations.lightning import CkptoolsCheckpointIO  # doctest: +SKIP
        >>> trainer = Trainer(plugins=[CkptoolsCheckpointIO()])  # doctest: +SKIP
        >>> trainer.fit(model, ckpt_path="last")  # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        verify: bool = True,
        mmap: bool = True,
        weights_only: bool = True,
        trust_code: bool | None = None,
        read: str = "auto",
    ) -> None:
        track()  # the optimizer steps watched from here: an open accumulation window's gradients
        super().__init__()
        if read not in ("auto", "once", "each"):
            raise ValueError(f"read must be 'auto', 'once' or 'each', got {read!r}")
        self.verify = verify
        self.mmap = mmap
        self.weights_only = weights_only_switch(weights_only, trust_code, type(self).__name__)
        self.read = read

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` to ``path`` atomically (global rank 0 only, as Lightning calls it).

        Raises:
            TypeError: ``storage_options`` was given (as Lightning's ``TorchCheckpointIO``, none are taken).
            CheckpointError: the write failed; the file at ``path`` is then untouched.
        """
        _no_storage_options(storage_options)
        started = time.monotonic()
        written = _write(resolve(path), checkpoint)
        log.report("saved", str(path), started, written)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Read a checkpoint, after checking every CRC-32 (``verify``).

        ``weights_only=None`` (Lightning's default) loads as ``torch.load`` does by default
        (``weights_only=True``): a file that needs arbitrary code (hyper-parameters holding a
        ``pathlib.Path`` or an ``argparse.Namespace``) raises `UnsafeCheckpointError` naming what
        it needs and the fix: ``trainer.fit(model, ckpt_path=..., weights_only=False)`` for a file
        you trust.
        """
        location = resolve(path)
        trust = weights_only is False or not self.weights_only

        def read(where: Location, target: Any, *, verify: bool, mmap: bool) -> Any:
            try:
                return TORCH_FILE.read_tree(where, map_location=target, trust_code=trust, verify=verify, mmap=mmap)
            except UnsafeCheckpointError as refusal:  # e.g. save_hyperparameters() of a Path or a Namespace
                raise UnsafeCheckpointError(f"{refusal}. {_trusting()}") from refusal

        loaded: Any = None
        device = _device(map_location)
        if device is not None and self._reads_once(location):
            arrive("CkptoolsCheckpointIO.load_checkpoint")  # every rank, or a clear error on those that came
            with contextlib.suppress(ReadAnotherWay):  # a legacy file, a store without ranged reads: each reads
                loaded = read_once(location, device, lambda where: read(where, "cpu", verify=False, mmap=True),
                                   verify=self.verify)  # fmt: skip
        if loaded is None:
            target = map_location if map_location is not None else "cpu"
            loaded = read(location, target, verify=self.verify, mmap=self.mmap)
        if not isinstance(loaded, dict):
            raise CheckpointError(f"{path} holds a {type(loaded).__name__}, not a Lightning checkpoint (a dict)")
        return loaded

    def _reads_once(self, location: Location) -> bool:
        """Whether this load reads ``location`` once between the ranks (the same on every rank)."""
        world = get_world_size()
        if self.read == "each" or world == 1:
            return False
        return self.read == "once" or once_pays(location, world)

    def remove_checkpoint(self, path: Any) -> None:
        """Remove a checkpoint, unless it is the newest of its folder (then it is kept, with a warning).

        Lightning's ``ModelCheckpoint`` removes the checkpoint a new one replaces; if the new one
        never came (a failed write), the one asked for may be the newest complete checkpoint,
        and removing it would leave nothing to resume from.
        """
        location = resolve(path)
        if not location.fs.exists(location.path):
            return
        newer = _newest_sibling(location)
        if newer is None or newer == location.path:
            log.warn(f"kept {path}: it is the newest checkpoint in its folder (nothing newer was saved)",
                     all_ranks=True)  # fmt: skip
            return
        location.fs.rm(location.path, recursive=True)


class AsyncCkptoolsCheckpointIO(CkptoolsCheckpointIO):
    """`CkptoolsCheckpointIO` that writes in a background thread from a copy staged at the call.

    ``save_checkpoint`` copies every tensor of the checkpoint into host buffers kept between
    saves (pinned for CUDA tensors), returns, and a thread writes the file (atomically, as the
    sync plugin). One save is in flight at most: the next call, a load, a removal and Lightning's
    ``teardown`` first wait for it, and a failed background write is raised there. Whatever else
    in this process looks at the path through ckptools (another plugin instance, ``ck.load``) or
    through ``ModelCheckpoint``'s choice of a new name waits for it too (a hook on the ModelCheckpoints of
    the trainer that saves through the plugin, for its run alone: nothing on Lightning's classes), and a
    ``trainer.save_checkpoint`` outside ``fit`` returns once the file is written. With a Lightning other
    than `TESTED_LIGHTNING` a trainer's saves all return once written. Another process sees the file once
    `wait` (or ``teardown``) returned.

    Examples:
        >>> from ckptools.integrations.lightning import AsyncCkptoolsCheckpointIO  # doctest: +SKIP
        >>> trainer = Trainer(plugins=[AsyncCkptoolsCheckpointIO()])  # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        verify: bool = True,
        mmap: bool = True,
        weights_only: bool = True,
        trust_code: bool | None = None,
        read: str = "auto",
    ) -> None:
        track()  # the optimizer steps watched from here: an open accumulation window's gradients
        super().__init__(verify=verify, mmap=mmap, weights_only=weights_only, trust_code=trust_code, read=read)
        self._buffers = StagingBuffers()
        self._writer = BackgroundWriter("ckptools-lightning-save")
        self._hooked: list[Any] = []  # the ModelCheckpoints of the trainer in its run: unhooked at teardown

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Stage ``checkpoint`` (copy it to host buffers) and write it in the background (see the class)."""
        _no_storage_options(storage_options)
        self.wait()  # the buffers are reused: the previous write must be done with them
        trainer = _calling_trainer(self)
        in_run = trainer is not None and _tested(trainer) and _running(trainer)
        if in_run:  # its ModelCheckpoints must see this save when they pick their next name
            self._hooked += [c for c in getattr(trainer, "checkpoint_callbacks", []) if _hook_file_exists(c)]
        started = time.monotonic()
        location = resolve(path)
        staged = self._buffers.take(checkpoint)
        log.logger.debug("%s staged in %.3f s", path, time.monotonic() - started)
        # Already off the training thread (Lightning's own AsyncCheckpointIO wrapping this one, whose
        # teardown waits for its executor but not for us): write here, so that it does. A trainer's save
        # outside its run (after fit: Lightning's teardown, which waits, has run; the caller reads the file
        # at once) returns once written too, and Trainer.save_checkpoint's own barrier then holds every rank
        # until it is.
        inline = threading.current_thread() is not threading.main_thread() or (trainer is not None and not in_run)
        # Announced before returning: whoever reads the path next in this process waits for it.
        self._writer.start(
            location.url, lambda: _write(location, staged), started=started, announce=True, inline=inline
        )
        if inline:
            self.wait()

    def wait(self) -> None:
        """Block until the save in flight (if any) is on disk; raise its failure (once)."""
        self._writer.join()
        error = self._writer.take_error()
        if error is not None:
            raise CheckpointError(f"a background checkpoint save failed: {type(error).__name__}: {error}") from error

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """As `CkptoolsCheckpointIO.load_checkpoint`, after the save in flight is done."""
        self.wait()
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        """As `CkptoolsCheckpointIO.remove_checkpoint`, once the save in flight (the file that
        replaces this one) is on disk: if it failed, nothing is removed and the failure is raised."""
        self.wait()
        super().remove_checkpoint(path)

    def teardown(self) -> None:
        """Lightning's end of fit/validate/test: wait for the save in flight, free the buffers, take the
        hooks of the run's ModelCheckpoints away."""
        try:
            self.wait()
        finally:
            self._buffers.release()
            _unhook(self._hooked)


for _base in _BASES[1:]:
    _base.register(CkptoolsCheckpointIO)  # an ABC: isinstance() holds for that Lightning too


# The Lightning versions whose call chain (Trainer.save_checkpoint -> Strategy.save_checkpoint -> the
# CheckpointIO, ModelCheckpoint.file_exists) the plugin's hooks were tested with (`make interop`,
# `make lightning-suite`). Outside them the plugin hooks nothing: a trainer's saves return once written.
TESTED_LIGHTNING = ((2, 5), (2, 6))


def _calling_trainer(io: Any) -> Any | None:
    """The Trainer whose save is calling ``io`` now (its strategy's CheckpointIO, or a wrapper's), found
    up this thread's frames (Trainer.save_checkpoint, then its strategy's); None for a direct call, or a
    save Lightning's own AsyncCheckpointIO runs in its thread."""
    frame: types.FrameType | None = sys._getframe(2)
    for _ in range(8):  # Trainer.save_checkpoint is two or three frames up in the versions tested
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if type(owner).__name__ == "Trainer" and _saves_through(owner, io):
            return owner
        frame = frame.f_back
    return None


def _tested(trainer: Any) -> bool:
    """Whether ``trainer``'s Lightning is one of `TESTED_LIGHTNING` (warned once where not)."""
    package = sys.modules.get(type(trainer).__module__.split(".")[0])
    found = str(getattr(package, "__version__", "0"))
    version = tuple(int(part) for part in re.findall(r"\d+", found)[:2])
    if version in TESTED_LIGHTNING:
        return True
    log.warn(f"AsyncCkptoolsCheckpointIO was not tested with Lightning {found}: it hooks nothing into this "
             "trainer, and each of its saves returns once the file is written (as CkptoolsCheckpointIO's)",
             once="lightning-untested")  # fmt: skip
    return False


def _saves_through(trainer: Any, io: Any) -> bool:
    """Whether ``trainer`` saves through ``io`` (itself, or wrapped by Lightning's ``AsyncCheckpointIO``)."""
    found = getattr(getattr(trainer, "strategy", None), "checkpoint_io", None)
    for _ in range(4):  # a wrapper's wrapper at most; never a loop
        if found is io:
            return True
        found = getattr(found, "checkpoint_io", None)
        if found is None:
            return False
    return False


def _running(trainer: Any) -> bool:
    status = getattr(getattr(trainer, "state", None), "status", None)
    return getattr(status, "value", status) == "running"


def _hook_file_exists(callback: Any) -> bool:
    """Make this one ``ModelCheckpoint`` wait for a save in flight of the path it asks about (an instance
    attribute over its class's method; `_unhook` takes it away); whether it was hooked now.

    ``ModelCheckpoint`` picks a new file's name (``name-v1.ckpt`` when ``name.ckpt`` exists) with
    ``file_exists``, through Lightning's own filesystem: a save of ``name.ckpt`` still in flight would
    read as absent and the next epoch's file would overwrite it (with ``save_top_k=-1`` and a fixed
    ``filename``, 2 of 4 checkpoints were lost). Lightning has no hook before that step."""
    if "file_exists" in vars(callback) or not callable(getattr(callback, "file_exists", None)):
        return False  # hooked already, or not a ModelCheckpoint of the versions tested
    original = callback.file_exists  # bound to this callback

    def file_exists(filepath: Any, trainer: Any) -> Any:
        wait_for_write(os.fspath(filepath))
        return original(filepath, trainer)

    callback.file_exists = file_exists
    return True


def _unhook(callbacks: list[Any]) -> None:
    for callback in callbacks:
        vars(callback).pop("file_exists", None)  # the class's own method again
    callbacks.clear()


def _no_storage_options(storage_options: Any | None) -> None:
    if storage_options is not None:
        raise TypeError(
            "CkptoolsCheckpointIO takes no storage_options (as Lightning's TorchCheckpointIO): pass the "
            "options of an fsspec URL in the URL or the environment"
        )


def _write(location: Location, checkpoint: Any) -> int:
    """Rank 0's writer alone, no exchange (`ckptools.write.write_file`), into a folder
    made if missing, after removing what a kill mid-save of this name left there."""
    if location.local:
        folder = os.path.dirname(os.path.abspath(location.path))
        location.fs.makedirs(folder, exist_ok=True)
        for leftover in abandoned_tmps(folder, f".{os.path.basename(location.path)}{TMP_MARKER}"):
            remove(leftover)
    return write_file(location, checkpoint)


def _newest_sibling(location: Location) -> str | None:
    """The most recently modified file beside ``location`` with its suffix (its own path included)."""
    fs = location.fs
    folder = os.path.dirname(location.path.rstrip("/")) or "."
    suffix = os.path.splitext(location.path)[1]
    newest: tuple[float, str] | None = None
    for entry in fs.ls(folder, detail=True):
        name = str(entry["name"])
        base = os.path.basename(name)
        if entry.get("type") != "file" or base.startswith(".") or not base.endswith(suffix):
            continue  # temporary files of a write in progress are hidden; other kinds are not ours
        mtime = entry.get("mtime") or entry.get("LastModified") or entry.get("created") or 0
        stamp = mtime.timestamp() if hasattr(mtime, "timestamp") else float(mtime)
        if newest is None or stamp > newest[0]:
            newest = (stamp, name)
    return None if newest is None else newest[1]


def _trusting() -> str:
    """How to load a trusted checkpoint in the Lightning installed here: ``fit(weights_only=False)``
    exists from Lightning 2.6; before it, the plugin's ``weights_only=False``."""
    import inspect

    fits = []
    for name in ("pytorch_lightning", "lightning.pytorch"):  # the package, or the unified one
        try:
            fits.append(importlib.import_module(name).Trainer.fit)
        except (ImportError, AttributeError):
            continue
    if not fits or any("weights_only" in inspect.signature(fit).parameters for fit in fits):
        return ("In Lightning, for a checkpoint you wrote yourself: trainer.fit(model, ckpt_path=..., "
                "weights_only=False) (validate, test and predict take it too), or fabric.load(path, state, "
                "weights_only=False)")  # fmt: skip
    return ("In Lightning before 2.6 (no weights_only in trainer.fit), for checkpoints you wrote yourself: "
            "Trainer(plugins=[CkptoolsCheckpointIO(weights_only=False)])")  # fmt: skip


def _device(map_location: Any) -> torch.device | None:
    """The one device ``map_location`` names (None: the CPU), or None where it is a function or a
    mapping (every rank then reads as torch maps it)."""
    if map_location is None:
        return torch.device("cpu")
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    return None
