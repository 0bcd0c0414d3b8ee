"""Queries on a parsed checkpoint tree: which nodes are tensors, their size, where the weights are."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import CheckpointFormatError, KeyMismatchError
from .dtypes import DTYPE_ITEMSIZE, STORAGE_ITEMSIZE
from .parsed import Call, Global, StorageRef
from .pickles import REBUILD_FUNCTIONS

# The entry that marks a checkpoint Lightning's Trainer wrote.
LIGHTNING_VERSION_KEY = "pytorch-lightning_version"


# Where other tools nest a model's weights, most specific first.
WEIGHT_KEYS = ("state_dict", "model_state_dict", "model", "module")


def is_tensor(node: Any) -> bool:
    """Whether a parsed node is a tensor (a call of one of torch's rebuild functions)."""
    return isinstance(node, Call) and (node.func.name in REBUILD_FUNCTIONS or node.func.name == "_rebuild_from_type_v2")


def simple_tensor(node: Any) -> tuple[StorageRef, int, list[int], list[int]] | None:
    """``(storage, storage_offset, shape, stride)`` of a plain dense tensor or Parameter, else None."""
    if isinstance(node, Call) and node.func.name in ("_rebuild_parameter", "_rebuild_parameter_with_state"):
        node = node.args[0] if node.args else None
    if not (isinstance(node, Call) and node.func.name == "_rebuild_tensor_v2" and len(node.args) >= 4):
        return None
    storage, offset, shape, stride = node.args[:4]
    metadata = node.args[6] if len(node.args) > 6 else None
    if metadata is not None and (not isinstance(metadata, Mapping) or any(metadata.values())):
        return None  # a conjugate or negative view ({"conj": True}): its bytes are not its values
    if not (isinstance(storage, StorageRef) and type(offset) is int and isinstance(shape, (tuple, list))):
        return None
    if not isinstance(stride, (tuple, list)) or len(stride) != len(shape):
        return None
    if not all(type(d) is int and d >= 0 for d in shape) or not all(type(d) is int for d in stride) or offset < 0:
        return None
    return storage, offset, list(shape), list(stride)


def tensor_info(node: Call) -> dict[str, Any]:
    """Shape, dtype, bytes and saved device of a parsed tensor (as far as its form tells)."""
    while node.func.name in ("_rebuild_parameter", "_rebuild_parameter_with_state", "_rebuild_from_type_v2"):
        inner = node.args[0] if node.func.name != "_rebuild_from_type_v2" else Call(node.args[0], node.args[2])
        if not isinstance(inner, Call):
            break
        node = inner
    if node.func.name == "_rebuild_meta_tensor_no_storage" and len(node.args) > 1:  # (dtype, size, stride, ...)
        dtype, size = node.args[0], node.args[1]
        if isinstance(dtype, Global) and isinstance(size, (tuple, list)) and all(type(d) is int for d in size):
            return {"shape": list(size), "dtype": dtype.name, "bytes": 0, "device": "meta", "storage": None}
    if node.func.name == "_rebuild_nested_tensor" and len(node.args) > 1 and all(map(is_tensor, node.args[:2])):
        # (buffer, sizes, strides, offsets): one flat buffer and a row of sizes per tensor it holds
        buffer, rows = tensor_info(node.args[0]), tensor_info(node.args[1])
        count = rows["shape"][:1] if rows["shape"] else [0]
        return {**buffer, "shape": count}
    if node.func.name == "_rebuild_sparse_tensor" and len(node.args) > 1 and isinstance(node.args[1], tuple):
        # (layout, (indices, values, size, ...)) for COO; (crow/ccol, col/row, values, size) for compressed.
        parts = [tensor_info(x) for x in node.args[1] if is_tensor(x)]
        sizes = [x.args[0] if isinstance(x, Call) and x.func.name == "Size" and x.args else x for x in node.args[1]]
        size = next((x for x in sizes if isinstance(x, (tuple, list))), None)
        if parts and size is not None and all(type(d) is int for d in size):
            values = parts[-1]
            return {"shape": list(size), "dtype": values["dtype"], "bytes": sum(p["bytes"] for p in parts),
                    "device": values["device"], "storage": values["storage"]}  # fmt: skip
    if (
        node.func.name in ("_rebuild_tensor_v2", "_rebuild_tensor", "_rebuild_tensor_v3", "_rebuild_qtensor")
        and node.args
    ):
        storage = node.args[0]
        shape = list(node.args[2]) if len(node.args) > 2 and isinstance(node.args[2], (tuple, list)) else []
        if isinstance(storage, StorageRef):
            dtype, itemsize = STORAGE_ITEMSIZE.get(storage.storage_type.name, ("?", 0))
            named = node.args[6] if node.func.name == "_rebuild_tensor_v3" and len(node.args) > 6 else None
            if isinstance(named, Global) and named.name in DTYPE_ITEMSIZE:  # an untyped storage: the dtype is here
                dtype, itemsize = named.name, DTYPE_ITEMSIZE[named.name]
            numel = 1
            for d in shape:
                numel *= int(d)
            return {"shape": shape, "dtype": dtype, "bytes": numel * itemsize, "device": storage.location,
                    "storage": storage.key}  # fmt: skip
    return {"shape": [], "dtype": "?", "bytes": 0, "device": "?", "storage": None}


def entry_at(tree: Any, key: str, *, path: str = "checkpoint") -> Any:
    """The node at ``key`` in a checkpoint tree: dotted for nesting, through dicts (an integer part
    also finds an integer key, as in an optimizer's ``state``) and lists (``optimizer_states.0``).

    Raises:
        KeyMismatchError: no such node; the message names the keys that exist where the walk stopped.

    Examples:
        >>> entry_at({"optimizer_states": [{"state": {0: {"step": 3}}}]}, "optimizer_states.0.state.0.step")
        3
    """
    return _walk(tree, key, path)[2]


def _walk(tree: Any, key: str, path: str) -> tuple[Any, Any, Any]:
    """``(parent, name, node)`` at ``key`` (see `entry_at`)."""
    parent: Any = None
    name: Any = None
    node = tree
    walked: list[str] = []
    for part in key.split("."):
        found, name = _child(node, part)
        if not found:
            where = f"under {'.'.join(walked)!r}" if walked else "at the top level"
            raise KeyMismatchError(f"{path} has no entry {key!r}; {where} it has {_children(node)}", missing=[key])
        parent, node = node, node[name]
        walked.append(part)
    return parent, name, node


def _child(node: Any, part: str) -> tuple[bool, Any]:
    """Whether ``node`` has a child named ``part``, and the key or index that names it."""
    if isinstance(node, Mapping):
        if part in node:
            return True, part
        if part.lstrip("-").isdigit() and int(part) in node:  # an optimizer's state: {0: {...}, 1: {...}}
            return True, int(part)
    elif isinstance(node, (list, tuple)) and part.isdigit() and int(part) < len(node):
        return True, int(part)
    return False, None


def _children(node: Any) -> str:
    """The names of ``node``'s children, in words, for an error message."""
    if isinstance(node, Mapping):
        names = sorted(map(str, node))
        return "no entries" if not names else "entries " + ", ".join(names[:30]) + (", ..." if len(names) > 30 else "")
    if isinstance(node, (list, tuple)):
        return f"a {type(node).__name__} of {len(node)} (indices 0 to {len(node) - 1})" if node else "an empty list"
    return f"a {type(node).__name__} value, no entries"


def locate_weights(
    tree: Any, *, key: str | None = None, path: str = "checkpoint", is_leaf: Any = None
) -> tuple[Any, Any, Mapping[str, Any]]:
    """Find the model weights in a checkpoint tree (loaded by torch, or parsed by `loads`).

    Weights are a non-empty mapping whose values are all tensors (``is_leaf``; default: parsed
    tensors): the tree itself, or the first of `WEIGHT_KEYS` that holds one, or ``key``
    (dotted for nesting, e.g. ``"ema.model"``).

    Returns:
        ``(parent, name, weights)`` with ``parent[name] is weights``, or ``(None, None, tree)``
        when the tree is itself a bare state dict.

    Raises:
        CheckpointFormatError: nothing found (the message lists the entries and says to pass a key),
            or ``key`` names something that is no dict.
        KeyMismatchError: ``key`` does not exist (`entry_at`).
    """
    leaf = is_leaf or is_tensor

    def weights(node: Any) -> bool:
        return isinstance(node, Mapping) and bool(node) and all(leaf(v) for v in node.values())

    if not isinstance(tree, Mapping):
        raise CheckpointFormatError(f"{path} holds a {type(tree).__name__}, not a dict of weights")
    if key is not None:
        parent, name, node = _walk(tree, key, path)
        if not isinstance(node, Mapping):
            raise CheckpointFormatError(f"{path}: entry {key!r} is a {type(node).__name__}, not a dict of weights")
        return parent, name, node
    if weights(tree):
        return None, None, tree
    for candidate in WEIGHT_KEYS:
        if weights(tree.get(candidate)):
            return tree, candidate, tree[candidate]
    raise CheckpointFormatError(
        f"cannot find model weights in {path}: entries are {sorted(map(str, tree))[:20]}; "
        "pass key=... (--key on the command line) to name the entry that holds them"
    )
