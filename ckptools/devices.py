"""Device handling: where loaded tensors go, and a state's tensors copied to the CPU."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Union

import torch

from .collective.launch import local_gpu

__all__ = ["goes_to_cuda", "registered_with_cuda", "resolve_map_location", "to_cpu"]

MapLocation = Union[str, torch.device, Mapping[str, str], Callable[..., Any], None]

_SPEC_HELP = (
    'use "auto" (this rank\'s device), "cpu", "cuda" (this rank\'s GPU), "cuda:N", a torch.device, '
    'a dict such as {"cuda:0": "cuda:1"}, or a callable(storage, location)'
)


def _check_cuda(target: torch.device, spec: object) -> None:
    if target.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise ValueError(f'map_location={spec!r} asks for CUDA but CUDA is not available here; use "cpu" or "auto"')
    count = torch.cuda.device_count()
    if target.index is not None and target.index >= count:
        raise ValueError(f"map_location={spec!r} names GPU {target.index} but this machine has {count}; {_SPEC_HELP}")


def _auto_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_gpu())
    return torch.device("cpu")


def resolve_map_location(spec: MapLocation = "auto") -> Any:
    """Turn a device spec into a value ``torch.load(map_location=...)`` accepts.

    ``"auto"``/None mean this rank's own device: ``cuda:LOCAL_RANK`` when CUDA is available
    (``LOCAL_RANK % device_count`` where a node runs more ranks than it has GPUs), else ``cpu``.
    ``"cuda"`` without an index also means this rank's GPU (not GPU 0: on an 8-GPU node every
    rank would otherwise load onto GPU 0 and run out of memory there).

    Args:
        spec: ``"auto"``, None, ``"cpu"``, ``"cuda"``, ``"cuda:N"``, a ``torch.device``, a dict
            mapping saved locations to targets, or a callable ``(storage, location)``.

    Returns:
        A ``torch.device``, a dict, or the callable unchanged.

    Raises:
        ValueError: the spec is not understood, or it names CUDA where there is none.

    Examples:
        >>> import ckptools as ck
        >>> ck.resolve_map_location("auto")  # on a machine without CUDA
        device(type='cpu')
    """
    if spec is None or (isinstance(spec, str) and spec == "auto"):
        device = _auto_device()
        _check_cuda(device, "auto")
        return device
    if callable(spec) and not isinstance(spec, (str, torch.device)):
        return spec
    if isinstance(spec, Mapping):
        resolved: dict[str, str] = {}
        for src, dst in spec.items():
            try:
                src_dev, dst_dev = torch.device(src), torch.device(dst)
            except (RuntimeError, TypeError) as err:
                raise ValueError(f"map_location entry {src!r}: {dst!r} is not a device pair; {_SPEC_HELP}") from err
            _check_cuda(dst_dev, spec)
            resolved[str(src_dev)] = str(dst_dev)
        return resolved
    if isinstance(spec, (str, torch.device)):
        try:
            device = torch.device(spec)
        except (RuntimeError, TypeError) as err:
            raise ValueError(f"map_location={spec!r} is not a device; {_SPEC_HELP}") from err
        if device.type == "cuda" and device.index is None:
            device = _auto_device() if torch.cuda.is_available() else device
        _check_cuda(device, spec)
        return device
    raise ValueError(f"map_location={spec!r} ({type(spec).__name__}) is not understood; {_SPEC_HELP}")


def keep_view_bits(source: torch.Tensor, copy: torch.Tensor) -> None:
    """Give ``copy`` (built on a copy of ``source``'s storage) ``source``'s conjugate and negative
    bits: a lazily conjugated view's bytes are not its values (torch.save records the bits too)."""
    if source.is_conj() or source.is_neg():
        torch._utils.set_tensor_metadata(copy, torch._utils.get_tensor_metadata(source))  # type: ignore[no-untyped-call]


def _copy_tensor(t: torch.Tensor, memo: dict[Any, torch.UntypedStorage]) -> torch.Tensor:
    if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
        return t.detach().to("cpu", copy=True)
    storage = t.untyped_storage()
    key = (t.device, storage.data_ptr(), storage.nbytes())
    cpu_storage = memo.get(key)
    if cpu_storage is None:
        # Copy the whole storage (as torch.save does) so that views and tied tensors keep
        # sharing memory in the copy exactly as they did in the input.
        cpu_storage = torch.UntypedStorage(storage.nbytes(), device="cpu")  # type: ignore[no-untyped-call]
        cpu_storage.copy_(storage)
        memo[key] = cpu_storage
    out = torch.empty(0, dtype=t.dtype, device="cpu")
    out.set_(cpu_storage, t.storage_offset(), t.size(), t.stride())
    keep_view_bits(t, out)
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(out, requires_grad=t.requires_grad)
    return out


def _to_cpu(obj: Any, memo: dict[Any, torch.UntypedStorage]) -> Any:
    if isinstance(obj, torch.Tensor):
        return _copy_tensor(obj, memo)
    if isinstance(obj, Mapping):
        items = [(k, _to_cpu(v, memo)) for k, v in obj.items()]
        try:
            out: Any = type(obj)(items)  # type: ignore[call-arg]  # dict, OrderedDict and the like
        except TypeError:
            out = dict(items)
        metadata = getattr(obj, "_metadata", None)
        if metadata is not None:
            out._metadata = copy.deepcopy(metadata)
        return out
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_to_cpu(v, memo) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v, memo) for v in obj)
    return copy.deepcopy(obj)


