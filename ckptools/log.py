"""What ckptools tells the user: save/load reports on the ``ckptools`` logger, and warnings.

- ``logging.getLogger("ckptools")`` gets one INFO record per save and per load, on rank 0 only
  (path, bytes, seconds, GB/s; also as ``record.ckpt_path``, ``ckpt_bytes``, ``ckpt_seconds``).
  ckptools adds no handler: nothing is printed unless the application configures logging.
- Everything that goes wrong without stopping the run is a `CheckpointWarning` through
  `warnings` (so one filter, ``warnings.simplefilter("error", ck.CheckpointWarning)`` or pytest's
  ``-W error::ckptools.CheckpointWarning``, catches all of them, and ``catch_warnings`` records
  them) and, once, a WARNING record on the ``ckptools`` logger where the application has set up
  logging (so a job that logs sees it in its logs; without a handler, only the warning is
  printed; with ``logging.captureWarnings(True)``, only the ``py.warnings`` record it makes).
  Hazards that are the same on every rank (a DataLoader without its own seed, ...) are warned
  about once per process, on rank 0.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
import threading
import time
import warnings
from types import FrameType

from .errors import CheckpointWarning
from .storage import CALLER, PathLike, file_size
from .text import human_size

logger = logging.getLogger("ckptools")

_warned: set[str] = set()  # the `once` keys already warned about in this process
# A warning points at the user's line: the first frame outside ckptools and torch (a sampler's
# warning is raised from inside the DataLoader, a save's from inside the manager).
# torch's folder is found without importing torch (over a second): reading a file needs no torch.
_TORCH = importlib.util.find_spec("torch")
_TORCH_FOLDERS = (_TORCH.submodule_search_locations or []) if _TORCH else []
_INTERNAL = (os.path.dirname(os.path.abspath(__file__)) + os.sep, *(os.path.join(f, "") for f in _TORCH_FOLDERS))


def _rank() -> int:
    """This process's global rank; 0 while torch is not even imported (no process group can exist)."""
    if "torch" not in sys.modules:
        return 0
    import torch.distributed as dist  # here, not above: only once the program imported torch

    # Asked of torch itself: the collective wing stands on this module, not the other way round.
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _ours(frame: FrameType) -> bool:
    return frame.f_code.co_filename.startswith(_INTERNAL) or frame.f_code.co_filename == contextlib.__file__


def warn(message: str, *, once: str | None = None, all_ranks: bool = False) -> None:
    """Issue a `CheckpointWarning` and log it (rank 0 only unless ``all_ranks``; once per ``once`` key)."""
    if not all_ranks and _rank() != 0:
        return
    if once is not None:
        if once in _warned:
            return
        _warned.add(once)
    level, frame = 1, sys._getframe()
    while frame.f_back is not None and _ours(frame):  # the user's line, past ckptools and its context managers
        level, frame = level + 1, frame.f_back
    # The record first: under "-W error" the warning raises, and the log still says what happened.
    # Only where logging is set up (otherwise logging's last-resort handler would print the message
    # to stderr a second time, beside the warning itself), and not where logging.captureWarnings
    # already turns every warning into a record (the "py.warnings" logger's).
    captured = getattr(warnings.showwarning, "__module__", None) == "logging"
    if logger.hasHandlers() and not captured:
        logger.warning("%s", message, extra={"ckpt_warning": True})
    caller = CALLER.get() if frame.f_code.co_filename == threading.__file__ else None
    if caller is None:
        warnings.warn(message, CheckpointWarning, stacklevel=level)
        return
    while caller.f_back is not None and _ours(caller):  # a watched thread's: at the line that called ckptools
        caller = caller.f_back
    registry = caller.f_globals.setdefault("__warningregistry__", {})
    warnings.warn_explicit(message, CheckpointWarning, caller.f_code.co_filename, caller.f_lineno,
                           caller.f_globals.get("__name__"), registry, caller.f_globals)  # fmt: skip


def report(verb: str, path: PathLike, started: float, nbytes: int | None = None) -> None:
    """Log ``verb path (size in s, GB/s)`` at INFO on rank 0; ``started`` is a ``time.monotonic()``.

    The size is looked up only when the record will be emitted (``nbytes`` None: from the file,
    through ``path``'s filesystem when it is a resolved `Location`).
    """
    if _rank() != 0 or not logger.isEnabledFor(logging.INFO):
        return
    seconds = time.monotonic() - started
    if nbytes is None:
        try:
            nbytes = file_size(path)
        except OSError:
            nbytes = 0
    rate = f", {nbytes / seconds / 1e9:.3g} GB/s" if seconds > 0 else ""
    path = os.fspath(path)
    logger.info(
        "%s %s (%s in %.2f s%s)",
        verb,
        path,
        human_size(nbytes),
        seconds,
        rate,
        extra={"ckpt_path": path, "ckpt_bytes": nbytes, "ckpt_seconds": seconds},
    )
