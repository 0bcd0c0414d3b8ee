"""Sending a loaded checkpoint's storages between ranks: from rank 0 to every rank
(``ck.load(..., broadcast=True)``, `broadcast_tree`), or each storage from the rank that read it
(a read-once restore, `share_storages`).

Rank 0 reads the file; every other rank receives the same tree over the process group. The tree
minus its tensors (a skeleton) goes as one object broadcast; the tensors' *storages* follow as
raw bytes in buckets of at most ``bucket_bytes``, so views and tied tensors come out sharing
storage exactly as ``torch.load`` gives them, and no rank holds more than the checkpoint plus one
bucket. With nccl the buckets travel GPU to GPU; with gloo through host memory.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from .group import broadcast_object, get_rank, peer_error, run_collective

__all__ = ["Skeleton", "broadcast_tree", "owners_of", "pieces_of", "share_pieces", "share_storages"]

BUCKET_BYTES = 64 << 20


class _TensorRef:
    """Where a tensor's data lives in the broadcast storages, and how to view it."""

    __slots__ = ("bits", "dtype", "offset", "parameter", "requires_grad", "shape", "storage", "stride")

    def __init__(self, t: torch.Tensor, storage: int) -> None:
        self.storage, self.dtype = storage, t.dtype
        self.shape, self.stride, self.offset = tuple(t.shape), tuple(t.stride()), t.storage_offset()
        self.parameter, self.requires_grad = isinstance(t, torch.nn.Parameter), t.requires_grad
        # A conjugate or negative view's bits: its bytes are not its values without them.
        self.bits = torch._utils.get_tensor_metadata(t) if t.is_conj() or t.is_neg() else None  # type: ignore[no-untyped-call]


def _dense(t: torch.Tensor) -> bool:
    return t.layout == torch.strided and not t.is_quantized and t.device.type != "meta"


def _skeleton(tree: Any, storages: list[Any], index: dict[tuple[Any, ...], int]) -> Any:
    """``tree`` with dense tensors replaced by `_TensorRef` (their storages listed once)."""
    if isinstance(tree, torch.Tensor) and _dense(tree):
        st = tree.untyped_storage()
        key = (st.device, st.data_ptr(), st.nbytes())
        if key not in index:
            index[key] = len(storages)
            storages.append(st)
        return _TensorRef(tree, index[key])
    if isinstance(tree, Mapping):
        out = {k: _skeleton(v, storages, index) for k, v in tree.items()}
        return type(tree)(out) if type(tree) is not dict else out  # type: ignore[call-arg]  # OrderedDict stays one
    if isinstance(tree, (list, tuple)) and type(tree) in (list, tuple):
        return type(tree)(_skeleton(v, storages, index) for v in tree)
    return tree  # plain values and non-dense tensors travel pickled, inside the skeleton


def _rebuild(tree: Any, storages: list[Any], device: torch.device) -> Any:
    if isinstance(tree, _TensorRef):
        t = torch.empty(0, dtype=tree.dtype, device=device)
        t.set_(storages[tree.storage], tree.offset, tree.shape, tree.stride)
        if tree.bits:
            torch._utils.set_tensor_metadata(t, tree.bits)  # type: ignore[no-untyped-call]
        if tree.parameter:
            return torch.nn.Parameter(t, requires_grad=tree.requires_grad)
        return t.requires_grad_(tree.requires_grad) if tree.requires_grad else t
    if isinstance(tree, Mapping):
        out = {k: _rebuild(v, storages, device) for k, v in tree.items()}
        return type(tree)(out) if type(tree) is not dict else out  # type: ignore[call-arg]
    if isinstance(tree, (list, tuple)) and type(tree) in (list, tuple):
        return type(tree)(_rebuild(v, storages, device) for v in tree)
    return tree


def _bytes_of(storage: Any) -> torch.Tensor:
    """A flat uint8 tensor over a whole untyped storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


def _windows(sizes: list[int], bucket: int) -> Iterator[list[tuple[int, int, int, int]]]:
    """Buckets over the concatenated storages: lists of (storage, start, length, bucket offset)."""
    current: list[tuple[int, int, int, int]] = []
    used = 0
    for i, size in enumerate(sizes):
        start = 0
        while start < size:
            take = min(size - start, bucket - used)
            current.append((i, start, take, used))
            used += take
            start += take
            if used == bucket:
                yield current
                current, used = [], 0
    if current:
        yield current


def broadcast_tree(
    tree: Any, *, device: torch.device, comm_device: torch.device, bucket_bytes: int = BUCKET_BYTES
) -> Any:
    """Collective: rank 0's ``tree`` (a loaded checkpoint) on every rank, tensors on ``device``.

    Other ranks pass anything (ignored). ``comm_device`` is where buckets travel: the GPU with
    nccl, the CPU with gloo. Returns rank 0's own ``tree`` on rank 0.
    """
    rank = get_rank()
    parts = Skeleton(tree) if rank == 0 else None
    structure, sizes = broadcast_object((parts.structure, parts.sizes()) if parts is not None else None)
    new = torch.UntypedStorage
    storages = parts.storages if parts is not None else [new(n, device=device) for n in sizes]  # type: ignore[no-untyped-call]
    share_storages(storages, [0] * len(sizes), comm_device=comm_device, bucket_bytes=bucket_bytes)
    return tree if rank == 0 else _rebuild(structure, storages, device)


class Skeleton:
    """A loaded tree taken apart: its structure (every rank builds the same from the same file) and
    its storages, each listed once (tied tensors share one), in the tree's order.

    Examples:
        >>> import torch
        >>> w = torch.arange(4.0)
        >>> parts = Skeleton({"w": w, "v": w[:2]})
        >>> [s.nbytes() for s in parts.storages]  # one storage for the tensor and its view
        [16]
        >>> parts.rebuilt(parts.storages, torch.device("cpu"))["v"].tolist()
        [0.0, 1.0]
    """

    def __init__(self, tree: Any) -> None:
        self.storages: list[Any] = []
        self.structure = _skeleton(tree, self.storages, {})

    def sizes(self) -> list[int]:
        """Each storage's bytes."""
        return [int(s.nbytes()) for s in self.storages]

    def rebuilt(self, storages: list[Any], device: torch.device) -> Any:
        """The tree again, over ``storages`` (one per listed storage, as large)."""
        return _rebuild(self.structure, storages, device)