def to_cpu(obj: Any) -> Any:
    """Deep-copy a nest of dicts/lists/tuples with every tensor on CPU, sharing no storage.

    This is how to take a snapshot of a model that lives on a GPU inside DDP without
    ``ddp_model.to("cpu")`` (which moves the parameters DDP's reducer points at and silently breaks
    gradient sync): ``snapshot = ck.to_cpu(ddp_model.state_dict())``. Tensors that share storage in
    the input (tied weights, views) share it in the copy too; CPU tensors are copied as well, so
    later in-place updates of the model never show through the snapshot.

    Args:
        obj: a tensor, or any nest of mappings, lists and tuples; other leaves are deep-copied.

    Returns:
        The copy.

    Examples:
        >>> import torch, ckptools as ck
        >>> w = torch.ones(2)
        >>> snap = ck.to_cpu({"w": w, "tied": w})
        >>> snap["w"].untyped_storage().data_ptr() == snap["tied"].untyped_storage().data_ptr()
        True
        >>> snap["w"].untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
        False
    """
    with torch.no_grad():
        return _to_cpu(obj, {})


# A mapping smaller than this is copied to the GPU unregistered: pinning has a fixed cost, and pageable
# copies of a few MiB are quick.
REGISTER_BYTES = 64 << 20


def goes_to_cuda(map_location: Any) -> bool:
    """Whether a load with ``map_location`` (as `resolve_map_location` gives it) puts storages on a GPU
    of this machine: a CUDA device, a mapping onto one, or a callable (which may; ckptools' own send
    most storages there).

    Examples:
        >>> goes_to_cuda(torch.device("cpu")), goes_to_cuda("cpu"), goes_to_cuda({"cuda:0": "cpu"})
        (False, False, False)
    """
    if not torch.cuda.is_available():
        return False
    if isinstance(map_location, Mapping):
        return any(str(target).startswith("cuda") for target in map_location.values())
    if callable(map_location):
        return True
    return isinstance(map_location, (str, torch.device)) and str(map_location).startswith("cuda")


@contextlib.contextmanager
def registered_with_cuda(storage: Any, map_location: Any) -> Iterator[bool]:
    """While the block runs, ``storage`` (a file torch mapped whole: a snapshot in node memory, a checkpoint
    in the page cache) is registered with CUDA as pinned memory when the load puts storages on a GPU, so
    each host-to-device copy runs at pinned speed instead of pageable (10.3x the pinned floor for 1 GiB
    from node memory on an H200 before: docs/gpu-proof.md). Read-only where the driver allows it (a
    private mapping pinned for writing would be copied page by page); a refusal (an ext4 file's mapping,
    on some drivers) leaves the copies pageable, as before. Yields whether it is registered.

    Examples:
        >>> with registered_with_cuda(torch.UntypedStorage(8), "cpu") as pinned:
        ...     pinned
        False
    """
    size = storage.nbytes()
    if size < REGISTER_BYTES or storage.device.type != "cpu" or not goes_to_cuda(map_location):
        yield False
        return
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    pointer, pinned = storage.data_ptr(), False
    for flags in (1 | 8, 1):  # cudaHostRegisterPortable | cudaHostRegisterReadOnly, then Portable alone
        try:
            pinned = int(cudart.cudaHostRegister(pointer, size, flags)) == 0
        except Exception:  # noqa: BLE001 - a binding without it: copies stay pageable
            break
        if pinned:
            break
        clear = getattr(cudart, "cudaGetLastError", None)
        if clear is not None:  # a refused registration must not surface at torch's next kernel check
            with contextlib.suppress(Exception):
                clear()
    try:
        yield pinned
    finally:
        if pinned:
            with contextlib.suppress(Exception):
                cudart.cudaHostUnregister(pointer)
