"""The ``__ckptools__`` record: what ckptools adds to every checkpoint it writes, in one typed place.

Writers build a `Record` and store ``record.to_dict()`` under `META_KEY`; readers get it back with
`record_of`, which checks ``format_version``: a record of a newer format than this ckptools reads
is refused with `CheckpointVersionError` naming the ckptools that wrote it, never read as if it
were today's. Keys this version does not know (a newer minor addition) are ignored by readers and
kept by those that copy the record whole (the keeper's write-outs, ``ckpt strip-module``).

Torch-free: the record holds plain values (the RNG states are lists of tensors, opaque here).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointLayoutError, CheckpointVersionError

__all__ = ["FORMAT_VERSION", "META_KEY", "Record", "record_of"]

# The entry ckptools adds to every checkpoint it writes.
META_KEY = "__ckptools__"
# The record's format: raised when a reader of this version could no longer read what a writer
# puts there (an added key does not raise it). A file of a greater one is refused.
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Record:
    """What a checkpoint says of itself (see the module docstring).

    Examples:
        >>> r = Record(rng=[], metadata={"step": 3}, world_size=2)
        >>> record_of({META_KEY: r.to_dict()}, "ckpt.pt").metadata["step"]
        3
    """

    rng: list[Any] | None = None  # every rank's random streams, by rank (`ckptools.rng.get_rng_state`)
    metadata: dict[str, Any] = field(default_factory=dict)  # the user's `metadata=` (a manager's "step")
    world_size: int | None = None
    ddp_buckets: Mapping[str, Any] | None = None  # DDP's rebuilt gradient buckets (`ckptools.write.buckets`)
    format_version: int = FORMAT_VERSION
    ckptools_version: str | None = None
    torch_version: str | None = None
    created_unix: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """The record as stored (plain types only, so ``torch.load(weights_only=True)`` reads it)."""
        out: dict[str, Any] = {
            "format_version": self.format_version,
            "ckptools_version": self.ckptools_version,
            "torch_version": self.torch_version,
            "world_size": self.world_size,
            "created_unix": self.created_unix,
            "rng": self.rng,
            "metadata": self.metadata,
        }
        if self.ddp_buckets:
            out["ddp_buckets"] = self.ddp_buckets
        return out


def record_of(ckpt: Mapping[str, Any], path: str) -> Record | None:
    """The record of a loaded checkpoint dict; None when it has none (a file ckptools did not write).

    Raises:
        CheckpointVersionError: a newer ckptools wrote it, in a format this one does not read.
        CheckpointLayoutError: the entry is there but is no record of ckptools' (not a mapping, no
            number for its format): a file of another tool that uses the name, never called damaged.

    Examples:
        >>> record_of({"model": {}}, "ckpt.pt") is None
        True
        >>> try:
        ...     record_of({META_KEY: {"format_version": 9, "ckptools_version": "2.0.0"}}, "ckpt.pt")
        ... except CheckpointVersionError as err:
        ...     print(str(err)[:51])
        ckpt.pt was written by ckptools 2.0.0 in checkpoint
    """
    raw = ckpt.get(META_KEY)
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise CheckpointLayoutError(f"{path}: its {META_KEY!r} entry is a {type(raw).__name__}, not ckptools' record")
    version = raw.get("format_version", FORMAT_VERSION)
    if type(version) is not int:
        raise CheckpointLayoutError(f"{path}: its {META_KEY!r} record has format_version {version!r}, not a number")
    if version > FORMAT_VERSION:
        who = raw.get("ckptools_version")
        raise CheckpointVersionError(
            f"{path} was written by ckptools {who if isinstance(who, str) else '(a newer version)'} in checkpoint "
            f"format {version}; this ckptools reads format {FORMAT_VERSION} and older: upgrade ckptools "
            "(pip install -U ckptools) to read it"
        )
    metadata = raw.get("metadata")
    world = raw.get("world_size")
    buckets = raw.get("ddp_buckets")
    rng = raw.get("rng")
    return Record(
        rng=list(rng) if isinstance(rng, (list, tuple)) else None,
        metadata=dict(metadata) if isinstance(metadata, Mapping) else {},
        world_size=world if type(world) is int else None,
        ddp_buckets=buckets if isinstance(buckets, Mapping) else None,
        format_version=version,
        ckptools_version=_text(raw.get("ckptools_version")),
        torch_version=_text(raw.get("torch_version")),
        created_unix=float(raw["created_unix"]) if isinstance(raw.get("created_unix"), (int, float)) else None,
    )


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None
