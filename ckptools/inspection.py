"""What ``ckpt info``, ``ckpt verify`` and ``ckpt diff`` compute, on any layout (through its view)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import CheckpointFormatError, CheckpointLayoutError, NotChecksummedError, deprecated, weights_only_switch
from .layouts import open_checkpoint, open_location
from .read import META_KEY, loaded_weights
from .state_dict import strip_wrappers, tensor_identity
from .storage import PathLike, fspath, resolve
from .view import CheckpointView

__all__ = ["diff", "inspect", "judge", "verify", "verify_report"]


def inspect(path: PathLike, *, weights_only: bool = True, trust_code: bool | None = None) -> dict[str, Any]:
    """What a checkpoint holds, without reading tensor data: ``ckpt info --json`` as a dict.

    Keys: ``path``, ``format``, ``file_bytes``, ``entries``, ``tensors`` (name, shape, dtype, bytes,
    device, shared), ``totals``, ``metadata``, and for folders ``files`` and ``extras``;
    ``skipped_globals`` when a lenient read stood placeholders in for refused classes. ``weights_only=False``
    lets torch unpickle every class the file names, running its code (files you trust only; ``trust_code=True``,
    the old spelling, warns and goes in 0.6).

    Examples:
        >>> import torch, ckptools as ck
        >>> torch.save({"model": {"w": torch.ones(2)}, "step": 3}, "/tmp/i.pt")
        >>> ck.inspect("/tmp/i.pt")["totals"]
        {'tensors': 1, 'bytes': 8, 'module_prefixed': 0}
    """
    return open_checkpoint(path, weights_only=weights_only_switch(weights_only, trust_code, "ck.inspect")).report()


def verify(path: PathLike, *, weights_only: bool = True, trust_code: bool | None = None, strict: bool = False) -> str:
    """Read every byte of a checkpoint and check what it stores; return a line saying what was checked.

    Zip records' CRC-32s for torch files, ckptools' per-tensor CRC-32s for safetensors, every
    shard and the index's agreement with them (each tensor present once, in the shard named, no
    stray shard) for sharded checkpoints, every data file of a DCP folder; for a Hugging Face,
    Accelerate or HF Trainer folder, every file in it too (torch files' CRC-32s, safetensors
    structure, a ``ckptools-manifest.json``'s sizes and CRC-32s, the Trainer's expected set: the
    judgement ``latest_complete_checkpoint`` makes). Bytes no stored checksum covers (a
    safetensors file from another tool, a DCP folder, a tokenizer file) are named at the end of
    the line, after ``data not checksummed:``. The verdict is `verify_report`'s.

    Args:
        path: a file, a folder or an fsspec URL of a file.
        weights_only: keep torch's safe unpickler (the default); False lets torch unpickle everything in
            the file, running its code: for files you trust only (torch's and `ckptools.load`'s name).
        trust_code: deprecated (goes in 0.6): ``trust_code=True`` is ``weights_only=False``.
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
    report, damage = judge(path, weights_only_switch(weights_only, trust_code, "ck.verify"), strict)
    if damage is not None:
        raise damage
    if not report["passed"]:
        raise NotChecksummedError(f"{report['path']}: {report['line']}; with strict, every byte must carry a checksum")
    return str(report["line"])


# Each verdict's label, as `ckpt verify` prints it before the path.
LABELS = {"ok": "OK", "structure_ok": "STRUCTURE OK", "damaged": "DAMAGED"}


def verify_report(
    path: PathLike, *, weights_only: bool = True, trust_code: bool | None = None, strict: bool = False
) -> dict[str, Any]:
    """The verdict on one checkpoint, decided here alone (`verify` and ``ckpt verify`` render it):
    what ``ckpt verify --json`` prints, as a dict; damage is a result here, not an exception.

    Keys: ``path``; ``status``: ``"ok"`` (every byte matched a stored checksum),
    ``"structure_ok"`` (whole as far as it could be checked, but ``not_checksummed`` names bytes
    no checksum covers) or ``"damaged"``; ``passed`` (``"ok"``, or ``"structure_ok"`` without
    ``strict``); ``label`` (``OK``, ``STRUCTURE OK``, ``NOT CHECKSUMMED (--strict)``, ``DAMAGED``);
    ``line`` (what was checked, or what is damaged); ``checksummed`` (bool); ``not_checksummed``
    (file: what was checked instead). ``weights_only`` and ``trust_code`` as for `verify`.

    Raises:
        CheckpointNotFoundError, CheckpointLayoutError, UnsafeCheckpointError: not a checkpoint
            that can be judged (``ckpt verify`` exits 2 for these).

    Examples:
        >>> import torch, ckptools as ck
        >>> torch.save({"w": torch.ones(2)}, "/tmp/r.pt")
        >>> ck.verify_report("/tmp/r.pt")["status"]
        'ok'
    """
    return judge(path, weights_only_switch(weights_only, trust_code, "ck.verify_report"), strict)[0]


