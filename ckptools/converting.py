"""Conversion and renaming: the weights of any layout to safetensors (one file, or a Hugging Face folder of
shards), or to a torch file; their keys renamed without decoding a tensor (`rename_checkpoint`).

What is written for a source is its layout's to say (`ckptools.layouts.plan_safetensors`); the
safetensors format itself (reader, writer, checks) is `ckptools.codecs.safetensors`.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from collections.abc import Mapping
from typing import IO, Any

from . import log
from .errors import CheckpointLayoutError, CheckpointNotFoundError, weights_only_switch
from .layouts import SAFETENSORS_FILE, Planned, Transform, detect, plan_safetensors, read_weights, writer_for
from .state_dict import strip_for_reading
from .storage import PathLike, atomic_write, fspath, open_local, resolve

__all__ = ["convert", "convert_to_safetensors", "export_huggingface", "parse_size", "rename_checkpoint"]


def writes_folder(dst: str, max_shard_size: int | str | None = None) -> bool:
    """Whether converting to ``dst`` writes a Hugging Face folder: ``dst`` ends in ``/`` or is a
    folder, or a shard size is given. The one rule `convert`, `convert_to_safetensors` and
    ``ckpt convert`` follow."""
    return dst.endswith("/") or os.path.isdir(dst) or max_shard_size is not None


def convert_to_safetensors(
    src: PathLike,
    dst: PathLike,
    *,
    key: str | None = None,
    strip: str | None = "module.",
    metadata: Mapping[str, str] | None = None,
    max_shard_size: int | str | None = None,
    weights_only: bool = True,
    trust_code: bool | None = None,
) -> str:
    """Convert a checkpoint's weights to a safetensors file, or to a Hugging Face folder.

    The source is any layout `ckptools.open_checkpoint` reads (a torch file, a sharded
    index, a Hugging Face, Accelerate or DCP folder). The weights are found as in
    `ckptools.load_state_dict` (bare, or under ``state_dict``, ``model_state_dict``,
    ``model``, ``module``, or ``key``), the prefix is stripped, tied tensors are stored once (the
    dropped names in the ``ckptools.aliases`` metadata; the first name in the checkpoint's order
    is kept, so a tied ``lm_head`` is the one dropped, as transformers expects), scalar entries such as ``epoch`` and
    ``step`` are kept as JSON strings in the metadata, and each tensor's CRC-32 is recorded so
    ``ckpt verify`` can detect bit rot. A local zip checkpoint is streamed: each tensor's bytes
    are copied straight out of its zip record (torch is not even imported); other sources are
    read whole once.

    ``dst`` ending in ``/`` (or an existing folder), or ``max_shard_size`` given, writes a
    Hugging Face folder instead: see `export_huggingface`.

    Args:
        src: a checkpoint file or folder (path or URL).
        dst: the ``.safetensors`` file to write (atomically), or a folder.
        key: the entry holding the weights, when the usual names do not find them.
        strip: prefix to remove from every key that has it; None keeps keys as stored.
        metadata: extra string metadata.
        max_shard_size: for a folder: the largest shard (``"5GB"``, ``"500MB"``, or bytes).
        weights_only: keep torch's safe unpickler (the default); False lets torch unpickle everything in
            ``src`` (runs code from the file: for files you trust only), and a whole pickled module
            (``torch.save(model)``) gives its ``state_dict()``.
        trust_code: deprecated (goes in 0.6): ``trust_code=True`` is ``weights_only=False``.

    Returns:
        ``dst`` as a string.

    Raises:
        CheckpointNotFoundError: nothing at ``src``.
        CheckpointFormatError: ``src`` is damaged or not a checkpoint, or a tensor cannot be stored.
        UnsafeCheckpointError: the weights themselves need classes torch's safe loader refuses.
        KeyMismatchError: ``key`` names no entry.

    Examples:
        >>> import torch, ckptools as ck
        >>> torch.save({"model": {"w": torch.ones(2)}, "epoch": 3}, "/tmp/c.pt")
        >>> ck.convert_to_safetensors("/tmp/c.pt", "/tmp/c.safetensors")
        '/tmp/c.safetensors'
    """
    src, dst = fspath(src), fspath(dst)
    weights_only = weights_only_switch(weights_only, trust_code, "ck.convert_to_safetensors")
    if writes_folder(dst, max_shard_size):
        export_huggingface(src, dst, key=key, strip=strip, max_shard_size=max_shard_size or "5GB", metadata=metadata,
                           weights_only=weights_only)  # fmt: skip
        return dst
    with _plan(src, key, strip, not weights_only) as planned:
        return planned.write(dst, metadata=metadata)


def _plan(src: str, key: str | None, strip: str | None, trust_code: bool) -> Planned:
    """What to write for ``src``'s weights, ``strip`` removed from their names."""
    return plan_safetensors(
        src, key=key, transform=lambda weights: strip_for_reading(weights, strip), trust_code=trust_code
    )


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def parse_size(size: int | str) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"500MiB"`` -> 524_288_000, ``1024`` -> 1024 (transformers' units).

    Examples:
        >>> parse_size("5GB")
        5000000000
    """
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(size), re.IGNORECASE)
        if not match:
            raise ValueError(
                f"cannot read {size!r} as a size: give bytes or a number with KB/MB/GB/TB (or KiB/MiB/GiB)"
            )
        value = int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])
    if value <= 0:
        raise ValueError(f"a shard size must be positive, got {size!r}")
    return value


_WEIGHT_FILES = re.compile(r"(model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json)")


def export_huggingface(
    src: PathLike,
    out_dir: PathLike,
    *,
    max_shard_size: int | str = "5GB",
    key: str | None = None,
    strip: str | None = "module.",
    metadata: Mapping[str, str] | None = None,
    force: bool = False,
    config: PathLike | None = None,
    weights_only: bool = True,
    trust_code: bool | None = None,
) -> list[str]:
    """Write ``src``'s weights as a folder ``transformers``' ``from_pretrained`` reads.

    One ``model.safetensors`` when the weights fit in ``max_shard_size``, else
    ``model-0000k-of-0000n.safetensors`` shards (filled in the checkpoint's own tensor order, as
    ``save_pretrained`` does) and ``model.safetensors.index.json`` (``metadata.total_size`` and
    ``weight_map``). Tied tensors are stored once under the first name in that order (the input
    embedding, not ``lm_head``) and the other names left out of the index, as transformers
    writes them; ``from_pretrained`` ties them again. Each file carries ``format: pt`` and
    ckptools' CRC-32s. The folder may already hold ``config.json`` and tokenizer files (they are
    left alone); weight files already there are refused unless ``force``, and then replaced (no
    stale shard is left behind). Each file is written atomically and the index last.

    ``from_pretrained`` also needs the model's ``config.json`` (without it transformers fails with
    a misleading "ignore_mismatched_sizes" message): ``config`` copies it in, from a
    ``config.json`` file or from a folder (the one the model was loaded from, a Hub snapshot), with
    the generation config and tokenizer files found beside it. Without ``config``, a source that
    is itself such a folder (an HF Trainer's ``checkpoint-N/``, a ``save_pretrained`` folder or its
    index) brings them along, except those ``out_dir`` already holds (replaced with ``force``). A
    folder left without a ``config.json`` gets a `CheckpointWarning` saying so.

    Args:
        src: any checkpoint `ckptools.open_checkpoint` reads.
        out_dir: the folder (created if missing; local).
        max_shard_size: the largest shard: bytes or ``"5GB"``-style (GB = 10**9, GiB = 2**30).
        key: as for `convert_to_safetensors`.
        strip: as for `convert_to_safetensors`.
        metadata: as for `convert_to_safetensors`.
        force: replace weight files (and config files ``config`` brings) already in ``out_dir``.
        config: a ``config.json``, or a folder holding one (and tokenizer files), to copy in.
        weights_only: as for `convert_to_safetensors`.
        trust_code: deprecated (goes in 0.6): ``trust_code=True`` is ``weights_only=False``.

    Returns:
        The files written (weights first, then the config files copied).

    Examples:
        >>> import torch, ckptools as ck
        >>> torch.save({"model": {"w": torch.ones(2)}}, "/tmp/e.pt")
        >>> ck.export_huggingface("/tmp/e.pt", "/tmp/e-hf", force=True)
        ['/tmp/e-hf/model.safetensors']
    """
    src, out = fspath(src), fspath(out_dir).rstrip("/") or "/"
    if "://" in out:
        raise CheckpointLayoutError(f"{out}: a Hugging Face folder is written to a local path; copy it up afterwards")
    limit = parse_size(max_shard_size)
    if os.path.exists(out) and not os.path.isdir(out):
        raise CheckpointLayoutError(f"{out} is a file; name a folder to write a Hugging Face checkpoint into")
    old = sorted(n for n in os.listdir(out) if _WEIGHT_FILES.fullmatch(n)) if os.path.isdir(out) else []
    if old and not force:
        raise FileExistsError(f"{out} already holds weights ({', '.join(old[:3])}); pass --force to replace them")
    if config is not None:
        extras = _config_files(fspath(config), out, force)
    else:  # the source's own folder (checkpoint-N/, a save_pretrained folder) brings its config along
        beside = _source_folder(src)
        extras = [] if beside is None else _config_files(beside, out, force=True)
        extras = [f for f in extras if force or not os.path.exists(os.path.join(out, os.path.basename(f)))]
    trust = not weights_only_switch(weights_only, trust_code, "ck.export_huggingface")
    with _plan(src, key, strip, trust) as planned:
        return _write_folder(planned, out, limit, metadata, old, extras)


def _write_folder(
    planned: Planned, out: str, limit: int, metadata: Mapping[str, str] | None, old: list[str], extras: list[str]
) -> list[str]:
    """`export_huggingface`'s writes: the shards, the index, the config files; the files written."""
    meta = {**dict(metadata or {}), "format": "pt"}  # transformers refuses files without format=pt
    shards: list[list[str]] = [[]]
    filled = 0
    for name in planned.specs:  # the checkpoint's own order, as save_pretrained fills shards
        nbytes = planned.nbytes(name)
        if shards[-1] and filled + nbytes > limit:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += nbytes
    os.makedirs(out, exist_ok=True)
    written: list[str] = []
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map: dict[str, str] = {}
    for file, members in zip(names, shards):
        written.append(planned.write(os.path.join(out, file), members, meta))
        weight_map.update(dict.fromkeys(members, file))
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(map(planned.nbytes, planned.specs))}, "weight_map": weight_map}
        payload = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
        written.append(atomic_write(os.path.join(out, "model.safetensors.index.json"), lambda f: f.write(payload)))
    for stale in old:  # replaced: leave no shard the new index does not name
        if os.path.join(out, stale) not in written:
            os.remove(os.path.join(out, stale))
    for source in extras:
        written.append(atomic_write(os.path.join(out, os.path.basename(source)), _writer(source)))
    if not os.path.exists(os.path.join(out, "config.json")):
        log.warn(
            f"{out} has no config.json, which from_pretrained needs: pass config= (ckpt convert --config), a "
            "config.json or the folder the model came from, or copy it in"
        )
    return written


