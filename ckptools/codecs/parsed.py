"""The inert objects a parsed ``data.pkl`` is made of, and the check that its tensors fit their storages.

`Global` (an allowlisted global, never imported), `Call` (what its ``REDUCE`` would have built),
`StorageRef` (a persistent storage reference) and `Opaque` (an object of a class the strict reader
refuses, in a lenient read) are what `ckptools.codecs.pickles` builds instead of real objects;
`check_extents` holds every tensor of such a tree to its storage, as torch's ``set_`` does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import CheckpointFormatError
from .dtypes import DTYPE_ITEMSIZE, STORAGE_ITEMSIZE

__all__ = ["STORAGE_REBUILDS", "Call", "Global", "Opaque", "StorageRef", "check_extents"]


class Global:
    """A reference to an allowlisted global (``torch._utils._rebuild_tensor_v2``), never imported."""

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, *args: Any) -> Call:
        return Call(self, args)

    def __repr__(self) -> str:
        return f"{self.module}.{self.name}"


class Call:
    """What ``REDUCE`` of a `Global` would have built; kept as (func, args, BUILD state)."""

    __slots__ = ("args", "func", "state")

    def __init__(self, func: Global, args: tuple[Any, ...]) -> None:
        self.func, self.args, self.state = func, args, None

    def __setstate__(self, state: Any) -> None:
        self.state = state


class StorageRef:
    """A persistent storage reference: ``('storage', type, key, location, numel)``."""

    __slots__ = ("key", "location", "numel", "storage_type")

    def __init__(self, storage_type: Global, key: str, location: str, numel: int) -> None:
        self.storage_type, self.key, self.location, self.numel = storage_type, key, location, numel


class Opaque:
    """An object of a class the strict reader refuses, in a lenient read: inert, never built.

    Holds what the pickle said about it (class, constructor arguments, items, state), so reading
    the *weights* of a file never needs the classes of its other entries (a Lightning
    checkpoint's ``hyper_parameters`` holding a ``pathlib.Path`` or an ``argparse.Namespace``),
    and `dumps` writes it back as it was read (``ckpt strip-module`` keeps such entries).
    ``cls`` is None for the class reference itself.
    """

    __slots__ = ("args", "cls", "dictitems", "listitems", "module", "name", "newobj", "qualname", "state")

    def __init__(self, module: str, qualname: str, cls: Opaque | None = None, args: tuple[Any, ...] = ()) -> None:
        self.module, self.qualname, self.name = module, qualname, f"{module}.{qualname}"
        self.cls, self.args, self.newobj = cls, args, False
        self.state: Any = None
        self.listitems: list[Any] = []
        self.dictitems: list[tuple[Any, Any]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Opaque:
        return Opaque(self.module, self.qualname, self, args)

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __setitem__(self, key: Any, value: Any) -> None:
        self.dictitems.append((key, value))

    def append(self, value: Any) -> None:
        self.listitems.append(value)

    def extend(self, values: Any) -> None:
        self.listitems.extend(values)

    def __repr__(self) -> str:
        return f"<{self.name}, not loaded>"

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled as itself (a broadcast load sends the tree to every rank): the placeholder, not
        # the class it stands for. (dumps() writes it back as the original object instead.)
        fields = (self.cls, self.args, self.newobj, self.state, self.listitems, self.dictitems)
        return (_opaque, (self.module, self.qualname, *fields))


def _opaque(module: str, qualname: str, cls: Opaque | None, args: tuple[Any, ...], newobj: bool, state: Any,
            listitems: list[Any], dictitems: list[tuple[Any, Any]]) -> Opaque:  # fmt: skip
    made = Opaque(module, qualname, cls, args)
    made.newobj, made.state, made.listitems, made.dictitems = newobj, state, listitems, dictitems
    return made


# The rebuild functions whose first four arguments are (storage, storage_offset, size, stride).
STORAGE_REBUILDS = frozenset({"_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_qtensor"})
_INT64_MAX = 2**63 - 1


def check_extents(tree: Any, path: str = "checkpoint") -> None:
    """Every tensor in a parsed tree lies inside its storage, as torch's ``set_`` requires.

    A tensor's size, stride and storage offset are the pickle's word: a file may claim a tensor
    reaching past its storage (torch refuses it; a reader that trusted the claim would list a
    tensor that cannot exist, or read another tensor's bytes). Shared containers are walked once.

    Raises:
        CheckpointFormatError: naming the tensor, its claim and its storage's size.

    Examples:
        >>> check_extents({"w": Call(Global("torch._utils", "_rebuild_tensor_v2"),
        ...                          (StorageRef(Global("torch", "FloatStorage"), "0", "cpu", 4), 0, (2, 2), (2, 1)))})
    """
    walked: set[int] = set()
    stack: list[tuple[Any, str]] = [(tree, "")]
    while stack:
        node, name = stack.pop()
        if isinstance(node, (Mapping, list, tuple, Call, Opaque)):
            if id(node) in walked:
                continue
            walked.add(id(node))
        if isinstance(node, Mapping):
            stack.extend((v, f"{name}.{k}" if name else str(k)) for k, v in node.items())
        elif isinstance(node, (list, tuple)):
            stack.extend((v, f"{name}.{i}" if name else str(i)) for i, v in enumerate(node))
        elif isinstance(node, Call):
            if node.func.name in STORAGE_REBUILDS:
                _check_extent(node.args, node.state, name or "the tensor", path)
            elif node.func.name in ("_rebuild_parameter", "_rebuild_parameter_with_state") and node.state is not None:
                _check_extent((), node.state, name or "the tensor", path)  # torch: Tensor.__setstate__, set_
            elif node.func.name == "_rebuild_from_type_v2" and len(node.args) > 2:  # (func, type, args, state)
                inner = node.args[0]
                if isinstance(inner, Global) and inner.name in STORAGE_REBUILDS and isinstance(node.args[2], tuple):
                    _check_extent(node.args[2], None, name or "the tensor", path)
            stack.extend((v, name) for v in node.args)
        elif isinstance(node, Opaque):
            stack.extend((v, name) for v in (*node.args, node.state, *node.listitems, *(v for _, v in node.dictitems)))


def _check_extent(args: tuple[Any, ...], state: Any, name: str, path: str) -> None:
    if state is not None:
        raise CheckpointFormatError(
            f"{path}: tensor {name!r} sets its storage while it loads (a pickle BUILD of {type(state).__name__}), "
            "in a form no torch.save writes; ckptools does not read it (only for a file you trust: torch.load)"
        )
    if len(args) < 4 or not isinstance(args[0], StorageRef):
        return  # not a tensor over a storage of this file: described as unknown, never read
    storage, offset, size, stride = args[:4]
    ints = isinstance(size, (tuple, list)) and isinstance(stride, (tuple, list)) and type(offset) is int
    if not ints or len(size) != len(stride) or not all(type(d) is int for d in (*size, *stride)):
        raise CheckpointFormatError(f"{path}: tensor {name!r} has a malformed size, stride or offset "
                                    f"({size!r}, {stride!r}, {offset!r}): corrupt file")  # fmt: skip
    numel = 1
    for d in size:
        numel *= d
    if offset < 0 or any(d < 0 for d in (*size, *stride)) or numel > _INT64_MAX:
        raise CheckpointFormatError(
            f"{path}: tensor {name!r} claims size {list(size)}, stride {list(stride)} and offset {offset}, which "
            "no tensor can have (negative, or more elements than torch can count): corrupt or built to attack"
        )
    if numel == 0:
        return
    itemsize = STORAGE_ITEMSIZE.get(storage.storage_type.name, ("", 1))[1]
    dtype = args[6] if len(args) > 6 and isinstance(args[6], Global) else None
    unit = (
        DTYPE_ITEMSIZE.get(dtype.name, 1) if dtype is not None and storage.storage_type.name == "UntypedStorage" else 1
    )
    last = offset + sum(st * (d - 1) for d, st in zip(size, stride))  # the last element, in the tensor's elements
    if (last + 1) * unit * itemsize > storage.numel * itemsize:
        raise CheckpointFormatError(
            f"{path}: tensor {name!r} (size {list(size)}, stride {list(stride)}, offset {offset}) reaches element "
            f"{last} of a storage of {storage.numel // unit}: past its end (torch refuses it); corrupt or built "
            "to attack, pick another file"
        )
