"""The zip writer: a torch zip written at planned offsets, by rank 0 alone or by every rank.

`create_tmp` makes the temporary file at its full size (a token at its start, for the other
ranks to check they see it); `write_shares` puts storages' bytes at their offsets with one
``pwrite`` each and fsyncs; `commit` writes the headers, small records and central directory
(`write_directory`) and publishes the file (`ckptools.storage.publish`). The order they are called
in is `ckptools.write.commit`'s protocol.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
from collections.abc import Mapping

import torch

from ..codecs.torchzip import ZipPlan
from ..storage import Location, crc32, fresh_tmp, local_target, moved, publish, watched_fsync
from . import upload
from .plan import PREFIX, TOKEN_BYTES, Plan, Share, host_bytes

__all__ = ["commit", "create_tmp", "discard", "write_directory", "write_shares"]


def create_tmp(location: Location, plan: Plan) -> Plan:
    """Rank 0: ``plan``'s temporary file beside ``location``, at the file's full size (a file size
    limit or a quota says so at once), a random token at its start; ``plan`` with both set."""
    directory, name = local_target(location.path)
    tmp = fresh_tmp(directory, name)  # a killed earlier save's temporary goes first
    token = secrets.token_bytes(TOKEN_BYTES)
    try:
        with open(tmp, "wb") as f:
            f.write(token)
            f.truncate(plan.size)
        moved()
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    plan.tmp, plan.token = tmp, token
    return plan


def write_shares(plan: Plan, chunks: list[tuple[Share, torch.UntypedStorage]]) -> dict[str, int]:
    """Write each share's bytes at its offset in the temporary file, fsync; CRC-32 by key.

    ``chunks`` pairs each share with its storage (or its staged copy). Every byte is written
    first; then a helper thread waits in ``fsync`` for the disk while this thread computes the
    CRC-32s from the same memory (nothing changes it meanwhile: the caller's save holds it, or
    it is the save's own staged copy), so the checksums hide behind the disk's flush instead of
    adding to it; the figures, and the two designs that were slower, are in docs/benchmarks.md.
    """
    if plan.upload:  # S3: this rank's parts of the multipart upload
        return upload.write_parts(plan, chunks)
    crcs: dict[str, int] = {}
    views: list[tuple[Share, memoryview]] = []
    fd = os.open(plan.tmp, os.O_WRONLY)
    try:
        for share, storage in chunks:
            data = host_bytes(storage)
            if storage.device.type != "cpu":
                # A host copy made for this write (a GPU tensor): checksummed now and let go,
                # so that host memory holds one storage at a time, not the whole share.
                crcs[share.key] = crc32(data)
            else:
                views.append((share, data))
            _pwrite_all(fd, data, share.offset)
        failed: list[BaseException] = []
        writer = threading.get_ident()

        def flush() -> None:
            try:
                watched_fsync(fd, writer=writer)
            except BaseException as err:  # noqa: BLE001 - raised below, in the caller's thread
                failed.append(err)

        # File I/O only, never a collective: the thread blocks in fsync with the GIL released. A
        # plain thread, not an executor: an async save still writing when the script ends runs
        # during interpreter shutdown, where executors refuse new work ("cannot schedule new
        # futures after interpreter shutdown"; test_a_script_that_ends_with_a_save_in_flight_...).
        flusher = threading.Thread(target=flush, name="ckptools-fsync", daemon=True)
        flusher.start()
        try:
            crcs.update((share.key, crc32(data)) for share, data in views)
        finally:
            flusher.join()
        if failed:
            raise failed[0]
    finally:
        os.close(fd)
    return crcs


# The most one pwrite hands the storage at once: a watched write moves at least this often (on a storage
# writing 1 MB/s, every 4.2 s), so a slow storage is never taken for a stuck one and its speed is seen while it
# writes (`ckptools.storage.moved`); 256 system calls a GiB cost nothing beside the bytes.
PWRITE_BYTES = 4 << 20


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    data = data.cast("B")
    done = 0
    while done < len(data):
        step = os.pwrite(fd, data[done : done + PWRITE_BYTES], offset + done)
        done += step
        moved(step)


def commit(plan: Plan, location: Location, crcs: dict[str, int]) -> int:
    """Rank 0: headers, small records and central directory, fsync, rename, fsync the directory.

    Returns the file's size. S3: the upload's last part and its completion (`ckptools.write.upload`).
    """
    if plan.upload:
        return upload.commit(plan, location, crcs)
    size = write_directory(plan, crcs, sync=True)
    # The temporary file already sits in the target directory: nothing is resolved again.
    publish(plan.tmp, os.path.dirname(plan.tmp), location.name)
    return size


def write_directory(plan: Plan, crcs: Mapping[str, int] | None, *, sync: bool = False) -> int:
    """Write the local headers, small records and central directory into ``plan.tmp`` (a local
    file); the file's size. ``crcs``: each storage's CRC-32 by key, or None to write them as 0 (a
    snapshot's slot, sealed later: `ckptools.node.sealing`). ``sync``: fsync the file."""
    zplan = ZipPlan(plan.records, force_zip64=plan.force_zip64)
    by_key = {f"{PREFIX}data/{k}": c for k, c in (crcs or {}).items()}
    all_crcs = []
    fd = os.open(plan.tmp, os.O_WRONLY)
    try:
        for index, (name, _) in enumerate(plan.records):
            data = plan.small.get(index)
            crc = crc32(data) if data is not None else by_key[name] if crcs is not None else 0
            all_crcs.append(crc)
            _pwrite_all(fd, memoryview(zplan.header(index, crc)), zplan.header_offsets[index])
            if data is not None:
                _pwrite_all(fd, memoryview(data), zplan.data_offsets[index])
        _pwrite_all(fd, memoryview(zplan.directory(all_crcs)), zplan.directory_offset)
        if sync:
            watched_fsync(fd)
    finally:
        os.close(fd)
    return zplan.size


def discard(plan: Plan | None) -> None:
    """Rank 0: remove the temporary file of a save that failed (S3: abort the upload)."""
    if plan is not None and plan.upload:
        upload.discard(plan)
    elif plan is not None:
        with contextlib.suppress(OSError):
            os.unlink(plan.tmp)
