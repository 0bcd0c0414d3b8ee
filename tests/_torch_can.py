"""What the installed torch can do, probed rather than read off its version: the suite runs on every
torch the package declares (`make compat`: its oldest and its newest), and some tests hold ckptools
against torch's own behaviour, which changed between releases."""

from __future__ import annotations

import functools
import io

import torch


@functools.cache
def save(dtype_name: str) -> bool:
    """Whether torch has the dtype and torch.save can write a tensor of it (2.4 cannot write uint16)."""
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        return False
    try:
        torch.save(torch.zeros(2).to(dtype), io.BytesIO())
    except Exception:  # noqa: BLE001 - any refusal means "cannot"
        return False
    return True


def load_safely(value: object) -> bool:
    """Whether torch.load(weights_only=True) reads back ``value`` as torch.save wrote it (before 2.5 its
    safe loader refused sets, bytes and complex numbers)."""
    buffer = io.BytesIO()
    torch.save({"v": value}, buffer)
    buffer.seek(0)
    try:
        return torch.load(buffer, weights_only=True)["v"] == value
    except Exception:  # noqa: BLE001
        return False


SAFE_GLOBALS_CONTEXT = hasattr(torch.serialization, "safe_globals")  # torch 2.5+


def handback_before_2_13() -> bool:
    """Whether this torch predates 2.13, whose tensors hand their Python object back to the thread
    that lets go of their second-to-last C++ reference (c10/util/intrusive_ptr.h, decref_pyobject):
    before it, a gloo thread never takes the GIL for a collective's tensors, ckptools' or anyone's."""
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return (major, minor) < (2, 13)
