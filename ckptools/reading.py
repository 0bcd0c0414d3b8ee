"""One read-only view of every checkpoint layout ckptools reads, and the operations built on it.

`open_checkpoint` opens a path as a `CheckpointView`, whatever it is:

========================  ====================================================================
layout                    recognised by
========================  ====================================================================
torch zip                 a file starting ``PK`` (``torch.save`` since 1.6: .pt/.pth/.bin/.ckpt)
torch legacy              any other file that is not one of the below (pre-1.6 ``torch.save``)
safetensors               a ``.safetensors`` file
sharded index             a ``*.index.json`` with a ``weight_map`` (transformers' sharded
                          ``model.safetensors.index.json`` / ``pytorch_model.bin.index.json``)
Hugging Face folder       a folder holding ``model.safetensors[.index.json]`` or
                          ``pytorch_model.bin[.index.json]`` (``save_pretrained``)
Accelerate folder         the same, plus ``optimizer.bin`` / ``scheduler.bin`` /
                          ``random_states_*.pkl`` (``Accelerator.save_state``)
DCP folder                a folder holding ``.metadata`` (``torch.distributed.checkpoint``)
========================  ====================================================================

Every view gives tensor names with dtype, shape and bytes without reading tensor data
(`CheckpointView.tensors`), the model weights (`CheckpointView.weights`, read
lazily shard by shard), the non-tensor entries, and an integrity check
(`CheckpointView.verify`). `inspect`, `diff` and `verify` are what
``ckpt info``, ``ckpt diff`` and ``ckpt verify`` print; ``load_state_dict``, ``load`` (for a
model entry) and ``convert_to_safetensors`` read through the same views.

Nothing here runs code from a file: pickles are read with torch's weights-only unpickler or
ckptools' own parser. A file whose *other* entries need classes outside the allowlist (a
Lightning checkpoint whose ``hyper_parameters`` hold a ``pathlib.Path``) still gives up its
weights, read with inert placeholders for those classes; `CheckpointView.skipped` names
them. ``trust_code=True`` is the opt-in to let torch unpickle anything, for trusted files only.
"""

from __future__ import annotations

import collections
import fnmatch
import importlib
import json
import os
import pathlib
import pickle
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from .errors import CheckpointFormatError, CheckpointLayoutError, CheckpointNotFoundError, UnsafeCheckpointError
from .state_dict import tensor_identity
from .storage import PathLike, _fspath, get_filesystem, is_local, open_for_read, plural

__all__ = ["CheckpointView", "TensorInfo", "diff", "inspect", "open_checkpoint", "verify"]

# What Accelerator.save_state writes beside the model (accelerate/utils/constants.py).
_ACCELERATE_EXTRAS = {
    "optimizer*.bin": "optimizer state",
    "scheduler*.bin": "LR scheduler state",
    "sampler*.bin": "sampler state",
    "dl_state_dict*.bin": "DataLoader state",
    "scaler.pt": "GradScaler state",
    "random_states_*.pkl": "RNG states (a pickle; not read)",
    "custom_checkpoint_*.pkl": "custom object state (a pickle; not read)",
}
_MODEL_FILES = (
    "model.safetensors.index.json",
    "model.safetensors",
    "pytorch_model.bin.index.json",
    "pytorch_model.bin",
)


@dataclass
class TensorInfo:
    """One tensor as stored: name, dtype (torch's name: ``float32``), shape, bytes, saved device.

    ``shared`` marks a tensor whose storage another, earlier tensor already holds (tied
    weights; not counted twice in totals); ``file`` is the shard it lives in, for folders.
    """

    name: str
    dtype: str
    shape: list[int]
    bytes: int
    device: str = "cpu"
    shared: bool = False
    file: str | None = None


@dataclass
class CheckpointView:
    """A checkpoint of any layout, read-only. Made by `open_checkpoint`.

    Attributes:
        path: what was opened.
        format: the layout, in words (``"torch zip"``, ``"sharded safetensors (3 shards)"``, ...).
        tensors: every tensor the checkpoint holds (for a training checkpoint, optimizer state
            too), from headers and pickles only: no tensor data is read.
        entries: top-level entries and a line about each (``"dict, 4 keys, 4 tensors"``, ``"3"``).
        metadata: ckptools' metadata, a safetensors ``__metadata__`` or an index's ``metadata``.
        files: the files the checkpoint consists of.
        extras: other files of the folder and what they hold (an Accelerate optimizer state).
        skipped: globals a lenient read left as inert placeholders (nothing was imported or run).
        file_bytes: total size on disk, when known.
    """

    path: str
    format: str
    tensors: list[TensorInfo]
    entries: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    extras: dict[str, str] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    file_bytes: int | None = None
    _weights: Callable[[str | None, Any], Mapping[str, Any]] | None = field(default=None, repr=False)
    _verify: Callable[[], str] | None = field(default=None, repr=False)

    def weights(self, key: str | None = None, *, map_location: Any = "cpu") -> Mapping[str, Any]:
        """The model weights, names as stored (``module.`` and friends kept).

        Found as `ckptools.load_state_dict` finds them: a bare state dict, or under
        ``state_dict``/``model_state_dict``/``model``/``module``, or ``key`` (dotted). A sharded
        checkpoint gives a mapping that reads one shard at a time, when a tensor is asked for.

        Examples:
            >>> import torch, ckptools as ck
            >>> torch.save({"model": {"w": torch.ones(2)}}, "/tmp/v.pt")
            >>> list(ck.open_checkpoint("/tmp/v.pt").weights())
            ['w']
        """
        assert self._weights is not None
        return self._weights(key, map_location)

    def verify(self) -> str:
        """Read everything and check every checksum stored; return what was checked.

        Raises:
            CheckpointFormatError: the checkpoint is damaged (a checksum fails, a shard is missing
                or stray, a tensor cannot be read).
        """
        assert self._verify is not None
        return self._verify()

    def report(self) -> dict[str, Any]:
        """What ``ckpt info --json`` prints: format, files, entries, tensors, totals, metadata."""
        total = sum(t.bytes for t in self.tensors if not t.shared)
        prefixed = sum(1 for t in self.tensors if _wrapper_prefixed(t.name))
        report: dict[str, Any] = {
            "path": self.path,
            "format": self.format,
            "file_bytes": self.file_bytes,
            "entries": self.entries,
            "tensors": [{k: v for k, v in asdict(t).items() if k != "file" or v is not None} for t in self.tensors],
            "totals": {"tensors": len(self.tensors), "bytes": total, "module_prefixed": prefixed},
            "metadata": self.metadata,
        }
        if self.files:
            report["files"] = self.files
        if self.extras:
            report["extras"] = self.extras
        if self.skipped:
            report["skipped_globals"] = self.skipped
        return report


