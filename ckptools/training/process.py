"""A DDP job's two ends: joining it (`init_distributed`, which also starts noting optimizer steps)
and leaving it, every rank together, with nothing ckptools or the script wrote lost (`exit_process`)."""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import os
import sys
from typing import NoReturn

import torch

from ..collective import launch
from ..collective.arrival import arrive
from ..lifecycle import end_job
from ..owned.gradients import track

__all__ = ["ORPHANED_EXIT", "exit_process", "init_distributed", "leave"]


@functools.wraps(launch.init_distributed)  # its docstring, name and module: the one users read
def init_distributed(backend: str | None = None, *, timeout: datetime.timedelta | None = None) -> torch.device:
    # The first call of nearly every loop, before its first optimizer step: from here a save inside a
    # gradient-accumulation window knows which gradients no step consumed (owned/gradients.py). The
    # collective wing sits below owned/ and cannot register the hook itself.
    track()
    return launch.init_distributed(backend, timeout=timeout)


# The exit status of ranks that leave because torchrun's agent is gone: 128 + SIGHUP, as for a process
# whose controlling terminal hung up (`CheckpointManager.snapshot`, `Preemption.should_stop`).
ORPHANED_EXIT = 129


def exit_process(code: int = 0, *, collective: bool = True) -> NoReturn:
    """End a DDP script: finish a save in flight, barrier, flush, then ``os._exit(code)``.

    Collective: every rank calls it, as the script's last line (while the DDP model is still
    referenced). Returning from ``main`` instead lets Python free the DDP model, and freeing it
    destroys the process group from inside a destructor that can hang in gloo's thread join or
    abort with "terminate called without an active exception". Everything ckptools wrote is
    complete and fsynced by the time this runs, stdout, stderr and every logging handler are
    flushed, so skipping the interpreter's teardown loses nothing written through them (close
    files the script opened itself first).

    ``collective=False`` is for error paths, where the other ranks may never arrive: no barrier
    and no waiting for a background save (an interrupted write leaves the previous checkpoint
    intact); only the flush and the exit. The node-memory snapshots of `CheckpointManager.snapshot`
    are removed after the barrier of a collective exit only: a job that failed keeps them for its
    relaunch.

    Examples:
        >>> import ckptools as ck
        >>> if False:  # the last line of a DDP script's main(), on every rank
        ...     ck.exit_process(0)
    """
    if collective:
        arrive("ck.exit_process")
        end_job()  # the job ended normally: its node-memory snapshots go (a crash keeps them)
    leave(code)


def leave(code: int) -> NoReturn:
    """Flush stdout, stderr and every logging handler, then ``os._exit(code)``."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in getattr(logger, "handlers", []):
            with contextlib.suppress(Exception):
                handler.flush()
    os._exit(code)
