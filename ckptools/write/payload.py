"""What a save puts into the file: each entry's state (`state_entry`), ckptools' own metadata,
and the check that all of it loads back with ``torch.load(weights_only=True)``.

The payload rule of every save (``writers="rank0"``, ``"all"``, async or not) lives here and
only here; the writers below take the payload as given.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import enum
import io
import pickle
import re
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from pathlib import PurePath
from typing import Any, NamedTuple

import torch

from .. import log, rng
from .._version import __version__
from ..codecs.record import META_KEY, Record
from ..collective.group import get_rank, get_world_size
from ..devices import to_cpu
from ..errors import UnsafeStateError
from ..layouts.torch_io import GLOBAL_RE, first_line
from ..owned.gradients import accumulation_counter, describe_gradients, with_gradients
from ..owned.zero import describe_partitions, with_partitions
from ..per_rank import PER_RANK_KEY, PerRank
from ..state_dict import unwrap_model
from ..storage import PathLike, crc32, fspath
from .buckets import bucket_layout

__all__ = [
    "Opening",
    "as_saved",
    "build_payload",
    "check_loadable",
    "checked_args",
    "opening",
    "rank_part",
    "state_entry",
]


def checked_args(
    path: PathLike, state: Mapping[str, Any], metadata: Mapping[str, Any] | None
) -> tuple[str, dict[str, Any]]:
    """``path`` as a string and a copy of ``metadata``, once ``state`` is a mapping of string
    names without ckptools' own entry (`TypeError` otherwise, on every rank, before any collective)."""
    path = fspath(path)
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a mapping of names to objects, got {type(state).__name__}")
    if META_KEY in state:
        raise TypeError(f"{META_KEY!r} is reserved for ckptools' own metadata; rename that entry of state")
    bad = [k for k in state if not isinstance(k, str)]
    if bad:
        raise TypeError(f"state keys must be strings, got {bad!r}")
    return path, dict(metadata or {})


# A plain entry (no state_dict) larger than this is not compared between ranks at a save.
_DIGEST_MAX = 1 << 20


class Opening(NamedTuple):
    """What each rank brings to the opening exchange of a save or a snapshot, gathered on every rank
    (one all-gather: the same verdicts everywhere, no second exchange)."""

    part: dict[str, Any]  # `rank_part`: its RNG states, PerRank values, small entries' CRC-32s
    partitions: Any  # its ZeRO partition, described (metadata only), or None
    problem: str | None  # why its ZeRO optimizer or its open gradients cannot be saved, or None
    digests: Any = None  # save(verify_replicas=True): CRC-32s of its replicated tensors
    token: str | None = None  # snapshot: its node-memory folder's token (who shares the node)
    previous: str | None = None  # snapshot: its last commit's failure
    orphaned: bool = False  # snapshot: its torchrun agent is gone
    cadence: int = 0  # snapshot: its proposal of calls to skip (rank 0's is taken)
    folder: str | None = None  # snapshot: why its node-memory folder cannot be used (not its user's alone)
    gradients: Any = None  # its open accumulation window's gradients, described (`ckptools.owned.gradients`)


def opening(state: Mapping[str, Any], **extra: Any) -> Opening:
    """This rank's `Opening` of ``state``, with the fields of ``extra`` (a snapshot's, a save's digests).

    Examples:
        >>> import torch
        >>> opening({"w": torch.ones(2)}, cadence=3).cadence
        3
    """
    partitions, problem = describe_partitions(state)
    gradients, unsavable = describe_gradients(state)
    return Opening(rank_part(state), partitions, problem or unsavable, gradients=gradients, **extra)


def as_saved(state: Mapping[str, Any], gathered: list[Opening]) -> Mapping[str, Any]:
    """``state`` as a save writes it, given every rank's `Opening`: a ZeRO optimizer as its
    `ZeroEntry`, an open accumulation window's gradients as a `GradientsEntry` (each rank's own)."""
    state = with_partitions(state, [reply.partitions for reply in gathered])
    return with_gradients(state, [reply.gradients for reply in gathered])


