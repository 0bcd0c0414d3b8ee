"""Whether a checkpoint folder is whole: the one judgement `ckpt verify` and the HF Trainer's resume share.

A Hugging Face ``Trainer`` writes ``checkpoint-N/`` file by file, in place; Accelerate's
``save_state`` and ``save_pretrained`` write their folders likewise. A kill mid-save leaves a
folder that looks like a checkpoint and is not one. `check_folder` says, for every file it can
judge, whether it is whole and how it knows:

1. ``ckptools-manifest.json`` (written last, atomically, by
   ``ckptools.integrations.transformers.CkptoolsCallback``): every file it lists is there with its
   size and, with ``verify``, its CRC-32. Those bytes are checksummed.
2. The Trainer's expected set: a folder the Trainer wrote (named ``checkpoint-N`` as the Trainer
   names them, or holding a file only the Trainer writes: ``training_args.bin``,
   ``rng_state*.pth``, ``trainer_state.json``) is whole only with a ``trainer_state.json`` that
   reads, which the Trainer writes after everything else.
3. Accelerate's expected set: a folder ``save_state`` wrote (holding ``random_states_<rank>.pkl``,
   ``optimizer*.bin``, ``scheduler*.bin``, ``sampler*.bin`` or ``dl_state_dict*.bin``) is whole only
   with a model file, a ``random_states_<rank>.pkl`` for every rank from 0 to the highest found (each
   a complete pickle stream: the last files ``save_state`` writes, one per process), an
   ``optimizer*.bin`` where a ``scheduler*.bin`` is, and no temporary file inside. How many processes
   wrote it is recorded nowhere: a missing last rank's file is not seen without a manifest, and the
   verdict says so.
4. With ``verify``, every other file by its kind: torch zips by every record's CRC-32 (and the
   records the pickle names: `ckptools.layouts.torch_io.verify_torch_file`), safetensors files by
   their structure and the CRC-32s ckptools stores in them, JSON files by parsing. A file that
   none of this covers (a pickle, a tokenizer model, a legacy torch file) is named as not
   checksummed, never passed over in silence.
"""

from __future__ import annotations

import json
import os
import pickletools
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import IO

from ..codecs.safetensors import header_of, verify_safetensors
from ..codecs.torchzip import ZIP_MAGIC
from ..errors import CheckpointError
from ..storage import TMP_MARKER, atomic_write, crc32_range, fsync_dir, open_local
from ..text import plural
from .frameworks import ACCELERATE_RNG, ACCELERATE_STATE, TRAINER_STATE, is_accelerate_folder, is_trainer_folder
from .named import writer_for
from .safetensors_file import SAFETENSORS_FILE
from .torch_file import TORCH_FILE
from .torch_io import verify_torch_file

__all__ = [
    "MANIFEST",
    "FolderCheck",
    "check_folder",
    "file_crc32",
    "files_whole",
    "folder_files",
    "write_manifest",
]

MANIFEST = "ckptools-manifest.json"
_PICKLE = b"\x80"  # the first byte of a pickle stream (protocol 2 and later): a legacy torch file
# Its weights, either name with either suffix (wider than accelerate_file's two), or their sharded index.
_ACCELERATE_MODEL = re.compile(
    r"^(model|pytorch_model)(_\d+)?\.(safetensors|bin)$|^(model\.safetensors|pytorch_model\.bin)\.index\.json$"
)
_TEMPORARY = re.compile(r"(\.tmp|\.temp|\.part|~)$|^\.?tmp|\.tmp\.", re.I)


@dataclass
class FolderCheck:
    """What `check_folder` found.

    Attributes:
        problem: why the folder is not whole (a file missing, cut short or damaged), or None.
        said: what was checked, in words, for a verify line.
        checksummed: the files whose bytes matched a stored checksum (the manifest's or their own).
        not_checksummed: the files no checksum covers, each with what was checked instead.
    """

    problem: str | None = None
    said: list[str] = field(default_factory=list)
    checksummed: set[str] = field(default_factory=set)
    not_checksummed: dict[str, str] = field(default_factory=dict)


def folder_files(folder: str) -> list[str]:
    """Every file below ``folder``, relative to it, sorted; a writer's temporaries left out."""
    found = []
    for root, _, names in os.walk(folder):
        for name in names:
            if TMP_MARKER not in name:
                found.append(os.path.relpath(os.path.join(root, name), folder))
    return sorted(found)


def file_crc32(path: str) -> int:
    """The CRC-32 of a whole local file, as the manifest stores it."""
    with open_local(path) as f:
        return crc32_range(f, 0, os.fstat(f.fileno()).st_size, what=path)


