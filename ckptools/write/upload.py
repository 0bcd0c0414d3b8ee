"""``writers="all"`` on S3: every rank uploads its share as parts of one multipart upload.

An object store has no shared file to write at offsets, but S3's multipart upload takes its parts
from any client, in any order, each numbered, and shows the object only once it is completed. The
plan (`ckptools.write.plan.make_plan` with ``upload``) puts each writing rank's records together,
rank 1's first, rank 0's last with the small records and the central directory, so that each
rank's bytes are one range of the file; `part_ranges` cuts each range into parts (every part but
the last at least 5 MiB, at most 10,000 parts), numbered in file order.

1. Rank 0 creates the upload (`create`); the plan carries its id to every rank.
2. Every rank computes the CRC-32 of each of its records (its local headers hold them), then
   uploads its parts, `PARTS_AT_ONCE` at a time, each built from the tensors' memory when its turn
   comes (`write_parts`). Rank 0 holds back the file's last part (the records after the last
   storage and the central directory, a few KiB): the directory needs every rank's CRC-32s.
3. The CRC-32s reach rank 0 as for a local file (an all-gather, or the store for an async save);
   rank 0 uploads the last part, checks with ListParts that every planned part is there at its
   planned size, and completes the upload (`commit`): the object appears whole, at once. Any
   failure on any rank aborts the upload (`discard`); the previous object stays as it was. A job
   killed before the completion leaves an incomplete upload, never an object (a bucket lifecycle
   rule that aborts incomplete uploads reaps its parts, as for any multipart upload).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import math
from typing import Any

import torch

from ..codecs.torchzip import ZipPlan, storage_key
from ..collective.group import get_rank, get_world_size
from ..errors import CheckpointError
from ..storage import Location, crc32, resolve
from .plan import MIN_PART, PREFIX, Plan, Share, host_bytes

__all__ = ["PARTS_AT_ONCE", "commit", "create", "discard", "part_ranges", "write_parts"]

# Parts of 32 MiB (more for an object over 280 GiB: at most 10,000 parts), 4 in flight per rank:
# a client's one connection gets a fraction of what the store serves to several.
PART_BYTES = 32 << 20
MAX_PARTS = 10_000
PARTS_AT_ONCE = 4


def part_ranges(plan: Plan, zplan: ZipPlan, world: int) -> list[tuple[int, int, int, int]]:
    """``(number, start, end, rank)`` of every part, in file order: each writing rank's range cut
    into parts of at least `PART_BYTES` (the last of a range takes the rest: never under
    `MIN_PART`), and the file's last part, rank 0's: the records after the last storage and the
    central directory (the one part that waits for every rank's CRC-32s; with rank 0's records when
    those are under `MIN_PART`)."""
    first: dict[int, int] = {}  # rank -> where its range starts
    writers = {share.key: share.writer for share in plan.shares}
    last_storage = -1
    for index, (name, _) in enumerate(plan.records):
        stored = storage_key(name)
        rank = writers.get(stored, 0) if stored is not None else 0
        first.setdefault(rank, zplan.header_offsets[index])
        if stored is not None:
            last_storage = index
    tail = max(first[0], zplan.header_offsets[last_storage + 1])
    ranges = sorted((start, rank) for rank, start in first.items())
    ends = [start for start, _ in ranges[1:]] + [tail]
    size = max(PART_BYTES, math.ceil(plan.size / (MAX_PARTS - world - 1)))
    parts: list[tuple[int, int, int, int]] = []
    for (start, rank), end in zip(ranges, ends):
        if rank == 0 and end - start < MIN_PART:
            tail = start  # too little for a part of its own: it waits in the last part
            continue
        if end - start < MIN_PART:
            raise CheckpointError(f"internal: rank {rank}'s part of the upload is {end - start} bytes")
        count = max(1, (end - start) // size)
        cuts = [start + (end - start) * i // count for i in range(count)] + [end]
        parts += [(len(parts) + 1 + i, a, b, rank) for i, (a, b) in enumerate(zip(cuts, cuts[1:]))]
    return [*parts, (len(parts) + 1, tail, plan.size, 0)]


def create(location: Location, plan: Plan) -> Plan:
    """Rank 0: start the multipart upload of ``location``; ``plan`` with its id and parts."""
    fs = location.fs
    bucket, key, _ = fs.split_path(location.path)
    plan.tmp = location.url
    plan.parts = part_ranges(plan, ZipPlan(plan.records, force_zip64=plan.force_zip64), get_world_size())
    plan.upload = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
    return plan


class _Pieces:
    """What one rank puts into the file: ``(offset, bytes)`` in file order, headers and data."""

    def __init__(self) -> None:
        self.offsets: list[int] = []
        self.data: list[memoryview] = []

    def add(self, offset: int, data: Any) -> None:
        view = memoryview(data).cast("B")
        if len(view):
            self.offsets.append(offset)
            self.data.append(view)

    def fill(self, start: int, end: int) -> bytearray:
        """The bytes of ``[start, end)``, all of them this rank's."""
        body = bytearray(end - start)
        i = max(0, bisect.bisect_right(self.offsets, start) - 1)
        while i < len(self.offsets) and self.offsets[i] < end:
            at, data = self.offsets[i], self.data[i]
            lo, hi = max(start, at), min(end, at + len(data))
            if lo < hi:
                body[lo - start : hi - start] = data[lo - at : hi - at]
            i += 1
        return body


