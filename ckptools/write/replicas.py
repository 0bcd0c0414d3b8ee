"""DDP's replicas compared before a save or a snapshot commits anything.

Under ``DistributedDataParallel`` every rank holds the same parameters and the same optimizer state, bit
for bit. A copy changed on one rank alone (a flipped bit in one GPU's memory, a rank-dependent bug) is
otherwise saved as if nothing happened: rank 0's copy, or with ``writers="all"`` a mosaic of every rank's.
Each rank brings digests of its replicated tensors (`ckptools.write.plan.replicated_tensors`: a DDP
model's parameters, a plain optimizer's state for them) and of its optimizers' parameter groups to the
exchange every save and snapshot opens with, and every rank judges the same replies alike: a difference
raises `ReplicaMismatchError` on every rank before anything is written.

- **By default, a rotating sample.** The replicated bytes, laid end to end in the state's order (the same
  on every rank), are cut into `SAMPLE_CALLS` equal ranges; each call digests one range, the next call the
  next: every byte is compared within `SAMPLE_CALLS` calls, at 1/`SAMPLE_CALLS` of a full pass per call.
  The parameter groups (``lr``, ``betas``, ...) are compared at every call.
- **In full** at every durable save (`ckptools.save`, `CheckpointManager.save`) and in `ckptools.check_replicas`.
- **One switch**, ``replicas=``, the same four words on every call that compares: ``"auto"`` (the default: every
  byte at a save, the sample at a snapshot), ``"all"``, ``"sample"``, ``"off"`` (`replicas_switch`; the old
  ``verify_replicas`` and ``check_replicas`` keep working, with a warning, until 0.6).
- **The digest**: CRC-32 of a CPU tensor's bytes; on a GPU the 64-bit sum of its bytes read as integers,
  computed there (a flipped bit changes it; no copy to the host).

Never compared: buffers (BatchNorm's running statistics differ per rank until DDP's next broadcast),
`PerRank` values, RNG states, a ZeRO optimizer's partitions (each rank's own), a model that is not
wrapped in DDP.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import ReplicaMismatchError, deprecated
from ..storage import crc32
from .payload import state_entry
from .plan import plain_optimizer, replica_module, replicated_tensors

__all__ = [
    "REPLICAS",
    "SAMPLE_CALLS",
    "compare_now",
    "compare_replicas",
    "replica_digests",
    "replicas_switch",
    "what_to_compare",
]

REPLICAS = ("auto", "all", "sample", "off")  # replicas=: each call's default, every byte, a rotating sample, none

SAMPLE_CALLS = 50
_PIECE = 64 << 20  # digested apart (a thread each, in a full pass); a difference is named within its piece
_CALLS = [0]  # this process's sampled calls so far: the same count on every rank (collective calls)

Digest = tuple[str, int, int, int]  # (where, first byte, bytes, digest)


def _name(where: tuple[Any, ...]) -> str:
    """``model.fc1.weight``, ``opt.state[3].exp_avg`` for a replicated tensor's place."""
    name, *keys = where
    if len(keys) == 3 and keys[0] == "state":
        return f"{name}.state[{keys[1]}].{keys[2]}"
    return ".".join([str(name), *map(str, keys)])


def _digest(tensor: torch.Tensor, start: int, length: int) -> int:
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)[start : start + length]
    if flat.device.type == "cpu":
        return crc32(memoryview(flat.numpy()))  # type: ignore[arg-type]  # its bytes where they are: no copy
    # On the GPU: the bytes' sum as 64-bit integers, where they are (one flipped bit changes it).
    return int(flat.to(torch.int64).sum().item())


def replica_digests(state: Mapping[str, Any], *, sample: bool, declared: bool = False) -> list[Digest]:
    """This rank's digests of its replicated bytes (all, or this call's range with ``sample``) and of
    its optimizers' parameter groups, in an order the same on every rank; empty without DDP.
    ``declared``: every module of ``state`` is a replica (`ckptools.write.plan.replicated_tensors`)."""
    if not any(replica_module(obj, declared) for obj in state.values()):
        return []
    entries = {name: state_entry(obj) for name, obj in state.items() if replica_module(obj, declared)}
    entries.update({name: state_entry(obj) for name, obj in state.items() if plain_optimizer(obj)})
    tensors = [(where, t) for where, t in replicated_tensors(state, entries, declared=declared) if t.numel()]
    sizes = [t.numel() * t.element_size() for _, t in tensors]
    total = sum(sizes)
    first, end = 0, total
    if sample:
        call = _CALLS[0] % SAMPLE_CALLS
        _CALLS[0] += 1
        first, end = call * total // SAMPLE_CALLS, (call + 1) * total // SAMPLE_CALLS
    pieces: list[tuple[str, torch.Tensor, int, int]] = []  # (where, tensor, first byte, bytes)
    at = 0
    for (where, tensor), size in zip(tensors, sizes):
        lo, hi = max(first, at), min(end, at + size)
        for start in range(lo, hi, _PIECE):  # the same cuts on every rank: the sizes are the same
            pieces.append((_name(where), tensor, start - at, min(hi, start + _PIECE) - start))
        at += size
    found: list[Digest] = []
    if not sample and end - first > _PIECE and all(t.device.type == "cpu" for _, t, _, _ in pieces):
        # Every byte (a durable save): CRC-32 (ISA-L) lets go of the GIL, so the pieces are digested on
        # the cores there are, at up to 4x the speed of one (the threads end before this returns).
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
            digests = list(pool.map(lambda piece: _digest(piece[1], piece[2], piece[3]), pieces))
    else:
        digests = [_digest(tensor, start, length) for _, tensor, start, length in pieces]
    found += [(name, start, length, digest) for (name, _, start, length), digest in zip(pieces, digests)]
    for name, obj in state.items():
        if plain_optimizer(obj):
            groups = [{k: v for k, v in group.items() if k != "params"} for group in entries[name]["param_groups"]]
            found.append((f"{name}.param_groups", 0, 0, crc32(pickle.dumps(repr(groups)))))
    return found


