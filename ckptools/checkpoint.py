"""Collective ``save``/``load`` of training checkpoints, and ``load_state_dict`` for weights."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.data.distributed import DistributedSampler

from . import _log, background, rng
from .convert import _local_zip
from .devices import MapLocation, resolve_map_location
from .dist import _all_gather_object, _broadcast_object, get_rank, get_world_size
from .errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    KeyMismatchError,
    UnsafeCheckpointError,
    UnsafeStateError,
)
from .reading import _is_layout, load_without_code, read_weights
from .sampler import ResumableDistributedSampler
from .serialization import check_loadable, load_file, save_file, verify_torch_file
from .state_dict import (
    WRAPPER_PREFIXES,
    add_prefix,
    strip_for_reading,
    strip_prefix,
    strip_wrappers,
    tensor_identity,
    unwrap_model,
)
from .storage import PathLike, _fspath
from .torchzip import META_KEY
from .torchzip import locate_weights as _locate

__all__ = ["async_save", "load", "load_state_dict", "save"]

FORMAT_VERSION = 1
# Objects that exist only to continue training: a load that restores one of them is a resume,
# so it restores the RNG too (see `load`'s restore_rng).
_TRAINING_TYPES: tuple[type, ...] = (
    torch.optim.Optimizer,
    torch.optim.lr_scheduler.LRScheduler,
    torch.optim.lr_scheduler.ReduceLROnPlateau,
    torch.amp.GradScaler,
    DistributedSampler,
)


def _entry(obj: Any) -> Any:
    """What a state entry becomes on disk."""
    if isinstance(obj, torch.nn.Module):
        # Unwrapped, so the file never carries "module." / "_orig_mod." whatever the wrapping.
        return unwrap_model(obj).state_dict()
    if isinstance(obj, DistributedSampler) and not hasattr(obj, "state_dict"):
        return {"epoch": int(obj.epoch), "seed": int(obj.seed)}
    if callable(getattr(obj, "state_dict", None)):
        return obj.state_dict()
    return obj


def _ckptools_version() -> str:
    from . import __version__

    return __version__


def save(path: PathLike, state: Mapping[str, Any], *, metadata: Mapping[str, Any] | None = None) -> str:
    """Save a training checkpoint; collective: every rank calls it, global rank 0 writes.

    With no process group (a notebook, a single process) it is a plain, atomic save: the same
    call works before and after ``init_process_group``. Missing parent folders are created
    (local paths; object stores have none).

    Each entry of ``state`` is stored under its own name: a model (wrapped in DDP, DataParallel
    or ``torch.compile`` or not) as its plain state dict without ``module.``; optimizers,
    GradScalers, LR schedulers and anything with ``state_dict()`` as that; a
    ``DistributedSampler`` as its epoch and seed (a `ResumableDistributedSampler` also
    with its progress); tensors and plain values as they are. A ``__ckptools__`` entry adds the
    format version, library versions, world size, every rank's RNG states and ``metadata``.

    The model stays where it is (on its GPU, inside DDP); buffers are stored as rank 0 holds
    them. The write is atomic (temporary name, fsync, rename; a multipart upload on S3) and every rank returns
    only after the file is complete. If rank 0 fails, every rank raises
    `CheckpointError` (rank 0 chains the original exception): no rank is left waiting in a
    barrier, and an earlier file at ``path`` is untouched. No RNG is advanced. An
    `async_save` still in flight is finished first (and its failure raised, on every rank).

    Everything is checked before anything is written: an entry (or a value inside one, or
    inside ``metadata``) that ``torch.load(weights_only=True)`` would refuse, such as an
    ``argparse.Namespace``, a ``pathlib.Path`` or a numpy scalar, raises
    `UnsafeStateError` on every rank, naming the entry and the fix (``vars(args)``,
    ``str(path)``, ``x.item()``). Otherwise the run would only find out when it restarts.

    Args:
        path: file path or fsspec URL (``s3://bucket/run/step_100.pt``, ``memory://...``).
        state: names mapped to objects to store.
        metadata: extra plain values (str, int, float, bool, None, lists/dicts of them).

    Returns:
        ``path`` as a string.

    Raises:
        UnsafeStateError: a value the checkpoint could not be loaded back with (every rank,
            nothing written; also a ``TypeError``).
        CheckpointError: writing failed on rank 0 (raised on every rank).
        TypeError: ``state`` is not a mapping of string names or names ``__ckptools__``.

    Examples:
        >>> import torch, ckptools as ck
        >>> model = torch.nn.Linear(2, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> ck.save("/tmp/ckpt.pt", {"model": model, "optimizer": opt, "step": 10})
        '/tmp/ckpt.pt'
    """
    return _save(path, state, metadata=metadata)


def save_weights(path: PathLike, model: Any, *, metadata: Mapping[str, str] | None = None) -> str:
    """Save a model's weights alone, for inference or sharing; collective like `save`.

    ``model`` is a module (wrapped in DDP, DataParallel or ``torch.compile`` or not) or a state
    dict; either way the weights are stored without ``module.`` / ``_orig_mod.``. A path ending
    in ``.safetensors`` gets a safetensors file (tied tensors stored once under their first name,
    as ``from_pretrained`` expects; ``format: pt`` and ``metadata`` as string metadata); any other
    path a ``torch.save`` file of the plain state dict. Global rank 0 writes, atomically; every
    rank returns once the file is complete, and a failure raises `CheckpointError` on
    every rank. Tensors are copied to the CPU first; the model is left where it is.

    Args:
        path: file path or fsspec URL.
        model: an ``nn.Module`` or a mapping of names to tensors.
        metadata: strings to store in a safetensors file's metadata (ignored for torch files).

    Returns:
        ``path`` as a string.

    Examples:
        >>> import torch, ckptools as ck
        >>> ddp_model = torch.nn.Linear(2, 2)  # in a DDP script: DistributedDataParallel(...)
        >>> ck.save_weights("/tmp/ckptools-doc-final.safetensors", ddp_model)
        '/tmp/ckptools-doc-final.safetensors'
    """
    from .devices import to_cpu
    from .safetensors_file import save_safetensors

    if not isinstance(model, (torch.nn.Module, Mapping)):  # on every rank, before any collective
        raise TypeError(f"save_weights needs a module or a state dict, not {type(model).__name__}")
    background.finish_pending()
    path = _fspath(path)
    error: BaseException | None = None
    if get_rank() == 0:
        try:
            weights = unwrap_model(model).state_dict() if isinstance(model, torch.nn.Module) else model
            tensors = to_cpu({k: v.detach() for k, v in strip_wrappers(dict(weights)).items()})
            if path.endswith(".safetensors"):
                save_safetensors(path, tensors, metadata={"format": "pt", **dict(metadata or {})})
            else:
                save_file(path, tensors)
        except Exception as err:  # noqa: BLE001 - shared with every rank below, then re-raised
            error = err
    _share_outcome(error, path)
    return path


def _save(
    path: PathLike,
    state: Mapping[str, Any],
    *,
    metadata: Mapping[str, Any] | None = None,
    before_write: Callable[[], None] | None = None,
) -> str:
    """`save`; ``before_write`` runs on rank 0 once the payload passed its checks (housekeeping)."""
    path, started, written = _on_rank0(path, state, metadata, lambda p, payload: _write(p, payload, before_write))
    _log.report("saved", path, started, written)
    return path


def _write(path: str, payload: Any, before_write: Callable[[], None] | None) -> int:
    """Rank 0: housekeeping, then the atomic write; the bytes written."""
    if before_write is not None:
        before_write()
    return save_file(path, payload)


def _on_rank0(
    path: PathLike,
    state: Mapping[str, Any],
    metadata: Mapping[str, Any] | None,
    then: Callable[[str, dict[str, Any]], Any],
) -> tuple[str, float, Any]:
    """The collective part every save shares: finish a save in flight, check the arguments,
    gather every rank's RNG, and on rank 0 build the checked payload and pass it to ``then``.

    Returns the path, when the save started, and what ``then`` returned (None off rank 0); an
    error on rank 0 is raised on every rank.
    """
    background.finish_pending()
    started = time.monotonic()
    path, user_meta = _checked_args(path, state, metadata)
    # Every rank's RNG is captured before rank 0 does anything that could draw from it.
    rng_states = _all_gather_object(rng.get_rng_state())
    error: BaseException | None = None
    result: Any = None
    if get_rank() == 0:
        try:
            result = then(path, _payload(state, user_meta, rng_states))
        except Exception as err:  # noqa: BLE001 - shared with every rank below, then re-raised
            error = err
    _share_outcome(error, path)
    return path, started, result


def async_save(
    path: PathLike, state: Mapping[str, Any], *, metadata: Mapping[str, Any] | None = None
) -> background.AsyncSave:
    """Save like `save`, but return once the state is copied; rank 0 writes in the background.

    Collective: every rank calls it. It returns as soon as global rank 0 has copied ``state``
    into host memory that training never touches, so the caller may step the optimizer the
    moment it returns: the file holds the values as of the call, bit for bit. The file, its
    checks (an unsafe value raises `UnsafeStateError` here, on every rank, before
    anything is copied) and its atomic write are those of `save`; tensors are stored as
    CPU tensors (``load`` puts them where ``map_location`` says, as always).

    At most one save is in flight. A later ``save``, ``async_save``, ``load`` or
    ``CheckpointManager`` call first waits for it, collectively; if rank 0's background write
    failed, *that* call raises `CheckpointError` on every rank (naming the failed file)
    before doing anything else. So a failure surfaces at ``handle.wait()`` or at the next
    checkpoint call, whichever comes first, and it is also logged by rank 0 the moment it
    happens. A process that ends with a save in flight finishes the write before it exits
    (unless it leaves through ``os._exit``: then wait first).

    The snapshot goes into buffers kept from the previous async save while sizes match (pinned
    host memory for CUDA tensors, copied non-blocking, then one synchronize), so the steady
    cost is one memory copy of the state; that memory (one state's size) stays held until
    `ckptools.release_snapshot_buffers`. Only rank 0 copies anything.

    Args:
        path: as for `save`.
        state: as for `save`.
        metadata: as for `save`.

    Returns:
        An `AsyncSave` handle: ``wait()`` (collective) returns the path on every rank or
        raises `CheckpointError` on every rank; ``done()`` is a local poll.

    Examples:
        >>> import torch, ckptools as ck
        >>> model = torch.nn.Linear(2, 2)
        >>> handle = ck.async_save("/tmp/async.pt", {"model": model, "step": 10})
        >>> with torch.no_grad():
        ...     _ = model.weight.add_(1.0)  # at once: the file keeps the weights as of the call
        >>> handle.wait()
        '/tmp/async.pt'
    """
    return _async_save(path, state, metadata=metadata)


def _async_save(
    path: PathLike,
    state: Mapping[str, Any],
    *,
    metadata: Mapping[str, Any] | None = None,
    before_write: Callable[[], None] | None = None,
    after_write: Callable[[], None] | None = None,
) -> background.AsyncSave:
    """`async_save`; ``before_write``/``after_write`` run in rank 0's writer thread (file I/O)."""
    path, started, snapshot = _on_rank0(path, state, metadata, lambda _, payload: background._BUFFERS.take(payload))
    handle = background.AsyncSave(path, started)
    if get_rank() == 0:
        handle._start(lambda: _write(path, snapshot, before_write), after_write)
    background.set_pending(handle)
    return handle


def _checked_args(
    path: PathLike, state: Mapping[str, Any], metadata: Mapping[str, Any] | None
) -> tuple[str, dict[str, Any]]:
    path = _fspath(path)
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a mapping of names to objects, got {type(state).__name__}")
    if META_KEY in state:
        raise TypeError(f"{META_KEY!r} is reserved for ckptools' own metadata; rename that entry of state")
    bad = [k for k in state if not isinstance(k, str)]
    if bad:
        raise TypeError(f"state keys must be strings, got {bad!r}")
    return path, dict(metadata or {})


def _payload(state: Mapping[str, Any], user_meta: dict[str, Any], rng_states: list[Any]) -> dict[str, Any]:
    """Rank 0: what goes into the file, every value checked to load back with weights_only."""
    payload = {}
    for name, obj in state.items():
        payload[name] = entry = _entry(obj)
        check_loadable(entry, f"state[{name!r}]" + (".state_dict()" if entry is not obj else ""))
    check_loadable(user_meta, "metadata")
    payload[META_KEY] = {
        "format_version": FORMAT_VERSION,
        "ckptools_version": _ckptools_version(),
        "torch_version": str(torch.__version__),  # TorchVersion itself is refused by weights_only
        "world_size": get_world_size(),
        "created_unix": time.time(),
        "rng": rng_states,
        "metadata": user_meta,
    }
    return payload


def _share_outcome(error: BaseException | None, path: str) -> None:
    """Raise rank 0's ``error`` on every rank (collective).

    A failure on rank 0 surfaces everywhere at once instead of leaving the other ranks in a
    barrier until the collective timeout.
    """
    outcome: tuple[bool, str] | None = None
    if error is not None:
        unsafe = isinstance(error, UnsafeStateError)
        outcome = (unsafe, str(error) if unsafe else f"{type(error).__name__}: {error}")
    outcome = _broadcast_object(outcome)
    if outcome is None:
        return
    unsafe, message = outcome
    if unsafe:  # the same refusal on every rank: rank 0's own error, the others its text
        if error is not None:
            raise error
        raise UnsafeStateError(message)
    text = f"saving checkpoint {path} failed on rank 0: {message}; earlier checkpoints are untouched"
    if error is not None:
        raise CheckpointError(text) from error
    raise CheckpointError(text)


def _model_keys(model: torch.nn.Module) -> list[str]:
    return list(model.state_dict().keys())


def _prefix_candidates(weights: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """``weights`` with wrapper prefixes stripped or added, and with a leading component every
    key shares (a LightningModule holding ``self.model`` saves ``model.0.weight``) stripped."""

    def renamed(rename: Any, *args: Any) -> list[Mapping[str, Any]]:
        try:
            return [rename(*args)]
        except ValueError:  # two keys would become one: not a candidate
            return []

    bases = [weights, *(w for p in WRAPPER_PREFIXES for w in renamed(strip_prefix, weights, p))]
    found = [*bases, *renamed(add_prefix, weights, "module.")]
    for base in bases:
        heads = {key.split(".", 1)[0] for key in base}
        if len(heads) == 1 and all("." in key for key in base):
            inner = strip_prefix(base, f"{heads.pop()}.")  # every key has it: no two collide
            found += [inner, *renamed(strip_wrappers, inner)]  # "model._orig_mod.": a compiled inner network
    return found


def _fit_prefix(weights: Mapping[str, Any], target_keys: list[str]) -> Mapping[str, Any]:
    """Strip or add prefixes so ``weights`` match ``target_keys``, judged by the keys themselves.

    Candidates: ``module.``, ``_orig_mod.`` (``torch.compile``) and their nestings stripped,
    ``module.`` added, and a leading component every key shares stripped. A candidate is taken
    only when it makes more keys match, so a model whose own submodule is really named
    ``module`` (or ``_orig_mod``, or ``model``) keeps its keys.
    """
    target = set(target_keys)
    best = weights
    best_hits = len(target.intersection(weights))
    for candidate in _prefix_candidates(weights):
        hits = len(target.intersection(candidate))
        if hits > best_hits:
            best, best_hits = candidate, hits
    return best


def _load_model(model: torch.nn.Module, weights: Mapping[str, Any], *, strict: bool, path: str, name: str) -> None:
    inner = unwrap_model(model)
    target_keys = _model_keys(inner)
    weights = _fit_prefix(weights, target_keys)
    weights = _fill_ties(inner, weights)
    missing = sorted(set(target_keys) - set(weights))
    unexpected = sorted(set(weights) - set(target_keys))
    if strict and (missing or unexpected):
        raise KeyMismatchError(
            f"{path}: entry {name!r} does not match the model: missing keys {_short(missing)}, unexpected keys "
            f"{_short(unexpected)}; check the architecture, or pass strict=False to load the matching keys",
            missing=missing,
            unexpected=unexpected,
        )
    try:
        inner.load_state_dict(weights, strict=strict)
    except RuntimeError as err:  # shape mismatches
        raise KeyMismatchError(f"{path}: entry {name!r} cannot be loaded into the model: {err}") from err


def _fill_ties(model: torch.nn.Module, weights: Mapping[str, Any]) -> Mapping[str, Any]:
    """``weights`` with each key the model ties to a loaded key (the same tensor: transformers'
    ``lm_head.weight`` and ``transformer.wte.weight``) filled from it: files store a tie once."""
    own = model.state_dict(keep_vars=True)
    absent = [k for k in own if k not in weights]
    if not absent:
        return weights
    loaded: dict[tuple[Any, ...], str] = {}
    for k, v in own.items():
        ident = tensor_identity(v) if k in weights else None
        if ident is not None:
            loaded.setdefault(ident, k)
    filled = dict(weights)
    for k in absent:
        ident = tensor_identity(own[k])
        if ident is not None and ident in loaded:
            filled[k] = weights[loaded[ident]]
    return filled


def _short(keys: list[str], limit: int = 10) -> str:
    if not keys:
        return "[]"
    shown = ", ".join(keys[:limit])
    return f"[{shown}{', ...' if len(keys) > limit else ''}] ({len(keys)})"


def _restore(obj: Any, entry: Any, *, strict: bool, path: str, name: str) -> None:
    if isinstance(obj, torch.nn.Module):
        if not isinstance(entry, Mapping):
            raise CheckpointFormatError(f"{path}: entry {name!r} is a {type(entry).__name__}, not a model state dict")
        _load_model(obj, entry, strict=strict, path=path, name=name)
    elif isinstance(obj, torch.Tensor):
        with torch.no_grad():
            obj.copy_(entry)
    elif callable(getattr(obj, "load_state_dict", None)):
        obj.load_state_dict(entry)
    elif isinstance(obj, DistributedSampler):
        obj.set_epoch(int(entry["epoch"]))
    # Plain values cannot be restored in place; they are in the returned dict.


def locate_weights(
    ckpt: Any, *, key: str | None = None, path: str = "checkpoint"
) -> tuple[dict[str, Any] | None, str | None, Mapping[str, Any]]:
    """Find the model weights inside a loaded checkpoint; see `ckptools.torchzip.locate_weights`."""
    return _locate(ckpt, key=key, path=path, is_leaf=lambda v: isinstance(v, torch.Tensor))


def _find_weights(ckpt: Any, *, key: str | None, path: str) -> Mapping[str, Any]:
    return locate_weights(ckpt, key=key, path=path)[2]


def _all_ok(error: BaseException | None, what: str, *, missing_hint: str | None = None) -> None:
    """Raise on every rank if any rank failed (a collective; no-op without a process group).

    ``missing_hint`` is added to a `CheckpointNotFoundError` of a rank that could not
    find a file rank 0 read (a node-local disk).
    """
    messages = _all_gather_object(None if error is None else f"{type(error).__name__}: {error}")
    if isinstance(error, CheckpointNotFoundError) and missing_hint and messages[0] is None:
        raise CheckpointNotFoundError(f"{error}, but rank 0 read it: {missing_hint}") from error
    if error is not None:
        raise error
    failed = [(rank, msg) for rank, msg in enumerate(messages) if msg is not None]
    if failed:
        rank, msg = failed[0]
        raise CheckpointError(f"{what} failed on rank {rank}: {msg}")


def load(
    path: PathLike,
    state: Mapping[str, Any] | None = None,
    *,
    map_location: MapLocation = "auto",
    strict: bool = True,
    weights_only: bool = True,
    restore_rng: bool | None = None,
    verify: bool = False,
    broadcast: bool = False,
) -> dict[str, Any]:
    """Load a checkpoint and restore, in place, every object named in ``state``.

    Collective when a process group exists: every rank reads the file, and if any rank fails
    every rank raises (so no rank runs ahead into a collective the others never reach).
    A model loads whether it or the file carries ``module.``; whether to strip or add it is
    decided against the model's own keys. Optimizer state lands on its parameters' device.
    Plain ``torch.save`` dicts load too: entries are matched by name, and a lone model in
    ``state`` also finds its weights in a bare state dict or under
    ``state_dict``/``model``/``model_state_dict``/``module``, or in a ``.safetensors`` file.
    Its keys may carry ``module.``, ``_orig_mod.`` (``torch.compile``) or a leading component
    every key shares (a LightningModule's ``model.``): what to strip or add is decided
    against the model's own keys.

    Restoring RNG is part of resuming training, not of looking at a file. By default
    (``restore_rng=None``) this rank's RNG states (python, numpy, torch, CUDA) are restored only
    when ``state`` holds something that exists to continue training: an optimizer, an LR
    scheduler, a GradScaler or a sampler. ``ck.load(path)`` or ``ck.load(path, {"model": m})``
    in a notebook leaves the notebook's random streams alone (and says nothing about the world
    size). `CheckpointManager.restore` always restores them. They are restored only when
    the file was saved by ckptools with the same world size; otherwise the per-rank streams have
    no meaningful mapping, so they are left alone and rank 0 warns.

    Args:
        path: file path or fsspec URL.
        state: names mapped to objects to restore (model, optimizer, scaler, scheduler, sampler,
            tensors, anything with ``load_state_dict``).
        map_location: see `resolve_map_location`; ``"auto"`` is this rank's device.
        strict: raise `KeyMismatchError` when a named entry is missing or a model's keys
            differ; with False, load what matches.
        weights_only: keep torch's safe unpickler; False runs arbitrary code from the file and
            is for trusted files only.
        restore_rng: restore this rank's RNG states from the file: True, False, or None to
            decide by ``state`` as above.
        verify: check every record's CRC-32 before loading (reads the file twice).
        broadcast: only rank 0 reads the file; every other rank receives what it read over the
            process group (GPU to GPU with nccl) in buckets of 64 MiB, and ends holding exactly
            what it would have read itself, its own RNG state included. For node-local disks
            where only rank 0's node has the file, and to read a file once instead of once per
            rank on a shared filesystem.

    Returns:
        The whole checkpoint dict (entries on ``map_location``), including ``__ckptools__``.

    Raises:
        CheckpointNotFoundError, CheckpointFormatError, UnsafeCheckpointError, KeyMismatchError:
            on the rank where it happened; other ranks raise `CheckpointError`.

    Examples:
        >>> import torch, ckptools as ck
        >>> model = torch.nn.Linear(2, 2)
        >>> _ = ck.save("/tmp/ckpt.pt", {"model": model, "step": 10})
        >>> ck.load("/tmp/ckpt.pt", {"model": model})["step"]
        10
    """
    background.finish_pending()  # the file may be the one still being written
    started = time.monotonic()
    path = _fspath(path)
    state = state or {}
    error: BaseException | None = None
    ckpt: dict[str, Any] = {}
    try:
        location = resolve_map_location(map_location)
        if broadcast and get_world_size() > 1:
            loaded: Any = _read_on_rank0(path, location, weights_only=weights_only, verify=verify, state=state)
        else:
            loaded = _read(path, location, weights_only=weights_only, verify=verify, state=state)
        if isinstance(loaded, torch.nn.Module):  # a trusted torch.save(model): its weights, as a checkpoint holds them
            loaded = dict(loaded.state_dict())
        if not isinstance(loaded, dict):
            raise CheckpointFormatError(
                f"{path} holds a {type(loaded).__name__}, not a checkpoint dict; "
                "use ck.load_state_dict for bare weights"
            )
        ckpt = loaded
        _restore_all(ckpt, state, strict=strict, path=path)
        if restore_rng is None:
            restore_rng = any(isinstance(obj, _TRAINING_TYPES) for obj in state.values())
        if restore_rng and _restore_rng(ckpt, path):
            for obj in state.values():
                if isinstance(obj, ResumableDistributedSampler):
                    obj._rng_restored()  # lets it notice the stream moving before the first batch
    except Exception as err:  # noqa: BLE001 - shared with every rank, then re-raised
        error = err
    hint = None if broadcast else "pass broadcast=True to ck.load / manager.restore to send it from rank 0"
    _all_ok(error, f"loading checkpoint {path}", missing_hint=hint)
    _log.report("loaded", path, started)
    return ckpt


def _read(path: str, location: Any, *, weights_only: bool, verify: bool, state: Mapping[str, Any]) -> Any:
    """What this rank reads from ``path`` for `load`."""
    if path.endswith(".safetensors") or _is_layout(path):
        # Bare weights (a model entry finds them): a .safetensors file, a Hugging Face or
        # Accelerate folder, a sharded index, a DCP folder. No code can run from these.
        return dict(read_weights(path, key=None, map_location=location, verify=verify))
    if verify:
        verify_torch_file(path)
    try:
        if _local_zip(path):
            # Memory-mapped: tensors are read from the page cache when restore_all copies them
            # into the model and optimizer, so resuming needs no second copy of the checkpoint in
            # anonymous memory. The mapping is private (copy-on-write): writing to a returned
            # tensor never touches the file, and replacing or deleting the file later is safe.
            try:
                return load_file(path, map_location=location, weights_only=weights_only, mmap=True)
            except CheckpointFormatError:
                pass  # a filesystem that cannot map files (some FUSE mounts): read it as usual
        return load_file(path, map_location=location, weights_only=weights_only)
    except UnsafeCheckpointError as err:
        if not weights_only:
            raise
        if not state:  # ck.load(path) alone asks for the whole checkpoint: placeholders would surprise
            raise UnsafeCheckpointError(
                f"{err}. To read it without running anything, name what to restore: ck.load(path, "
                "{'model': model}) restores it and gives the other entries as inert placeholders; "
                "ck.load_state_dict(path) gives the weights"
            ) from None
        # Entries torch's safe loader refuses (a Lightning checkpoint's pathlib.Path or OmegaConf
        # hyper-parameters) come back as inert placeholders, with a warning; what ``state`` names
        # is restored, and refused below only if it needs one of them.
        return load_without_code(path, location, err, mmap=_local_zip(path))[0]


def _read_on_rank0(path: str, location: Any, *, weights_only: bool, verify: bool, state: Mapping[str, Any]) -> Any:
    """Collective: rank 0 reads ``path``, every rank gets what it read (tensors on ``location``)."""
    from .broadcast import broadcast_tree

    tree, error = None, None
    if get_rank() == 0:
        try:
            tree = _read(path, location, weights_only=weights_only, verify=verify, state=state)
        except Exception as err:  # noqa: BLE001 - told to every rank before the transfer starts
            error = err
    failed = _broadcast_object(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if failed is not None:
        raise CheckpointError(f"loading checkpoint {path} failed on rank 0: {failed}")
    nccl = torch.distributed.get_backend() == "nccl"
    comm = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    device = location if isinstance(location, torch.device) else torch.device("cpu")
    return broadcast_tree(tree, device=device, comm_device=comm)


def _restore_all(ckpt: dict[str, Any], state: Mapping[str, Any], *, strict: bool, path: str) -> None:
    models = [name for name, obj in state.items() if isinstance(obj, torch.nn.Module)]
    for name, obj in state.items():
        if name in ckpt:
            entry = ckpt[name]
        elif META_KEY not in ckpt and len(models) == 1 and name == models[0]:
            # A file written without ckptools: the weights may be bare or nested.
            try:
                entry = _find_weights(ckpt, key=None, path=path)
            except CheckpointFormatError:
                raise CheckpointFormatError(
                    f"cannot find model weights in {path}: entries are {sorted(map(str, ckpt))[:20]}; name the entry "
                    f"that holds them in state (ck.load(path, {{'ENTRY': model}})), or for a nested one "
                    f"model.load_state_dict(ck.load_state_dict(path, key='a.b'))"
                ) from None
        elif strict:
            raise KeyMismatchError(
                f"{path} has no entry {name!r} (it has {sorted(map(str, ckpt))}); rename the entry in state, "
                "or pass strict=False to skip it",
                missing=[name],
            )
        else:
            continue
        placeholder = _placeholder_in(entry)
        if placeholder is not None:
            raise UnsafeCheckpointError(
                f"{path}: entry {name!r} needs {placeholder}, which could run arbitrary code, so it was read as an "
                "inert placeholder and cannot be restored. Only for a file you trust: pass weights_only=False"
            )
        try:
            _restore(obj, entry, strict=strict, path=path, name=name)
        except CheckpointError:
            raise
        except (ValueError, KeyError, RuntimeError, TypeError, IndexError) as err:
            raise CheckpointFormatError(
                f"{path}: cannot restore entry {name!r} into {type(obj).__name__}: {err}"
            ) from err


def _placeholder_in(entry: Any) -> str | None:
    """The class of the first inert placeholder inside ``entry`` (see `load_without_code`), if any."""
    from .torchzip import Opaque

    stack = [entry]
    while stack:
        node = stack.pop()
        if isinstance(node, Opaque):
            return node.name
        if isinstance(node, Mapping):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, (list, tuple, set, frozenset)):
            stack.extend(node)
    return None


def _restore_rng(ckpt: dict[str, Any], path: str) -> bool:
    """Restore this rank's RNG states from ``ckpt``; whether they were restored."""
    meta = ckpt.get(META_KEY)
    if not isinstance(meta, Mapping) or "rng" not in meta:
        return False
    states = meta["rng"]
    world = get_world_size()
    if len(states) != world:
        _log.warn(
            f"{path} was saved by {len(states)} ranks and is loaded by {world}: RNG states are per rank, "
            "so they are not restored (the run continues, but not bit-exactly)",
        )
        return False
    before = rng.get_rng_state()
    try:
        rng.set_rng_state(states[get_rank()])
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, AttributeError, RuntimeError) as err:
        rng.set_rng_state(before)  # all or nothing: no generator is left half-restored
        raise CheckpointFormatError(
            f"{path}: the RNG state stored for rank {get_rank()} is corrupt ({type(err).__name__}: {err}); "
            "load with restore_rng=False to skip it"
        ) from err
    return True


def load_state_dict(
    path: PathLike,
    *,
    map_location: MapLocation = "cpu",
    key: str | None = None,
    strip: str | None = "module.",
    verify: bool = False,
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
            ``torch.compile``'s ``_orig_mod.``, and both nested (``module._orig_mod.``).
        verify: check checksums first: every zip record's CRC-32 of a ``.pt`` file, or the
            per-tensor CRC-32s ``ckpt convert`` stores in a ``.safetensors`` file (files from
            other tools carry none; then only their structure is checked); for a folder, every
            shard and the index's agreement with them (`ckptools.verify`).

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
    path = _fspath(path)
    location = resolve_map_location(map_location)
    weights = dict(read_weights(path, key=key, map_location=location, verify=verify))
    _log.report("loaded weights from", path, started)
    return dict(strip_for_reading(weights, strip))
