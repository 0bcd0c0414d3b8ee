"""Errors raised by ckptools.

Every error ckptools raises on purpose derives from `CheckpointError`, and each
subclass also inherits the builtin exception that code without ckptools would catch::

    Exception
    └── CheckpointError
        ├── CheckpointNotFoundError  (also FileNotFoundError)
        ├── CheckpointFormatError    (also ValueError)   truncated, corrupt, not a checkpoint
        │   └── CheckpointLayoutError                    valid, but not read as given
        │       └── CheckpointVersionError               written by a newer ckptools, in a newer format
        ├── UnsafeCheckpointError    (also ValueError)   needs arbitrary code to load
        │   └── UnsafeStateError     (also TypeError)    save refused: the state holds such a value
        ├── MissingClassError        (also ImportError)  a trusted file's pickled class is not importable
        ├── NotChecksummedError      (also ValueError)   verify(strict=True): bytes no checksum covers
        └── KeyMismatchError         (also KeyError)     missing / unexpected keys

    UserWarning
    └── CheckpointWarning   a run that continues, but not the way the user expects (not bit-exactly,
                            a damaged checkpoint skipped, an old one that could not be deleted)

Messages name the path or key and say how to fix the problem. Warnings go through
`warnings`, never through the ``ckptools`` logger (which reports saves and loads at INFO), so
``warnings.simplefilter("error", ckptools.CheckpointWarning)`` (or pytest's
``-W error::ckptools.CheckpointWarning``) turns every one of them into an error in a test suite and
``logging.captureWarnings(True)`` sends them to the logs.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointLayoutError",
    "CheckpointNotFoundError",
    "CheckpointVersionError",
    "CheckpointWarning",
    "KeyMismatchError",
    "MissingClassError",
    "NotChecksummedError",
    "ReplicaMismatchError",
    "UnsafeCheckpointError",
    "UnsafeStateError",
]


class CheckpointError(Exception):
    """Base class of every error ckptools raises on purpose."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint file (or directory) does not exist."""

    def __str__(self) -> str:
        # FileNotFoundError would render a single argument as-is, but with two or more it
        # switches to "[Errno ...]" formatting; always show our message.
        return str(self.args[0]) if self.args else ""


class CheckpointFormatError(CheckpointError, ValueError):
    """The file exists but is truncated, corrupt, or not a checkpoint at all."""


class CheckpointLayoutError(CheckpointFormatError):
    """A valid file or folder, but not a checkpoint ckptools reads as given.

    One shard of a DCP checkpoint (``__0_0.distcp``: pass its folder), a folder that holds no
    model file, a JSON file that is no sharded index. Never a damaged file: ``ckpt verify`` exits
    2 for these, not 1, and the message says what to pass instead.
    """


class CheckpointVersionError(CheckpointLayoutError):
    """A checkpoint a newer ckptools wrote, in a record format this version does not read.

    Its ``__ckptools__`` record's ``format_version`` is greater than this ckptools' own: the
    message names the version that wrote it; upgrade ckptools to read it. Never damage.
    """


class UnsafeCheckpointError(CheckpointError, ValueError):
    """The file needs arbitrary code (pickled globals outside torch's allowlist) to load."""


class MissingClassError(CheckpointError, ImportError):
    """A file trusted to run its pickled code names a class that cannot be imported here.

    ``torch.save(model)`` pickles the model's class by its module path; an OmegaConf config needs
    ``omegaconf``. The file is intact: install the module (the message names it), or read the
    weights without trusting the file, with inert placeholders for such classes. ``ckpt verify``
    exits 2 for this, never 1 (damaged).
    """


class NotChecksummedError(CheckpointError, ValueError):
    """``verify(..., strict=True)`` found nothing damaged, but some bytes carry no checksum to check.

    A safetensors file written by another tool, a DCP folder, a legacy torch file, a folder's
    tokenizer files: their structure was checked, their data could not be. Never a damaged
    checkpoint; ``ckpt verify --strict`` exits 1 for it, and the message names the files.
    """


class NodeMemoryError(CheckpointError):
    """`CheckpointManager.snapshot` cannot keep its snapshots in the node-memory folder: too
    little free space for two slots (the message names the sizes and the fixes: a larger
    ``/dev/shm``, a memory-backed Kubernetes ``emptyDir``, another ``snapshot_dir``)."""


class StorageStalledError(CheckpointError):
    """A write to (or a restore's read from) the checkpoint's storage made no progress for the stall bound
    (``CKPTOOLS_STALL_TIMEOUT`` seconds, default 120): raised on every rank, well before the process group's
    own timeouts, instead of the ranks waiting in a collective until a watchdog kills the job. Nothing of
    that save is published (the writer, stuck in the storage, gives up at its next step); older checkpoints
    are untouched. The message names the rank whose storage stalled, the target, what was written and how
    fast, and the fixes (docs/guarantees.md, "Slow and stuck storage").
    """


class ReplicaMismatchError(CheckpointError):
    """A tensor DDP keeps equal on every rank differs between ranks: nothing of the save was written.

    Attributes:
        where: the first that differs (``model.fc1.weight``, ``opt.param_groups``).
        differ: the ranks whose copy disagrees with rank 0's.
    """

    def __init__(self, message: str, *, where: str = "", differ: list[int] | None = None) -> None:
        super().__init__(message)
        self.where = where
        self.differ = differ or []


class UnsafeStateError(UnsafeCheckpointError, TypeError):
    """``save`` refused a value that ``torch.load(weights_only=True)`` would refuse to load.

    Raised on every rank before anything is written, so a run finds out at its first save, not
    when it restarts. The message names the entry (``state['args']``) and the fix (``vars(args)``).
    """


class KeyMismatchError(CheckpointError, KeyError):
    """The checkpoint's keys do not match the target's keys (strict loading).

    Attributes:
        missing: keys the target expects but the checkpoint lacks.
        unexpected: keys the checkpoint has but the target does not expect.
    """

    def __init__(self, message: str, *, missing: list[str] | None = None, unexpected: list[str] | None = None) -> None:
        super().__init__(message)
        self.missing = list(missing or [])
        self.unexpected = list(unexpected or [])

    def __str__(self) -> str:
        # KeyError.__str__ would wrap the message in quotes.
        return str(self.args[0]) if self.args else ""


class CheckpointWarning(UserWarning):
    """A run goes on, but not as the user expects: not bit-exactly, or with a checkpoint skipped."""


def deprecated(message: str) -> None:
    """A `DeprecationWarning` saying ``message``, at the user's line: the first frame outside ckptools, however
    many of ckptools' calls (a manager, an integration, a wrapper) came between."""
    import os
    import sys
    import warnings

    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame = sys._getframe(1)  # the caller of deprecated: stack level 2 of warnings.warn below
    level = 2
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, DeprecationWarning, stacklevel=level)


def weights_only_switch(weights_only: bool, trust_code: bool | None, where: str) -> bool:
    """``weights_only`` (torch's name, the one spelling of every reader's switch: False runs code from a file you
    trust), with the old ``trust_code`` mapped onto it (a `DeprecationWarning` naming the new spelling; it goes in
    0.6): ``trust_code=True`` is ``weights_only=False``. ``where`` names the call in the warning.

    Examples:
        >>> weights_only_switch(True, None, "ck.inspect")
        True
    """
    if trust_code is None:
        return bool(weights_only)
    deprecated(f"{where}(trust_code=...) is deprecated and goes in 0.6: pass weights_only={not trust_code!r} "
               f"(trust_code={trust_code!r} is the same), torch's and ck.load's name for the switch")  # fmt: skip
    return bool(weights_only) and not trust_code
