"""What a run folder holds: each `CheckpointManager` prefix's checkpoints and this node's snapshots
(`ckpt info RUN_DIR`, `ckpt verify RUN_DIR`)."""

from __future__ import annotations

import re
from typing import Any

from .manager import CheckpointManager
from .storage import PathLike, file_size, fspath, list_files

__all__ = ["run_report"]

_RUN_FILE = re.compile(r"([A-Za-z0-9_-]+)-(\d{10})\.pt")


def run_report(directory: PathLike) -> dict[str, Any] | None:
    """What a `CheckpointManager`'s folder holds, or None when ``directory`` holds no numbered
    checkpoint: for each prefix its checkpoints and this node's snapshots (`ckpt info RUN_DIR`).

    Local (reads listings and sizes only; nothing is verified).

    Examples:
        >>> import torch, ckptools as ck
        >>> _ = ck.CheckpointManager("/tmp/ckptools-doc-run-report").save({"w": torch.ones(1)}, 1)
        >>> [c["step"] for c in run_report("/tmp/ckptools-doc-run-report")["runs"][0]["checkpoints"]][-1]
        1
    """
    directory = fspath(directory)
    prefixes = sorted({m.group(1) for n in list_files(directory) if (m := _RUN_FILE.fullmatch(n))})
    if not prefixes:
        return None
    runs = []
    for prefix in prefixes:
        manager = CheckpointManager(directory, prefix=prefix, keep_last=None)

        def described(found: list[tuple[int, str]]) -> list[dict[str, Any]]:
            return [{"step": step, "path": path, "bytes": file_size(path)} for step, path in found]

        runs.append({
            "prefix": prefix,
            "checkpoints": described(manager.checkpoints()),
            "snapshot_dir": manager.snapshot_dir,
            "snapshots": described(manager.snapshots()),
        })  # fmt: skip
    return {"path": directory, "runs": runs}
