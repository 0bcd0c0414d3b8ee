"""Reading torch's ``data.pkl`` pickles without torch: the allowlist, the strict and lenient readers.

The reader is at least as strict as ``torch.load(weights_only=True)``: ``find_class`` answers
only a fixed allowlist of the globals torch checkpoints use, with inert placeholders (`Global`,
`Call`, `StorageRef`); anything else raises `UnsafeCheckpointError` and is never imported or
called. The lenient reader stands an inert `Opaque` in for such a global instead, and
`hostile` says which of them run code (a file made to attack, refused whole).
"""

from __future__ import annotations

import _compat_pickle
import io
import pickle
import struct
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, ClassVar, Protocol

from ..errors import CheckpointFormatError, UnsafeCheckpointError
from .dtypes import DTYPE_ITEMSIZE, STORAGE_ITEMSIZE
from .parsed import STORAGE_REBUILDS, Call, Global, Opaque, StorageRef, check_extents


class Archive(Protocol):
    """What the readers need of the zip a ``data.pkl`` came from (`ckptools.codecs.torchzip.TorchZip`)."""

    def check_storages(self, storages: Iterable[StorageRef]) -> None: ...


REBUILD_FUNCTIONS = {
    "_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter",
    "_rebuild_parameter_with_state", "_rebuild_meta_tensor_no_storage", "_rebuild_qtensor",
    "_rebuild_sparse_tensor", "_rebuild_nested_tensor", "_rebuild_wrapper_subclass",
    "_rebuild_device_tensor_from_cpu_tensor",
}  # fmt: skip


_QSCHEMES = {"per_tensor_affine", "per_tensor_symmetric", "per_channel_affine", "per_channel_symmetric",
             "per_channel_affine_float_qparams"}  # fmt: skip


_TORCH_NAMES = {"Size", "device", "Tensor", "strided", "sparse_coo", *DTYPE_ITEMSIZE, *STORAGE_ITEMSIZE} | _QSCHEMES


# Real objects that are harmless to construct.
_SAFE_REAL = {
    ("collections", "OrderedDict"): OrderedDict,
    ("builtins", "set"): set,  # torch's allowlist has set but not frozenset: neither has this reader
    ("builtins", "bytearray"): bytearray,
    ("builtins", "complex"): complex,
    ("_codecs", "encode"): __import__("codecs").encode,
}


def canonical(module: str, name: str) -> tuple[str, str]:
    """The Python 3 name of a global that a protocol-2 pickle may give its Python 2 name.

    ``pickle`` (protocol < 3) and ``torch.load(weights_only=True)`` both read ``__builtin__.set``
    as ``builtins.set`` and ``__builtin__.long`` as ``builtins.int``; OmegaConf's pickles name plain
    types that way. Every reader here judges the Python 3 name.

    Examples:
        >>> canonical("__builtin__", "long"), canonical("copy_reg", "_reconstructor")
        (('builtins', 'int'), ('copyreg', '_reconstructor'))
    """
    mapped = _compat_pickle.NAME_MAPPING.get((module, name))
    if mapped is not None:
        return mapped
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


def _allowed(module: str, name: str) -> bool:
    if module == "torch":
        return name in _TORCH_NAMES
    if module == "torch._utils":
        return name in REBUILD_FUNCTIONS
    return (module, name) in {
        ("torch.storage", "UntypedStorage"),  # float8 and uint16/32/64 tensors: _rebuild_tensor_v3 gives the dtype
        ("torch._tensor", "_rebuild_from_type_v2"),
        ("torch.nn.parameter", "Parameter"),
        ("torch.serialization", "_get_layout"),
        ("collections", "Counter"),
    }


# The pure-Python pickle classes, whose internals (stack, memo, dispatch tables) the readers and
# the writer below extend; typeshed describes only the public interface of the C ones.
PyUnpickler: Any = pickle._Unpickler