def _wrapper_prefixed(name: str) -> bool:
    return name.startswith(("module.", "_orig_mod.")) or ".module." in name or "._orig_mod." in name


# --- opening -------------------------------------------------------------------------------------


def open_checkpoint(path: PathLike, *, trust_code: bool = False) -> CheckpointView:
    """Open a checkpoint file or folder of any layout ckptools reads (see the module docstring).

    Args:
        path: a file, a folder, or an fsspec URL of a file.
        trust_code: let torch unpickle globals outside its allowlist (runs code from the file:
            for files you trust only). Without it such entries are read as inert placeholders
            and only the weights are available.

    Raises:
        CheckpointNotFoundError: nothing there.
        CheckpointLayoutError: a valid file or folder of another kind (one shard of a DCP
            checkpoint, a folder holding no model file, a JSON file that is no index).
        CheckpointFormatError: damaged or not a checkpoint.
        UnsafeCheckpointError: the weights themselves need refused globals and ``trust_code`` is off.

    Examples:
        >>> import torch, ckptools as ck
        >>> torch.save({"model": {"w": torch.ones(2)}, "step": 3}, "/tmp/v.pt")
        >>> view = ck.open_checkpoint("/tmp/v.pt")
        >>> view.format, [t.name for t in view.tensors], view.entries["step"]
        ('torch zip', ['model.w'], '3')
    """
    path = _fspath(path)
    fs, fpath = get_filesystem(path)
    if is_local(fs) and os.path.isdir(fpath):
        return _open_folder(fpath.rstrip("/") or "/", trust_code)
    name = os.path.basename(fpath)
    if name == ".metadata" and is_local(fs):
        return _dcp_view(os.path.dirname(fpath) or ".")
    if name.endswith(".distcp"):
        folder = os.path.dirname(fpath) or "."
        if not fs.exists(fpath):
            raise CheckpointNotFoundError(f"{path} does not exist")
        raise CheckpointLayoutError(
            f"{path} is one shard of a torch.distributed.checkpoint (DCP) folder, not a checkpoint on its own; "
            f"pass the folder that holds it and its .metadata ({folder})"
        )
    if name.endswith(".json"):
        return _sharded_view(path, trust_code)
    if name.endswith(".safetensors"):
        return _safetensors_view(path)
    return _torch_view(path, trust_code)


def _open_folder(folder: str, trust_code: bool) -> CheckpointView:
    names = set(os.listdir(folder))
    if ".metadata" in names:
        return _dcp_view(folder)
    model = next((n for n in _MODEL_FILES if n in names), None)
    extras = {
        n: what for n in sorted(names) for pattern, what in _ACCELERATE_EXTRAS.items() if fnmatch.fnmatch(n, pattern)
    }
    if model is None:
        found = ", ".join(sorted(names)[:12]) or "nothing"
        raise CheckpointLayoutError(
            f"{folder} is a folder but not a checkpoint layout ckptools reads: it holds no .metadata (DCP) and none "
            f"of {', '.join(_MODEL_FILES)} (it holds {found}); pass the checkpoint file inside it"
        )
    inner = os.path.join(folder, model)
    if model.endswith(".json"):
        view = _sharded_view(inner, trust_code)
    elif model.endswith(".safetensors"):
        view = _safetensors_view(inner)
    else:
        view = _torch_view(inner, trust_code)
    kind = "Accelerate save_state folder" if extras else "Hugging Face folder"
    view.format = f"{kind}, {view.format}"
    view.path = folder
    for other in (n for n in _MODEL_FILES if n in names and n != model):  # say which one was read
        extras[other] = f"also a model file; {model} was read"
    for n in sorted(names):  # Accelerate's further models: model_1.safetensors, pytorch_model_1.bin
        if re.fullmatch(r"(model|pytorch_model)_\d+\.(safetensors|bin)", n):
            extras[n] = "another model's weights (read it by passing the file)"
    view.extras = extras
    checked = [os.path.join(folder, n) for n in extras if n.endswith((".bin", ".pt")) and "model" not in n]
    if checked:  # Accelerate's optimizer/scheduler/scaler states are torch zips: their CRC-32s too
        verify_model = view._verify

        def check() -> str:
            from .serialization import verify_torch_file

            said = verify_model() if verify_model is not None else ""
            for path in checked:
                verify_torch_file(path)
            return f"{said}; {', '.join(os.path.basename(p) for p in checked)}: every record's CRC-32 matches"

        view._verify = check
    return view


