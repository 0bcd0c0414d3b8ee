"""Files torch's weights-only loader refuses or mishandles, from pytorch's test/test_serialization.py and the
bypasses reported against it, written as torch.save writes them (real zips, real records) with only data.pkl
changed. Each is a function ``(path) -> None``."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ckptools.codecs.parsed import Call, Global
from ckptools.codecs.pickle_writer import dumps
from ckptools.codecs.pickles import loads
from ckptools.codecs.torchzip import TorchZip


def _rewritten(path: Path, obj: Any, change: Callable[[Any], Any]) -> None:
    """``torch.save(obj)`` to ``path``, then its data.pkl replaced by ``change(parsed tree)``."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    source = path.with_suffix(".src")
    source.write_bytes(buffer.getvalue())
    with open(source, "rb") as src:
        archive = TorchZip(str(source), src)
        tree = change(loads(archive.read_pickle(src), str(source)))
        with open(path, "wb") as out:
            archive.write_with_pickle(src, out, dumps(tree))
    source.unlink()


def shared_paths(path: Path, depth: int = 60) -> None:
    """A few KB whose pickle shares each list twice: 2^depth paths down to one tensor (torch loads it at once)."""
    node: Any = {"w": torch.zeros(2)}
    for _ in range(depth):
        node = [node, node]
    torch.save({"state_dict": {"a": torch.ones(3)}, "blob": node}, path)


def _tensor_args(extent: Callable[[tuple[Any, ...]], tuple[Any, ...]]) -> Callable[[Any], Any]:
    def change(tree: Any) -> Any:
        call = tree["w"]
        call.args = extent(tuple(call.args))
        return tree

    return change


def size_past_storage(path: Path) -> None:
    """``w`` claims 8 elements of a storage of 4 (test_serialization's out-of-bounds storage check)."""
    _rewritten(
        path, {"w": torch.ones(4), "b": torch.zeros(2)}, _tensor_args(lambda a: (a[0], a[1], (8,), (1,), *a[4:]))
    )


def stride_past_storage(path: Path) -> None:
    """``w`` is [2, 2] with stride (3, 1) over 4 elements: its last element is element 4."""
    _rewritten(
        path, {"w": torch.ones(4), "b": torch.zeros(2)}, _tensor_args(lambda a: (a[0], a[1], (2, 2), (3, 1), *a[4:]))
    )


def offset_past_storage(path: Path) -> None:
    """``w`` starts at element 3 of 4 and holds 4."""
    _rewritten(path, {"w": torch.ones(4), "b": torch.zeros(2)}, _tensor_args(lambda a: (a[0], 3, a[2], a[3], *a[4:])))


def numel_overflow(path: Path) -> None:
    """``w``'s size multiplies past 2^63 (its stride is 0: it would fit any storage if numel did not overflow)."""
    big = (2**32, 2**32)
    _rewritten(path, {"w": torch.ones(4), "b": torch.zeros(2)}, _tensor_args(lambda a: (a[0], 0, big, (0, 0), *a[4:])))


def build_set_out_of_range(path: Path) -> None:
    """A plain tensor whose pickle BUILD calls ``set_(storage, 2, (8,), (1,))`` on it: past its storage of 4."""

    def change(tree: Any) -> Any:
        tree["w"].state = (tree["w"].args[0], 2, (8,), (1,))
        return tree

    _rewritten(path, {"w": torch.ones(4), "b": torch.zeros(2)}, change)


def meta_tensors(path: Path, cols: int = 4) -> None:
    """A checkpoint holding a meta tensor beside a real one (a model built on the meta device, saved as is)."""
    torch.save({"a": torch.empty(3, cols, device="meta"), "b": torch.ones(2)}, path)


def protocol_4(path: Path) -> None:
    """What ``torch.save(obj, f, pickle_protocol=4)`` writes: FRAME, MEMOIZE, STACK_GLOBAL, SHORT_BINUNICODE."""
    weights = {"module.a": torch.arange(10.0), "module.b": torch.ones(2, 3)}
    torch.save({"state_dict": weights, "n": {"step": 7}}, path, pickle_protocol=4)


REFUSED = {
    "size_past_storage": size_past_storage,
    "stride_past_storage": stride_past_storage,
    "offset_past_storage": offset_past_storage,
    "numel_overflow": numel_overflow,
    "build_set_out_of_range": build_set_out_of_range,
}

__all__ = ["REFUSED", "Call", "Global", "meta_tensors", "protocol_4", "shared_paths"]
