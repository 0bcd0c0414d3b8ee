"""The read-only view of a checkpoint of any layout: what `ckptools.open_checkpoint` returns.

The layouts that make views are ``ckptools.layouts``; this module holds only the value types, so
that everything reading a view (the CLI, ``inspect``/``diff``) needs no layout code.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .storage import Location


class ViewReader(Protocol):
    """What a view reads through: its layout (`ckptools.layouts.base.Layout`)."""

    def weights(self, view: CheckpointView, key: str | None, map_location: Any) -> Mapping[str, Any]: ...

    def entry(self, view: CheckpointView, key: str, map_location: Any) -> Any: ...

    def verify(self, view: CheckpointView) -> Verification: ...


__all__ = ["CheckpointView", "TensorInfo", "Verification"]


@dataclass
class Verification:
    """What verifying a checkpoint found, when nothing was damaged.

    Attributes:
        said: what was checked, in words (``"torch zip, every record's CRC-32 matches, 3 tensors loaded"``).
        not_checksummed: the files whose bytes no stored checksum covers, each with what was
            checked instead (``{"model.safetensors": "structure checked; no checksums stored"}``).
            Empty when every byte was held against a checksum.

    Examples:
        >>> Verification("safetensors, 2 tensors", {"w.safetensors": "no checksums stored"}).line()
        'safetensors, 2 tensors; data not checksummed: w.safetensors (no checksums stored)'
    """

    said: str
    not_checksummed: dict[str, str] = field(default_factory=dict)

    @property
    def checksummed(self) -> bool:
        """Whether every byte was held against a stored checksum."""
        return not self.not_checksummed

    def line(self) -> str:
        """``said``, and what was not checksummed, in one line: never an OK about unchecked bytes."""
        if self.checksummed:
            return self.said
        return f"{self.said}; data not checksummed: " + ", ".join(f"{n} ({w})" for n, w in self.not_checksummed.items())


@dataclass
class TensorInfo:
    """One tensor as stored: name, dtype (torch's name: ``float32``), shape, bytes, saved device.

    ``shared`` marks a tensor whose storage another, earlier tensor already holds (tied
    weights; not counted twice in totals); ``file`` is the shard it lives in, for folders.
    """

    name: str
    dtype: str
    shape: list[int]
    bytes: int
    device: str = "cpu"
    shared: bool = False
    file: str | None = None


@dataclass
class CheckpointView:
    """A checkpoint of any layout, read-only. Made by `ckptools.open_checkpoint`.

    Attributes:
        path: what was opened.
        format: the layout, in words (``"torch zip"``, ``"sharded safetensors (3 shards)"``, ...).
        tensors: every tensor the checkpoint holds (for a training checkpoint, optimizer state
            too), from headers and pickles only: no tensor data is read.
        entries: top-level entries and a line about each (``"dict, 4 keys, 4 tensors"``, ``"3"``).
        metadata: ckptools' metadata, a safetensors ``__metadata__`` or an index's ``metadata``.
        files: the files the checkpoint consists of.
        extras: other files of the folder and what they hold (an Accelerate optimizer state).
        skipped: globals a lenient read left as inert placeholders (nothing was imported or run).
        file_bytes: total size on disk, when known.
        layout: the layout that opened it (`ckptools.layouts.base.Layout`), which reads and verifies it.
        location: where it is, resolved once.
        trust_code: whether it was opened with the opt-in to run code from the file.
        state: what the layout keeps between opening it and its later calls.
    """

    path: str
    format: str
    tensors: list[TensorInfo]
    entries: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    extras: dict[str, str] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    file_bytes: int | None = None
    layout: ViewReader | None = field(default=None, repr=False)
    location: Location | None = field(default=None, repr=False)
    trust_code: bool = field(default=False, repr=False)
    state: Any = field(default=None, repr=False)

    def weights(self, key: str | None = None, *, map_location: Any = "cpu") -> Mapping[str, Any]:
        """The model weights, names as stored (``module.`` and friends kept).

        Found as `ckptools.load_state_dict` finds them: a bare state dict, or under
        ``state_dict``/``model_state_dict``/``model``/``module``, or ``key`` (dotted). A sharded
        checkpoint gives a mapping that reads one shard at a time, when a tensor is asked for.

        Examples:
            >>> import torch, ckptools as ck
            >>> torch.save({"model": {"w": torch.ones(2)}}, "/tmp/view.pt")
            >>> list(ck.open_checkpoint("/tmp/view.pt").weights())
            ['w']
        """
        if self.layout is None:
            raise TypeError("this CheckpointView was not made by open_checkpoint: it has no layout to read from")
        return self.layout.weights(self, key, map_location)

    def entry(self, key: str, *, map_location: Any = "cpu") -> Any:
        """The entry at ``key`` (dotted for nesting, list indices too: ``"optimizer_states.0.state"``).

        Raises:
            KeyMismatchError: no such entry; the message names the keys that exist.
            CheckpointLayoutError: the layout holds bare weights (safetensors, folders): no entries.

        Examples:
            >>> import torch, ckptools as ck
            >>> torch.save({"model": {"w": torch.ones(2)}, "opt": [{"lr": 0.1}]}, "/tmp/entry.pt")
            >>> ck.open_checkpoint("/tmp/entry.pt").entry("opt.0.lr")
            0.1
        """
        if self.layout is None:
            raise TypeError("this CheckpointView was not made by open_checkpoint: it has no layout to read from")
        return self.layout.entry(self, key, map_location)

    def verify(self) -> Verification:
        """Read everything and check every checksum stored; return what was checked and what no checksum covers.

        Raises:
            CheckpointFormatError: the checkpoint is damaged (a checksum fails, a shard is missing
                or stray, a tensor cannot be read).
        """
        if self.layout is None:
            raise TypeError("this CheckpointView was not made by open_checkpoint: it has no layout to verify")
        return self.layout.verify(self)

    def report(self) -> dict[str, Any]:
        """What ``ckpt info --json`` prints: format, files, entries, tensors, totals, metadata."""
        total = sum(t.bytes for t in self.tensors if not t.shared)
        prefixed = sum(1 for t in self.tensors if wrapper_prefixed(t.name))
        report: dict[str, Any] = {
            "path": self.path,
            "format": self.format,
            "file_bytes": self.file_bytes,
            "entries": self.entries,
            "tensors": [{k: v for k, v in asdict(t).items() if k != "file" or v is not None} for t in self.tensors],
            "totals": {"tensors": len(self.tensors), "bytes": total, "module_prefixed": prefixed},
            "metadata": self.metadata,
        }
        if self.files:
            report["files"] = self.files
        if self.extras:
            report["extras"] = self.extras
        if self.skipped:
            report["skipped_globals"] = self.skipped
        return report


def wrapper_prefixed(name: str) -> bool:
    """Whether a tensor name carries a wrapper's prefix (DDP's ``module.``, torch.compile's ``_orig_mod.``)."""
    return name.startswith(("module.", "_orig_mod.")) or ".module." in name or "._orig_mod." in name