# --- torch files ---------------------------------------------------------------------------------


def _is_zip(path: str) -> bool:
    from .convert import _local_zip

    # Remote files are taken as zip (the legacy format predates object stores), without a download.
    return not is_local(get_filesystem(path)[0]) or _local_zip(path)


def _torch_view(path: str, trust_code: bool) -> CheckpointView:
    zipped = _is_zip(path)
    fs, fpath = get_filesystem(path)
    skipped: list[str] = []
    parsed = None
    if zipped and is_local(fs):
        # From data.pkl alone: no torch import, no tensor read.
        from .torchzip import TorchZip, is_tensor, loads, tensor_info

        archive = TorchZip(fpath)
        data = archive.read_pickle()
        try:
            parsed = loads(data, path, archive)
        except UnsafeCheckpointError as refusal:
            if not trust_code:  # else torch loads it below, running what it names
                parsed, skipped = _lenient_tree(data, path, refusal, archive)
    if parsed is not None:
        tensors, entries, metadata = _walk_tree(parsed, lambda n: tensor_info(n) if is_tensor(n) else None)
    else:
        devices: dict[int, str] = {}

        def remember(storage: Any, location: str) -> Any:
            devices[storage.data_ptr()] = location  # the device each storage was saved from
            return storage

        tree = _load_whole(path, trust_code, mmap=False, map_location=remember)
        tensors, entries, metadata = _walk_tree(tree, _loaded_tensor_info(devices))
    size = os.path.getsize(fpath) if is_local(fs) else fs.size(fpath)

    def weights(key: str | None, map_location: Any) -> Mapping[str, Any]:
        return _torch_weights(path, key, map_location, trust_code)

    def check() -> str:
        from .serialization import verify_torch_file

        if zipped:
            verify_torch_file(path)
        if skipped:  # the strict load would refuse: read what can be read without code
            n = len(_torch_weights(path, None, "cpu", trust_code))
            return (
                f"torch zip, every record's CRC-32 matches, {plural(n, 'weight tensor')} read "
                f"({plural(len(skipped), 'global')} skipped)"
            )
        loaded = _load_whole(path, trust_code, mmap=zipped and is_local(fs))  # a remote file cannot be mapped
        n = len(_walk_tree(loaded, _loaded_tensor_info())[0])
        if zipped:
            return f"torch zip, every record's CRC-32 matches, {plural(n, 'tensor')} loaded"
        return f"torch legacy format (no checksums), {plural(n, 'tensor')} loaded"

    return CheckpointView(
        path=path, format="torch zip" if zipped else "torch legacy", tensors=tensors, entries=entries,
        metadata=metadata, files=[path], skipped=skipped, file_bytes=size, _weights=weights, _verify=check,
    )  # fmt: skip


def _lenient_tree(data: bytes, path: str, refusal: UnsafeCheckpointError, archive: Any = None) -> tuple[Any, list[str]]:
    """The tree of a ``data.pkl`` whose other entries need refused classes, with placeholders for
    them. The refusal stands when there are no weights beside them, or when a refused global
    runs code (``os.system``: a file made to attack, not a checkpoint with a ``Path`` in it)."""
    from .torchzip import hostile, loads_lenient, locate_weights

    tree, skipped = loads_lenient(data, path, archive)
    if hostile(skipped):
        raise refusal
    _refuse_whole_object(tree, path)
    try:
        locate_weights(tree, path=path)
    except Exception:  # noqa: BLE001 - no weights to give: nothing here is worth a lenient read
        raise refusal from None
    return tree, skipped


def _refuse_whole_object(tree: Any, path: str) -> None:
    """Refuse, saying so, a file that is one pickled object of a refused class (``torch.save(model)``)."""
    from .torchzip import Opaque

    if isinstance(tree, Opaque) and tree.cls is not None:
        raise UnsafeCheckpointError(
            f"{path} is a whole pickled {tree.name} object (torch.save(model)), not a dict of weights: only "
            "that class's code can rebuild it, so it was refused and nothing was executed. For a file you trust, "
            "--trust-pickled-code (weights_only=False) reads its state_dict(); better, re-save it as "
            "torch.save(model.state_dict(), path)"
        )


def _load_whole(path: str, trust_code: bool, *, mmap: bool, map_location: Any = "cpu") -> Any:
    """The whole file through torch; a trusted whole pickled module (``torch.save(model)``) as its
    ``state_dict()``, which is what a checkpoint of it would hold (never "0 tensors")."""
    import torch

    from .serialization import load_file

    try:
        return load_file(path, map_location=map_location, weights_only=True, mmap=mmap)
    except UnsafeCheckpointError:
        if not trust_code:
            raise
        tree = load_file(path, map_location=map_location, weights_only=False, mmap=mmap)
    return dict(tree.state_dict()) if isinstance(tree, torch.nn.Module) else tree