class PickleReader(PyUnpickler):  # type: ignore[misc]  # subclassing Any: see above
    """The strict unpickler: allowlisted globals become inert placeholders, nothing is imported.

    Built on the pure-Python unpickler on purpose: the C one sizes its memo table by the index a
    ``LONG_BINPUT`` names, so five hostile bytes make it allocate gigabytes (found by fuzzing);
    this one keeps the memo in a dict and reads every length-prefixed field from a ``BytesIO``,
    which never returns more than is there. ``data.pkl`` files are small: the speed is moot.
    """

    def __init__(self, data: bytes, path: str) -> None:
        super().__init__(io.BytesIO(data))
        self._data = data
        self._path = path
        self._globals: dict[tuple[str, str], Global] = {}
        self.storages: list[StorageRef] = []

    def find_class(self, module: str, name: str) -> Any:
        module, name = canonical(module, name)
        real = _SAFE_REAL.get((module, name))
        if real is not None:
            return real
        if not _allowed(module, name):
            needed = ", ".join(refused_globals(self._data)) or f"{module}.{name}"
            raise UnsafeCheckpointError(
                f"{self._path} needs {needed} to load, which could run arbitrary code, so it was refused and "
                "nothing was executed. Only for a file you trust: load it with torch.load(..., weights_only=False)"
            )
        # One object per global, so the writer memoizes it exactly as the original did.
        return self._globals.setdefault((module, name), Global(module, name))

    def load_build(self) -> None:
        # BUILD sets the state of the object below it. On what the pickle built (a rebuilt tensor, an
        # OrderedDict's _metadata, a placeholder) that is data; on a global itself (a class, a
        # function: `collections.Counter`, `torch._utils._rebuild_tensor_v2`) it would change it for
        # the whole process, which torch's weights-only loader refuses too.
        target = self.stack[-2] if len(self.stack) > 1 else None
        reached = isinstance(target, (Global, type)) or (callable(target) and not isinstance(target, (Call, Opaque)))
        if reached:
            raise UnsafeCheckpointError(build_refusal(self._path, repr(target) if target is not None else "nothing"))
        if isinstance(target, Call) and target.func.name in STORAGE_REBUILDS and self._set_storage(target):
            return
        super().load_build()

    def _set_storage(self, tensor: Call) -> bool:
        """A ``BUILD`` onto a rebuilt tensor: torch's loaders call ``tensor.set_(*state)`` (legacy
        pickles). ``(storage, offset, size, stride)`` becomes the tensor's own arguments, so every
        reader here sees the tensor torch would build (and `check_extents` checks it); any other
        state is kept on the call, where `check_extents` refuses it."""
        state = self.stack[-1]
        if not (isinstance(state, tuple) and len(state) == 4 and isinstance(state[0], StorageRef)):
            return False
        self.stack.pop()
        tensor.args = (*state, *tensor.args[4:])
        return True

    dispatch: ClassVar[dict[int, Any]] = dict(PyUnpickler.dispatch)
    dispatch[pickle.BUILD[0]] = load_build

    def persistent_load(self, pid: Any) -> StorageRef:
        if (
            isinstance(pid, tuple)
            and len(pid) == 5
            and pid[0] == "storage"
            and isinstance(pid[1], Global)
            and isinstance(pid[2], str)
            and isinstance(pid[3], str)
            and isinstance(pid[4], int)
        ):
            ref = StorageRef(pid[1], pid[2], pid[3], pid[4])
            self.storages.append(ref)
            return ref
        raise CheckpointFormatError(f"{self._path}: unexpected persistent id {pid!r} in data.pkl")


def build_refusal(path: str, target: str) -> str:
    """The message for a pickle that sets the state of ``target``, a global (a pickle ``BUILD`` onto it)."""
    return (
        f"{path} sets the state of {target} while it loads (a pickle BUILD onto a global), which would change it "
        "for the whole process: torch's weights-only loader refuses that, and only a file built to attack its "
        "reader does it. It was refused; nothing was executed or changed"
    )


_STRING_OPS = frozenset(
    {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING", "STRING"}
)


_PUT_OPS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})


_GET_OPS = frozenset({"GET", "BINGET", "LONG_BINGET"})


def refused_globals(data: bytes) -> list[str]:
    """Every global outside the allowlist that ``data`` names, found by reading opcodes only.

    ``STACK_GLOBAL`` (protocol 4+) takes its module and name from the stack, and a pickler
    fetches a string it wrote before from the memo (``BINGET``) instead of writing it again: the
    last two values pushed are followed through the memo, so the names are the real ones.
    """
    import pickletools

    found: list[str] = []
    memo: dict[Any, Any] = {}
    recent: list[Any] = []  # the values the latest opcodes pushed (None: not a string)
    try:
        for opcode, arg, _ in pickletools.genops(data):
            op = opcode.name
            if op in _STRING_OPS:
                recent.append(arg if isinstance(arg, str) else None)
            elif op == "MEMOIZE":
                memo[len(memo)] = recent[-1] if recent else None
            elif op in _PUT_OPS:
                memo[arg] = recent[-1] if recent else None
            elif op in _GET_OPS:
                recent.append(memo.get(arg))
            elif op == "GLOBAL" and isinstance(arg, str):
                module, _, name = arg.partition(" ")
                _note(found, module, name)
                recent.append(None)
            elif op == "STACK_GLOBAL":
                if len(recent) >= 2 and isinstance(recent[-2], str) and isinstance(recent[-1], str):
                    _note(found, recent[-2], recent[-1])
                recent.append(None)
            else:
                recent.append(None)
            del recent[:-2]
    except (ValueError, EOFError, pickle.UnpicklingError):
        pass  # a corrupt tail: report what was found before it
    return found


def _refused(module: str, name: str) -> bool:
    return (module, name) not in _SAFE_REAL and not _allowed(module, name)


