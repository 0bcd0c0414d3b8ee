"""What ``ckpt info``, ``ckpt verify`` and ``ckpt diff`` compute, on any layout (through its view)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import CheckpointFormatError, CheckpointLayoutError, NotChecksummedError
from .layouts import open_checkpoint
from .state_dict import strip_wrappers, tensor_identity
from .storage import PathLike, fspath
from .view import CheckpointView

__all__ = ["diff", "inspect", "verify", "verify_report"]


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


def verify(path: PathLike, *, trust_code: bool = False, strict: bool = False) -> str:
    """Read every byte of a checkpoint and check what it stores; return a line saying what was checked.

    Zip records' CRC-32s for torch files, ckptools' per-tensor CRC-32s for safetensors, every
    shard and the index's agreement with them (each tensor present once, in the shard named, no
    stray shard) for sharded checkpoints, every data file of a DCP folder; for a Hugging Face,
    Accelerate or HF Trainer folder, every file in it too (torch files' CRC-32s, safetensors
    structure, a ``ckptools-manifest.json``'s sizes and CRC-32s, the Trainer's expected set: the
    judgement ``latest_complete_checkpoint`` makes). Bytes no stored checksum covers (a
    safetensors file from another tool, a DCP folder, a tokenizer file) are named at the end of
    the line, after ``data not checksummed:``.

    Args:
        path: a file, a folder or an fsspec URL of a file.
        trust_code: let torch unpickle globals outside its allowlist (files you trust only).
        strict: raise `NotChecksummedError` when any byte is not covered by a checksum.

    Raises:
        CheckpointFormatError: damaged (``ckpt verify`` exits 1). A valid file of another kind
            raises `CheckpointLayoutError` instead, which ``ckpt verify`` never calls damaged.
        NotChecksummedError: with ``strict``, whole as far as could be checked, but not every byte
            carries a checksum (``ckpt verify --strict`` exits 1).

    Examples:
        >>> import torch, ckptools as ck
        >>> torch.save({"w": torch.ones(2)}, "/tmp/f.pt")
        >>> ck.verify("/tmp/f.pt")
        "torch zip, every record's CRC-32 matches, 1 tensor loaded"
    """
    found = open_checkpoint(path, trust_code=trust_code).verify()
    if strict and not found.checksummed:
        raise NotChecksummedError(f"{fspath(path)}: {found.line()}; with strict, every byte must carry a checksum")
    return found.line()


def verify_report(path: PathLike, *, trust_code: bool = False) -> dict[str, Any]:
    """What ``ckpt verify --json`` prints, as a dict: damage is a result here, not an exception.

    Keys: ``path``; ``status``: ``"ok"`` (every byte matched a stored checksum),
    ``"structure_ok"`` (whole as far as it could be checked, but ``not_checksummed`` names bytes
    no checksum covers) or ``"damaged"``; ``line`` (`verify`'s line, or what is damaged);
    ``checksummed`` (bool); ``not_checksummed`` (file: what was checked instead).

    Raises:
        CheckpointNotFoundError, CheckpointLayoutError, UnsafeCheckpointError: not a checkpoint
            that can be judged (``ckpt verify`` exits 2 for these).

    Examples:
        >>> import torch, ckptools as ck
        >>> torch.save({"w": torch.ones(2)}, "/tmp/r.pt")
        >>> ck.verify_report("/tmp/r.pt")["status"]
        'ok'
    """
    path = fspath(path)
    try:
        found = open_checkpoint(path, trust_code=trust_code).verify()
    except CheckpointLayoutError:
        raise  # a valid file of another kind is never called damaged
    except CheckpointFormatError as damage:
        return {"path": path, "status": "damaged", "line": str(damage), "checksummed": False, "not_checksummed": {}}
    status = "ok" if found.checksummed else "structure_ok"
    return {"path": path, "status": status, "line": found.line(), "checksummed": found.checksummed,
            "not_checksummed": found.not_checksummed}  # fmt: skip


def diff(
    a: PathLike, b: PathLike, *, atol: float = 0.0, trust_code: bool = False, key: str | None = None
) -> dict[str, Any]:
    """Compare the weights of two checkpoints of any layouts (wrapper prefixes ignored), or one entry.

    ``key`` (dotted for nesting, list indices too: ``"model.state_dict"``, ``"optimizer"``,
    ``"optimizer_states.0.state"``, ``"hyper_parameters"``) names the entry to compare in each file
    that has entries; a tree of tensors (an optimizer's state) is compared tensor by tensor, other
    values (numbers, strings, lists of them) by value. A file that holds bare weights (a
    ``.safetensors`` file, a folder, a bare state dict) is compared whole, so a training checkpoint
    compares with its export. A tensor that only one side names, stored once in the other under a
    name it is tied to there (transformers' ``lm_head.weight``, tied to ``transformer.wte.weight``),
    is no difference: ``tied`` maps it to that name.

    Returns a dict: ``differ`` (bool), ``missing_in_b``, ``only_in_b``, ``tied``, ``shape_or_dtype_mismatch``
    (also a tensor on one side and a value on the other), ``changed`` (max |a-b| above ``atol``, or
    NaN; or a value that differs), ``max_abs_diff`` per common tensor and ``values`` (``[a, b]``, as
    ``repr``, per common value that is no tensor).

    Raises:
        KeyMismatchError: a file with entries has none at ``key``; the message names those it has.

    Examples:
        >>> import torch, ckptools as ck
        >>> torch.save({"module.w": torch.ones(2)}, "/tmp/a.pt")
        >>> torch.save({"w": torch.ones(2)}, "/tmp/b.pt")
        >>> ck.diff("/tmp/a.pt", "/tmp/b.pt")["differ"]
        False
    """
    a, b = fspath(a), fspath(b)
    wa = _compared_at(open_checkpoint(a, trust_code=trust_code), key)
    wb = _compared_at(open_checkpoint(b, trust_code=trust_code), key)
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
    values: dict[str, list[str]] = {}
    order = {stored: i for i, stored in enumerate(wa)}
    for name in sorted(common, key=lambda n: order[na[n]]):
        ta, tb = wa[na[name]], wb[nb[name]]
        tensors = isinstance(ta, torch.Tensor), isinstance(tb, torch.Tensor)
        if tensors == (False, False):  # plain values (hyper-parameters, a step count): by value
            values[name] = [repr(ta), repr(tb)]
            if not _same_value(ta, tb):
                changed.append(name)
            continue
        if not all(tensors) or ta.dtype != tb.dtype or _kind(ta) != _kind(tb):
            mismatched.append({"name": name, "a": _described(ta), "b": _described(tb)})
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
            "max_abs_diff": max_abs, "values": dict(sorted(values.items()))}  # fmt: skip


def _compared_at(view: CheckpointView, key: str | None) -> Mapping[str, Any]:
    """What `diff` compares in ``view``: its weights, or the leaves of the entry at ``key``."""
    if key is None:
        return view.weights()
    try:
        node = view.entry(key)
    except CheckpointLayoutError:
        return view.weights()  # bare weights: no entries to look in, compared whole (an export)
    leaves: dict[str, Any] = {}
    _collect(node, "", leaves)
    if not leaves and not isinstance(node, (Mapping, list, tuple)):
        leaves[key] = node
    return leaves


def _collect(node: Any, prefix: str, leaves: dict[str, Any]) -> None:
    """Every leaf under ``node`` (a tensor, or a value in no container), by dotted name."""
    if isinstance(node, Mapping):
        for k, v in node.items():
            _collect(v, f"{prefix}.{k}" if prefix else str(k), leaves)
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            _collect(v, f"{prefix}.{i}" if prefix else str(i), leaves)
    elif prefix:
        leaves[prefix] = node


def _same_value(a: Any, b: Any) -> bool:
    """Whether two plain values are the same (NaN the same as NaN; types that cannot say: their repr)."""
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b) or repr(a) == repr(b)
    except Exception:  # noqa: BLE001 - an object whose == raises or returns no bool: compared by what it shows
        return repr(a) == repr(b)


def _described(value: Any) -> list[Any]:
    """Shape and dtype of a tensor, or the type of a value, for a mismatch line."""
    import torch

    if isinstance(value, torch.Tensor):
        return [_shape(value), _kind(value) or str(value.dtype)]
    return ["value", type(value).__name__]


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
    import torch

    only = {name for name in only if isinstance(weights[names[name]], torch.Tensor)}
    if not only:
        return {}
    partner: dict[tuple[Any, ...], str] = {}
    for name in sorted(common):
        if not isinstance(weights[names[name]], torch.Tensor):
            continue
        ident = tensor_identity(weights[names[name]])
        if ident is not None:
            partner.setdefault(ident, name)
    found = {}
    for name in sorted(only):
        ident = tensor_identity(weights[names[name]])
        if ident is not None and ident in partner:
            found[name] = partner[ident]
    return found
