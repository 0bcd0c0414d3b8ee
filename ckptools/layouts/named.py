"""Which layout one file of weights is by its name alone, and which layout writes a name.

`ckptools.layouts.detect` decides what a path is (it looks at folders first); a folder or an
index that names its weight files (``model.safetensors``, ``pytorch_model-00001-of-00002.bin``)
asks `file_layout` here, and `save_weights` and `convert` ask `writer_for` which layout writes
the file they were given. One place knows the suffixes.
"""

from __future__ import annotations

from .base import Layout
from .safetensors_file import SAFETENSORS_FILE
from .torch_file import TORCH_FILE

__all__ = ["TORCH_SUFFIXES", "file_layout", "writer_for"]

# The names torch files go by (``torch.save`` itself takes any).
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


def file_layout(name: str) -> Layout:
    """The layout of one file of weights: a ``.safetensors`` file, else a torch file.

    Examples:
        >>> file_layout("model-00001-of-00002.safetensors").name, file_layout("pytorch_model.bin").name
        ('safetensors file', 'torch file')
    """
    return SAFETENSORS_FILE if name.endswith(".safetensors") else TORCH_FILE


def writer_for(name: str) -> Layout | None:
    """The layout that writes bare weights to a file of this name (`Layout.write_weights`), or
    None for a name that is neither a ``.safetensors`` file nor a torch file.

    Examples:
        >>> writer_for("final.safetensors").name, writer_for("final.pt").name, writer_for("final.txt")
        ('safetensors file', 'torch file', None)
    """
    if name.endswith(".safetensors"):
        return SAFETENSORS_FILE
    return TORCH_FILE if name.endswith(TORCH_SUFFIXES) else None