def _note(found: list[str], module: str, name: str) -> None:
    module, name = canonical(module, name)
    if _refused(module, name) and f"{module}.{name}" not in found:
        found.append(f"{module}.{name}")


class LenientReader(PickleReader):
    """The strict reader, except that a refused global becomes an `Opaque` placeholder."""

    dispatch: ClassVar[dict[int, Any]] = dict(PickleReader.dispatch)

    def __init__(self, data: bytes, path: str) -> None:
        super().__init__(data, path)
        self.skipped: list[str] = []

    def find_class(self, module: str, name: str) -> Any:
        module, name = canonical(module, name)
        if not _refused(module, name):
            return super().find_class(module, name)
        if f"{module}.{name}" not in self.skipped:
            self.skipped.append(f"{module}.{name}")
        return Opaque(module, name)

    # NEWOBJ calls cls.__new__(cls, ...), which a placeholder instance cannot answer.
    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        self.append(_new_opaque(cls, args) if isinstance(cls, Opaque) else cls.__new__(cls, *args))

    def load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        cls = self.stack.pop()
        if isinstance(cls, Opaque) and kwargs:
            raise CheckpointFormatError(f"{self._path}: {cls.name} is built with keyword arguments; it cannot be kept")
        self.append(_new_opaque(cls, args) if isinstance(cls, Opaque) else cls.__new__(cls, *args, **kwargs))

    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex


# Modules whose callables exist to run code, spawn processes or reach the network: a legitimate
# checkpoint never names them, so a file that does is refused even by the lenient reader (which
# would not run them either) and called what it is.
_HOSTILE_MODULES = ("os", "posix", "nt", "subprocess", "builtins", "sys", "runpy", "importlib",
                    "shutil", "socket", "pty", "code", "codeop", "pickle", "_pickle", "marshal", "ctypes",
                    "webbrowser", "pdb", "timeit", "multiprocessing", "asyncio", "signal", "urllib", "http",
                    "requests", "functools", "operator", "types", "inspect", "torch._dynamo", "torch.jit")  # fmt: skip


# The builtins that only are or build plain data (types, as OmegaConf's metadata names them:
# ``object_type=list``, ``key_type=int``). A lenient read keeps them as placeholders like any
# other class; every other builtin (eval, exec, getattr, __import__, open, compile, ...)
# can run code or reach any object, and makes the file hostile.
DATA_BUILTINS = frozenset({
    "list", "dict", "set", "frozenset", "tuple", "int", "float", "complex", "bool", "str", "bytes",
    "bytearray", "slice", "range", "object", "NoneType", "Ellipsis", "NotImplemented",
    "type",  # pickle writes type(None) as a call of builtins.type
})  # fmt: skip


def hostile(globals_: list[str]) -> list[str]:
    """Those of ``globals_`` (``module.name``) that belong to code-running modules.

    Python 2 names count as their Python 3 ones (``__builtin__.eval`` is ``builtins.eval``); the
    builtins that only are data types (`DATA_BUILTINS`) are not hostile.

    Examples:
        >>> hostile(["pathlib.PosixPath", "posix.system", "__builtin__.list", "__builtin__.eval"])
        ['posix.system', '__builtin__.eval']
    """
    found = []
    for name in globals_:
        module, _, attr = name.rpartition(".")
        module, attr = canonical(module, attr)
        if module == "builtins" and attr in DATA_BUILTINS:
            continue
        if any(module == m or module.startswith(m + ".") for m in _HOSTILE_MODULES):
            found.append(name)
    return found


def _new_opaque(cls: Opaque, args: tuple[Any, ...]) -> Opaque:
    made = cls(*args)
    made.newobj = True  # written back with NEWOBJ: cls.__new__, no __init__, as it was read
    return made


def loads_lenient(data: bytes, path: str = "checkpoint", archive: Archive | None = None) -> tuple[Any, list[str]]:
    """Like `loads`, with refused globals read as inert `Opaque` placeholders.

    Returns the tree and the globals that were skipped. Nothing is imported or executed.
    """
    reader = LenientReader(data, path)
    return _parse(reader, path, archive), reader.skipped


def loads(data: bytes, path: str = "checkpoint", archive: Archive | None = None) -> Any:
    """Parse a torch ``data.pkl`` into plain containers, `Call` and `StorageRef`.

    With ``archive`` (the zip it came from), every storage it names must have a record that
    holds all its bytes (`TorchZip.check_storages`).
    """
    return _parse(PickleReader(data, path), path, archive)


def _parse(reader: PickleReader, path: str, archive: Archive | None = None) -> Any:
    try:
        tree = reader.load()
    except (UnsafeCheckpointError, CheckpointFormatError):
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            RecursionError, MemoryError, struct.error) as err:  # fmt: skip
        raise CheckpointFormatError(f"{path}: data.pkl is corrupt ({type(err).__name__}: {err})") from err
    check_extents(tree, path)
    if archive is not None:
        archive.check_storages(reader.storages)
    return tree
