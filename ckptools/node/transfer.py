"""A node's snapshot sent to the nodes that lack it, at a restore: one file broadcast in chunks."""

from __future__ import annotations

import contextlib
import os
from typing import IO

import torch

from ..collective.agree import Agreement
from ..collective.group import broadcast_bytes, broadcast_object, get_rank
from ..errors import CheckpointError
from ..storage import fresh_tmp, open_local

__all__ = ["send_file"]


def send_file(path: str, src: int, receive: bool, chunk: int = 64 << 20) -> None:
    """Collective: rank ``src`` sends the file ``path`` to the ranks with ``receive``, which write
    it at ``path`` in their own folder (atomically); every rank takes part in the broadcasts. A
    failure on any rank is raised on every rank, and nothing is left half-written."""
    rank = get_rank()
    error: BaseException | None = None
    source: IO[bytes] | None = None
    target: IO[bytes] | None = None
    tmp = fresh_tmp(os.path.dirname(path), os.path.basename(path))
    try:
        if rank == src:  # a snapshot of this job's own: no link followed, its size the open file's
            source = open_local(path, own=True)
        elif receive:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
            target = os.fdopen(os.open(tmp, flags, 0o600), "wb")
    except (CheckpointError, OSError) as err:
        error = err
    size = broadcast_object(os.fstat(source.fileno()).st_size if source is not None else None, src=src) or 0
    buffer = torch.empty(min(chunk, max(size, 1)), dtype=torch.uint8)
    done = 0
    while done < size:
        n = min(chunk, size - done)
        piece = buffer[:n]
        if source is not None and error is None:
            try:
                source.readinto(piece.numpy())  # type: ignore[attr-defined]  # a binary file
            except OSError as err:
                error = err
        broadcast_bytes(piece, src)  # every rank, even one that failed: no one is left waiting
        if target is not None and error is None:
            try:
                target.write(piece.numpy().tobytes())
            except OSError as err:
                error = err
        done += n
    for f in (source, target):
        if f is not None:
            f.close()
    if target is not None:
        try:
            if error is None:
                os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    Agreement(f"sending the snapshot {path} from rank {src}").on_every_rank(error)
