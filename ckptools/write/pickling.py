"""``data.pkl`` as ``torch.save`` writes it, with its storages named in order: the pickle every
planned writer (`ckptools.write.plan`) lays out around."""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

__all__ = ["pickle_payload"]

_PLAIN = frozenset((int, float, str, bool, type(None), tuple, list, dict, bytes, torch.dtype, torch.device, torch.Size))


def pickle_payload(
    payload: Any, *, on_cpu: bool = False, cpu: frozenset[int] = frozenset()
) -> tuple[bytes, dict[str, torch.UntypedStorage]]:
    """``data.pkl`` as ``torch.save`` writes it, and its storages by record key, in order.

    The storage naming is torch.serialization._save's: storages by reference, keys in order of
    first appearance, the storage type and ``location_tag`` of each (``"cpu"`` for all with
    ``on_cpu``: an async save stores its staged host copy, as with ``writers="rank0"``; and for the
    storages in ``cpu``, by ``_cdata``: a ZeRO partition, as torch's consolidation stores it); views of one
    storage with different dtypes are refused as torch refuses them.
    """
    from torch.serialization import location_tag, normalize_storage_type

    storages: dict[str, torch.UntypedStorage] = {}
    keys: dict[int, str] = {}
    dtypes: dict[int, torch.dtype] = {}

    def persistent_id(obj: Any) -> Any:
        if not (isinstance(obj, torch.storage.TypedStorage) or torch.is_storage(obj)):
            return None
        if isinstance(obj, torch.storage.TypedStorage):
            storage, dtype = obj._untyped_storage, obj.dtype
            storage_type = getattr(torch, obj._pickle_storage_type())  # type: ignore[no-untyped-call]
            numel = obj._size()  # type: ignore[no-untyped-call]
        else:
            storage, dtype = obj, torch.uint8
            storage_type = normalize_storage_type(type(obj))  # type: ignore[no-untyped-call]
            numel = storage.nbytes()
        allocated = str(storage.device) != "meta" and storage.data_ptr() != 0
        if allocated and dtypes.setdefault(storage.data_ptr(), dtype) != dtype:
            raise RuntimeError("Cannot save multiple tensors or storages that view the same data as different types")
        key = keys.setdefault(storage._cdata, str(len(keys)))
        storages[key] = storage
        fake = getattr(obj, "_fake_device", None)
        if on_cpu or storage._cdata in cpu:
            location = "cpu"
        else:
            location = str(fake) if fake is not None else location_tag(storage)
        return ("storage", storage_type, key, location, numel)

    class _Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            # Called for every object pickled: the plain ones (most of them) leave at once.
            return None if type(obj) in _PLAIN else persistent_id(obj)

    class _PlaceholderPickler(_Pickler):
        def reducer_override(self, obj: Any) -> Any:
            # Another rank's ZeRO tensor, a meta placeholder here: reduced as torch reduces the CPU
            # tensor it stands for (torch reduces a meta tensor without its storage).
            if type(obj) is torch.Tensor and obj.device.type == "meta" and obj.untyped_storage()._cdata in cpu:
                return _reduce_as_stored(obj)
            return NotImplemented

    buffer = io.BytesIO()
    # torch.save's default protocol; the override (a Python call per object) only when needed.
    (_PlaceholderPickler if cpu else _Pickler)(buffer, protocol=2).dump(payload)
    return buffer.getvalue(), storages


def _reduce_as_stored(tensor: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
    """``Tensor._reduce_ex_internal``'s reduction of a dense tensor with its storage (torch 2.x),
    for a tensor whose storage is not here."""
    from collections import OrderedDict

    storage: Any
    if tensor.dtype in torch.storage._new_dtypes():
        rebuild: Any = torch._utils._rebuild_tensor_v3
        storage = tensor.untyped_storage()
    else:
        rebuild = torch._utils._rebuild_tensor_v2
        storage = torch.storage.TypedStorage(  # type: ignore[no-untyped-call]
            wrap_storage=tensor.untyped_storage(), dtype=tensor.dtype, _internal=True
        )
    args: tuple[Any, ...] = (
        storage,
        tensor.storage_offset(),
        tuple(tensor.size()),
        tensor.stride(),
        tensor.requires_grad,
        OrderedDict(),
    )
    if isinstance(storage, torch.UntypedStorage):
        args += (tensor.dtype,)
    return rebuild, args
