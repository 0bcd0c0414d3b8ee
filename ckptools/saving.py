"""Collective ``save`` and ``async_save`` of training checkpoints, and ``save_weights`` for weights.

Who writes is ``writers``' choice (global rank 0 alone, or every rank its share of one file);
every rank's RNG is gathered into the file; an error on any rank is raised on every rank. What is
read back is `ckptools.loading`'s part.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from . import log
from .collective import agree
from .collective.arrival import checked_in
from .collective.group import all_gather_object, get_rank
from .devices import to_cpu
from .layouts import TORCH_FILE, writer_for
from .lifecycle import finish_pending
from .state_dict import strip_wrappers, unwrap_model
from .storage import Location, PathLike, fspath, resolve
from .write import (
    AsyncSave,
    build_payload,
    check_writers,
    checked_args,
    choose,
    compare_replicas,
    opening,
    plan_shares,
    replica_digests,
    set_pending,
    stage,
    whole_storage,
    write_alone,
    write_and_commit,
    write_share_in_background,
)
from .zero import with_partitions

# Who writes when the caller does not say; see `save`.
DEFAULT_WRITERS = "auto"

__all__ = ["async_save", "save", "save_weights"]


@checked_in("ck.save")
def save(
    path: PathLike,
    state: Mapping[str, Any],
    *,
    metadata: Mapping[str, Any] | None = None,
    writers: str = DEFAULT_WRITERS,
    verify_replicas: bool = False,
) -> str:
    """Save a training checkpoint; collective: every rank calls it, and rank 0 or every rank writes.

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
    only after the file is complete. If a writer fails, every rank raises
    `CheckpointError` (rank 0 chains the original exception): no rank is left waiting in a
    barrier, and an earlier file at ``path`` is untouched. No RNG is advanced. An
    `async_save` still in flight is finished first (and its failure raised, on every rank).

    Everything is checked before anything is written: an entry (or a value inside one, or
    inside ``metadata``) that ``torch.load(weights_only=True)`` would refuse, such as an
    ``argparse.Namespace``, a ``pathlib.Path`` or a numpy scalar, raises
    `UnsafeStateError` on every rank, naming the entry and the fix (``vars(args)``,
    ``str(path)``, ``x.item()``). Otherwise the run would only find out when it restarts.

    Who writes (``writers``): with ``"rank0"`` global rank 0 writes the whole file. With
    ``"all"`` every rank writes a balanced share of what DDP keeps equal on every rank (the
    parameters of a ``DistributedDataParallel`` entry and an optimizer's state for them) into
    the same one file, at offsets rank 0 planned; everything else (buffers, scaler, sampler,
    RNG, plain values) comes from rank 0 as always, and the file loads bit-identical to the
    ``"rank0"`` one (see `ckptools.write.plan`). It needs every rank to see the directory: if one
    does not, ``"all"`` raises on every rank before writing, while ``"auto"`` (the default)
    lets rank 0 write alone. Object stores, single processes and a ``state`` without a
    ``DistributedDataParallel`` entry (nothing known to be replicated) get rank 0's writer.
    ``verify_replicas=True`` first checks, whoever writes, that the replicated tensors really
    agree (a CRC-32 of each, on every rank, compared in the exchange every save makes anyway;
    a full read of them, copied to the CPU first on a GPU) and refuses to save on every rank,
    naming the tensor, if they do not: a rank whose copy was changed outside the training step
    would otherwise have its share stored as if it were everyone's.

    Args:
        path: file path or fsspec URL (``s3://bucket/run/step_100.pt``, ``memory://...``).
        state: names mapped to objects to store.
        metadata: extra plain values (str, int, float, bool, None, lists/dicts of them).
        writers: ``"auto"``, ``"all"`` or ``"rank0"``, the same on every rank.
        verify_replicas: check that the shared tensors are equal on every rank first.

    Returns:
        ``path`` as a string.

    Raises:
        UnsafeStateError: a value the checkpoint could not be loaded back with (every rank,
            nothing written; also a ``TypeError``).
        CheckpointError: writing failed on some rank, the replicas differ, or ``"all"`` was
            asked for a directory not every rank sees (raised on every rank).
        TypeError: ``state`` is not a mapping of string names or names ``__ckptools__``.
        ValueError: ``writers`` is none of the three.

    Examples:
        >>> import torch, ckptools as ck
        >>> model = torch.nn.Linear(2, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> ck.save("/tmp/ckpt.pt", {"model": model, "optimizer": opt, "step": 10})
        '/tmp/ckpt.pt'
    """
    return save_with_hooks(path, state, metadata=metadata, writers=writers, verify_replicas=verify_replicas)


@checked_in("ck.save_weights")
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
    finish_pending()
    path = fspath(path)

    def write() -> None:
        weights = unwrap_model(model).state_dict() if isinstance(model, torch.nn.Module) else model
        tensors = to_cpu({k: v.detach() for k, v in strip_wrappers(dict(weights)).items()})
        # A .safetensors file, or else a torch file (whatever the name: torch.save takes any).
        writer = writer_for(path) or TORCH_FILE
        writer.write_weights(resolve(path), tensors, {"format": "pt", **dict(metadata or {})})

    agree.saving(path).on_rank0(write)
    return path


def save_with_hooks(
    path: PathLike,
    state: Mapping[str, Any],
    *,
    metadata: Mapping[str, Any] | None = None,
    before_write: Callable[[], None] | None = None,
    writers: str = DEFAULT_WRITERS,
    verify_replicas: bool = False,
) -> str:
    """`save`; ``before_write`` runs on rank 0 once the payload passed its checks (housekeeping)."""
    check_writers(writers)
    start = _begin(path, state, metadata, verify_replicas)
    state = start.state  # a ZeRO optimizer as its ZeroEntry
    planned = _shares(start, state, before_write, writers)
    if planned is None:
        written = _on_rank0(start, state, lambda payload: _write(start.location, payload, before_write, start.written))
    else:
        written = write_and_commit(start.location, *planned)
    log.report("saved", start.path, start.started, written)
    return start.path


class _Start:
    """What every save has once it began: the checked arguments and every rank's part (`rank_part`)."""

    def __init__(
        self,
        path: str,
        user_meta: dict[str, Any],
        parts: list[dict[str, Any]],
        started: float,
        state: Mapping[str, Any],
    ) -> None:
        self.path, self.user_meta, self.parts, self.started = path, user_meta, parts, started
        self.state = state  # what is saved: the state, a ZeRO optimizer as its ZeroEntry
        self.location: Location = resolve(path)
        self.written = False  # rank 0: whether before_write ran already (a fallback must not rerun it)

    def payload(self, state: Mapping[str, Any]) -> Callable[[], dict[str, Any]]:
        """Rank 0's way to build the checked payload of ``state`` (when it is needed)."""
        return lambda: build_payload(state, self.user_meta, self.parts)


def _shares(
    start: _Start,
    state: Mapping[str, Any],
    before_write: Callable[[], None] | None,
    writers: str,
    *,
    on_cpu: bool = False,
) -> tuple[Any, list[Any]] | None:
    """The plan and this rank's storages when every rank writes its share, else None (rank 0 writes)."""
    if choose(writers, start.location, state) != "all":
        return None
    start.written = True  # rank 0 runs before_write while planning, whatever comes of it
    return plan_shares(start.location, state, start.payload(state), before_write, writers, on_cpu=on_cpu)


def _begin(path: PathLike, state: Mapping[str, Any], metadata: Mapping[str, Any] | None, verify: bool) -> _Start:
    """The collective part every save opens with: finish a save in flight, check the
    arguments, gather every rank's part (its RNG, before rank 0 does anything that could draw from
    it; its `PerRank` values) and, with ``verify``, every rank's CRC-32s of the replicated tensors
    (the same exchange)."""
    finish_pending()
    started = time.monotonic()
    path, user_meta = checked_args(path, state, metadata)
    # Each rank's ZeRO partition, described (metadata, never a tensor), rides the same exchange.
    gathered = all_gather_object(opening(state, digests=replica_digests(state) if verify else None))
    agreement = agree.saving(path)
    agreement.raise_first(gathered, lambda reply: reply.problem)
    if verify:  # every rank has every rank's digests: the same verdict everywhere, no exchange
        failure = compare_replicas([reply.digests for reply in gathered])
        if failure is not None:
            raise agreement.failure(failure)
    saved = with_partitions(state, [reply.partitions for reply in gathered])
    return _Start(path, user_meta, [reply.part for reply in gathered], started, saved)


def _write(location: Location, payload: Any, before_write: Callable[[], None] | None, ran: bool = False) -> int:
    """Rank 0: housekeeping (unless it ran already), then the atomic write; the bytes written.

    `ckptools.write.zip_writer.write_alone`: a local file through the planned writer (one pwrite
    per storage from the tensors' memory, the file ``writers="all"`` writes; see
    docs/guides/writers.md for the figures), anything else through ``torch.save`` (a
    multipart upload on S3)."""
    if before_write is not None and not ran:
        before_write()
    return write_alone(location, payload)  # the save's path, resolved once by _begin


def _on_rank0(start: _Start, state: Mapping[str, Any], then: Callable[[dict[str, Any]], Any]) -> Any:
    """Rank 0 builds the checked payload and passes it to ``then``; its result (None off rank
    0). An error on rank 0 is raised on every rank."""
    return agree.saving(start.path).on_rank0(lambda: then(build_payload(state, start.user_meta, start.parts)))


@checked_in("ck.async_save")
def async_save(
    path: PathLike,
    state: Mapping[str, Any],
    *,
    metadata: Mapping[str, Any] | None = None,
    writers: str = DEFAULT_WRITERS,
    verify_replicas: bool = False,
) -> AsyncSave:
    """Save like `save`, but return once the state is copied; the writers write in the background.

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

    The staged copy goes into buffers kept from the previous async save while sizes match (pinned
    host memory for CUDA tensors, copied non-blocking, then one synchronize), so the steady
    cost is one memory copy of the state; that memory (one state's size) stays held until
    `ckptools.release_staging_buffers`. Only rank 0 copies anything.

    With ``writers="all"`` (what ``"auto"`` becomes when every rank sees the directory; see
    `save`) each rank copies only its own share, about 1/N of the state (rank 0 also what
    only it writes), and writes it from its own background thread; the stall and the host
    memory per rank drop to about 1/N. Each rank's writer thread reports its CRC-32s to rank
    0's through the process group's store (no collective runs off the main thread), and rank
    0's writer commits the file the moment the last share is on disk, as one writer would. A
    writer's failure is raised on every rank by ``wait()`` or the next checkpoint call, naming
    the rank.

    Args:
        path: as for `save`.
        state: as for `save`.
        metadata: as for `save`.
        writers: as for `save`.
        verify_replicas: as for `save`.

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
    return async_save_with_hooks(path, state, metadata=metadata, writers=writers, verify_replicas=verify_replicas)


def async_save_with_hooks(
    path: PathLike,
    state: Mapping[str, Any],
    *,
    metadata: Mapping[str, Any] | None = None,
    before_write: Callable[[], None] | None = None,
    after_write: Callable[[], None] | None = None,
    writers: str = DEFAULT_WRITERS,
    verify_replicas: bool = False,
) -> AsyncSave:
    """`async_save`; ``before_write``/``after_write`` run on rank 0 around the write (file I/O),
    in its writer thread (``before_write`` on the main thread with ``writers="all"``)."""
    check_writers(writers)
    start = _begin(path, state, metadata, verify_replicas)
    state = start.state  # a ZeRO optimizer as its ZeroEntry
    planned = _shares(start, state, before_write, writers, on_cpu=True)
    handle = AsyncSave(start.path, start.started, shared=planned is not None)
    if planned is None:
        staged = _on_rank0(start, state, stage)
        if get_rank() == 0:
            ran = start.written
            handle.start(lambda: _write(start.location, staged, before_write, ran), after_write)
    else:
        plan, storages = planned
        # This rank's share only, into the reused host buffers: 1/N of the state per rank.
        copies = stage([whole_storage(storage) for storage in storages])
        pairs = [(share, copy.untyped_storage()) for share, copy in zip(plan.mine(), copies)]
        handle.start(lambda: write_share_in_background(start.location, plan, pairs, handle), after_write)
    set_pending(handle)
    return handle