def _loaded_tensor_info(devices: Mapping[int, str] | None = None) -> Callable[[Any], dict[str, Any] | None]:
    import torch

    def describe(node: Any) -> dict[str, Any] | None:
        if not isinstance(node, torch.Tensor):
            return None
        if node.is_nested:  # no sizes of its own: how many tensors it holds, and their bytes
            parts = list(node.unbind())
            nbytes = sum(p.numel() * p.element_size() for p in parts)
            dtype = str(node.dtype).removeprefix("torch.")
            return {"shape": [len(parts)], "dtype": dtype, "bytes": nbytes, "device": "cpu", "storage": id(node)}
        if node.layout != torch.strided:  # sparse: its parts' bytes; no storage of its own
            parts = _sparse_parts(node)
            ptr = parts[-1].untyped_storage().data_ptr()
            nbytes = sum(p.numel() * p.element_size() for p in parts)
        else:
            ptr, nbytes = node.untyped_storage().data_ptr(), node.numel() * node.element_size()
        return {
            "shape": list(node.shape),
            "dtype": str(node.dtype).removeprefix("torch."),
            "bytes": nbytes,
            "device": (devices or {}).get(ptr, "cpu"),
            "storage": ptr,
        }

    return describe


def _sparse_parts(tensor: Any) -> list[Any]:
    """The dense tensors a sparse tensor is made of (indices first, values last)."""
    import torch

    if tensor.layout == torch.sparse_coo:
        return [tensor._indices(), tensor._values()]
    if tensor.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [tensor.crow_indices(), tensor.col_indices(), tensor.values()]
    return [tensor.ccol_indices(), tensor.row_indices(), tensor.values()]  # csc, bsc


def _torch_weights(path: str, key: str | None, map_location: Any, trust_code: bool) -> dict[str, Any]:
    import torch

    from .torchzip import locate_weights

    try:
        tree = _load_whole(path, False, mmap=False, map_location=map_location)
    except UnsafeCheckpointError as refusal:
        if trust_code:
            tree = _load_whole(path, True, mmap=False, map_location=map_location)
        else:
            # The weights never need the other entries' classes: read them without running code.
            return weights_without_code(path, key, map_location, refusal)
    return dict(locate_weights(tree, key=key, path=path, is_leaf=lambda v: isinstance(v, torch.Tensor))[2])


def weights_without_code(path: str, key: str | None, location: Any, refusal: UnsafeCheckpointError) -> dict[str, Any]:
    """The weights of a local zip checkpoint whose *other* entries need refused classes.

    The file is read by `load_without_code` (those classes as inert placeholders, nothing is
    imported or run) and the weights found as usual. Raises ``refusal`` when that cannot be done
    (a remote or legacy file, the weights themselves needing such a class).
    """
    import torch

    from .torchzip import Opaque, locate_weights

    tree, _ = load_without_code(path, location, refusal)
    try:
        weights = locate_weights(tree, key=key, path=path, is_leaf=lambda v: isinstance(v, torch.Tensor))[2]
    except CheckpointFormatError:
        if key is None and isinstance(tree, Opaque):
            raise refusal from None
        raise
    return dict(weights)


def load_without_code(
    path: str, map_location: Any, refusal: UnsafeCheckpointError, *, mmap: bool = False
) -> tuple[Any, list[str]]:
    """The whole tree of a local zip checkpoint some of whose entries need refused classes.

    Tensors, dtypes, devices and containers load as ``torch.load(weights_only=True)`` loads them
    (torch's own allowlist, and whatever ``torch.serialization.add_safe_globals`` added); every
    other global is an inert `ckptools.torchzip.Opaque` placeholder that holds what the pickle
    said about it: nothing is imported, constructed or called. Files naming code-running modules
    (`ckptools.torchzip.hostile`) raise ``refusal``, as do remote and legacy files. Warns once,
    naming what was skipped. Returns the tree and the skipped globals.
    """
    from . import _log
    from .convert import _local_zip
    from .serialization import load_file
    from .torchzip import TorchZip, hostile, loads_lenient

    fs, fpath = get_filesystem(path)
    if not is_local(fs) or not _local_zip(fpath):
        raise refusal
    archive = TorchZip(fpath)
    # Our own torch-free reader vets the pickle first (structure, storage sizes, hostile names).
    parsed, skipped = loads_lenient(archive.read_pickle(), path, archive)
    if hostile(skipped):
        raise refusal
    _refuse_whole_object(parsed, path)
    if not isinstance(parsed, Mapping):
        raise refusal
    tree = load_file(path, map_location=map_location, weights_only=False, mmap=mmap, pickle_module=_placeholders(path))
    _log.warn(
        f"{path}: read without loading {', '.join(skipped)} (inert placeholders stand in for them; nothing was "
        "executed). To load the whole file, trust it and use torch.load(..., weights_only=False)",
        once=f"weights {path}",
    )
    return tree, skipped


