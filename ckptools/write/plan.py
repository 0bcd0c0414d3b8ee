"""``writers="all"``: every rank writes its share of the replicated tensors into one torch file.

Under DDP every rank holds the same parameters and the same optimizer state for them. Instead
of rank 0 copying and writing all of it while the others wait, the save is planned first and
then written by every rank at once, into the *one* ordinary torch zip `ckptools.save` writes
with ``writers="rank0"`` (``torch.load`` reads it; it loads bit-identical to that file):

1. Rank 0 builds the checked payload and pickles it as ``torch.save`` does, which names every
   storage. Each storage becomes a record at a planned offset (`ZipPlan`: 64-byte aligned data,
   headers of known length). Storages of replicated tensors are spread over the ranks,
   largest first onto the least loaded rank (rank 0 starts with everything that is not
   replicated: buffers, scaler, RNG, plain values). A storage is named to the other ranks by
   where it sits in ``state`` (entry and key path), never by a memory address.
2. Rank 0 creates the temporary file at the file's full size with a random token at its
   start; the plan (temporary path, token, who writes what where) is broadcast.
3. Every rank opens the temporary file and checks the token: one all-gather. A rank that does
   not see it (a node-local directory) makes ``"auto"`` fall back to rank 0 alone and
   ``"all"`` fail on every rank before anything is written, since a file one rank cannot see
   whole would be written in part. With ``verify_replicas`` the same exchange carries a CRC-32
   of every replicated storage as each rank holds it, and any difference fails the save.
4. Every rank writes its records' data with ``pwrite`` at their offsets, CRC-32 as it goes,
   fsyncs, and sends its CRC-32s (or its error) to rank 0: the second all-gather, the one
   barrier. Rank 0 then writes every local header (they hold the CRC-32s), the small records
   and the central directory, fsyncs, renames the file into place and fsyncs the directory,
   and the outcome is broadcast: every rank returns, or every rank raises. A failure or a
   death anywhere before the rename leaves only the temporary file (removed by rank 0, or by a
   later `CheckpointManager` save once its writer is gone) and the previous checkpoint intact.

On S3 there is no shared file to write at offsets: the same plan, its records grouped by
writer, becomes the parts of one multipart upload (`ckptools.write.upload`), uploaded by every
rank and completed by rank 0. Other object stores have no such upload: rank 0 writes there
(``"auto"`` and ``"all"`` alike; `choose` says so once).

The asynchronous variant (`ckptools.async_save`) stages each rank's own share only and
writes it from each rank's background thread. A background thread may do file I/O but never a
collective, so step 4's exchange goes through the process group's key-value store instead:
each rank's writer sets a key with its CRC-32s (or its error), rank 0's writer polls for all of
them, commits or discards, and ``wait()`` shares the outcome as with one writer.
"""

from __future__ import annotations

import secrets
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from .. import log
from ..codecs.torchzip import ZipPlan
from ..collective.group import get_rank, get_world_size
from ..errors import CheckpointError
from ..owned.gradients import has_gradients, owned_gradients, owned_refusal
from ..owned.zero import has_partitions, is_zero, owned_tensors, refusal
from ..state_dict import unwrap_model
from ..storage import Location, streams_multipart
from .pickling import pickle_payload

__all__ = ["WRITERS", "Plan", "choose", "make_plan"]

WRITERS = ("rank0", "all", "auto")
PREFIX = "archive/"  # the folder torch.save puts every record in
TOKEN_BYTES = 16  # bytes of the token rank 0 writes at the temporary file's start


def check_writers(writers: str) -> None:
    """Refuse an unknown ``writers`` value (on every rank, before any collective)."""
    if writers not in WRITERS:
        raise ValueError(f"writers must be one of {', '.join(map(repr, WRITERS))}, got {writers!r}")


