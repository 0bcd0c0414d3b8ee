"""Collective ``save`` and ``async_save`` of training checkpoints, and ``save_weights`` for weights.

Who writes is ``writers``' choice (global rank 0 alone, or every rank its share of one file);
every rank's RNG is gathered into the file; an error on any rank is raised on every rank. What is
read back is the read wing's part (`ckptools.read`).
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
from .storage import Location, PathLike, fspath, resolve, run_watched
from .write import (
    AsyncSave,
    as_saved,
    build_payload,
    check_writers,
    checked_args,
    choose,
    compare_now,
    compare_replicas,
    opening,
    plan_shares,
    replicas_switch,
    set_pending,
    settle_cuda,
    stage,
    what_to_compare,
    whole_storage,
    write_alone,
    write_and_commit,
    write_share_in_background,
)

# Who writes when the caller does not say; see `save`.
DEFAULT_WRITERS = "auto"

__all__ = ["async_save", "check_replicas", "save", "save_weights"]


@checked_in("ck.save")
def save(
    path: PathLike,
    state: Mapping[str, Any],
    *,
    metadata: Mapping[str, Any] | None = None,
    writers: str = DEFAULT_WRITERS,
    replicas: str = "auto",
    verify_replicas: bool | None = None,
    check_replicas: bool | None = None,
) -> str:
    """Save a training checkpoint; collective: every rank calls it, and rank 0 or every rank writes.

    Each entry of ``state`` is stored under its own name: a model (in DDP, DataParallel or
    ``torch.compile`` or not) as its plain state dict, anything with ``state_dict()`` as that, a
    sampler as its position, plain values as they are; ``__ckptools__`` adds the versions, the
    world size, every rank's RNG states and ``metadata``. Everything is checked before anything
    is written (a value ``torch.load(weights_only=True)`` would refuse raises `UnsafeStateError`,
    naming the fix); the write is atomic, and every rank returns once the file is complete or
    raises the same error. With no process group it is a plain atomic save; missing parent
    folders are created (local paths).
    ``writers="all"`` has every rank write its share of what DDP keeps equal into the one file
    (``"auto"``: where every rank sees the folder). Under DDP the replicas are compared first
    (`ckptools.check_replicas`'s judgement on every replicated byte: a durable save is rare and disk-bound;
    snapshots compare a rotating sample): a difference raises `ReplicaMismatchError` on every rank and
    nothing is written. What is stored, and why: docs/guarantees.md; who writes: docs/guides/writers.md.

    Args:
        path: file path or fsspec URL (``s3://bucket/run/step_100.pt``, ``memory://...``).
        state: names mapped to objects to store.
        metadata: extra plain values (str, int, float, bool, None, lists/dicts of them).
        writers: ``"auto"``, ``"all"`` or ``"rank0"``, the same on every rank.
        replicas: how much of DDP's replicas to compare first: ``"auto"`` (the default) and ``"all"``
            every byte, ``"sample"`` a rotating 1/50 (as a snapshot does), ``"off"`` none.
        verify_replicas: deprecated (goes in 0.6): ``True`` is ``replicas="all"``.
        check_replicas: deprecated (goes in 0.6): ``False`` is ``replicas="off"``.

    Returns:
        ``path`` as a string.

    Raises:
        UnsafeStateError: a value the checkpoint could not be loaded back with (every rank,
            nothing written; also a ``TypeError``).
        ReplicaMismatchError: the replicas differ (every rank, nothing written).
        CheckpointError: writing failed on some rank, or ``"all"`` was
            asked for a directory not every rank sees (raised on every rank).
        TypeError: ``state`` is not a mapping of string names or names ``__ckptools__``.
        ValueError: ``writers`` or ``replicas`` is none of its words.

    Examples:
        >>> import torch, ckptools as ck
        >>> model = torch.nn.Linear(2, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> ck.save("/tmp/ckpt.pt", {"model": model, "optimizer": opt, "step": 10})
        '/tmp/ckpt.pt'
    """
    return save_with_hooks(path, state, metadata=metadata, writers=writers, replicas=replicas,
                           verify_replicas=verify_replicas, check_replicas=check_replicas)  # fmt: skip


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
    replicas: str = "auto",
    verify_replicas: bool | None = None,
    check_replicas: bool | None = None,
    where: str = "ck.save",
) -> str:
    """`save`; ``before_write`` runs on rank 0 once the payload passed its checks (housekeeping)."""
    check_writers(writers)
    replicas = replicas_switch(replicas, where, verify_replicas=verify_replicas, check_replicas=check_replicas)
    start = _begin(path, state, metadata, replicas)
    state = start.state  # as saved (`as_saved`): a ZeRO optimizer as its ZeroEntry, open gradients
    planned = _shares(start, state, before_write, writers)
    if planned is None:
        # Rank 0's write in a thread its main thread watches: a storage that makes no progress for the stall
        # bound is a StorageStalledError on every rank, long before the others' wait times out.
        written = _on_rank0(start, state, lambda payload: _watched_write(start, payload, before_write))
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


def _begin(path: PathLike, state: Mapping[str, Any], metadata: Mapping[str, Any] | None, replicas: str) -> _Start:
    """The collective part every save opens with: finish a save in flight, check the
    arguments, gather every rank's part (its RNG, before rank 0 does anything that could draw from
    it; its `PerRank` values) and every rank's digests of the replicated tensors (by ``replicas``:
    every byte unless told otherwise, `ckptools.write.replicas`), in the same exchange."""
    finish_pending()
    started = time.monotonic()
    path, user_meta = checked_args(path, state, metadata)
    # Each rank's ZeRO partition, described (metadata, never a tensor), rides the same exchange.
    # A durable save is rare and disk-bound: every replicated byte is compared (a snapshot, every step
    # and memory-bound, compares a rotating sample: ckptools.node.snapshot).
    digests = what_to_compare(state, replicas, default="all")
    gathered = all_gather_object(opening(state, digests=digests))
    agreement = agree.saving(path)
    agreement.raise_first(gathered, lambda reply: reply.problem)
    if digests is not None:  # every rank has every rank's digests: the same verdict everywhere, no exchange
        failure = compare_replicas([reply.digests for reply in gathered])
        if failure is not None:
            raise failure
    return _Start(path, user_meta, [reply.part for reply in gathered], started, as_saved(state, gathered))


def _write(location: Location, payload: Any, before_write: Callable[[], None] | None, ran: bool = False) -> int:
    """Rank 0: housekeeping (unless it ran already), then the atomic write; the bytes written.

    `ckptools.write.zip_writer.write_alone`: a local file through the planned writer (one pwrite
    per storage from the tensors' memory, the file ``writers="all"`` writes; see
    docs/guides/writers.md for the figures), anything else through ``torch.save`` (a
    multipart upload on S3)."""
    if before_write is not None and not ran:
        before_write()
    return write_alone(location, payload)  # the save's path, resolved once by _begin


def _watched_write(start: _Start, payload: Any, before_write: Callable[[], None] | None) -> int:
    """Rank 0: `_write` in a thread of its own (file I/O only) that this thread watches; `StorageStalledError`
    when the write makes no progress for the stall bound (`ckptools.storage.run_watched`: it is given up and
    publishes nothing), which every rank raises."""
    settle_cuda(payload)  # the helper thread copies from CUDA on its own stream: this thread's work first
    return run_watched(lambda: _write(start.location, payload, before_write, start.written), start.path)


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
    replicas: str = "auto",
    verify_replicas: bool | None = None,
    check_replicas: bool | None = None,
) -> AsyncSave:
    """Save like `save`, but return once the state is copied; the writers write in the background.

    Collective. The caller may step the optimizer the moment it returns: the file holds the
    values as of the call, bit for bit, checked and written atomically as by `save`. The copy
    goes into host buffers kept from the previous async save (pinned for CUDA tensors) until
    `ckptools.release_staging_buffers`; with ``writers="all"`` each rank copies and writes only
    its share. At most one save is in flight: the next checkpoint call (or ``wait()``) finishes
    it, and raises a background failure on every rank. Why and how: docs/guides/preemption.md.

    Args:
        path: as for `save`.
        state: as for `save`.
        metadata: as for `save`.
        writers: as for `save`.
        replicas: as for `save`.
        verify_replicas: as for `save` (deprecated).
        check_replicas: as for `save` (deprecated).

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
    return async_save_with_hooks(path, state, metadata=metadata, writers=writers, replicas=replicas,
                                 verify_replicas=verify_replicas, check_replicas=check_replicas)  # fmt: skip