def judge(path: PathLike, weights_only: bool, strict: bool) -> tuple[dict[str, Any], CheckpointFormatError | None]:
    """The one place a verdict is decided: `verify_report`'s dict, and the damage found (or None); what
    ``ckpt verify`` asks (the switch in its one spelling)."""
    path = fspath(path)
    try:
        found = open_location(resolve(path), weights_only=weights_only).verify()
    except CheckpointLayoutError:
        raise  # a valid file of another kind is never called damaged
    except CheckpointFormatError as damage:
        report = {"path": path, "status": "damaged", "passed": False, "label": LABELS["damaged"], "line": str(damage),
                  "checksummed": False, "not_checksummed": {}}  # fmt: skip
        return report, damage
    status = "ok" if found.checksummed else "structure_ok"
    passed = status == "ok" or not strict
    label = LABELS[status] if passed else "NOT CHECKSUMMED (--strict)"
    report = {"path": path, "status": status, "passed": passed, "label": label, "line": found.line(),
              "checksummed": found.checksummed, "not_checksummed": found.not_checksummed}  # fmt: skip
    return report, None


# ckptools' own entry: what says when and with what a file was saved is not compared (it differs between any
# two saves); what a resume restores from it (the ranks' random streams, the world size, metadata) is.
_PROVENANCE = ("created_unix", "ckptools_version", "torch_version", "format_version")