def choose(writers: str, location: Location, state: Mapping[str, Any]) -> str:
    """``"rank0"`` or ``"all"``: what this save can do, decided alike on every rank (no exchange).

    A single process, a state without a ``DistributedDataParallel`` model or a ZeRO optimizer
    (nothing in it is known to be replicated or partitioned) and an object store other than S3
    get rank 0's writer; ``"auto"`` and ``"all"`` both get the planned writer otherwise (whether
    every rank sees the directory is checked once the plan exists; on S3 every rank uploads parts
    of one multipart upload). A ZeRO optimizer's partitions are written by their own ranks or not
    at all: with ``"rank0"`` or an object store the save is refused (`CheckpointError`, on every
    rank), since rank 0 alone would have to receive every partition (torch's
    ``consolidate_state_dict``).
    """
    if get_world_size() == 1:
        return "rank0"
    partitioned = has_partitions(state) or has_gradients(state)  # records each rank writes itself
    if partitioned and (writers == "rank0" or not location.local):
        why = "writers='rank0'" if writers == "rank0" else f"{location} is in an object store (no shared file)"
        fix = "save to a local or shared folder every rank sees with writers='auto' or 'all', then copy the file"
        raise CheckpointError(
            f"saving checkpoint {location} failed: {owned_refusal(state, f'{why} does not allow', fix)}; earlier "
            "checkpoints are untouched"
        )
    if writers == "rank0":
        return "rank0"
    if not partitioned and not any(isinstance(obj, DistributedDataParallel) for obj in state.values()):
        return "rank0"
    if not location.local and not streams_multipart(location.fs):
        if writers == "all":
            log.warn(
                f"writers='all' writes local files and S3 only; rank 0 writes {location} (this store has no "
                "shared file to write at offsets, nor an upload that takes parts from every rank)",
                once="writers-remote",
            )
        return "rank0"
    return "all"


@dataclass
class Share:
    """One storage's record: written by rank ``writer`` at ``offset``; ``where`` names it in
    ``state`` (entry, then keys) for that rank, None when rank 0 writes it (from the payload)."""

    key: str
    nbytes: int
    offset: int
    writer: int
    where: tuple[Any, ...] | None


@dataclass
class Plan:
    """What every rank needs to write its part (broadcast by rank 0). ``tmp`` and ``token`` are
    the temporary file's, once the zip writer created it (`ckptools.write.zip_writer.create_tmp`)."""

    tmp: str
    token: bytes
    records: list[tuple[str, int]]
    shares: list[Share]
    force_zip64: bool = False
    size: int = 0  # of the whole file
    # An S3 multipart upload (`ckptools.write.upload`): its id, and its parts as (number, start, end, rank).
    upload: str = ""
    parts: list[tuple[int, int, int, int]] = field(default_factory=list)
    # Rank 0 only, never sent: the pickle, the other small records and the storages by key.
    small: dict[int, bytes] = field(default_factory=dict, repr=False)
    storages: dict[str, torch.UntypedStorage] = field(default_factory=dict, repr=False)
    held: Any = field(default=None, repr=False)  # rank 0, an upload: what its last part is built from

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "small": {}, "storages": {}, "held": None}

    def mine(self) -> list[Share]:
        rank = get_rank()
        return [s for s in self.shares if s.writer == rank]


def describe(where: tuple[Any, ...]) -> str:
    """``state['model']['fc.weight']`` for a share's ``where``."""
    return "state" + "".join(f"[{k!r}]" for k in where)


# --- rank 0: the plan -----------------------------------------------------------------------------


def replicated_tensors(
    state: Mapping[str, Any], entries: Mapping[str, Any], *, declared: bool = False
) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """The tensors every rank holds alike, each with where it sits (entry, then keys), in an
    order that depends only on the structure of ``state`` (the same on every rank).

    Replicated are the parameters of a ``DistributedDataParallel`` model (not those it was told
    to ignore) and an optimizer's state for those parameters. Buffers are not (BatchNorm
    statistics differ per rank), nor is anything else. ``entries`` are the state's entries as
    saved (`state_entry`; rank 0's payload). ``declared``: every module of ``state`` is a replica (the
    caller knows DDP wraps it: an integration that sees the module DDP wraps, not DDP itself).
    """
    params: set[int] = set()
    for obj in state.values():
        if replica_module(obj, declared):
            ignored = ignored_parameters(obj)
            for name, param in unwrap_model(obj).named_parameters(remove_duplicate=False):
                if name not in ignored:
                    params.add(id(param))

    def plain(tensor: Any) -> bool:
        return type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.layout == torch.strided

    for name, obj in state.items():
        if replica_module(obj, declared):
            ignored = ignored_parameters(obj)
            names = {n for n, _ in unwrap_model(obj).named_parameters(remove_duplicate=False)} - ignored
            for key, tensor in entries[name].items():
                if key in names and plain(tensor):
                    yield (name, key), tensor
        elif plain_optimizer(obj):
            index, indices = 0, set()
            for group in obj.param_groups:
                for param in group["params"]:
                    if id(param) in params:
                        indices.add(index)
                    index += 1
            for index, values in entries[name].get("state", {}).items():
                if index in indices and isinstance(values, dict):
                    for key, tensor in values.items():
                        if plain(tensor):
                            yield (name, "state", index, key), tensor


