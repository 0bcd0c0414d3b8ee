"""Renaming the weights of a checkpoint file or folder without decoding tensors (``ckpt strip-module``)."""

from __future__ import annotations

from .layouts import Transform, detect
from .storage import PathLike, fspath, resolve

__all__ = ["rename_checkpoint"]


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