# What from_pretrained and AutoTokenizer read beside the weights, copied by export_huggingface(config=...).
CONFIG_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model",
    "sentencepiece.bpe.model", "chat_template.jinja", "chat_template.json", "preprocessor_config.json",
    "processor_config.json",
)  # fmt: skip


def _source_folder(src: str) -> str | None:
    """The local folder ``src`` is (or whose index ``src`` is), when it holds a ``config.json``."""
    if "://" in src:
        return None
    folder = src if os.path.isdir(src) else os.path.dirname(src) if src.endswith(".index.json") else None
    if folder is None or not os.path.isfile(os.path.join(folder or ".", "config.json")):
        return None
    return folder or "."


def _writer(source: str) -> Any:
    with open_local(source) as f:  # config and tokenizer files: small (a named pipe is refused, never waited on)
        payload = f.read()

    def write(f: IO[bytes]) -> None:
        f.write(payload)

    return write


def _config_files(config: str, out: str, force: bool) -> list[str]:
    """The files to copy for ``config`` (a config.json, or a folder holding one), checked first."""
    if os.path.isdir(config):
        files = [os.path.join(config, n) for n in CONFIG_FILES if os.path.isfile(os.path.join(config, n))]
        if not any(os.path.basename(f) == "config.json" for f in files):
            raise CheckpointNotFoundError(f"{config} holds no config.json; pass the model's config.json or its folder")
    elif os.path.isfile(config):
        files = [config]
        try:
            json.loads(pathlib.Path(config).read_bytes())
        except (ValueError, UnicodeDecodeError) as err:
            raise CheckpointLayoutError(f"{config} is not a JSON config ({err}); pass the model's config.json") from err
    else:
        raise CheckpointNotFoundError(f"config {config} does not exist; pass the model's config.json or its folder")
    if os.path.isfile(config) and os.path.basename(config) != "config.json":
        raise CheckpointLayoutError(f"{config}: from_pretrained reads a file named config.json; pass that file")
    same = [f for f in files if os.path.abspath(os.path.dirname(f)) == os.path.abspath(out)]
    clash = [os.path.basename(f) for f in files if os.path.exists(os.path.join(out, os.path.basename(f)))]
    if clash and not force and len(same) != len(files):
        raise FileExistsError(f"{out} already holds {', '.join(clash[:3])}; pass --force to replace them")
    return [f for f in files if f not in same]


