"""A ``ZeroRedundancyOptimizer`` saved without consolidation: every rank writes its partition.

``torch.distributed.optim.ZeroRedundancyOptimizer`` keeps on each rank the optimizer state of
that rank's partition of the parameters only; its ``state_dict()`` refuses until
``consolidate_state_dict(to=0)`` has sent every partition to one rank (all of the optimizer
state through one rank's memory). A save here sends metadata only:

1. Every rank describes its partition's state (per global parameter index: each tensor's dtype,
   shape, strides and storage size; other values as they are) in the exchange every save opens
   with (`ckptools.saving`'s first all-gather; a snapshot's too).
2. Each ZeRO entry of the state becomes a `ZeroEntry` on every rank: its ``state_dict()`` is the
   dict torch's consolidation gives (``param_groups`` of the wrapper, ``state`` keyed by torch's
   global parameter numbering, sorted), holding this rank's own tensors where they are and, for
   the other ranks' parameters, placeholders of the right dtype, shape and size on the ``meta``
   device (no memory).
3. Rank 0 pickles that dict, so the file's ``data.pkl`` is what ``torch.save`` of torch's
   consolidated state would hold; `ckptools.write.plan` gives each partition's storages to the
   rank that owns them, which writes them from its own tensors at their offsets
   (``writers="all"``). Their location is ``cpu``, as in torch's consolidated dict.

Loading needs nothing of this: the file's entry is an ordinary optimizer state dict, which
``ZeroRedundancyOptimizer.load_state_dict`` (at any world size: it keeps its new partition and
drops the rest) and ``torch.optim.AdamW.load_state_dict`` accept alike.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..collective.group import get_rank
from ..errors import CheckpointError

__all__ = [
    "TensorMeta",
    "ZeroEntry",
    "describe_partitions",
    "has_partitions",
    "is_zero",
    "owned_tensors",
    "prefetch_partition",
    "refusal",
    "tensor_meta",
    "with_partitions",
]


def refusal(obstacle: str, fix: str) -> str:
    """The one wording of why a ZeRO optimizer cannot be saved some way: its state is partitioned,
    each rank writes its own partition, what stands in the way (``obstacle``), and ``fix``.

    Examples:
        >>> refusal("writers='rank0' does not allow", "use 'auto'").split(", which ")[1]
        "writers='rank0' does not allow; use 'auto'"
    """
    return (
        "a ZeroRedundancyOptimizer's state is partitioned over the ranks and each rank writes its own partition, "
        f"which {obstacle}; {fix}"
    )


def is_zero(obj: Any) -> bool:
    """Whether ``obj`` is a ``torch.distributed.optim.ZeroRedundancyOptimizer``."""
    return isinstance(obj, torch.optim.Optimizer) and type(obj).__name__ == "ZeroRedundancyOptimizer"


def has_partitions(state: Mapping[str, Any]) -> bool:
    """Whether ``state`` holds a ZeRO optimizer: as is (what a load restores into) or as its
    `ZeroEntry` (what a save writes)."""
    return any(is_zero(obj) or isinstance(obj, ZeroEntry) for obj in state.values())


@dataclass(frozen=True)
class TensorMeta:
    """What rank 0 needs to pickle another rank's tensor: never its data."""

    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    storage_nbytes: int

    def placeholder(self) -> torch.Tensor:
        storage = torch.empty(self.storage_nbytes, dtype=torch.uint8, device="meta").untyped_storage()
        return torch.empty(0, dtype=self.dtype, device="meta").set_(
            storage, self.storage_offset, self.size, self.stride
        )


# Per ZeRO entry of a state: global parameter index -> its state, tensors described.
Partitions = dict[str, dict[int, dict[str, Any]]]


def _check(zero: Any, name: str) -> None:
    if getattr(zero, "_overlap_with_ddp", False):
        raise CheckpointError(
            f"state[{name!r}] is a ZeroRedundancyOptimizer with overlap_with_ddp=True: its partition follows "
            "DDP's gradient buckets and its local optimizer exists only after DDP rebuilt them, which ckptools "
            "does not follow yet; save it with overlap_with_ddp=False (the default)"
        )
    if not hasattr(zero, "_partition_parameters") or not hasattr(zero, "_param_to_index"):
        raise CheckpointError(
            f"state[{name!r}] is a ZeroRedundancyOptimizer of a torch ckptools does not know (no partition): "
            f"torch {torch.__version__}"
        )


def _own_state(zero: Any) -> dict[int, dict[str, Any]]:
    """This rank's partition's state, keyed by torch's global parameter index (as the
    consolidated dict keys it): the local optimizer's state dict translated as
    ``ZeroRedundancyOptimizer.state_dict`` translates it."""
    local = zero.optim.state_dict()
    groups = zero._partition_parameters()[zero.rank]
    if len(local["param_groups"]) != len(groups):
        raise CheckpointError("a ZeroRedundancyOptimizer's local and global parameter groups differ in number")
    own: dict[int, dict[str, Any]] = {}
    for local_group, group in zip(local["param_groups"], groups):
        for local_index, param in zip(local_group["params"], group["params"]):
            if local_index in local["state"]:
                own[zero._param_to_index[param]] = local["state"][local_index]
    return own