def rank_part(state: Mapping[str, Any]) -> dict[str, Any]:
    """What this rank brings to a save's opening exchange: its RNG states (before anything could
    draw from them), its values of `PerRank` entries (CPU copies), and a CRC-32 of each small plain
    entry, so that rank 0 can tell when one differs between ranks (`build_payload` warns)."""
    values = {name: to_cpu(obj.value) for name, obj in state.items() if isinstance(obj, PerRank)}
    digests = {}
    for name, obj in state.items():
        if isinstance(obj, (PerRank, torch.nn.Module)) or callable(getattr(obj, "state_dict", None)):
            continue
        if accumulation_counter(obj) is not None:  # an Accelerator: its step, the same on every rank
            continue
        digest = _digest(obj)
        if digest is not None:
            digests[name] = digest
    # DDP's rebuilt gradient buckets (rank 0's: every rank's are the same), so that a restore reduces as
    # this run does (ckptools.write.buckets); computed once per DDP object.
    buckets = {}
    if get_rank() == 0:
        buckets = {name: layout for name, obj in state.items() if (layout := bucket_layout(obj)) is not None}
    return {"rng": rng.get_rng_state(), "per_rank": values, "digests": digests, "buckets": buckets}


def _small(value: Any, budget: int = _DIGEST_MAX, visits: int = 10_000) -> bool:
    """Whether ``value`` holds at most ``budget`` bytes of tensors, arrays and strings, found by a walk
    that stops at the first excess: pickling a large entry only to find it large would copy it all,
    a dict of CUDA weights moved to the CPU at every save (docs/gpu-proof.md, the H100 run)."""
    todo, size = [value], 0
    while todo:
        visits -= 1
        item = todo.pop()
        if visits < 0:
            return False
        if isinstance(item, torch.Tensor):
            size += item.nbytes if item.layout == torch.strided else budget + 1
        elif isinstance(item, (str, bytes, bytearray)):
            size += len(item)
        elif isinstance(item, Mapping):
            todo.extend(item.keys())
            todo.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            todo.extend(item)
        elif isinstance(getattr(item, "nbytes", None), int):  # a numpy array
            size += item.nbytes
        elif hasattr(item, "__dict__") and not isinstance(item, type):
            todo.extend(vars(item).values())
        else:
            size += 8
        if size > budget:
            return False
    return True


def _comparable(value: Any) -> Any:
    """``value`` with each tensor as its dtype, shape and bytes: a tensor's own pickle names its
    storage by address (torch's legacy format inside it), which differs on every rank."""
    if isinstance(value, torch.Tensor):
        if value.is_quantized:
            raise TypeError("a quantized tensor is not compared")
        flat = value.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
        return (str(value.dtype), tuple(value.shape), flat.view(torch.uint8).numpy().tobytes())
    if isinstance(value, Mapping):
        return (type(value).__name__, [(k, _comparable(v)) for k, v in value.items()])
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_comparable(v) for v in value])
    return value


def _digest(value: Any) -> int | None:
    """A CRC-32 of ``value`` (None when it is large, or cannot be pickled: not compared)."""
    try:
        if not _small(value):  # a large or non-strided tensor too
            return None
        data = pickle.dumps(_comparable(value), protocol=4)
    except Exception:  # noqa: BLE001 - not comparable (an odd tensor, an object); check_loadable judges it
        return None
    return crc32(data) if len(data) <= _DIGEST_MAX else None