def _placeholders(path: str) -> Any:
    """A ``pickle_module`` for ``torch.load`` whose unpickler builds torch's allowlisted globals
    and stands an inert `Opaque` in for every other one.

    torch's own weights-only unpickler refuses a whole file for one ``pathlib.Path``; this one
    differs from it only there. It is the pure-Python unpickler (no memo table sized by a hostile
    index); ``BUILD`` sets state only where torch's safe loader does, or on a placeholder.
    """
    import types
    from collections import OrderedDict

    import torch
    import torch._weights_only_unpickler as safe

    from .torchzip import Opaque, _LenientReader, _PyUnpickler, canonical, hostile

    allowed = {**safe._get_allowed_globals(), **safe._get_user_allowed_globals()}  # type: ignore[no-untyped-call]
    buildable = {torch.Tensor, torch.nn.Parameter, OrderedDict, *(t for t in allowed.values() if isinstance(t, type))}

    class Unpickler(_PyUnpickler):  # type: ignore[misc]  # the pure-Python one (typed Any)
        dispatch: ClassVar[dict[int, Any]] = dict(_PyUnpickler.dispatch)
        _path = path  # named in _LenientReader's errors

        def find_class(self, module: str, name: str) -> Any:
            module, name = canonical(module, name)
            real = allowed.get(f"{module}.{name}")
            if real is not None:
                return real
            if hostile([f"{module}.{name}"]):  # vetted above; kept so this reader never resolves one alone
                raise UnsafeCheckpointError(f"refused {module}.{name}: it runs code")
            return Opaque(module, name)

        def load_build(self) -> None:
            state, inst = self.stack[-1], self.stack[-2]
            if state is None or (isinstance(state, (dict, tuple)) and not any(state)):
                self.stack.pop()  # an empty state (OmegaConf writes them): pickle sets nothing either
            elif isinstance(inst, Opaque) or type(inst) in buildable:  # where torch's safe loader sets state
                super().load_build()
            else:
                raise UnsafeCheckpointError(f"refused to set the state of a {type(inst).__name__}")

        dispatch[pickle.BUILD[0]] = load_build
        dispatch[pickle.NEWOBJ[0]] = _LenientReader._load_newobj
        dispatch[pickle.NEWOBJ_EX[0]] = _LenientReader._load_newobj_ex

    def load(*_: Any, **__: Any) -> Any:  # torch calls it for legacy files only, which never come here
        raise UnsafeCheckpointError(f"{path}: a legacy (pre-1.6) file cannot be read with placeholders")

    return types.SimpleNamespace(Unpickler=Unpickler, load=load, __name__="ckptools_placeholders")


def _walk_tree(
    tree: Any, describe: Callable[[Any], dict[str, Any] | None]
) -> tuple[list[TensorInfo], dict[str, str], dict[str, Any]]:
    """Tensors, entry lines and ckptools metadata of a checkpoint tree (loaded or parsed).

    ``describe(node)`` returns shape, dtype, bytes, device and a storage identity for a tensor
    (a repeated storage marks the tensor as shared), None for anything else.
    """
    from .torchzip import META_KEY

    tensors: list[TensorInfo] = []
    seen: set[Any] = set()

    def walk(node: Any, prefix: str) -> None:
        info = describe(node)
        if info is not None:
            storage = info.pop("storage")
            shared = storage is not None and storage in seen and info["bytes"] > 0
            seen.add(storage)
            tensors.append(TensorInfo(name=prefix, shared=shared, **info))
        elif isinstance(node, Mapping):
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        elif isinstance(node, (list, tuple)):
            for i, value in enumerate(node):
                walk(value, f"{prefix}.{i}" if prefix else str(i))

    entries: dict[str, str] = {}
    metadata: dict[str, Any] = {}
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            if key == META_KEY and isinstance(value, Mapping):
                metadata = {k: v for k, v in value.items() if k != "rng"}
                metadata["rng_ranks"] = len(value.get("rng", []))
                continue
            first = len(tensors)
            walk(value, str(key))
            entries[str(key)] = _describe(value, tensors[first:])
    else:
        walk(tree, "")
    return tensors, entries, metadata


