"""The Hugging Face ``Trainer``: checkpoint folders a resume can trust.

    >>> from ckptools.integrations.transformers import CkptoolsCallback, latest_complete_checkpoint  # doctest: +SKIP
    >>> trainer = Trainer(..., callbacks=[CkptoolsCallback()])  # doctest: +SKIP
    >>> trainer.train(resume_from_checkpoint=latest_complete_checkpoint(args.output_dir))  # doctest: +SKIP

The ``Trainer`` writes ``checkpoint-N/`` file by file, in place (``_save_checkpoint``: model,
optimizer, scheduler, scaler, RNG states, ``trainer_state.json``, then it removes the oldest
folders beyond ``save_total_limit``), and ``resume_from_checkpoint=True`` takes the folder with
the highest N (``get_last_checkpoint``), whole or not: a kill mid-save leaves a folder without its
optimizer or trainer state, and the resume fails on it, or silently restarts parts of the state.

What the Trainer's extension points allow (read in transformers 5.x; ``on_save`` runs right after
``_save_checkpoint``): `CkptoolsCallback` writes ``ckptools-manifest.json`` into each new
``checkpoint-N/`` last, atomically, on the process that saves: every file's size and CRC-32.
`latest_complete_checkpoint` returns the newest folder that is complete: its manifest matches
(sizes; CRC-32s with ``verify=True``), or, for a folder without one (saved without the
callback, or killed between the Trainer's last file and the manifest), its
``trainer_state.json`` reads and every torch file and safetensors file in it checks out. A
folder it skips is named in a warning, with why.
"""

from __future__ import annotations

import json
import os
import re
from typing import IO, Any

from .. import log
from ..codecs.safetensors import verify_safetensors
from ..errors import CheckpointError
from ..serialization import verify_torch_file
from ..storage import TMP_MARKER, atomic_write, crc32_range

try:
    from transformers import TrainerCallback
except ImportError as err:
    raise ImportError("ckptools.integrations.transformers needs transformers: pip install transformers") from err

__all__ = ["MANIFEST", "CkptoolsCallback", "latest_complete_checkpoint", "write_manifest"]

MANIFEST = "ckptools-manifest.json"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_TORCH = (".pt", ".pth", ".bin", ".ckpt")


def write_manifest(folder: str) -> str:
    """Write ``folder/ckptools-manifest.json`` (every file's size and CRC-32), atomically, last.

    Returns:
        The manifest's path.

    Examples:
        >>> import os, tempfile
        >>> from ckptools.integrations.transformers import write_manifest
        >>> folder = tempfile.mkdtemp()
        >>> _ = open(os.path.join(folder, "trainer_state.json"), "w").write("{}")
        >>> os.path.basename(write_manifest(folder))
        'ckptools-manifest.json'
    """
    files = {}
    for root, _, names in os.walk(folder):
        for name in sorted(names):
            if name == MANIFEST or TMP_MARKER in name:
                continue
            path = os.path.join(root, name)
            files[os.path.relpath(path, folder)] = {"bytes": os.path.getsize(path), "crc32": _crc32(path)}
    text = json.dumps({"format": 1, "files": files}, indent=1, sort_keys=True).encode()

    def write(f: IO[bytes]) -> None:
        f.write(text)

    return atomic_write(os.path.join(folder, MANIFEST), write)


class CkptoolsCallback(TrainerCallback):  # type: ignore[misc,unused-ignore]  # Any without transformers
    """A ``TrainerCallback`` that seals every ``checkpoint-N/`` the Trainer saves with a manifest.

    Runs on the process that saves (``args.should_save``), in ``on_save``, i.e. after the
    Trainer wrote the folder's last file. Costs one read of the folder (its CRC-32s).

    Examples:
        >>> from ckptools.integrations.transformers import CkptoolsCallback  # doctest: +SKIP
        >>> trainer = Trainer(model, args, train_dataset=data, callbacks=[CkptoolsCallback()])  # doctest: +SKIP
    """

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if getattr(args, "should_save", True):
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            if os.path.isdir(folder):
                write_manifest(folder)
        return control


def latest_complete_checkpoint(output_dir: str, *, verify: bool = True) -> str | None:
    """The newest ``checkpoint-N`` folder of ``output_dir`` that is complete, or None.

    Complete: its manifest (`CkptoolsCallback`) lists every file with the size it has (and, with
    ``verify``, the CRC-32); without a manifest, its ``trainer_state.json`` reads and, with
    ``verify``, every torch file passes its CRC-32s and every safetensors file its structure.
    Folders that are not are skipped with a warning saying why.

    Examples:
        >>> from ckptools.integrations.transformers import latest_complete_checkpoint
        >>> latest_complete_checkpoint("/tmp/no-such-run") is None
        True
    """
    try:
        names = os.listdir(output_dir)
    except FileNotFoundError:
        return None
    steps = sorted(((int(m.group(1)), name) for name in names if (m := _CHECKPOINT.match(name))), reverse=True)
    for _, name in steps:
        folder = os.path.join(output_dir, name)
        if not os.path.isdir(folder):
            continue
        problem = _incomplete(folder, verify)
        if problem is None:
            return folder
        log.logger.warning("skipped %s: %s", folder, problem)
    return None


def _incomplete(folder: str, verify: bool) -> str | None:
    """Why ``folder`` is not a complete checkpoint (None if it is)."""
    manifest = os.path.join(folder, MANIFEST)
    if os.path.exists(manifest):
        try:
            with open(manifest, encoding="utf-8") as f:
                files = json.load(f)["files"]
        except (OSError, ValueError, KeyError) as err:
            return f"its {MANIFEST} is unreadable ({err})"
        for relative, entry in files.items():
            path = os.path.join(folder, relative)
            if not os.path.isfile(path):
                return f"{relative} is missing"
            if os.path.getsize(path) != entry["bytes"]:
                return f"{relative} has {os.path.getsize(path)} bytes, the manifest says {entry['bytes']}"
            if verify and _crc32(path) != entry["crc32"]:
                return f"{relative} does not match its CRC-32 in the manifest (damaged)"
        return None
    state = os.path.join(folder, "trainer_state.json")
    try:
        with open(state, encoding="utf-8") as f:
            json.load(f)
    except (OSError, ValueError) as err:
        return f"no {MANIFEST}, and trainer_state.json (the Trainer's last file) does not read ({err})"
    if verify:
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            try:
                if name.endswith(_TORCH):
                    verify_torch_file(path)
                elif name.endswith(".safetensors"):
                    verify_safetensors(path)
            except CheckpointError as err:
                return f"{name}: {err}"
    return None


def _crc32(path: str) -> int:
    with open(path, "rb") as f:
        return crc32_range(f, 0, os.path.getsize(path), what=path)
