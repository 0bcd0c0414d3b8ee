"""What ``ckpt info``, ``ckpt verify`` and ``ckpt diff`` compute, on any layout (through its view)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import CheckpointFormatError, KeyMismatchError
from .layouts import open_checkpoint
from .state_dict import strip_wrappers, tensor_identity
from .storage import PathLike, fspath
from .view import CheckpointView

__all__ = ["diff", "inspect", "verify"]


def inspect(path: PathLike, *, trust_code: bool = False) -> dict[str, Any]:
    """What a checkpoint holds, without reading tensor data: ``ckpt info --json`` as a dict.

    Keys: ``path``, ``format``, ``file_bytes``, ``entries``, ``tensors`` (name, shape, dtype, bytes,
    device, shared), ``totals``, ``metadata``, and for folders ``files`` and ``extras``;
    ``skipped_globals`` when a lenient read stood placeholders in for refused classes.

    Examples:
        >>> import torch, ckptools as ck
        >>> torch.save({"model": {"w": torch.ones(2)}, "step": 3}, "/tmp/i.pt")
        >>> ck.inspect("/tmp/i.pt")["totals"]
        {'tensors': 1, 'bytes': 8, 'module_prefixed': 0}
    """
    return open_checkpoint(path, trust_code=trust_code).report()


def verify(path: PathLike, *, trust_code: bool = False) -> str:
    """Read every byte of a checkpoint and check what it stores; return a line saying what was checked.

    Zip records' CRC-32s for torch files, ckptools' per-tensor CRC-32s for safetensors, every
    shard and the index's agreement with them (each tensor present once, in the shard named, no
    stray shard) for sharded checkpoints, every data file of a DCP folder.

    Raises:
        CheckpointFormatError: damaged (``ckpt verify`` exits 1). A valid file of another kind
            raises `CheckpointLayoutError` instead, which ``ckpt verify`` never calls damaged.

    Examples:
        >>> import torch, ckptools as ck
        >>> torch.save({"w": torch.ones(2)}, "/tmp/f.pt")
        >>> ck.verify("/tmp/f.pt")
        "torch zip, every record's CRC-32 matches, 1 tensor loaded"
    """
    return open_checkpoint(path, trust_code=trust_code).verify()


def diff(
    a: PathLike, b: PathLike, *, atol: float = 0.0, trust_code: bool = False, key: str | None = None
) -> dict[str, Any]:
    """Compare the weights of two checkpoints of any layouts (wrapper prefixes ignored).

    ``key`` (dotted for nesting: ``"model.state_dict"``) names the entry that holds the weights
    in each file that has it; a file without that entry (a ``.safetensors`` file, a folder, a
    bare state dict) is read as without ``key``, so a training checkpoint compares with its export.
    A tensor that only one side names, stored once in the other under a name it is tied to there
    (transformers' ``lm_head.weight``, tied to ``transformer.wte.weight``), is no difference:
    ``tied`` maps it to that name.

    Returns a dict: ``differ`` (bool), ``missing_in_b``, ``only_in_b``, ``tied``, ``shape_or_dtype_mismatch``,
    ``changed`` (max |a-b| above ``atol``, or NaN) and ``max_abs_diff`` per common tensor.

    Examples:
        >>> import torch, ckptools as ck
        >>> torch.save({"module.w": torch.ones(2)}, "/tmp/a.pt")
        >>> torch.save({"w": torch.ones(2)}, "/tmp/b.pt")
        >>> ck.diff("/tmp/a.pt", "/tmp/b.pt")["differ"]
        False
    """
    a, b = fspath(a), fspath(b)
    wa = _weights_at(open_checkpoint(a, trust_code=trust_code), key)
    wb = _weights_at(open_checkpoint(b, trust_code=trust_code), key)
    import torch  # after both opened: a file refused there is refused without it

    # Compared without any wrapper's prefix (DDP's "module.", torch.compile's "_orig_mod."). Names
    # are mapped first and tensors read one at a time, in A's order: a sharded checkpoint is
    # then read shard by shard, never held whole.
    na = strip_wrappers({name: name for name in wa})
    nb = strip_wrappers({name: name for name in wb})
    common = set(na) & set(nb)
    tied = {**_tied_names(set(na) - set(nb), na, wa, common), **_tied_names(set(nb) - set(na), nb, wb, common)}
    missing = sorted(set(na) - set(nb) - set(tied))
    unexpected = sorted(set(nb) - set(na) - set(tied))
    mismatched: list[dict[str, Any]] = []
    changed: list[str] = []
    max_abs: dict[str, float] = {}
    order = {stored: i for i, stored in enumerate(wa)}
    for name in sorted(common, key=lambda n: order[na[n]]):
        ta, tb = wa[na[name]], wb[nb[name]]
        if ta.dtype != tb.dtype or _kind(ta) != _kind(tb):
            mismatched.append({"name": name, "a": [_shape(ta), _kind(ta) or str(ta.dtype)],
                               "b": [_shape(tb), _kind(tb) or str(tb.dtype)]})  # fmt: skip
            continue
        ta, tb = _dense(ta), _dense(tb)  # sparse, quantized, nested: compared by their values
        if ta.shape != tb.shape or ta.dtype != tb.dtype:
            mismatched.append(
                {"name": name, "a": [list(ta.shape), str(ta.dtype)], "b": [list(tb.shape), str(tb.dtype)]}
            )
            continue
        if ta.numel() == 0:
            continue
        if torch.equal(ta, tb):
            delta = 0.0
        elif ta.dtype.is_floating_point or ta.dtype.is_complex:
            delta = (ta.double() - tb.double()).abs().max().item()
        else:
            delta = float((ta.long() - tb.long()).abs().max().item())
        if delta != delta or delta > atol:  # NaN counts as different
            changed.append(name)
        max_abs[name] = delta
    max_abs = dict(sorted(max_abs.items()))
    mismatched.sort(key=lambda m: m["name"])
    changed.sort()
    differ = bool(missing or unexpected or mismatched or changed)
    return {"a": a, "b": b, "atol": atol, "differ": differ, "missing_in_b": missing, "only_in_b": unexpected,
            "tied": dict(sorted(tied.items())), "shape_or_dtype_mismatch": mismatched, "changed": changed,
            "max_abs_diff": max_abs}  # fmt: skip


def _weights_at(view: CheckpointView, key: str | None) -> Mapping[str, Any]:
    if key is None:
        return view.weights()
    try:
        return view.weights(key)
    except (KeyMismatchError, CheckpointFormatError) as missing:
        try:
            return view.weights()  # this side holds no such entry: its weights as found without key
        except CheckpointFormatError:
            raise missing from None


def _kind(tensor: Any) -> str:
    """How a tensor is laid out, when not plainly: ``sparse_coo``, ``nested``, ``quantized``."""
    import torch

    if tensor.is_nested:
        return "nested"
    if tensor.layout != torch.strided:
        return str(tensor.layout).removeprefix("torch.")
    return "quantized" if tensor.is_quantized else ""


def _shape(tensor: Any) -> list[int]:
    return [len(tensor.unbind())] if tensor.is_nested else list(tensor.shape)


def _dense(tensor: Any) -> Any:
    """A plain tensor holding the same values (what diff compares)."""
    import torch

    if tensor.is_nested:  # its parts, one after the other (their shapes compared by the count above)
        return torch.cat([part.reshape(-1) for part in tensor.unbind()]) if tensor.unbind() else tensor.new_empty(0)
    if tensor.layout != torch.strided:
        return tensor.to_dense()
    return tensor.dequantize() if tensor.is_quantized else tensor


def _tied_names(
    only: set[str], names: Mapping[str, str], weights: Mapping[str, Any], common: set[str]
) -> dict[str, str]:
    """Those of ``only`` (names one side alone has) tied, on that side, to a name both sides
    have: the other side stores the tensor once, under that name. Compared there."""
    if not only:
        return {}
    partner: dict[tuple[Any, ...], str] = {}
    for name in sorted(common):
        ident = tensor_identity(weights[names[name]])
        if ident is not None:
            partner.setdefault(ident, name)
    found = {}
    for name in sorted(only):
        ident = tensor_identity(weights[names[name]])
        if ident is not None and ident in partner:
            found[name] = partner[ident]
    return found