def _describe(value: Any, tensors: list[TensorInfo]) -> str:
    """One line about a top-level entry, given the tensors found under it."""
    if tensors and not isinstance(value, (Mapping, list, tuple)):  # the entry is itself a tensor
        return f"tensor {tensors[0].shape} {tensors[0].dtype}"
    if isinstance(value, Mapping):
        return f"dict, {plural(len(value), 'key')}" + (f", {plural(len(tensors), 'tensor')}" if tensors else "")
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of {len(value)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# --- safetensors ---------------------------------------------------------------------------------


def _safetensors_view(path: str, *, file: str | None = None) -> CheckpointView:
    from .safetensors_file import ALIAS_KEY, TORCH_NAMES, _name_map, read_safetensors_header

    header, metadata, _, size = read_safetensors_header(path)
    tensors = [
        TensorInfo(name=n, dtype=TORCH_NAMES[e["dtype"]], shape=e["shape"],
                   bytes=e["data_offsets"][1] - e["data_offsets"][0], file=file)
        for n, e in sorted(header.items())
    ]  # fmt: skip
    aliases = _name_map(path, metadata, ALIAS_KEY)  # validated: ckptools' own metadata is untrusted input too
    by_name = {t.name: t for t in tensors}
    for alias, target in sorted(aliases.items()):
        if target in by_name and alias not in by_name:  # stored once, listed under both names
            t = by_name[target]
            tensors.append(TensorInfo(alias, t.dtype, t.shape, t.bytes, shared=True, file=file))

    def weights(key: str | None, map_location: Any) -> Mapping[str, Any]:
        return _safetensors_weights(path, key, map_location)

    def check() -> str:
        from .safetensors_file import verify_safetensors

        checked = verify_safetensors(path)
        _load_safetensors(path, "cpu")
        return f"safetensors, {plural(len(tensors), 'tensor')}" + (
            f", {checked} CRC-32s match" if checked else ", structure checked (no checksums stored)"
        )

    return CheckpointView(
        path=path, format="safetensors", tensors=tensors, metadata=dict(metadata), files=[path], file_bytes=size,
        _weights=weights, _verify=check,
    )  # fmt: skip


def _safetensors_weights(path: str, key: str | None, location: Any) -> dict[str, Any]:
    if key is not None:  # a safetensors file has no entries to look in: a clear error
        from .torchzip import locate_weights

        return dict(locate_weights({}, key=key, path=path)[2])
    return _load_safetensors(path, location)


def _load_safetensors(path: str, location: Any) -> dict[str, Any]:
    # The strict reader: duplicate names, overlapping offsets and the like are refused before
    # safetensors (which accepts some of them) decodes anything; aliases are re-tied.
    import torch

    from .safetensors_file import load_safetensors

    tensors = load_safetensors(path)
    # A dict or callable map_location describes torch storage tags, which safetensors files do
    # not have: their tensors stay on CPU.
    if isinstance(location, torch.device) and location.type != "cpu":
        tensors = {k: v.to(location) for k, v in tensors.items()}
    return tensors


# --- sharded checkpoints (transformers' index + shards) -----------------------------------------


def _read_index(path: str) -> tuple[dict[str, str], dict[str, Any]]:
    source, local = open_for_read(path)
    try:
        if local:
            with open(source, "rb") as f:
                raw = f.read()
        else:
            raw = source.getvalue()
        index = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise CheckpointFormatError(f"{path} is not valid JSON ({err}); a sharded checkpoint's index is") from err
    if not isinstance(index, dict) or "weight_map" not in index:
        raise CheckpointLayoutError(
            f"{path} is a JSON file but not a sharded checkpoint's index (it has no 'weight_map'); pass the "
            "checkpoint file or the folder that holds it"
        )
    weight_map = index["weight_map"]
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and v and "/" not in v and "\\" not in v and v not in (".", "..")
        for k, v in weight_map.items()
    ):
        raise CheckpointFormatError(
            f"{path}: 'weight_map' must map tensor names to shard file names in the same folder (corrupt index)"
        )
    metadata = index.get("metadata")
    return weight_map, dict(metadata) if isinstance(metadata, dict) else {}


def _shard_pattern(shards: list[str]) -> str | None:
    """The glob transformers' shard names follow (``model-00001-of-00003.safetensors``), if they do."""
    match = re.fullmatch(r"(.+)-\d{5}-of-(\d{5})(\.\w+)", shards[0]) if shards else None
    return f"{match.group(1)}-?????-of-?????{match.group(3)}" if match else None


def _sharded_view(index_path: str, trust_code: bool) -> CheckpointView:
    fs, findex = get_filesystem(index_path)
    if not fs.exists(findex):
        raise CheckpointNotFoundError(f"{index_path} does not exist")
    weight_map, metadata = _read_index(index_path)
    folder = index_path.rsplit("/", 1)[0] if "/" in index_path else "."
    shards = sorted(set(weight_map.values()))
    views: dict[str, CheckpointView] = {}
    for shard in shards:
        shard_path = f"{folder}/{shard}"
        if not fs.exists(get_filesystem(shard_path)[1]):
            raise CheckpointFormatError(
                f"{index_path} names shard {shard}, which is missing from {folder} (an incomplete copy or download)"
            )
        if shard.endswith(".safetensors"):
            views[shard] = _safetensors_view(shard_path, file=shard)
        else:
            views[shard] = _torch_view(shard_path, trust_code)
            for t in views[shard].tensors:
                t.file = shard
    tensors = [t for shard in shards for t in views[shard].tensors]
    kind = "safetensors" if all(s.endswith(".safetensors") for s in shards) else "torch"

    def weights(key: str | None, map_location: Any) -> Mapping[str, Any]:
        if key is not None:
            from .torchzip import locate_weights

            return locate_weights({}, key=key, path=index_path)[2]
        where = {n: views[s] for n, s in weight_map.items()}
        for shard in shards:  # names ckptools stored once (tied), listed in a shard's metadata only
            where.update({t.name: views[shard] for t in views[shard].tensors if t.shared and t.name not in where})
        # Shard by shard, each in its own stored order (an index's weight_map is sorted by name,
        # which would put lm_head before the embedding it is tied to).
        order = [t.name for shard in shards for t in views[shard].tensors if t.name in where]
        order += [n for n in where if n not in set(order)]
        return _ShardedWeights(where, map_location, list(dict.fromkeys(order)))

    def check() -> str:
        problems = _index_problems(index_path, weight_map, views, fs, folder)
        if problems:
            raise CheckpointFormatError(f"{index_path}: " + "; ".join(problems))
        said = [views[s].verify() for s in shards]
        checked = sum(1 for s in said if "CRC-32" in s and "no checksums" not in s)
        return (
            f"sharded {kind}, {plural(len(shards), 'shard')}, {plural(len(weight_map), 'tensor')}; "
            "the index and the shards agree; "
            + (f"{checked} of {len(shards)} shards carry checksums and match" if checked else "no checksums stored")
        )

    sizes = [v.file_bytes or 0 for v in views.values()]
    return CheckpointView(
        path=index_path, format=f"sharded {kind} ({len(shards)} shards)", tensors=tensors, metadata=metadata,
        files=[index_path, *(f"{folder}/{s}" for s in shards)], file_bytes=sum(sizes), _weights=weights,
        _verify=check,
    )  # fmt: skip


