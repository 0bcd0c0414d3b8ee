"""Helpers the fault-injection tests share with their spawned ranks (imported by module name)."""

from __future__ import annotations

import errno
import os
import signal
import time

import fsspec
import torch
from fsspec.implementations.memory import MemoryFileSystem


def dies_midway(how: str):
    """A stand-in for a rank's ``write_shares``: half of its first record reaches the file, then
    the rank is gone (``how="kill"``: SIGKILL) or its disk fails (ENOSPC)."""

    def write_shares(plan, chunks):
        share = chunks[0][0]
        fd = os.open(plan.tmp, os.O_WRONLY)
        os.pwrite(fd, bytes(share.nbytes // 2), share.offset)
        os.close(fd)
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise OSError(28, "No space left on device")

    return write_shares


class FlakyFileSystem(MemoryFileSystem):
    """An in-memory filesystem whose writes die halfway, like a connection reset mid-upload.

    While ``fail_after`` is set, writing more bytes than that stores the first ``fail_after``
    bytes where the write was aimed (a non-atomic store keeps what arrived) and raises EIO.
    """

    protocol = "flaky"
    store: dict = {}  # noqa: RUF012 - fsspec's own convention: one store per class, not shared with memory://
    pseudo_dirs: list = [""]  # noqa: RUF012
    fail_after: int | None = None

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        data = bytes(value)
        limit = type(self).fail_after
        if limit is not None and len(data) > limit:
            super().pipe_file(path, data[:limit], **kwargs)
            raise OSError(errno.EIO, f"connection reset after {limit} of {len(data)} bytes (injected)")
        return super().pipe_file(path, data, **kwargs)


def register_flaky() -> None:
    fsspec.register_implementation("flaky", FlakyFileSystem, clobber=True)


class Net(torch.nn.Module):
    """A small model whose ``state_dict()`` can be told to fail, hang or kill its process."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.mode: str | None = None

    def state_dict(self, *args, **kwargs):
        if self.mode == "raise":
            raise RuntimeError("boom inside state_dict (injected)")
        if self.mode == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.mode == "hang":
            time.sleep(120)
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict=True, assign=False):
        if self.mode == "exit":
            os._exit(3)  # this rank dies while the others are inside the collective load
        return super().load_state_dict(state_dict, strict=strict, assign=assign)