def build_payload(state: Mapping[str, Any], user_meta: dict[str, Any], parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0: what goes into the file, every value checked to load back with weights_only.

    ``parts``: every rank's `rank_part`, by rank."""
    payload: dict[str, Any] = {}
    digests = parts[0]["digests"]
    differ = [name for name, digest in digests.items() if any(p["digests"].get(name, digest) != digest for p in parts)]
    for name in differ:
        log.warn(
            f"state[{name!r}] differs between ranks, and the checkpoint keeps rank 0's: after a restore every rank "
            f"gets rank 0's value back. Right for a value rank 0 alone computes (a metric); for one each rank carries "
            f"for itself (a batch fetched ahead), wrap it, state[{name!r}] = ck.PerRank(value), to keep its own",
            once=f"differs:{name}",
        )
    for name, obj in state.items():
        if isinstance(obj, PerRank):
            payload[name] = entry = {PER_RANK_KEY: [p["per_rank"][name] for p in parts]}
            check_loadable(entry, f"state[{name!r}] (a ck.PerRank, every rank's value)")
            continue
        payload[name] = entry = state_entry(obj)
        check_loadable(entry, f"state[{name!r}]" + (".state_dict()" if entry is not obj else ""))
    check_loadable(user_meta, "metadata")
    payload[META_KEY] = Record(
        rng=[p["rng"] for p in parts],
        metadata=user_meta,
        world_size=get_world_size(),
        ddp_buckets=parts[0].get("buckets") or None,
        ckptools_version=__version__,
        torch_version=str(torch.__version__),  # TorchVersion itself is refused by weights_only
        created_unix=time.time(),
    ).to_dict()
    return payload


def state_entry(obj: Any) -> Any:
    """What a state entry becomes on disk (`ckptools.save`'s rules)."""
    from torch.utils.data.distributed import DistributedSampler

    if isinstance(obj, torch.nn.Module):
        # Unwrapped, so the file never carries "module." / "_orig_mod." whatever the wrapping.
        return unwrap_model(obj).state_dict()
    if isinstance(obj, DistributedSampler) and not hasattr(obj, "state_dict"):
        return {"epoch": int(obj.epoch), "seed": int(obj.seed)}
    if callable(getattr(obj, "state_dict", None)):
        return obj.state_dict()
    counter = accumulation_counter(obj)  # an Accelerate Accelerator: the window's position
    return obj if counter is None else counter


# --- what save() may store -------------------------------------------------------------------------
# A checkpoint that torch.load(weights_only=True) refuses cannot resume the run: save() checks
# what it is about to write, so the run finds out at its first save instead of at its restart.
_PLAIN = frozenset({str, int, float, bool, type(None)})
_CONTAINERS = frozenset({dict, OrderedDict, list, tuple})


def check_loadable(obj: Any, where: str) -> None:
    """Raise `UnsafeStateError` if ``torch.load(weights_only=True)`` would refuse ``obj``.

    The values of a training state (tensors, numbers, strings, and dicts/lists/tuples of them)
    are recognised in one walk. Anything else is pickled the way ``torch.save`` pickles it
    (storages by reference, so no tensor data is copied) and unpickled by torch's own
    weights-only unpickler: exactly what a later load accepts, including types the program
    allowlisted with ``torch.serialization.add_safe_globals``.

    Args:
        obj: the value about to be saved.
        where: how the user names it, for the message (``"state['args']"``).

    Raises:
        UnsafeStateError: naming the offending value, its type and the fix.

    Examples:
        >>> import argparse
        >>> check_loadable({"lr": 0.1, "args": argparse.Namespace(lr=0.1)}, "state")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ckptools.errors.UnsafeStateError: cannot save state['args'] (type argparse.Namespace): ...
    """
    for suspect, name in _suspects(obj, where):
        reason = _refusal(suspect)
        if reason is not None:
            culprit, name, reason = _narrow(suspect, name, reason)
            raise UnsafeStateError(_unsafe_state_message(culprit, name, reason))


def _suspects(obj: Any, where: str) -> Iterator[tuple[Any, str]]:
    """The values under ``obj`` that are not plainly loadable, with their names (iterative walk)."""
    import torch

    stack = [(obj, where)]
    seen: set[int] = set()
    while stack:
        value, name = stack.pop()
        kind = type(value)
        if kind in _PLAIN or (kind is torch.Tensor and _plain_tensor(value)):
            continue
        if kind not in _CONTAINERS:
            yield value, name
            continue
        if id(value) in seen:  # shared or cyclic containers are walked once
            continue
        seen.add(id(value))
        if kind in (list, tuple):
            stack.extend((item, f"{name}[{i}]") for i, item in reversed(list(enumerate(value))))
            continue
        for key, item in reversed(list(value.items())):
            if type(key) not in (str, int):
                yield key, f"{name} (the key {key!r})"
            stack.append((item, f"{name}[{key!r}]"))
        if kind is OrderedDict and vars(value):  # a state dict's `_metadata` travels as its __dict__
            stack.append((vars(value), f"{name}.__dict__"))


def _plain_tensor(t: torch.Tensor) -> bool:
    import torch

    # Dense tensors without Python attributes rebuild through functions torch always allows;
    # anything fancier (sparse, quantized, attributes) is left to the real unpickler.
    return t.layout == torch.strided and not t.is_quantized and not t.__dict__


def _refusal(obj: Any) -> str | None:
    """Why torch.load(weights_only=True) would refuse what torch.save writes for ``obj``; None if it would not."""
    import torch
    from torch import _weights_only_unpickler

    storages: list[Any] = []

    class _Pickler(pickle.Pickler):
        # As torch.save: storages go by reference (their bytes are written as records of their own).
        def persistent_id(self, value: Any) -> Any:
            if isinstance(value, torch.storage.TypedStorage) or torch.is_storage(value):
                storages.append(value)
                return ("storage", len(storages) - 1)
            return None

    buffer = io.BytesIO()
    try:
        _Pickler(buffer, protocol=2).dump(obj)  # torch.save's default protocol
    except Exception as err:  # noqa: BLE001 - anything pickle raises means torch.save would fail too
        return f"it cannot be pickled: {first_line(err)}"
    buffer.seek(0)
    unpickler = _weights_only_unpickler.Unpickler(buffer, encoding="utf-8")
    unpickler.persistent_load = lambda pid: storages[pid[1]]  # type: ignore[method-assign]
    try:
        unpickler.load()  # type: ignore[no-untyped-call]
    except Exception as err:  # noqa: BLE001 - the refusal itself is the answer
        found = GLOBAL_RE.findall(str(err))
        return f"it needs the global {found[0]}" if found else first_line(err)
    return None


def _narrow(obj: Any, name: str, reason: str) -> tuple[Any, str, str]:
    """Descend from a refused container to the innermost refused value inside it."""
    while True:
        if isinstance(obj, Mapping):
            children: list[tuple[Any, str]] = [(v, f"{name}[{k!r}]") for k, v in obj.items()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            children = [(v, f"{name}[{i}]") for i, v in enumerate(obj)]
        else:
            return obj, name, reason
        for child, child_name in children:
            child_reason = _refusal(child)
            if child_reason is not None:
                obj, name, reason = child, child_name, child_reason
                break
        else:
            return obj, name, reason  # the container type itself is what is refused


def _unsafe_state_message(value: Any, where: str, reason: str) -> str:
    kind = type(value)
    qualname = f"{kind.__module__}.{kind.__qualname__}"
    keys = re.findall(r"\['([A-Za-z_]\w*)'\]", where)
    var = keys[-1] if keys else "value"
    plain = "plain values (str, int, float, bool, None, tensors, and lists, tuples or dicts of them)"
    if isinstance(value, argparse.Namespace):
        fix = f"store vars({var}) instead (a dict of its values)"
    elif isinstance(value, PurePath):
        fix = f"store str({var}) instead"
    elif kind.__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        fix = f"store {var}.item() instead (a Python number)"
    elif kind.__module__ == "numpy" and hasattr(value, "ndim"):
        fix = f"store torch.from_numpy({var}) instead"
    elif dataclasses.is_dataclass(value):
        fix = f"store dataclasses.asdict({var}) instead"
    elif isinstance(value, enum.Enum):
        fix = f"store {var}.value instead"
    elif isinstance(value, (datetime.date, datetime.time)):
        fix = f"store {var}.isoformat() instead"
    elif kind.__module__.startswith("omegaconf"):
        fix = f"store OmegaConf.to_container({var}, resolve=True) instead"
    elif isinstance(value, Mapping):
        fix = f"store dict({var}) instead"
    elif reason.startswith("it cannot be pickled"):
        fix = f"store {plain} instead"
    else:
        fix = (
            f"store {plain} instead; or, if every program that loads this file may trust {qualname}, call "
            f"torch.serialization.add_safe_globals([{kind.__qualname__}]) in the saving and in the loading program"
        )
    return (
        f"cannot save {where} (type {qualname}): torch.load(weights_only=True) refuses it ({reason}), so this "
        f"checkpoint could not be loaded to resume the run. Nothing was written; {fix}"
    )