def async_save_with_hooks(
    path: PathLike,
    state: Mapping[str, Any],
    *,
    metadata: Mapping[str, Any] | None = None,
    before_write: Callable[[], None] | None = None,
    after_write: Callable[[], None] | None = None,
    writers: str = DEFAULT_WRITERS,
    replicas: str = "auto",
    verify_replicas: bool | None = None,
    check_replicas: bool | None = None,
    where: str = "ck.async_save",
) -> AsyncSave:
    """`async_save`; ``before_write``/``after_write`` run on rank 0 around the write (file I/O),
    in its writer thread (``before_write`` on the main thread with ``writers="all"``)."""
    check_writers(writers)
    replicas = replicas_switch(replicas, where, verify_replicas=verify_replicas, check_replicas=check_replicas)
    start = _begin(path, state, metadata, replicas)
    state = start.state  # as saved (`as_saved`): a ZeRO optimizer as its ZeroEntry, open gradients
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


@checked_in("ck.check_replicas")
def check_replicas(state: Mapping[str, Any]) -> int:
    """Compare every byte DDP keeps equal on every rank (collective): a DDP model's parameters, a plain
    optimizer's state for them and its parameter groups; the number of digests compared per rank (0
    without DDP). Saves compare the same by default, snapshots a rotating sample of it; this is the
    whole comparison, at any moment (after ``optimizer.step()`` in a debug run).

    Raises:
        ReplicaMismatchError: on every rank, naming the first tensor that differs and which ranks
            disagree with rank 0.

    Examples:
        >>> import torch, ckptools as ck
        >>> ck.check_replicas({"model": torch.nn.Linear(2, 2)})  # not DDP: nothing replicated
        0
    """
    return compare_now(state, sample=False, declared=False)