def replicated(state: Mapping[str, Any], payload: Mapping[str, Any]) -> dict[int, tuple[Any, ...]]:
    """Storages (by ``_cdata``) of `replicated_tensors`, each with where it first sits."""
    found: dict[int, tuple[Any, ...]] = {}
    for where, tensor in replicated_tensors(state, payload):
        found.setdefault(tensor.untyped_storage()._cdata, where)
    return found


def settle_cuda(tree: Any) -> None:
    """Wait for the CUDA work this thread queued on each device a tensor or storage in ``tree`` (containers
    walked) lives on: a helper thread, on its own default stream, then copies them to the host as this thread
    would have (a user's side stream included). Only those devices: another's would get a context.

    Examples:
        >>> settle_cuda({"w": torch.ones(2)})  # CPU tensors: nothing to wait for
    """
    devices: set[torch.device] = set()
    seen: set[int] = set()
    stack = [tree]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, (torch.Tensor, torch.UntypedStorage)):
            if item.device.type == "cuda":
                devices.add(item.device)
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    for device in devices:
        torch.cuda.current_stream(device).synchronize()


def host_bytes(storage: torch.UntypedStorage) -> memoryview:
    """A storage's bytes on the CPU, without a copy when it is there already."""
    if storage.device.type != "cpu":
        storage = storage.cpu()  # type: ignore[no-untyped-call]
    if storage.nbytes() == 0:
        return memoryview(b"")
    return memoryview(torch.empty(0, dtype=torch.uint8).set_(storage).numpy())  # type: ignore[arg-type]


def ignored_parameters(model: torch.nn.Module) -> set[str]:
    """The parameters DDP was told to leave alone (each rank's own): DDP's ``parameters_to_ignore``, or for
    the module it wraps what DDP reads them from (``_ddp_params_and_buffers_to_ignore``)."""
    names = getattr(model, "parameters_to_ignore", None)
    if names is None:
        names = getattr(unwrap_model(model), "_ddp_params_and_buffers_to_ignore", None)
    return set(names or ())


def replica_module(obj: Any, declared: bool = False) -> bool:
    """Whether ``obj`` is a model whose parameters every rank holds alike: DDP's, or with ``declared``
    any module (`replicated_tensors`)."""
    return isinstance(obj, DistributedDataParallel) or (declared and isinstance(obj, torch.nn.Module))


def plain_optimizer(obj: Any) -> bool:
    # ZeroRedundancyOptimizer shards its state: a rank holds only its own part.
    return isinstance(obj, torch.optim.Optimizer) and not is_zero(obj)


def make_plan(
    location: Location,
    state: Mapping[str, Any],
    payload: Mapping[str, Any],
    *,
    on_cpu: bool = False,
    alone: bool = False,
    nodes: list[list[int]] | None = None,
    upload: bool = False,
) -> Plan:
    """Rank 0: pickle ``payload``, assign every storage to a writer (all to rank 0 when
    ``alone``) and lay out the file (no file is touched: `ckptools.write.zip_writer.create_tmp` makes it).

    With ``nodes`` (each node's ranks, lowest first; a node snapshot) every node writes a whole
    copy of the file: each storage gets one share per node, the replicated ones spread over that
    node's ranks, the others on its lowest rank (which, on a node without rank 0, receives them
    from rank 0: their ``where`` is None, like rank 0's own).

    With ``upload`` (an S3 multipart upload, `ckptools.write.upload`) each writing rank's records
    sit together, rank 0's last (with the small records and the central directory), and a rank
    other than 0 writes at least `MIN_PART` bytes or nothing: its bytes are parts of their own."""
    owned = {} if alone else {**owned_tensors(state, payload), **owned_gradients(state, payload)}
    data_pkl, storages = pickle_payload(payload, on_cpu=on_cpu, cpu=frozenset(owned))
    where = {} if alone else replicated(state, payload)
    if nodes is None:
        nodes = [[0]] if alone else [list(range(get_world_size()))]
    serial = str(secrets.randbits(128)).zfill(40)[:40]
    small = {
        "data.pkl": data_pkl,
        ".format_version": b"1",
        ".storage_alignment": b"64",
        "byteorder": sys.byteorder.encode(),
    }
    tail = {"version": b"3\n", ".data/serialization_id": serial.encode()}
    owners = [_owners(storages, owned, ranks) for ranks in nodes]
    spread = _for_upload if upload else _spread
    writers = [spread(storages, where, ranks, fixed) for ranks, fixed in zip(nodes, owners)]
    order = list(storages)
    if upload:  # rank 1's records, rank 2's, ..., then rank 0's: each rank's bytes are one range
        order.sort(key=lambda k: (writers[0][k] == 0, writers[0][k]))
    heads = [(PREFIX + n, b) for n, b in small.items()]
    stored: list[tuple[str, Any]] = [(f"{PREFIX}data/{k}", storages[k].nbytes()) for k in order]
    # The small records open the file (torch.save's order); in an upload, rank 0's part of it.
    at = next((i for i, k in enumerate(order) if writers[0][k] == 0), len(order)) if upload else 0
    named = stored[:at] + heads + stored[at:] + [(PREFIX + n, b) for n, b in tail.items()]
    records = [(name, len(b) if isinstance(b, bytes) else b) for name, b in named]
    zplan = ZipPlan(records)
    index = {name: i for i, (name, _) in enumerate(records)}
    offsets = {k: zplan.data_offsets[index[f"{PREFIX}data/{k}"]] for k in storages}
    shares = []
    for fixed, writer in zip(owners, writers):
        for key, storage in storages.items():
            # Rank 0 writes from its payload; another node's leader what only rank 0 holds, received;
            # a ZeRO partition its owner, from its own tensors.
            if key in fixed:
                place = owned[storage._cdata][1] if fixed[key] != 0 else None
            else:
                located = writer[key] != 0 and _spreadable(storage, where)
                place = where.get(storage._cdata) if located else None
            shares.append(Share(key, storage.nbytes(), offsets[key], writer[key], place))
    content = {index[name]: b for name, b in named if isinstance(b, bytes)}
    return Plan("", b"", records, shares, small=content, storages=storages, size=zplan.size)