def convert(
    src: PathLike,
    dst: PathLike,
    *,
    key: str | None = None,
    strip: str | None = "module.",
    max_shard_size: int | str | None = None,
    config: PathLike | None = None,
    force: bool = False,
    weights_only: bool = True,
    trust_code: bool | None = None,
) -> list[str]:
    """Convert the weights of any checkpoint into what ``dst`` names: what ``ckpt convert`` does.

    ``dst`` ending in ``/`` (or an existing folder, or ``max_shard_size`` given): a Hugging Face
    folder (`export_huggingface`, with ``config`` and ``force``); ``.safetensors``: one file
    (`convert_to_safetensors`); ``.pt``/``.pth``/``.bin``/``.ckpt``: a torch file of the bare
    weights, which ``torch.load(weights_only=True)`` reads. ``weights_only=False`` is the opt-in of every
    reader (torch's name): let torch unpickle everything in a file you trust (``trust_code=True``, the old
    spelling, warns and goes in 0.6).

    Returns:
        The files written.

    Raises:
        CheckpointLayoutError: ``dst`` names none of these, or ``config`` is given for a single file.

    Examples:
        >>> import torch, ckptools as ck
        >>> torch.save({"model": {"module.w": torch.ones(2)}}, "/tmp/k.pt")
        >>> ck.convert("/tmp/k.pt", "/tmp/k.safetensors"), ck.convert("/tmp/k.pt", "/tmp/k-weights.pt")
        (['/tmp/k.safetensors'], ['/tmp/k-weights.pt'])
    """
    src, dst = fspath(src), fspath(dst)
    weights_only = weights_only_switch(weights_only, trust_code, "ck.convert")
    if writes_folder(dst, max_shard_size):
        return export_huggingface(src, dst, max_shard_size=max_shard_size or "5GB", key=key, strip=strip,
                                  force=force, config=config, weights_only=weights_only)  # fmt: skip
    if config is not None:
        raise CheckpointLayoutError("--config is for a folder output (OUT_DIR/): a single file holds no config")
    writer = writer_for(dst)
    if writer is SAFETENSORS_FILE:
        return [convert_to_safetensors(src, dst, key=key, strip=strip, weights_only=weights_only)]
    if writer is not None:
        weights = read_weights(src, key=key, map_location="cpu", trust_code=not weights_only)
        writer.write_weights(resolve(dst), dict(strip_for_reading(dict(weights), strip)), {})
        return [dst]
    raise CheckpointLayoutError(
        f"cannot convert {src} to {dst}: name a .safetensors or .pt file, or a folder ending in /"
    )


