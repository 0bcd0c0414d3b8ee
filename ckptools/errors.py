"""Errors raised by ckptools.

Every error ckptools raises on purpose derives from :class:`CheckpointError`, and each
subclass also inherits the builtin exception that code without ckptools would catch::

    Exception
    └── CheckpointError
        ├── CheckpointNotFoundError  (also FileNotFoundError)
        ├── CheckpointFormatError    (also ValueError)   truncated, corrupt, not a checkpoint
        ├── UnsafeCheckpointError    (also ValueError)   needs arbitrary code to load
        └── KeyMismatchError         (also KeyError)     missing / unexpected keys

Messages name the path or key and say how to fix the problem.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "KeyMismatchError",
    "UnsafeCheckpointError",
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


class UnsafeCheckpointError(CheckpointError, ValueError):
    """The file needs arbitrary code (pickled globals outside torch's allowlist) to load."""


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