def write_manifest(folder: str) -> str:
    """Write ``folder/ckptools-manifest.json`` (every file's size and CRC-32), atomically, last.

    ``ckptools.integrations.transformers.CkptoolsCallback`` calls it once the Trainer has written
    ``checkpoint-N/``; any writer of a folder can, once its last file is written.

    Returns:
        The manifest's path.

    Examples:
        >>> import os, tempfile
        >>> folder = tempfile.mkdtemp()
        >>> _ = open(os.path.join(folder, "trainer_state.json"), "w").write("{}")
        >>> os.path.basename(write_manifest(folder))
        'ckptools-manifest.json'
    """
    files = {}
    folders = {folder}
    for name in folder_files(folder):
        if name != MANIFEST:
            path = os.path.join(folder, name)
            files[name] = {"bytes": os.path.getsize(path), "crc32": file_crc32(path)}
            _fsync_file(path)  # the writer (torch.save, safetensors) left it in the page cache only
            folders.add(os.path.dirname(path))
    for directory in folders:  # their names too, before the manifest says they are there
        fsync_dir(directory)
    text = json.dumps({"format": 1, "files": files}, indent=1, sort_keys=True).encode()

    def write(f: IO[bytes]) -> None:
        f.write(text)

    return atomic_write(os.path.join(folder, MANIFEST), write)


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_folder(folder: str, *, verify: bool = True, skip: Collection[str] = ()) -> FolderCheck:
    """Judge whether ``folder`` is whole (see the module docstring for how).

    Args:
        folder: a local folder.
        verify: read every byte (CRC-32s, structure); without it only the manifest's sizes and the
            Trainer's expected set are checked, which is what a quick resume decision needs.
        skip: files (relative names) whose contents the caller checks itself (the model files a
            layout verifies); the manifest still covers them.

    Returns:
        A `FolderCheck`; ``problem`` is None when the folder is whole.

    Examples:
        >>> import json, os, tempfile
        >>> folder = os.path.join(tempfile.mkdtemp(), "checkpoint-4")
        >>> os.mkdir(folder)
        >>> check_folder(folder).problem
        "no ckptools-manifest.json, and trainer_state.json (the Trainer's last file) is missing"
    """
    names = folder_files(folder)
    found = FolderCheck()
    if MANIFEST in names:
        found.problem = _check_manifest(folder, verify, found)
        if found.problem is not None:
            return found
    elif is_trainer_folder(folder, names):
        found.problem = _check_trainer_state(folder, names)
        if found.problem is not None:
            return found
    elif is_accelerate_folder(names):
        found.problem = _check_accelerate(folder, names, found)
        if found.problem is not None:
            return found
    elif names and all(_ACCELERATE_MODEL.match(n) for n in names):
        found.not_checksummed["(whether it is whole)"] = (
            f"bare weights and no {MANIFEST}: a save_state killed after its first file leaves such a folder, "
            "which cannot be told from a folder of weights alone"
        )
    if not verify:
        return found
    covered = found.checksummed | {MANIFEST}
    zips: list[str] = []
    for name in names:
        if name in covered or name in skip:
            continue
        problem = _check_file(folder, name, found, zips)
        if problem is not None:
            found.problem = problem if problem.startswith(name) else f"{name}: {problem}"
            return found
    if zips:
        found.said.append(f"{', '.join(zips)}: every record's CRC-32 matches")
    return found