def owners_of(sizes: list[int], world: int) -> list[int]:
    """Which rank reads each storage: the largest first, each to the rank with the fewest bytes so far
    (the lowest such rank), so every rank reads about 1/``world`` of the bytes; the same on every rank.

    Examples:
        >>> owners_of([40, 10, 30, 20], 2)
        [0, 0, 1, 1]
    """
    load = [0] * world
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += sizes[i]
    return owners


# Where a split storage is cut: a multiple of this, so each piece's reads are whole pages.
PIECE_ALIGN = 4096


def pieces_of(sizes: list[int], world: int) -> list[tuple[int, int, int, int]]:
    """Who reads which bytes of storages of ``sizes``: ``(storage, start, length, rank)`` pieces.

    Whole storages go the `owners_of` way while that keeps every rank within 1 % of an even share
    (or of one alignment unit); otherwise the storages are laid end to end, largest first, and cut
    into ``world`` ranges of equal size (cuts rounded to `PIECE_ALIGN`), so a storage larger than a
    rank's share is read by several ranks: every rank reads 1/``world`` of the bytes, however few and
    large the storages. The same on every rank.

    Examples:
        >>> pieces_of([40, 10, 30, 20], 2)  # whole storages already even
        [(0, 0, 40, 0), (1, 0, 10, 0), (2, 0, 30, 1), (3, 0, 20, 1)]
        >>> [(i, n, r) for i, _, n, r in pieces_of([3 << 20] * 3, 2)]  # three equal storages, two ranks
        [(0, 3145728, 0), (1, 1572864, 0), (1, 1572864, 1), (2, 3145728, 1)]
    """
    owners = owners_of(sizes, world)
    load = [0] * world
    for size, owner in zip(sizes, owners):
        load[owner] += size
    total = sum(sizes)
    if world <= 1 or max(load, default=0) <= total / world * 1.01 + PIECE_ALIGN:
        return [(i, 0, size, owner) for i, (size, owner) in enumerate(zip(sizes, owners))]
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    cuts = [0] + [r * total // world for r in range(1, world)] + [total]
    pieces = []
    at = 0  # the first byte of storage ``i`` in the concatenation
    for i in order:
        start = 0
        while start < sizes[i]:
            rank = max(r for r in range(world) if cuts[r] <= at + start)
            end = sizes[i] if rank == world - 1 else min(sizes[i], cuts[rank + 1] - at)
            if end < sizes[i]:  # a cut inside this storage: rounded up to whole pages of it
                end = min(sizes[i], -(-end // PIECE_ALIGN) * PIECE_ALIGN)
            pieces.append((i, start, end - start, rank))
            start = end
        at += sizes[i]
    return sorted(pieces)


def share_storages(
    storages: list[Any], owners: list[int], *, comm_device: torch.device, bucket_bytes: int = BUCKET_BYTES
) -> None:
    """Collective: each storage's bytes from the rank that ``owners`` names into every other rank's
    storage at that place (allocated by the caller, as large), in buckets of ``bucket_bytes``; with
    nccl the buckets travel on ``comm_device`` (a GPU), with gloo through host memory."""
    pieces = [(i, 0, int(s.nbytes()), owner) for i, (s, owner) in enumerate(zip(storages, owners))]
    share_pieces(storages, pieces, comm_device=comm_device, bucket_bytes=bucket_bytes)


def share_pieces(
    storages: list[Any],
    pieces: list[tuple[int, int, int, int]],
    *,
    comm_device: torch.device,
    bucket_bytes: int = BUCKET_BYTES,
) -> None:
    """Collective: `share_storages` by pieces (`pieces_of`): each ``(storage, start, length, rank)``
    from that rank into every other rank's storage at that place."""
    rank, world = get_rank(), max((p[3] for p in pieces), default=0) + 1
    views = [_bytes_of(s) for s in storages]
    largest = max((p[2] for p in pieces), default=1)
    bucket = torch.empty(min(bucket_bytes, max(largest, 1)), dtype=torch.uint8, device=comm_device)
    try:
        for src in range(world):
            mine = [p for p in pieces if p[3] == src]
            for window in _windows([p[2] for p in mine], bucket.numel()):
                for j, start, length, at in window:
                    if rank == src:
                        view = views[mine[j][0]][mine[j][1] + start : mine[j][1] + start + length]
                        bucket[at : at + length].copy_(view, non_blocking=True)
                used = max(at + length for _, _, length, at in window)
                run_collective(dist.broadcast, bucket[:used], src=src)
                if rank != src:
                    for j, start, length, at in window:
                        view = views[mine[j][0]][mine[j][1] + start : mine[j][1] + start + length]
                        view.copy_(bucket[at : at + length], non_blocking=True)
        if comm_device.type == "cuda":
            torch.cuda.synchronize(comm_device)
    except RuntimeError as err:  # a peer died mid-transfer
        raise peer_error(err) from err
