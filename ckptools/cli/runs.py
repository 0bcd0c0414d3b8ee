"""What a run folder holds: each `CheckpointManager` prefix's checkpoints and this node's snapshots
(`ckpt info RUN_DIR`, `ckpt verify RUN_DIR`), every framework's snapshots included (`ckptools.layouts.frameworks`).

Read from listings and sizes alone, by the names the manager gives its files (`ckptools.node`'s
names): no manager is built and torch is not imported."""

from __future__ import annotations

import os
import re
from typing import Any

from ..layouts import all_frameworks, framework_of, is_checkpoint_folder
from ..node import checkpoint_names, default_folder, readable
from ..storage import PathLike, file_size, fspath, join, list_files, resolve

__all__ = ["run_folder", "run_report"]

_RUN_FILE = re.compile(r"([A-Za-z0-9_-]+)-(\d{10})\.pt")


def run_report(directory: PathLike) -> dict[str, Any] | None:
    """What a `CheckpointManager`'s folder holds, or None when ``directory`` holds no numbered
    checkpoint and no snapshot of it is in this node's memory: for each prefix its checkpoints and
    this node's snapshots (`ckpt info RUN_DIR`). The snapshots of every framework's integration
    (the HF Trainer's, Lightning's, Accelerate's: `ckptools.layouts.frameworks`) count too: their entry
    names the framework (``of``), and one whose checkpoints are folders (the HF Trainer's
    ``checkpoint-N/``) lists those as its checkpoints. A framework's snapshots belong to a folder
    that need not hold a numbered file (the Trainer's output_dir, Lightning's dirpath).

    Local (reads listings and sizes only; nothing is verified).

    Examples:
        >>> import torch, ckptools as ck
        >>> _ = ck.CheckpointManager("/tmp/ckptools-doc-run-report").save({"w": torch.ones(1)}, 1)
        >>> [c["step"] for c in run_report("/tmp/ckptools-doc-run-report")["runs"][0]["checkpoints"]][-1]
        1
    """
    directory = fspath(directory)
    prefixes = {m.group(1) for n in list_files(directory) if (m := _RUN_FILE.fullmatch(n))}
    runs = []
    # The table read now, not at import: it may grow.
    for prefix in sorted(prefixes | {f.prefix for f in all_frameworks()}):
        memory = default_folder(directory, prefix)
        snapshots = _described(_numbered(memory, prefix) if readable(memory) else [])
        if prefix not in prefixes and not snapshots:
            continue  # an integration with nothing of this folder's in node memory
        entry: dict[str, Any] = {"prefix": prefix}
        framework = framework_of(prefix)
        if framework is not None:
            entry["of"] = framework.name
        if framework is not None and framework.folders is not None:
            checkpoints = _folders(directory, framework.folders)
        else:
            checkpoints = _described(_numbered(directory, prefix))
        runs.append({**entry, "checkpoints": checkpoints, "snapshot_dir": memory, "snapshots": snapshots})
    return {"path": directory, "runs": runs} if runs else None


def run_folder(path: str) -> dict[str, Any] | None:
    """`run_report` of ``path`` when it is a local folder that no checkpoint layout reads (asked first:
    a folder that holds a checkpoint is that checkpoint, whatever numbered files lie beside it), else None."""
    if "://" in path or not os.path.isdir(path) or is_checkpoint_folder(resolve(path)):
        return None
    return run_report(path)


def _numbered(folder: str, prefix: str) -> list[tuple[int, str]]:
    """``(step, path)`` of the numbered files of ``prefix`` in ``folder``, oldest first."""
    names = checkpoint_names(prefix)
    return sorted((int(m.group(1)), join(folder, n)) for n in list_files(folder) if (m := names.fullmatch(n)))


def _described(found: list[tuple[int, str]]) -> list[dict[str, Any]]:
    return [{"step": step, "path": path, "bytes": file_size(path)} for step, path in found]


def _folders(directory: str, pattern: re.Pattern[str]) -> list[dict[str, Any]]:
    """A framework's checkpoint folders in ``directory`` (local; the HF Trainer's ``checkpoint-N/``), the
    step in ``pattern``'s group 1, oldest first, with their files' bytes."""
    if "://" in directory or not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        folder = os.path.join(directory, name)
        if (m := pattern.fullmatch(name)) and os.path.isdir(folder):
            size = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(folder) for f in files)
            found.append({"step": int(m.group(1)), "path": folder, "bytes": size})
    return sorted(found, key=lambda c: c["step"])
