"""Collective ``load`` of training checkpoints, and ``load_state_dict`` for the weights of any file.

What ``state`` names is restored in place (a model whether it and the file carry ``module.`` or
not, its tied weights filled), with this rank's RNG on a resume; an error on one rank is raised
on every rank. Files of every layout are read through `ckptools.layouts`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data.distributed import DistributedSampler

from .. import log
from ..collective.agree import Agreement
from ..collective.arrival import checked_in
from ..collective.group import get_world_size
from ..collective.tree import broadcast_tree
from ..devices import MapLocation, resolve_map_location
from ..errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    UnsafeCheckpointError,
    deprecated,
    weights_only_switch,
)
from ..layouts import is_lightning_checkpoint, read_checkpoint, read_weights, record_of
from ..lifecycle import finish_pending
from ..owned.zero import has_partitions
from ..state_dict import shared_prefix, strip_for_reading, strip_prefix
from ..storage import Location, PathLike, fspath, resolve, run_watched
from ..training.sampler import ResumableDistributedSampler, note_rng_restored
from .once import ReadAnotherWay, once_pays, read_once
from .restoring import restore_all, restore_rng_state

__all__ = ["load", "load_state_dict"]

# Objects that exist only to continue training: a load that restores one of them is a resume,
# so it restores the RNG too (see `load`'s restore_rng).
_TRAINING_TYPES: tuple[type, ...] = (
    torch.optim.Optimizer,
    torch.optim.lr_scheduler.LRScheduler,
    torch.optim.lr_scheduler.ReduceLROnPlateau,
    torch.amp.GradScaler,
    DistributedSampler,
)


@checked_in("ck.load")
def load(
    path: PathLike,
    state: Mapping[str, Any] | None = None,
    *,
    map_location: MapLocation = "auto",
    strict: bool = True,
    weights_only: bool = True,
    restore_rng: bool | None = None,
    verify: bool = False,
    broadcast: bool | None = None,
    trust_code: bool | None = None,
    read: str = "auto",
) -> dict[str, Any]:
    """Load a checkpoint and restore, in place, every object named in ``state``.

    Collective when a process group exists: if any rank fails, every rank raises. A model loads
    whether it or the file carries ``module.``, ``_orig_mod.`` or a prefix every key shares
    (decided against the model's own keys); plain ``torch.save`` dicts, bare state dicts and
    ``.safetensors`` files load too. This rank's RNG states are restored when ``state`` holds
    something that exists to continue training (an optimizer, a scheduler, a scaler, a sampler)
    and the world size is the one saved: a look at a file in a notebook leaves its random streams
    alone. How entries are matched, and why: docs/guides/resuming.md.

    Args:
        path: file path or fsspec URL.
        state: names mapped to objects to restore (model, optimizer, scaler, scheduler, sampler,
            tensors, anything with ``load_state_dict``).
        map_location: see `resolve_map_location`; ``"auto"`` is this rank's device. With a
            ZeroRedundancyOptimizer in ``state`` and a GPU target, what was saved on the CPU
            (its partitions, as torch's consolidation saves them) stays mapped on the CPU and
            each rank moves only its own partition to its GPU.
        strict: raise `KeyMismatchError` when a named entry is missing or a model's keys
            differ; with False, load what matches.
        weights_only: keep torch's safe unpickler; False runs arbitrary code from the file and
            is for trusted files only (torch's own name for the opt-in).
        restore_rng: restore this rank's RNG states from the file: True, False, or None to
            decide by ``state`` as above.
        verify: check every record's CRC-32 before loading (in the pass that checks the file).
        broadcast: deprecated (goes in 0.6): ``broadcast=True`` is ``read="rank0"``.
        trust_code: deprecated (goes in 0.5): ``trust_code=True`` is ``weights_only=False``.
        read: who reads the file: ``"each"`` rank the whole file; ``"rank0"``: rank 0 alone, every
            other rank receives what it read over the process group (GPU to GPU with nccl) in buckets
            of 64 MiB and ends holding exactly what it would have read itself, its own RNG state
            included (node-local disks where only rank 0's node has the file);
            ``"once"``: each rank about 1/N of a local file the ranks share or of an object (S3 and
            other stores with ranged reads), the rest received (bytes read from storage: 1.0x the
            file; another remote file: as ``"rank0"``); ``"auto"``: ``"once"`` where the ranks span
            several nodes and the file is local, and for an object in S3 (or gcs, azure, http), else ``"each"``.

    Returns:
        The whole checkpoint dict (entries on ``map_location``), including ``__ckptools__``.

    Raises:
        CheckpointNotFoundError, CheckpointFormatError, UnsafeCheckpointError, KeyMismatchError:
            on the rank where it happened; other ranks raise `CheckpointError`.

    Examples:
        >>> import torch, ckptools as ck
        >>> model = torch.nn.Linear(2, 2)
        >>> _ = ck.save("/tmp/load.pt", {"model": model, "step": 10})
        >>> ck.load("/tmp/load.pt", {"model": model})["step"]
        10
    """
    finish_pending()  # the file may be the one still being written
    started = time.monotonic()
    path = fspath(path)
    location = resolve(path)
    state = state or {}
    if trust_code is not None:  # one switch: torch's (and the contract's) name for load
        deprecated("ck.load(trust_code=...) is deprecated and goes in 0.5: pass weights_only=False for a file you "
                   "trust (trust_code=True is the same)")  # fmt: skip
        weights_only = weights_only and not trust_code
    if broadcast is not None:  # one switch for who reads: read=
        deprecated("ck.load(broadcast=...) is deprecated and goes in 0.6: pass read='rank0' (broadcast=True is "
                   "the same)")  # fmt: skip
        if broadcast and read not in ("auto", "rank0"):
            raise ValueError(f"broadcast=True is read='rank0'; it contradicts read={read!r}")
        read = "rank0" if broadcast else read
    error: BaseException | None = None
    ckpt: dict[str, Any] = {}
    how = read
    try:
        target = resolve_map_location(map_location)
        if has_partitions(state) and isinstance(target, torch.device) and target.type != "cpu":
            target = _partitions_stay_on_cpu(target)
        how = _who_reads(read, location, target)
        loaded: Any = None
        if how == "once":
            try:
                loaded = read_once(location, target, lambda where: _read(where, "cpu", weights_only=weights_only,
                                   verify=False, state=state), verify=verify)  # fmt: skip
            except ReadAnotherWay as other:  # every rank alike
                how = other.how
        if how == "rank0":
            loaded = _read_on_rank0(location, target, weights_only=weights_only, verify=verify, state=state)
        elif how == "each":
            loaded = _read(location, target, weights_only=weights_only, verify=verify, state=state)
        if isinstance(loaded, torch.nn.Module):  # a trusted torch.save(model): its weights, as a checkpoint holds them
            loaded = dict(loaded.state_dict())
        if not isinstance(loaded, dict):
            raise CheckpointFormatError(
                f"{path} holds a {type(loaded).__name__}, not a checkpoint dict; "
                "use ck.load_state_dict for bare weights"
            )
        ckpt = loaded
        record_of(ckpt, path)  # a newer ckptools' format is refused before anything is restored
    except Exception as err:  # noqa: BLE001 - shared with every rank, then re-raised
        error = err

    def amend(err: BaseException, outcomes: list[Any]) -> BaseException | None:
        # A file rank 0 read and this rank cannot find: a node-local disk.
        if isinstance(err, CheckpointNotFoundError) and how != "rank0" and outcomes[0] is None:
            hint = "pass read='rank0' to ck.load / manager.restore to send it from rank 0"
            return CheckpointNotFoundError(f"{err}, but rank 0 read it: {hint}")
        return None

    # Every rank read its checkpoint before any restores it: one rank's failed or stalled read leaves every
    # rank's objects as they were (a job that goes on after the error does not train on mixed states).
    agreement = Agreement(f"loading checkpoint {path}", own="as_is")
    agreement.on_every_rank(error, amend=amend)
    try:
        _restore(ckpt, state, strict=strict, path=path, restore_rng=restore_rng)
    except Exception as err:  # noqa: BLE001 - shared with every rank, then re-raised
        error = err
    agreement.on_every_rank(error)
    log.report("loaded", location, started)
    return ckpt


def _restore(
    ckpt: dict[str, Any], state: Mapping[str, Any], *, strict: bool, path: str, restore_rng: bool | None
) -> None:
    """`load`'s second half, on this rank: ``ckpt`` into the objects ``state`` names, and the RNG on a resume."""
    restore_all(ckpt, state, strict=strict, path=path)
    if restore_rng is None:
        restore_rng = any(isinstance(obj, _TRAINING_TYPES) for obj in state.values())
    if restore_rng and restore_rng_state(ckpt, path):
        for obj in state.values():
            if isinstance(obj, ResumableDistributedSampler):
                note_rng_restored(obj)  # lets it notice the stream moving before the first batch


_READS = ("auto", "each", "rank0", "once")


def _who_reads(read: str, location: Location, target: Any) -> str:
    """``"each"``, ``"rank0"`` or ``"once"``: the same on every rank (from the arguments and the
    environment alone; see `load`'s ``read``)."""
    if read not in _READS:
        raise ValueError(f"read must be one of {', '.join(map(repr, _READS))}, got {read!r}")
    world = get_world_size()
    if world == 1:
        return "each"
    if read == "rank0":
        return "rank0"
    if read == "auto":
        read = "once" if once_pays(location, world) else "each"
    if read == "once" and not isinstance(target, torch.device):  # a per-storage map_location: each rank maps
        return "each"
    return read


def _partitions_stay_on_cpu(device: torch.device) -> Any:
    """A ``map_location`` for a state holding a ZeroRedundancyOptimizer: storages saved on the
    CPU (every optimizer partition, as torch's consolidation saves them) stay mapped on the CPU,
    the rest goes to ``device``. ZeRO's ``load_state_dict`` moves its own partition to its
    parameters' device; on ``device`` every rank would hold every partition at once, the memory
    ZeRO exists to save.

    Examples:
        >>> import torch
        >>> restore = _partitions_stay_on_cpu(torch.device("cuda", 1))
        >>> storage = torch.zeros(2).untyped_storage()
        >>> restore(storage, "cpu") is storage
        True
    """

    def restore(storage: Any, location: str) -> Any:
        if location == "cpu":
            return storage
        return torch.serialization.default_restore_location(storage, str(device))  # type: ignore[no-untyped-call]

    return restore


def _read(location: Location, target: Any, *, weights_only: bool, verify: bool, state: Mapping[str, Any]) -> Any:
    """What this rank reads from ``location`` for `load` (`ckptools.layouts.read_checkpoint`); from a local
    path in a thread this one watches, so that a storage that stops answering is a `StorageStalledError`
    within the stall bound (which every rank raises), not a hang of every rank."""
    if not location.local:  # an object store's client has its own timeouts, and its bytes move in its threads
        return _read_here(location, target, weights_only=weights_only, verify=verify, state=state)
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]

    def on_this_device() -> Any:
        if device is not None:
            torch.cuda.set_device(device)  # the caller's GPU (a new thread's is GPU 0)
        read = _read_here(location, target, weights_only=weights_only, verify=verify, state=state)
        if device is not None:
            torch.cuda.synchronize(device)  # its copies done before the caller's stream uses them
        return read

    return run_watched(on_this_device, location.url, name="ckptools-read", reading=True)


def _read_here(location: Location, target: Any, *, weights_only: bool, verify: bool, state: Mapping[str, Any]) -> Any:
    try:
        # Entries torch's safe loader refuses (a Lightning checkpoint's pathlib.Path or OmegaConf
        # hyper-parameters) come back as inert placeholders when ``state`` names what to restore;
        # what it names is restored, and refused by restore_all only if it needs one of them.
        return read_checkpoint(
            location, map_location=target, trust_code=not weights_only, verify=verify, placeholders=bool(state)
        )
    except UnsafeCheckpointError as err:
        if not weights_only or state:
            raise
        # ck.load(path) alone asks for the whole checkpoint: placeholders would surprise.
        raise UnsafeCheckpointError(
            f"{err}. To read it without running anything, name what to restore: ck.load(path, "
            "{'model': model}) restores it and gives the other entries as inert placeholders; "
            "ck.load_state_dict(path) gives the weights"
        ) from None


def _read_on_rank0(
    location: Location, target: Any, *, weights_only: bool, verify: bool, state: Mapping[str, Any]
) -> Any:
    """Collective: rank 0 reads ``location``, every rank gets what it read (tensors on ``target``,
    the resolved map_location)."""
    # Told to every rank before the transfer starts.
    tree = Agreement(f"loading checkpoint {location.url}", own="as_is").on_rank0(
        lambda: _read(location, target, weights_only=weights_only, verify=verify, state=state)
    )
    nccl = torch.distributed.get_backend() == "nccl"
    comm = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    device = target if isinstance(target, torch.device) else torch.device("cpu")
    return broadcast_tree(tree, device=device, comm_device=comm)


def load_state_dict(
    path: PathLike,
    *,
    map_location: MapLocation = "cpu",
    key: str | None = None,
    strip: str | None = "module.",
    verify: bool = False,
    weights_only: bool = True,
    trust_code: bool | None = None,
) -> dict[str, torch.Tensor]:
    """Return just the model weights, from a file or folder of any layout ckptools reads.

    A ``.pt/.pth/.bin/.ckpt`` or ``.safetensors`` file, a sharded index
    (``model.safetensors.index.json``), a Hugging Face ``save_pretrained`` or Accelerate
    ``save_state`` folder, or a DCP folder (see `ckptools.open_checkpoint`). Weights are
    found as a bare state dict, or under ``state_dict``, ``model_state_dict``, ``model`` or
    ``module`` (or ``key``, dotted for deeper nesting: ``"ema.model"``). A file whose *other*
    entries need classes torch's safe unpickler refuses (a Lightning checkpoint whose
    ``hyper_parameters`` hold a ``pathlib.Path``) still gives its weights: they are read without
    running any code, with a warning naming what was skipped.

    Args:
        path: file path, folder, or fsspec URL of a file.
        map_location: where the tensors go (default ``"cpu"``); see `resolve_map_location`.
        key: the entry holding the weights, when the usual names do not find it.
        strip: prefix removed from every key that has it; None keeps keys as stored. The
            default ``"module."`` removes every wrapper's prefix: DDP's ``module.``,
            ``torch.compile``'s ``_orig_mod.``, and both nested (``module._orig_mod.``); and from a
            Lightning checkpoint, the LightningModule's attribute every key starts with
            (``net.`` of ``self.net``), so that the plain network loads them.
        verify: check checksums first: every zip record's CRC-32 of a ``.pt`` file, or the
            per-tensor CRC-32s ``ckpt convert`` stores in a ``.safetensors`` file (files from
            other tools carry none; then only their structure is checked); for a folder, every
            shard and the index's agreement with them (`ckptools.verify`).
        weights_only: keep torch's safe unpickler (the default); False lets torch unpickle everything in
            the file (runs code from it: for files you trust only), and a whole pickled module
            (``torch.save(model)``) gives its ``state_dict()``.
        trust_code: deprecated (goes in 0.6): ``trust_code=True`` is ``weights_only=False``.

    Returns:
        A dict of tensors.

    Raises:
        CheckpointNotFoundError: nothing at ``path``.
        CheckpointFormatError: the file is damaged or not a checkpoint.
        UnsafeCheckpointError: the weights themselves need classes torch's safe loader refuses.
        KeyMismatchError: ``key`` names no entry.

    Examples:
        >>> import torch, ckptools as ck
        >>> torch.save({"state_dict": {"module.w": torch.ones(1)}}, "/tmp/lightning.ckpt")
        >>> list(ck.load_state_dict("/tmp/lightning.ckpt"))
        ['w']
    """
    started = time.monotonic()
    location = resolve(path)
    target = resolve_map_location(map_location)
    trust = not weights_only_switch(weights_only, trust_code, "ck.load_state_dict")
    weights = dict(read_weights(location, key=key, map_location=target, verify=verify, trust_code=trust))
    log.report("loaded weights from", location, started)
    weights = dict(strip_for_reading(weights, strip))
    if strip == "module." and key in (None, "state_dict"):
        attribute = _lightning_attribute(location, weights)
        if attribute is not None:
            weights = dict(strip_prefix(weights, attribute))
    return weights


def _lightning_attribute(location: Location, weights: Mapping[str, Any]) -> str | None:
    """The LightningModule attribute (``"net."``) every key of a Lightning checkpoint's weights
    starts with, when there is one: the network a plain script builds has no such prefix."""
    head = shared_prefix(weights)
    return head if head is not None and is_lightning_checkpoint(location) else None
