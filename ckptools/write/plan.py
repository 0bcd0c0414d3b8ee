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

Local filesystems only: an object store has no shared file to write at offsets; its multipart
upload could take parts from several ranks, but every part but the last must be at least
5 MiB and the parts are fixed before the sizes of the ranks' shares are known, so rank 0
writes there (``"auto"`` and ``"all"`` alike; `choose` says so once).

The asynchronous variant (`ckptools.async_save`) snapshots each rank's own share only and
writes it from each rank's background thread. A background thread may do file I/O but never a
collective, so step 4's exchange goes through the process group's key-value store instead:
each rank's writer sets a key with its CRC-32s (or its error), rank 0's writer polls for all of
them, commits or discards, and ``wait()`` shares the outcome as with one writer.
"""

from __future__ import annotations

import pickle
import secrets
import sys
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from .. import log
from ..codecs.torchzip import ZipPlan
from ..collective.group import get_rank, get_world_size
from ..errors import CheckpointError
from ..state_dict import unwrap_model
from ..storage import Location
from ..zero import has_partitions, is_zero, owned_tensors, refusal
from .payload import state_entry

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
    (nothing in it is known to be replicated or partitioned) and an object store get rank 0's
    writer; ``"auto"`` and ``"all"`` both get the planned writer otherwise (whether every rank
    sees the directory is checked once the plan exists). A ZeRO optimizer's partitions are
    written by their own ranks or not at all: with ``"rank0"`` or an object store the save is
    refused (`CheckpointError`, on every rank), since rank 0 alone would have to receive every
    partition (torch's ``consolidate_state_dict``).
    """
    if get_world_size() == 1:
        return "rank0"
    partitioned = has_partitions(state)
    if partitioned and (writers == "rank0" or not location.local):
        why = "writers='rank0'" if writers == "rank0" else f"{location} is in an object store (no shared file)"
        fix = "save to a local or shared folder every rank sees with writers='auto' or 'all', then copy the file"
        raise CheckpointError(
            f"saving checkpoint {location} failed: {refusal(f'{why} does not allow', fix)}; earlier checkpoints are "
            "untouched"
        )
    if writers == "rank0":
        return "rank0"
    if not partitioned and not any(isinstance(obj, DistributedDataParallel) for obj in state.values()):
        return "rank0"
    if not location.local:
        if writers == "all":
            log.warn(
                f"writers='all' writes local files only; rank 0 writes {location} (an object store has no "
                "shared file to write at offsets)",
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
    # Rank 0 only, never sent: the pickle, the other small records and the storages by key.
    small: dict[int, bytes] = field(default_factory=dict, repr=False)
    storages: dict[str, torch.UntypedStorage] = field(default_factory=dict, repr=False)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "small": {}, "storages": {}}

    def mine(self) -> list[Share]:
        rank = get_rank()
        return [s for s in self.shares if s.writer == rank]


def describe(where: tuple[Any, ...]) -> str:
    """``state['model']['fc.weight']`` for a share's ``where``."""
    return "state" + "".join(f"[{k!r}]" for k in where)


# --- rank 0: the plan -----------------------------------------------------------------------------


_PLAIN = frozenset((int, float, str, bool, type(None), tuple, list, dict, bytes, torch.dtype, torch.device, torch.Size))