def compare_replicas(gathered: list[list[Digest]]) -> ReplicaMismatchError | None:
    """What every rank raises when a replicated tensor (or a parameter group) differs between ranks:
    the first that does, the ranks that agree with rank 0 and those that do not; None when all agree."""
    mine = gathered[0]
    for rank, theirs in enumerate(gathered[1:], start=1):
        if len(theirs) != len(mine) or [d[:3] for d in theirs] != [d[:3] for d in mine]:
            return ReplicaMismatchError(
                f"rank {rank} holds other replicated tensors than rank 0 ({len(theirs)} against {len(mine)}): the "
                "ranks passed different models or optimizers; nothing was written"
            )
    for index, (where, start, length, digest) in enumerate(mine):
        differ = [rank for rank, theirs in enumerate(gathered) if theirs[index][3] != digest]
        if differ:
            agree = [rank for rank in range(len(gathered)) if rank not in differ]
            span = f" (bytes {start}..{start + length})" if length else ""
            return ReplicaMismatchError(
                f"{where}{span} differs between ranks, although DDP keeps it equal on every rank: rank(s) "
                f"{', '.join(map(str, differ))} disagree with rank 0 (rank(s) {', '.join(map(str, agree))} agree). A "
                "copy changed on some rank alone (a faulty GPU's memory, an update that depends on the rank); "
                "nothing of this save was written and the previous checkpoints stay the newest: restart from them "
                "(and look at the disagreeing rank's device), or pass check_replicas=False to save anyway",
                where=where,
                differ=differ,
            )
    return None


def replicas_switch(
    replicas: str,
    where: str,
    *,
    verify_replicas: bool | None = None,
    check_replicas: bool | None = None,
) -> str:
    """``replicas`` checked, with the old names of the switch mapped onto it (a `DeprecationWarning` each,
    naming the new spelling; they go in 0.6): ``check_replicas=False`` is ``"off"``, ``verify_replicas=True``
    is ``"all"``, their other values the default. ``where`` names the call in the messages.

    Examples:
        >>> replicas_switch("auto", "ck.save")
        'auto'
    """
    if not isinstance(replicas, str) or replicas not in REPLICAS:
        raise ValueError(f"{where}: replicas must be one of {', '.join(map(repr, REPLICAS))}; got {replicas!r}")
    for old, value, new in (("verify_replicas", verify_replicas, "all"), ("check_replicas", check_replicas, "off")):
        if value is None:
            continue
        meant = new if bool(value) == (old == "verify_replicas") else "auto"
        deprecated(f"{where}({old}=...) is deprecated and goes in 0.6: pass replicas={meant!r} ({old}={value!r} "
                   "is the same)")  # fmt: skip
        if meant != "auto":
            if replicas not in ("auto", meant):
                raise ValueError(
                    f"{where}: {old}={value!r} is replicas={meant!r}, which contradicts replicas={replicas!r}"
                )
            replicas = meant
    return replicas


def what_to_compare(
    state: Mapping[str, Any], replicas: str, compare: Mapping[str, Any] | None = None, *, default: str = "sample"
) -> list[Digest] | None:
    """A save's or snapshot's digests for its opening exchange, by its ``replicas`` (``"auto"`` is
    ``default``): None (``"off"``), every byte (``"all"``) or this call's range (``"sample"``) of ``state``,
    or of ``compare`` (live objects the caller declares replicated: an integration whose state holds state
    dicts passes the model and its optimizers)."""
    mode = default if replicas == "auto" else replicas
    if mode == "off":
        return None
    if compare is not None:
        return replica_digests(compare, sample=mode == "sample", declared=True)
    return replica_digests(state, sample=mode == "sample")


def compare_now(objects: Mapping[str, Any], *, sample: bool, declared: bool) -> int:
    """Collective: compare the replicas of ``objects`` between the ranks now (all their bytes, or this
    call's range with ``sample``; ``declared`` as for `replica_digests`); the digests compared per rank.
    `ckptools.check_replicas`, and an integration that saves through another library's code (the Trainer's
    ``_save_checkpoint``) before that code writes anything.

    Raises:
        ReplicaMismatchError: on every rank, as `compare_replicas` says.
    """
    from ..collective.group import all_gather_object, get_world_size

    digests = replica_digests(objects, sample=sample, declared=declared)
    failure = compare_replicas(all_gather_object(digests)) if get_world_size() > 1 else None
    if failure is not None:
        raise failure
    return len(digests)