def rename_checkpoint(src: PathLike, dst: PathLike, transform: Transform, *, key: str | None = None) -> int:
    """Rename the weights' keys of a checkpoint file or folder into ``dst``; return how many changed.

    What ``ckpt strip-module`` and ``ckpt add-module`` do: ``transform`` maps a state dict to the
    renamed one (`ckptools.strip_prefix`, `ckptools.add_prefix`, or your own). No
    tensor is decoded: a torch zip's ``data.pkl`` or a safetensors header is rewritten and the
    tensor bytes copied; every other entry (optimizer, epoch; even ones that need classes torch's
    safe loader refuses) is kept. A folder (Hugging Face or Accelerate, sharded or not) is written
    as a folder; ``dst`` may equal ``src`` (each file is replaced atomically). ``key`` names the
    entry of a torch file that holds the weights (dotted for nesting) when the usual names do not.
    A legacy or remote torch file goes through torch's safe loader. Each layout does its own part
    (`ckptools.layouts.base.Layout.rename`); a DCP folder, whose names live in a pickle, is refused.

    Raises:
        CheckpointLayoutError: a DCP folder, a folder holding no model file, or ``key`` for bare weights.

    Examples:
        >>> import torch, ckptools as ck
        >>> torch.save({"model": {"module.w": torch.ones(1)}, "epoch": 2}, "/tmp/r.pt")
        >>> ck.rename_checkpoint("/tmp/r.pt", "/tmp/r2.pt", ck.strip_prefix)
        1
    """
    location = resolve(src)
    return detect(location).rename(location, fspath(dst), transform, key=key)