def pickle_payload(
    payload: Any, *, on_cpu: bool = False, cpu: frozenset[int] = frozenset()
) -> tuple[bytes, dict[str, torch.UntypedStorage]]:
    """``data.pkl`` as ``torch.save`` writes it, and its storages by record key, in order.

    The storage naming is torch.serialization._save's: storages by reference, keys in order of
    first appearance, the storage type and ``location_tag`` of each (``"cpu"`` for all with
    ``on_cpu``: an async save stores the CPU snapshot, as with ``writers="rank0"``; and for the
    storages in ``cpu``, by ``_cdata``: a ZeRO partition, as torch's consolidation stores it); views of one
    storage with different dtypes are refused as torch refuses them.
    """
    from torch.serialization import location_tag, normalize_storage_type

    storages: dict[str, torch.UntypedStorage] = {}
    keys: dict[int, str] = {}
    dtypes: dict[int, torch.dtype] = {}

    def persistent_id(obj: Any) -> Any:
        if not (isinstance(obj, torch.storage.TypedStorage) or torch.is_storage(obj)):
            return None
        if isinstance(obj, torch.storage.TypedStorage):
            storage, dtype = obj._untyped_storage, obj.dtype
            storage_type = getattr(torch, obj._pickle_storage_type())  # type: ignore[no-untyped-call]
            numel = obj._size()  # type: ignore[no-untyped-call]
        else:
            storage, dtype = obj, torch.uint8
            storage_type = normalize_storage_type(type(obj))  # type: ignore[no-untyped-call]
            numel = storage.nbytes()
        allocated = str(storage.device) != "meta" and storage.data_ptr() != 0
        if allocated and dtypes.setdefault(storage.data_ptr(), dtype) != dtype:
            raise RuntimeError("Cannot save multiple tensors or storages that view the same data as different types")
        key = keys.setdefault(storage._cdata, str(len(keys)))
        storages[key] = storage
        fake = getattr(obj, "_fake_device", None)
        if on_cpu or storage._cdata in cpu:
            location = "cpu"
        else:
            location = str(fake) if fake is not None else location_tag(storage)
        return ("storage", storage_type, key, location, numel)

    class _Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            # Called for every object pickled: the plain ones (most of them) leave at once.
            return None if type(obj) in _PLAIN else persistent_id(obj)

    class _PlaceholderPickler(_Pickler):
        def reducer_override(self, obj: Any) -> Any:
            # Another rank's ZeRO tensor, a meta placeholder here: reduced as torch reduces the CPU
            # tensor it stands for (torch reduces a meta tensor without its storage).
            if type(obj) is torch.Tensor and obj.device.type == "meta" and obj.untyped_storage()._cdata in cpu:
                return _reduce_as_stored(obj)
            return NotImplemented

    import io

    buffer = io.BytesIO()
    # torch.save's default protocol; the override (a Python call per object) only when needed.
    (_PlaceholderPickler if cpu else _Pickler)(buffer, protocol=2).dump(payload)
    return buffer.getvalue(), storages


def _reduce_as_stored(tensor: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
    """``Tensor._reduce_ex_internal``'s reduction of a dense tensor with its storage (torch 2.x),
    for a tensor whose storage is not here."""
    from collections import OrderedDict

    storage: Any
    if tensor.dtype in torch.storage._new_dtypes():
        rebuild: Any = torch._utils._rebuild_tensor_v3
        storage = tensor.untyped_storage()
    else:
        rebuild = torch._utils._rebuild_tensor_v2
        storage = torch.storage.TypedStorage(  # type: ignore[no-untyped-call]
            wrap_storage=tensor.untyped_storage(), dtype=tensor.dtype, _internal=True
        )
    args: tuple[Any, ...] = (
        storage,
        tensor.storage_offset(),
        tuple(tensor.size()),
        tensor.stride(),
        tensor.requires_grad,
        OrderedDict(),
    )
    if isinstance(storage, torch.UntypedStorage):
        args += (tensor.dtype,)
    return rebuild, args


def replicated_tensors(state: Mapping[str, Any], entries: Mapping[str, Any]) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """The tensors every rank holds alike, each with where it sits (entry, then keys), in an
    order that depends only on the structure of ``state`` (the same on every rank).

    Replicated are the parameters of a ``DistributedDataParallel`` model (not those it was told
    to ignore) and an optimizer's state for those parameters. Buffers are not (BatchNorm
    statistics differ per rank), nor is anything else. ``entries`` are the state's entries as
    saved (`state_entry`; rank 0's payload).
    """
    params: set[int] = set()
    for obj in state.values():
        if isinstance(obj, DistributedDataParallel):
            ignored = set(getattr(obj, "parameters_to_ignore", ()) or ())
            for name, param in unwrap_model(obj).named_parameters(remove_duplicate=False):
                if name not in ignored:
                    params.add(id(param))

    def plain(tensor: Any) -> bool:
        return type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.layout == torch.strided

    for name, obj in state.items():
        if isinstance(obj, DistributedDataParallel):
            ignored = set(getattr(obj, "parameters_to_ignore", ()) or ())
            names = {n for n, _ in unwrap_model(obj).named_parameters(remove_duplicate=False)} - ignored
            for key, tensor in entries[name].items():
                if key in names and plain(tensor):
                    yield (name, key), tensor
        elif _plain_optimizer(obj):
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


def host_bytes(storage: torch.UntypedStorage) -> memoryview:
    """A storage's bytes on the CPU, without a copy when it is there already."""
    if storage.device.type != "cpu":
        storage = storage.cpu()  # type: ignore[no-untyped-call]
    if storage.nbytes() == 0:
        return memoryview(b"")
    return memoryview(torch.empty(0, dtype=torch.uint8).set_(storage).numpy())  # type: ignore[arg-type]


def replica_digests(state: Mapping[str, Any]) -> list[tuple[tuple[Any, ...], int]]:
    """Each replicated tensor's place and the CRC-32 of its bytes as this rank holds it
    (``verify_replicas``; a full read of them, on the CPU)."""
    entries = {name: state_entry(obj) for name, obj in state.items() if isinstance(obj, DistributedDataParallel)}
    entries.update({name: state_entry(obj) for name, obj in state.items() if _plain_optimizer(obj)})
    found = []
    for where, tensor in replicated_tensors(state, entries):
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8) if tensor.numel() else tensor.new_empty(0)
        found.append((where, zlib.crc32(host_bytes(data.cpu().untyped_storage()))))
    return found