def _check_manifest(folder: str, verify: bool, found: FolderCheck) -> str | None:
    try:
        with open_local(os.path.join(folder, MANIFEST)) as f:
            files = json.loads(f.read().decode("utf-8"))["files"]
        entries = {str(name): (int(e["bytes"]), int(e["crc32"])) for name, e in files.items()}
    except (CheckpointError, OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return f"its {MANIFEST} is unreadable ({type(err).__name__}: {err})"
    for relative, (size, crc) in entries.items():
        path = os.path.join(folder, relative)
        if not os.path.isfile(path):
            return f"{relative} is missing (the manifest lists it)"
        if os.path.getsize(path) != size:
            return f"{relative} has {os.path.getsize(path)} bytes, the manifest says {size}"
        if verify and file_crc32(path) != crc:
            return f"{relative} does not match its CRC-32 in the manifest (damaged)"
    if verify:
        found.checksummed.update(entries)
        found.said.append(f"{MANIFEST}: sizes and CRC-32s of {plural(len(entries), 'file')} match")
    else:
        found.said.append(f"{MANIFEST}: sizes of {plural(len(entries), 'file')} match")
    return None


def _check_trainer_state(folder: str, names: Collection[str]) -> str | None:
    if TRAINER_STATE not in names:
        return f"no {MANIFEST}, and {TRAINER_STATE} (the Trainer's last file) is missing"
    try:
        with open_local(os.path.join(folder, TRAINER_STATE)) as f:
            json.loads(f.read().decode("utf-8"))
    except (CheckpointError, OSError, ValueError) as err:
        return f"no {MANIFEST}, and {TRAINER_STATE} (the Trainer's last file) does not read ({err})"
    return None


def _check_accelerate(folder: str, names: list[str], found: FolderCheck) -> str | None:
    """Accelerate's expected set (module docstring, 3.); why the folder is not whole, or None."""
    temporary = [n for n in os.listdir(folder) if _TEMPORARY.search(n) or TMP_MARKER in n]
    if temporary:
        return f"{', '.join(sorted(temporary)[:3])} is a temporary file: a save_state that did not finish"
    if not any(_ACCELERATE_MODEL.match(n) for n in names):
        return "no model file (model.safetensors, pytorch_model.bin or their shards), which save_state writes first"
    ranks = sorted(int(m[1]) for m in map(ACCELERATE_RNG.match, names) if m)
    if not ranks:
        return "no random_states_<rank>.pkl: save_state writes one per process, last, so it did not finish"
    missing = sorted(set(range(ranks[-1] + 1)) - set(ranks))
    if missing:
        return (
            f"random_states_{missing[0]}.pkl is missing (the folder has rank {ranks[-1]}'s): save_state did not finish"
        )
    for rank in ranks:
        name = f"random_states_{rank}.pkl"
        with open_local(os.path.join(folder, name)) as f:
            data = f.read()
        if data[:4] == ZIP_MAGIC:  # torch.save's zip (Accelerate since 0.2x): every record's CRC-32
            try:
                verify_torch_file(os.path.join(folder, name))
            except CheckpointError as err:
                return f"{err}; save_state did not finish".replace(os.path.join(folder, name), name)
            found.checksummed.add(name)
            continue
        try:
            for _ in pickletools.genops(data):  # a bare pickle, parsed, never run: one cut short has no STOP
                pass
        except (ValueError, EOFError) as err:
            return f"{name} is cut short ({len(data)} bytes: {err}); save_state did not finish"
    optimizers = any(n.startswith("optimizer") and ACCELERATE_STATE.match(n) for n in names)
    if not optimizers and any(n.startswith("scheduler") and ACCELERATE_STATE.match(n) for n in names):
        return "a scheduler*.bin without any optimizer*.bin, which save_state writes before it"
    found.said.append(
        f"Accelerate's files: a model file, {'random_states_0' if len(ranks) == 1 else f'random_states_0..{ranks[-1]}'}"
        ".pkl complete"
        + ("" if optimizers else ", no optimizer*.bin (an Accelerator without an optimizer writes none)")
    )
    found.not_checksummed["(the objects registered)"] = (
        "which schedulers, GradScaler, custom objects and further models or optimizers the Accelerator had is "
        f"recorded nowhere: a missing file of one cannot be told without a {MANIFEST} (an attached "
        "load_state, knowing the Accelerator, refuses it before loading anything)"
    )
    found.not_checksummed["(the number of processes)"] = (
        f"recorded nowhere: {len(ranks)} random_states files, and a missing last one cannot be told without a "
        f"{MANIFEST}"
    )
    return None


def files_whole(folder: str, names: Collection[str]) -> str | None:
    """Each of ``names`` in ``folder`` present and whole, told without reading its data (what a load about
    to read them needs first): a torch zip's directory, its ``data.pkl`` (CRC-32 checked, parsed without
    running anything) and a record holding every storage it names; a safetensors file's header and its
    size; a bare pickle's opcodes to its STOP. Why one is not, or None.

    Examples:
        >>> import tempfile
        >>> files_whole(tempfile.mkdtemp(), ["optimizer.bin"])
        'optimizer.bin is missing'
    """
    from ..codecs.pickles import loads_lenient
    from ..codecs.torchzip import TorchZip

    for name in names:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return f"{name} is missing"
        try:
            with open_local(path) as f:
                head = f.read(4)
                f.seek(0)
                if head == ZIP_MAGIC:
                    archive = TorchZip(path, f)
                    loads_lenient(archive.read_pickle(f), path, archive)
                elif name.endswith(".safetensors"):
                    header_of(f, path)
                else:
                    data = f.read()
                    for _ in pickletools.genops(data):  # a bare pickle: one cut short has no STOP
                        pass
        except CheckpointError as err:
            return str(err).replace(path, name)
        except (OSError, ValueError, EOFError) as err:
            return f"{name} is cut short or damaged ({type(err).__name__}: {err})"
    return None


def _check_file(folder: str, name: str, found: FolderCheck, zips: list[str]) -> str | None:
    """Check one file by its kind; record how; return why it is damaged, or None."""
    path = os.path.join(folder, name)
    try:
        writer = writer_for(name)  # the layout a weights file of this name is
        if writer is TORCH_FILE:
            with open_local(path) as f:
                legacy = f.read(1) == _PICKLE
            if legacy:  # torch before 1.6 wrote a bare pickle stream: nothing to check it against
                found.not_checksummed[name] = "torch's legacy format: no checksums"
            else:  # a zip, or not a torch file at all (damaged): the check says which
                verify_torch_file(path)
                found.checksummed.add(name)
                zips.append(name)
        elif writer is SAFETENSORS_FILE:
            if verify_safetensors(path):
                found.checksummed.add(name)
            else:
                found.not_checksummed[name] = "structure checked; no checksums stored"
        elif name.endswith(".json"):
            with open_local(path) as f:
                json.loads(f.read().decode("utf-8"))
            found.not_checksummed[name] = "reads as JSON"
        else:
            found.not_checksummed[name] = "not read"
    except CheckpointError as err:
        return str(err).replace(path, name)  # the folder is named once, by the caller
    except (OSError, ValueError) as err:
        return f"does not read ({type(err).__name__}: {err})"
    return None
