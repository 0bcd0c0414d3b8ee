"""Collective ``save`` and ``async_save`` of training checkpoints, and ``save_weights`` for weights.

Global rank 0 alone writes; every rank's RNG is gathered into the file; an error on rank 0 is
raised on every rank. What is read back is `ckptools.loading`'s part.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.data.distributed import DistributedSampler

from . import background, log, rng
from ._version import __version__
from .codecs.trees import META_KEY
from .devices import to_cpu
from .dist import all_gather_object, broadcast_object, get_rank, get_world_size
from .errors import CheckpointError, UnsafeStateError
from .layouts.safetensors_file import save_safetensors
from .serialization import check_loadable, save_file
from .state_dict import strip_wrappers, unwrap_model
from .storage import PathLike, fspath

__all__ = ["async_save", "save", "save_weights"]

FORMAT_VERSION = 1


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
    return save_with_hooks(path, state, metadata=metadata)


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
    if not isinstance(model, (torch.nn.Module, Mapping)):  # on every rank, before any collective
        raise TypeError(f"save_weights needs a module or a state dict, not {type(model).__name__}")
    background.finish_pending()
    path = fspath(path)
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


def save_with_hooks(
    path: PathLike,
    state: Mapping[str, Any],
    *,
    metadata: Mapping[str, Any] | None = None,
    before_write: Callable[[], None] | None = None,
) -> str:
    """`save`; ``before_write`` runs on rank 0 once the payload passed its checks (housekeeping)."""
    path, started, written = _on_rank0(path, state, metadata, lambda p, payload: _write(p, payload, before_write))
    log.report("saved", path, started, written)
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
    rng_states = all_gather_object(rng.get_rng_state())
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
    return async_save_with_hooks(path, state, metadata=metadata)


def async_save_with_hooks(
    path: PathLike,
    state: Mapping[str, Any],
    *,
    metadata: Mapping[str, Any] | None = None,
    before_write: Callable[[], None] | None = None,
    after_write: Callable[[], None] | None = None,
) -> background.AsyncSave:
    """`async_save`; ``before_write``/``after_write`` run in rank 0's writer thread (file I/O)."""
    path, started, snapshot = _on_rank0(path, state, metadata, lambda _, payload: background.take_snapshot(payload))
    handle = background.AsyncSave(path, started)
    if get_rank() == 0:
        background.start_writing(handle, lambda: _write(path, snapshot, before_write), after_write)
    background.set_pending(handle)
    return handle


def _checked_args(
    path: PathLike, state: Mapping[str, Any], metadata: Mapping[str, Any] | None
) -> tuple[str, dict[str, Any]]:
    path = fspath(path)
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
        "ckptools_version": __version__,
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
    outcome = broadcast_object(outcome)
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