def diff(
    a: PathLike,
    b: PathLike,
    *,
    atol: float = 0.0,
    trust_code: bool = False,
    key: str | None = None,
    weights: bool = False,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Compare two checkpoints of any layouts: the weights (wrapper prefixes ignored) and every other entry.

    Every entry both files hold is compared: the weights tensor by tensor (``module.`` and
    ``_orig_mod.`` ignored), any other entry as a tree, tensor by tensor (an optimizer's state) and
    value by value (a step, hyper-parameters), ckptools' own entry by what a resume restores from
    it (every rank's random streams, the world size, the metadata; not when and with which
    versions a file was saved, named in ``not_compared``). An entry only one file holds is a
    difference (``missing_in_b``, ``only_in_b``). A file that holds bare weights (a
    ``.safetensors`` file, a folder, a bare state dict) has only weights to compare, so a training
    checkpoint compares with its export, and the other file's entries are named in
    ``not_compared``. ``weights`` compares the weights alone (``ckpt diff --weights``; ``weights_only=True``,
    its old name, warns: in 0.6 ``weights_only`` becomes the reader's switch, as in every other reader, and
    ``trust_code`` goes); ``trust_code`` lets torch unpickle every class the files name; ``key`` (dotted for nesting,
    list indices too: ``"optimizer"``, ``"optimizer_states.0.state"``) one entry alone. A tensor
    that only one side names, stored once in the other under a name it is tied to there
    (transformers' ``lm_head.weight``, tied to ``transformer.wte.weight``), is no difference:
    ``tied`` maps it to that name.

    Returns a dict: ``differ`` (bool), ``compared`` (what was: ``"weights"``, the entries' names),
    ``not_compared`` (name: why), ``all_compared`` (every entry of both was: only when and with
    which versions they were saved was not), ``missing_in_b``, ``only_in_b``, ``tied``, ``shape_or_dtype_mismatch``
    (also a tensor on one side and a value on the other), ``changed`` (max |a-b| above ``atol``, or
    NaN; or a value that differs), ``max_abs_diff`` per common tensor and ``values`` (``[a, b]``, as
    ``repr``, per common value that is no tensor). Names of an entry's leaves start with the entry's.

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
    if weights_only is not None:
        deprecated(f"ck.diff(weights_only=...) is deprecated: pass weights={weights_only!r} to compare the weights "
                   "alone (the same); in 0.6 weights_only is the reader's switch")  # fmt: skip
        weights = weights or bool(weights_only)
    va, vb = open_checkpoint(a, weights_only=not trust_code), open_checkpoint(b, weights_only=not trust_code)
    result: dict[str, Any] = {"a": a, "b": b, "atol": atol, "differ": False, "all_compared": False,
                              "compared": [], "not_compared": {},
                              "missing_in_b": [], "only_in_b": [], "tied": {}, "shape_or_dtype_mismatch": [],
                              "changed": [], "max_abs_diff": {}, "values": {}}  # fmt: skip
    if key is not None:
        wa, wb = _compared_at(va, key), _compared_at(vb, key)
        _compare(wa, wb, result, weights=True)
        result["compared"] = [key]
        result["not_compared"]["everything else"] = f"--key {key} compares that entry alone"
    else:
        _compare(va.weights(), vb.weights(), result, weights=True)
        result["compared"] = ["weights"]
        ta, tb = _entries(va), _entries(vb)
        if weights:
            rest = sorted(set(ta or {}) | set(tb or {}))
            if rest:
                result["not_compared"][", ".join(rest)] = "--weights compares the weights alone"
        elif ta is not None and tb is not None:
            _compare_entries(ta, tb, result)
            result["all_compared"] = True
        else:  # one side (or both) holds bare weights: nothing else to hold the other's entries against
            result["all_compared"] = not ta and not tb
            for side, tree, other in (("A", ta, b), ("B", tb, a)):
                if tree:
                    why = f"only {side} holds them: {other} holds weights alone"
                    result["not_compared"][", ".join(sorted(tree))] = why
    if any(what.startswith("the values of ") for what in result["not_compared"]):
        result["all_compared"] = False  # meta tensors: their values are not there to compare
    for name in ("missing_in_b", "only_in_b", "changed"):
        result[name] = sorted(result[name])
    result["shape_or_dtype_mismatch"].sort(key=lambda m: m["name"])
    result["max_abs_diff"] = dict(sorted(result["max_abs_diff"].items()))
    result["values"] = dict(sorted(result["values"].items()))
    result["tied"] = dict(sorted(result["tied"].items()))
    result["differ"] = bool(
        result["missing_in_b"] or result["only_in_b"] or result["shape_or_dtype_mismatch"] or result["changed"]
    )
    return result


def _entries(view: CheckpointView) -> dict[str, Any] | None:
    """A checkpoint's entries other than its weights, as one tree (the file read once); None for a
    layout of bare weights. ckptools' own entry is kept without its provenance."""
    try:
        tree = view.entry("")
    except CheckpointLayoutError:
        return None
    if not isinstance(tree, Mapping):
        return None
    try:
        weights = loaded_weights(tree, None, view.path)
    except CheckpointFormatError:  # no weights in it: every entry is one to compare
        weights = None
    if weights is tree:  # a bare state dict
        return None
    rest = {str(k): v for k, v in tree.items() if v is not weights}
    if isinstance(rest.get(META_KEY), Mapping):
        rest[META_KEY] = {k: v for k, v in rest[META_KEY].items() if k not in _PROVENANCE}
    return rest


def _compare_entries(ta: dict[str, Any], tb: dict[str, Any], result: dict[str, Any]) -> None:
    """Every entry both hold, leaf by leaf; an entry only one holds is a difference."""
    result["missing_in_b"] += sorted(set(ta) - set(tb))
    result["only_in_b"] += sorted(set(tb) - set(ta))
    for name in sorted(set(ta) & set(tb)):
        la: dict[str, Any] = {}
        lb: dict[str, Any] = {}
        _collect(ta[name], name, la, set())
        _collect(tb[name], name, lb, set())
        if not la and not lb:  # an empty container on both sides
            la, lb = {name: ta[name]}, {name: tb[name]}
        _compare(la, lb, result, weights=False)
        result["compared"].append("the ranks' random streams and metadata" if name == META_KEY else name)
    if META_KEY in ta or META_KEY in tb:
        result["not_compared"]["when and with which versions each was saved"] = "it differs between any two saves"


def _compare(wa: Mapping[str, Any], wb: Mapping[str, Any], result: dict[str, Any], *, weights: bool) -> None:
    """Compare two name -> leaf maps into ``result``: tensors by their largest difference, other
    values by value. For ``weights``, names without any wrapper's prefix, and ties on one side."""
    import torch

    atol = result["atol"]
    # Weights are compared without any wrapper's prefix (DDP's "module.", torch.compile's "_orig_mod.").
    # Names are mapped first and tensors read one at a time, in A's order: a sharded checkpoint is
    # then read shard by shard, never held whole.
    na = strip_wrappers({name: name for name in wa}) if weights else {name: name for name in wa}
    nb = strip_wrappers({name: name for name in wb}) if weights else {name: name for name in wb}
    common = set(na) & set(nb)
    tied: dict[str, str] = {}
    if weights:
        tied = {**_tied_names(set(na) - set(nb), na, wa, common), **_tied_names(set(nb) - set(na), nb, wb, common)}
    result["tied"].update(tied)
    result["missing_in_b"] += sorted(set(na) - set(nb) - set(tied))
    result["only_in_b"] += sorted(set(nb) - set(na) - set(tied))
    order = {stored: i for i, stored in enumerate(wa)}
    metas: list[str] = []
    for name in sorted(common, key=lambda n: order[na[n]]):
        ta, tb = wa[na[name]], wb[nb[name]]
        tensors = isinstance(ta, torch.Tensor), isinstance(tb, torch.Tensor)
        if tensors == (False, False):  # plain values (hyper-parameters, a step count): by value
            result["values"][name] = [repr(ta), repr(tb)]
            if not _same_value(ta, tb):
                result["changed"].append(name)
            continue
        if not all(tensors) or ta.dtype != tb.dtype or _kind(ta) != _kind(tb):
            result["shape_or_dtype_mismatch"].append({"name": name, "a": _described(ta), "b": _described(tb)})
            continue
        ta, tb = _dense(ta), _dense(tb)  # sparse, quantized, nested: compared by their values
        if ta.shape != tb.shape or ta.dtype != tb.dtype:
            result["shape_or_dtype_mismatch"].append(
                {"name": name, "a": [list(ta.shape), str(ta.dtype)], "b": [list(tb.shape), str(tb.dtype)]}
            )
            continue
        if ta.numel() == 0:
            continue
        if ta.is_meta or tb.is_meta:  # a meta tensor has a shape and a dtype (compared above), no values
            metas.append(name)
            continue
        if torch.equal(ta, tb):
            delta = 0.0
        elif ta.dtype.is_floating_point or ta.dtype.is_complex:
            delta = (ta.double() - tb.double()).abs().max().item()
        else:
            delta = float((ta.long() - tb.long()).abs().max().item())
        if delta != delta or delta > atol:  # NaN counts as different
            result["changed"].append(name)
        result["max_abs_diff"][name] = delta
    if metas:
        result["not_compared"][f"the values of {', '.join(metas)}"] = (
            "a meta tensor holds none: compared by shape and dtype"
        )


def _compared_at(view: CheckpointView, key: str | None) -> Mapping[str, Any]:
    """What `diff` compares in ``view``: its weights, or the leaves of the entry at ``key``."""
    if key is None:
        return view.weights()
    try:
        node = view.entry(key)
    except CheckpointLayoutError:
        return view.weights()  # bare weights: no entries to look in, compared whole (an export)
    leaves: dict[str, Any] = {}
    _collect(node, "", leaves, set())
    if not leaves and not isinstance(node, (Mapping, list, tuple)):
        leaves[key] = node
    return leaves


def _collect(node: Any, prefix: str, leaves: dict[str, Any], walked: set[int]) -> None:
    """Every leaf under ``node`` (a tensor, or a value in no container), by dotted name; a container
    reached twice (shared in the pickle) only under the first name (`walk_tree` says why)."""
    if isinstance(node, (Mapping, list, tuple)):
        if id(node) in walked:
            return
        walked.add(id(node))
    if isinstance(node, Mapping):
        for k, v in node.items():
            _collect(v, f"{prefix}.{k}" if prefix else str(k), leaves, walked)
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            _collect(v, f"{prefix}.{i}" if prefix else str(i), leaves, walked)
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