def _index_problems(
    index_path: str, weight_map: dict[str, str], views: dict[str, CheckpointView], fs: Any, folder: str
) -> list[str]:
    problems = []
    for shard, view in views.items():
        # Every name a torch shard holds is an entry (tied ones share a storage); in a safetensors
        # shard a "shared" name is only an alias in ckptools' metadata, which no index lists.
        metadata_only = shard.endswith(".safetensors")
        held = {t.name for t in view.tensors if not (metadata_only and t.shared)}
        listed = {n for n, s in weight_map.items() if s == shard}
        if listed - held:
            problems.append(f"{len(listed - held)} tensors the index puts in {shard} are not there "
                            f"({', '.join(sorted(listed - held)[:5])})")  # fmt: skip
        stray = held - set(weight_map)
        if stray:
            problems.append(
                f"{shard} holds {len(stray)} tensors the index does not list ({', '.join(sorted(stray)[:5])})"
            )
        elsewhere = {n for n in held & set(weight_map) if weight_map[n] != shard}
        if elsewhere:
            problems.append(
                f"{shard} also holds {', '.join(sorted(elsewhere)[:5])}, which the index puts in another shard"
            )
    pattern = _shard_pattern(sorted(views))
    if pattern is not None:
        present = {os.path.basename(p) for p in fs.glob(get_filesystem(f"{folder}/{pattern}")[1])}
        stray_files = sorted(present - set(views))
        if stray_files:
            problems.append(f"stray shard files the index does not name: {', '.join(stray_files[:5])}")
    return problems


class _ShardedWeights(Mapping[str, Any]):
    """Weights of a sharded checkpoint, read one shard at a time (the last shard read is kept)."""

    def __init__(self, where: dict[str, CheckpointView], map_location: Any, order: list[str]) -> None:
        self._where = where
        self._order = order
        self._location = map_location
        self._shard: tuple[str, Mapping[str, Any]] | None = None

    def __getitem__(self, name: str) -> Any:
        view = self._where[name]
        if self._shard is None or self._shard[0] != view.path:
            self._shard = (view.path, view.weights(map_location=self._location))
        try:
            return self._shard[1][name]
        except KeyError:
            raise CheckpointFormatError(
                f"{view.path} does not hold {name!r}, which the index puts there (run ckpt verify on the folder)"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)  # shard by shard: iterating reads each shard once

    def __len__(self) -> int:
        return len(self._where)