def describe_partitions(state: Mapping[str, Any]) -> tuple[Partitions | None, str | None]:
    """This rank's part of the metadata exchange: for each ZeRO entry of ``state``, its
    partition's state with every tensor replaced by its `TensorMeta` (None without one); and
    what makes it unsavable, as text to raise on every rank once the exchange is done."""
    found: Partitions = {}
    for name, obj in state.items():
        if is_zero(obj):
            try:
                _check(obj, name)
            except CheckpointError as err:
                return None, str(err)
            found[name] = {
                index: {key: tensor_meta(v) if isinstance(v, torch.Tensor) else v for key, v in values.items()}
                for index, values in _own_state(obj).items()
            }
    return found or None, None


def tensor_meta(tensor: torch.Tensor) -> TensorMeta:
    """What rank 0 needs to pickle ``tensor`` of another rank (`TensorMeta`), never its data."""
    return TensorMeta(
        tensor.dtype,
        tuple(tensor.size()),
        tuple(tensor.stride()),
        int(tensor.storage_offset()),
        tensor.untyped_storage().nbytes(),
    )


class ZeroEntry:
    """A ZeRO optimizer as a save sees it on one rank, its ``state_dict()`` torch's consolidated
    dict with this rank's tensors and placeholders for the others'; ``owner`` says which rank
    holds each global parameter index's state."""

    def __init__(self, zero: Any, partitions: list[dict[int, dict[str, Any]]]) -> None:
        self.zero = zero
        self.partitions = partitions
        self.owner = {index: rank for rank, part in enumerate(partitions) for index in part}
        self.own = _own_state(zero)  # this rank's tensors: the save reads them several times

    def state_dict(self) -> dict[str, Any]:
        # The wrapper's own (global) param_groups, and its state as torch's state_dict() starts
        # from before it lays every rank's local state over it.
        result = torch.optim.Optimizer.state_dict(self.zero)
        rank = get_rank()
        state = dict(result["state"])
        for owner, part in enumerate(self.partitions):
            for index, values in part.items():
                if owner == rank:
                    state[index] = self.own[index]
                else:
                    state[index] = {
                        key: value.placeholder() if isinstance(value, TensorMeta) else value
                        for key, value in values.items()
                    }
        result["state"] = dict(sorted(state.items()))
        return result

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.zero.load_state_dict(state_dict)


def with_partitions(state: Mapping[str, Any], gathered: list[Partitions | None]) -> Mapping[str, Any]:
    """``state`` with each ZeRO entry as its `ZeroEntry`, given every rank's `describe_partitions`
    (the same ``state`` when it holds none)."""
    if not any(gathered):
        return state
    wrapped = dict(state)
    for name, obj in state.items():
        if is_zero(obj):
            wrapped[name] = ZeroEntry(obj, [dict((reply or {}).get(name, {})) for reply in gathered])
    return wrapped


def owned_tensors(state: Mapping[str, Any], payload: Mapping[str, Any]) -> dict[int, tuple[int, tuple[Any, ...]]]:
    """Rank 0: each partitioned storage (by ``_cdata``) of ``payload``, with the rank that owns
    it and where it sits in ``state`` (entry, "state", index, key)."""
    found: dict[int, tuple[int, tuple[Any, ...]]] = {}
    for name, obj in state.items():
        if not isinstance(obj, ZeroEntry):
            continue
        for index, values in payload[name]["state"].items():
            owner = obj.owner.get(index, 0)
            for key, value in (values or {}).items():
                if isinstance(value, torch.Tensor):
                    found.setdefault(value.untyped_storage()._cdata, (owner, (name, "state", index, key)))
    return found


def _madvise() -> Any:
    try:
        call = ctypes.CDLL(None, use_errno=True).madvise
    except (AttributeError, OSError):  # no libc madvise (Windows): reads stay page by page
        return None
    call.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    call.restype = ctypes.c_int
    return call


_MADVISE = _madvise()
_WILLNEED = getattr(mmap, "MADV_WILLNEED", 3)


def prefetch_partition(zero: Any, entry: Any) -> int:
    """Ask the kernel to read now the pages of a loaded optimizer entry (a file torch mapped)
    that this rank's partition of ``zero`` will copy, and only those; return the bytes asked for.

    Loading maps the whole file (`ckptools.layouts`), and each rank of a ZeRO optimizer touches
    only its partition, spread over the file between the other ranks' records. Touched page by
    page, every fault reads the disk's read-ahead window around it (8 MiB on some virtual disks),
    much of it the neighbours' partitions. ``MADV_WILLNEED`` over the partition's own ranges
    reads them in large requests at once, and the faults then find them in the page cache.
    Harmless on memory that is not a file's (nothing to read) and where madvise is missing.

    Examples:
        >>> prefetch_partition(object(), {"state": {}})  # not a ZeRO optimizer: nothing asked
        0
    """
    if _MADVISE is None or not is_zero(zero) or not isinstance(entry, Mapping):
        return 0
    index_to_param = zero._index_to_param
    owner = zero._param_to_rank
    page = mmap.PAGESIZE
    asked = 0
    for index, values in (entry.get("state") or {}).items():
        if not isinstance(index, int) or not 0 <= index < len(index_to_param) or not isinstance(values, Mapping):
            continue
        if owner.get(index_to_param[index]) != zero.rank:
            continue
        for value in values.values():
            if isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.numel():
                start = value.data_ptr()
                end = start + value.numel() * value.element_size()
                aligned = start - start % page
                if _MADVISE(aligned, end - aligned, _WILLNEED) == 0:
                    asked += end - aligned
    return asked