def compare_replicas(gathered: list[list[tuple[tuple[Any, ...], int]]]) -> str | None:
    """Which replicated tensor differs between rank 0 and another rank, if any."""
    for rank, theirs in enumerate(gathered[1:], start=1):
        for (where, mine), (other_where, other) in zip(gathered[0], theirs):
            if where != other_where or mine != other:
                return (
                    f"{describe(where)} differs between rank 0 and rank {rank}, although DDP keeps it equal on "
                    "every rank (was one rank's copy changed outside the training step?); nothing was written. "
                    "Make the replicas agree, or save without verify_replicas to store rank 0's"
                )
        if len(theirs) != len(gathered[0]):
            return f"rank {rank} holds {len(theirs)} replicated tensors, rank 0 {len(gathered[0])}: the states differ"
    return None


def _plain_optimizer(obj: Any) -> bool:
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
) -> Plan:
    """Rank 0: pickle ``payload``, assign every storage to a writer (all to rank 0 when
    ``alone``) and lay out the file (no file is touched: `ckptools.write.zip_writer.create_tmp` makes it).

    With ``nodes`` (each node's ranks, lowest first; a node snapshot) every node writes a whole
    copy of the file: each storage gets one share per node, the replicated ones spread over that
    node's ranks, the others on its lowest rank (which, on a node without rank 0, receives them
    from rank 0: their ``where`` is None, like rank 0's own)."""
    owned = {} if alone else owned_tensors(state, payload)
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
    records = [(PREFIX + n, len(b)) for n, b in small.items()]
    records += [(f"{PREFIX}data/{k}", s.nbytes()) for k, s in storages.items()]
    records += [(PREFIX + n, len(b)) for n, b in tail.items()]
    zplan = ZipPlan(records)
    first = len(small)
    offsets = {k: zplan.data_offsets[first + i] for i, k in enumerate(storages)}
    shares = []
    for ranks in nodes:
        fixed = _owners(storages, owned, ranks)
        writer = _spread(storages, where, ranks, fixed)
        for key, storage in storages.items():
            # Rank 0 writes from its payload; another node's leader what only rank 0 holds, received;
            # a ZeRO partition its owner, from its own tensors.
            if key in fixed:
                place = owned[storage._cdata][1] if fixed[key] != 0 else None
            else:
                located = writer[key] != 0 and _spreadable(storage, where)
                place = where.get(storage._cdata) if located else None
            shares.append(Share(key, storage.nbytes(), offsets[key], writer[key], place))
    content = {i: b for i, b in enumerate(small.values())}
    content.update({len(records) - len(tail) + i: b for i, b in enumerate(tail.values())})
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