# --- torch.distributed.checkpoint folders --------------------------------------------------------


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` is a plain pickle (torch reads it with ``pickle.load``, which would run
    any code in it): allow only DCP's own metadata classes and the plain types they hold."""

    _MODULES: ClassVar[tuple[str, ...]] = (
        "torch.distributed.checkpoint.metadata",
        "torch.distributed.checkpoint.filesystem",
        "torch.distributed.checkpoint._extension",
    )

    def find_class(self, module: str, name: str) -> Any:
        import dataclasses
        import enum

        import torch

        if module in self._MODULES:
            found = getattr(importlib.import_module(module), name, None)
            # Their data classes and enums only: building one runs no code of the file's choosing.
            if isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)):
                return found
        elif module == "torch" and name == "Size":
            return torch.Size
        elif module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        elif (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        elif (module, name) == ("torch.serialization", "_get_layout"):
            return _layout  # how torch pickles a torch.layout: by its name
        elif module == "pathlib" and name in ("PosixPath", "PurePosixPath"):
            return pathlib.PurePosixPath  # StorageMeta.checkpoint_id; a pure path touches nothing
        elif module == "pathlib" and name in ("WindowsPath", "PureWindowsPath"):
            return pathlib.PureWindowsPath
        raise UnsafeCheckpointError(f"needs {module}.{name}")


def _layout(name: str) -> Any:
    import torch

    found = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(found, torch.layout):
        raise UnsafeCheckpointError(f"names a layout {name!r} torch does not have")
    return found


def _dcp_metadata(folder: str) -> Any:
    path = os.path.join(folder, ".metadata")
    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"{path} does not exist")
    with open(path, "rb") as f:
        try:
            return _MetadataUnpickler(f).load()
        except UnsafeCheckpointError as err:
            raise UnsafeCheckpointError(
                f"{path} {err}, outside the classes a DCP .metadata file holds; refused, nothing was executed"
            ) from None
        except Exception as err:
            raise CheckpointFormatError(f"{path} is truncated or corrupt ({type(err).__name__}: {err})") from err


def _dcp_view(folder: str) -> CheckpointView:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    meta = _dcp_metadata(folder)
    items = getattr(meta, "state_dict_metadata", None)
    if not isinstance(items, dict):
        raise CheckpointFormatError(f"{folder}/.metadata holds no state_dict_metadata (corrupt or not DCP)")
    tensors: list[TensorInfo] = []
    objects: list[str] = []
    for name, item in items.items():
        if isinstance(item, TensorStorageMetadata):
            numel = 1
            for d in item.size:
                numel *= d
            dtype = item.properties.dtype
            tensors.append(TensorInfo(name, str(dtype).removeprefix("torch."), list(item.size),
                                      numel * dtype.itemsize))  # fmt: skip
        elif isinstance(item, BytesStorageMetadata):
            objects.append(name)
    files = sorted({info.relative_path for info in (getattr(meta, "storage_data", None) or {}).values()})
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in files if os.path.exists(os.path.join(folder, f)))
    counted = _count_by_top(t.name for t in tensors)
    pickled = _count_by_top(objects)
    entries = {}
    for top in dict.fromkeys([*counted, *pickled]):
        parts = [plural(counted[top], "tensor")] if top in counted else []
        parts += [f"{pickled[top]} pickled values (not read)"] if top in pickled else []
        entries[top] = ", ".join(parts)

    def weights(key: str | None, map_location: Any) -> Mapping[str, Any]:
        import torch

        from .torchzip import locate_weights

        tree = _dcp_tensors(folder, meta)
        found = locate_weights(tree, key=key, path=folder, is_leaf=lambda v: isinstance(v, torch.Tensor))[2]
        if isinstance(map_location, torch.device) and map_location.type != "cpu":
            return {k: v.to(map_location) for k, v in found.items()}
        return dict(found)

    def check() -> str:
        missing = [f for f in files if not os.path.exists(os.path.join(folder, f))]
        if missing:
            raise CheckpointFormatError(f"{folder}: DCP data files {', '.join(missing[:5])} are missing")
        stray = sorted(set(fnmatch.filter(os.listdir(folder), "*.distcp")) - set(files))
        if stray:
            raise CheckpointFormatError(
                f"{folder}: stray DCP data files the .metadata does not name: {', '.join(stray[:5])}"
            )
        _dcp_tensors(folder, meta)
        return (
            f"DCP folder, {plural(len(files), 'data file')}, {plural(len(tensors), 'tensor')} read "
            "(DCP stores no checksums)"
        )

    return CheckpointView(
        path=folder, format="DCP folder (torch.distributed.checkpoint)", tensors=tensors, entries=entries,
        files=[os.path.join(folder, ".metadata"), *(os.path.join(folder, f) for f in files)], file_bytes=size,
        _weights=weights, _verify=check,
    )  # fmt: skip


def _count_by_top(names: Iterator[str] | Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for name in names:
        top = name.split(".", 1)[0]
        counts[top] = counts.get(top, 0) + 1
    return counts


def _dcp_tensors(folder: str, meta: Any) -> dict[str, Any]:
    """Every tensor of a DCP folder, read by torch's own DCP reader without a process group, as
    the nested dict that was saved (``{"model": {...}, "optimizer": {...}}``). Pickled objects
    are not read: weights never need them."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader  # type: ignore[attr-defined]  # exported
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return meta  # already read, by the restricted unpickler

    flat = {
        name: torch.empty(tuple(item.size), dtype=item.properties.dtype)
        for name, item in meta.state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata)
    }
    try:
        _load_state_dict(flat, storage_reader=Reader(folder), planner=DefaultLoadPlanner(flatten_state_dict=False),
                         no_dist=True)  # fmt: skip
    except CheckpointFormatError:
        raise
    except Exception as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
        raise CheckpointFormatError(f"{folder}: torch's DCP reader failed ({type(err).__name__}: {first})") from err
    # Nest the flattened names back as they were saved (DCP's planner_data keeps each one's path).
    paths = meta.planner_data if isinstance(getattr(meta, "planner_data", None), dict) else {}
    tree: dict[str, Any] = {}
    for name, tensor in flat.items():
        parts = [str(p) for p in paths.get(name, (name,))]
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                node = tree
                parts = [name]
                break
        node[parts[-1]] = tensor
    return tree


def _is_layout(path: str) -> bool:
    """Whether ``path`` names a folder layout or an index rather than a single checkpoint file."""
    fs, fpath = get_filesystem(path)
    name = os.path.basename(fpath.rstrip("/"))
    return name.endswith((".json", ".distcp")) or name == ".metadata" or (is_local(fs) and os.path.isdir(fpath))


def read_weights(path: str, *, key: str | None, map_location: Any, verify: bool = False) -> Mapping[str, Any]:
    """The model weights of any layout, names as stored: what ``load_state_dict`` and ``load`` use.

    A single file is read directly (no view is built: a remote file is fetched once); ``verify``
    checks its checksums first. A folder or index goes through `open_checkpoint`, and
    ``verify`` runs the view's whole check (every shard, index agreement) first.
    """
    if _is_layout(path):
        view = open_checkpoint(path)
        if verify:
            view.verify()
        return view.weights(key, map_location=map_location)
    if path.endswith(".safetensors"):
        if verify:
            from .safetensors_file import verify_safetensors

            verify_safetensors(path)
        return _safetensors_weights(path, key, map_location)
    if verify:
        from .serialization import verify_torch_file

        verify_torch_file(path)
    return _torch_weights(path, key, map_location, False)


def _weights_at(view: CheckpointView, key: str | None) -> Mapping[str, Any]:
    from .errors import KeyMismatchError

    if key is None:
        return view.weights()
    try:
        return view.weights(key)
    except (KeyMismatchError, CheckpointFormatError) as missing:
        try:
            return view.weights()  # this side holds no such entry: its weights as found without key
        except CheckpointFormatError:
            raise missing from None


# --- operations ----------------------------------------------------------------------------------


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
    import torch

    from .state_dict import strip_wrappers

    a, b = _fspath(a), _fspath(b)
    wa = _weights_at(open_checkpoint(a, trust_code=trust_code), key)
    wb = _weights_at(open_checkpoint(b, trust_code=trust_code), key)
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