def _pieces(
    plan: Plan, zplan: ZipPlan, chunks: list[tuple[Share, torch.UntypedStorage]]
) -> tuple[_Pieces, dict[str, int], dict[int, int]]:
    """This rank's records as pieces, the CRC-32 of each of its storages by key, and of each of its
    small records (rank 0's) by record."""
    index = {name: i for i, (name, _) in enumerate(plan.records)}
    crcs: dict[str, int] = {}
    found: list[tuple[int, Any, int]] = []  # (record, data, crc)
    for share, storage in chunks:
        data = host_bytes(storage)  # a GPU storage: its host copy, held until the parts are sent
        crcs[share.key] = crc32(data)
        found.append((index[f"{PREFIX}data/{share.key}"], data, crcs[share.key]))
    small_crcs = {record: crc32(small) for record, small in plan.small.items()}
    found += [(record, small, small_crcs[record]) for record, small in plan.small.items()]
    pieces = _Pieces()
    for record, data, crc in sorted(found, key=lambda item: item[0]):
        pieces.add(zplan.header_offsets[record], zplan.header(record, crc))
        pieces.add(zplan.data_offsets[record], data)
    return pieces, crcs, small_crcs


def _send(location: Location, plan: Plan, parts: list[tuple[int, int, int, int]], pieces: _Pieces) -> None:
    """Upload ``parts``, `PARTS_AT_ONCE` at a time, each built when its turn comes."""
    from fsspec.asyn import sync

    fs = location.fs
    bucket, key, _ = fs.split_path(location.path)

    async def send_all() -> None:
        gate = asyncio.Semaphore(PARTS_AT_ONCE)

        async def send(number: int, start: int, end: int) -> None:
            async with gate:
                body = bytes(pieces.fill(start, end))
                await fs._call_s3("upload_part", Bucket=bucket, Key=key, UploadId=plan.upload, PartNumber=number,
                                  Body=body)  # fmt: skip

        await asyncio.gather(*(send(number, start, end) for number, start, end, _ in parts))

    sync(fs.loop, send_all)


def write_parts(plan: Plan, chunks: list[tuple[Share, torch.UntypedStorage]]) -> dict[str, int]:
    """Upload this rank's parts (rank 0: all but the file's last); the CRC-32 of each storage by key."""
    location = resolve(plan.tmp)
    zplan = ZipPlan(plan.records, force_zip64=plan.force_zip64)
    rank = get_rank()
    pieces, crcs, small_crcs = _pieces(plan, zplan, chunks)
    mine = [part for part in plan.parts if part[3] == rank and part[0] != len(plan.parts)]
    _send(location, plan, mine, pieces)
    if rank == 0:
        plan.held = (pieces, small_crcs)  # the commit sends the last part from them
    return crcs


def commit(plan: Plan, location: Location, crcs: dict[str, int]) -> int:
    """Rank 0, after `write_parts`: upload the last part (rank 0's last records and the central
    directory), check that every planned part is there, complete the upload. Returns the size."""
    zplan = ZipPlan(plan.records, force_zip64=plan.force_zip64)
    pieces, small_crcs = plan.held  # rank 0's records as write_parts sent them (an async save's staged copies)
    by_key = {f"{PREFIX}data/{k}": c for k, c in crcs.items()}
    every = [small_crcs[i] if i in plan.small else by_key[name] for i, (name, _) in enumerate(plan.records)]
    pieces.add(zplan.directory_offset, zplan.directory(every))
    _send(location, plan, plan.parts[-1:], pieces)
    fs = location.fs
    bucket, key, _ = fs.split_path(location.path)
    uploaded = _listed(fs, bucket, key, plan.upload)
    expected = {number: end - start for number, start, end, _ in plan.parts}
    wrong = sorted(n for n in expected if uploaded.get(n, ("", -1))[1] != expected[n])
    if wrong or len(uploaded) != len(expected):
        raise CheckpointError(f"the upload of {location} lacks part(s) {wrong[:5]} or holds others: not completed")
    done = [{"PartNumber": n, "ETag": uploaded[n][0]} for n in sorted(expected)]
    fs.call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=plan.upload,
               MultipartUpload={"Parts": done})  # fmt: skip
    fs.invalidate_cache(location.path)
    return plan.size


def _listed(fs: Any, bucket: str, key: str, upload: str) -> dict[int, tuple[str, int]]:
    """Every part S3 holds of the upload: number -> (ETag, size)."""
    found: dict[int, tuple[str, int]] = {}
    marker = 0
    while True:
        reply = fs.call_s3("list_parts", Bucket=bucket, Key=key, UploadId=upload, PartNumberMarker=marker)
        for part in reply.get("Parts", []):
            found[int(part["PartNumber"])] = (part["ETag"], int(part["Size"]))
        if not reply.get("IsTruncated"):
            return found
        marker = int(reply["NextPartNumberMarker"])


def discard(plan: Plan) -> None:
    """Rank 0: abort the upload of a save that failed (its parts are deleted; no object appears)."""
    with contextlib.suppress(Exception):
        location = resolve(plan.tmp)
        bucket, key, _ = location.fs.split_path(location.path)
        location.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=plan.upload)