def _spreadable(storage: torch.UntypedStorage, where: Mapping[int, Any]) -> bool:
    """Whether any rank may write ``storage``: replicated, on the CPU or a GPU."""
    return storage.device.type in ("cpu", "cuda") and storage._cdata in where


def _owners(
    storages: Mapping[str, torch.UntypedStorage], owned: Mapping[int, tuple[int, Any]], ranks: list[int]
) -> dict[str, int]:
    """The ZeRO partitions' storages of ``storages`` (by key) with the rank that owns them; each
    must be among ``ranks`` (a node's, for a snapshot: it keeps a whole file)."""
    fixed = {}
    for key, storage in storages.items():
        if storage._cdata in owned:
            owner = owned[storage._cdata][0]
            if owner not in ranks:
                obstacle = (f"a snapshot in node memory, a whole copy on every node, cannot take: rank {owner}'s "
                            f"partition is not on the node of ranks {ranks}")  # fmt: skip
                fix = "snapshots of a ZeRO optimizer work on one node; over several, save()"
                raise CheckpointError(refusal(obstacle, fix))
            fixed[key] = owner
    return fixed


# S3's smallest part but the last: in an upload, a rank other than 0 writes this much or nothing.
MIN_PART = 5 << 20


def _for_upload(
    storages: Mapping[str, torch.UntypedStorage],
    where: Mapping[int, Any],
    ranks: list[int],
    fixed: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """`_spread` for an S3 upload: a rank other than the lowest whose share would be smaller than
    `MIN_PART` writes nothing (the least loaded such rank leaves, and the rest are spread again)."""
    while True:
        writer = _spread(storages, where, ranks, fixed)
        load = dict.fromkeys(ranks, 0)
        for key, rank in writer.items():
            load[rank] += storages[key].nbytes()
        short = [r for r in ranks[1:] if 0 < load[r] < MIN_PART and not (fixed and r in fixed.values())]
        if not short:
            return writer
        ranks = [r for r in ranks if r != min(short, key=lambda r: (load[r], r))]


def _spread(
    storages: Mapping[str, torch.UntypedStorage],
    where: Mapping[int, Any],
    ranks: list[int],
    fixed: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """Who of ``ranks`` writes each storage: largest first onto the least loaded rank (ties: the
    lowest), within one storage of even; what is not replicated on the lowest rank; ``fixed``
    (a ZeRO partition's) on its owner."""
    load = dict.fromkeys(ranks, 0)
    writer: dict[str, int] = {}
    spread = []
    for key, storage in storages.items():
        if fixed and key in fixed:
            writer[key] = fixed[key]
            load[fixed[key]] += storage.nbytes()
        elif _spreadable(storage, where):
            spread.append(key)
        else:
            writer[key] = ranks[0]
            load[ranks[0]] += storage.nbytes()
    for key in sorted(spread, key=lambda k: (-storages[k].nbytes(), int(k))):
        rank = min(ranks, key=lambda r: (load[r], r))
        writer[key] = rank
        load[rank] += storages[key].nbytes()
    return writer
