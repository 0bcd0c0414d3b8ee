"""torch zip checkpoints without torch: a strict pickle reader, a writer, and record-level rewrites.

A torch checkpoint (``torch.save`` since 1.6) is an uncompressed zip archive: ``data.pkl`` holds
the object structure, each storage sits raw in its own ``data/N`` record (64-byte aligned, so
``torch.load(mmap=True)`` can map it). Renaming keys only changes ``data.pkl``, so ckptools
rewrites that record and copies every other record byte for byte (``copy_file_range``) — no
tensor is decoded, memory stays flat, and ``import torch`` (over a second) is not needed.

The reader is at least as strict as ``torch.load(weights_only=True)``: ``find_class`` answers
only a fixed allowlist of the globals torch checkpoints use, with inert placeholders; anything
else raises `UnsafeCheckpointError` and is never imported or called.
"""

from __future__ import annotations

import _compat_pickle
import contextlib
import io
import pickle
import re
import struct
import zipfile
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import IO, Any, ClassVar, cast

from .errors import CheckpointFormatError, CheckpointLayoutError, CheckpointNotFoundError, UnsafeCheckpointError
from .storage import copy_range

# The entry ckptools adds to every checkpoint it writes.
META_KEY = "__ckptools__"
# Where other tools nest a model's weights, most specific first.
WEIGHT_KEYS = ("state_dict", "model_state_dict", "model", "module")

STORAGE_ITEMSIZE = {
    "DoubleStorage": ("float64", 8), "FloatStorage": ("float32", 4), "HalfStorage": ("float16", 2),
    "BFloat16Storage": ("bfloat16", 2), "LongStorage": ("int64", 8), "IntStorage": ("int32", 4),
    "ShortStorage": ("int16", 2), "CharStorage": ("int8", 1), "ByteStorage": ("uint8", 1),
    "BoolStorage": ("bool", 1), "ComplexDoubleStorage": ("complex128", 16),
    "ComplexFloatStorage": ("complex64", 8), "UntypedStorage": ("uint8", 1),
    # Quantized tensors (torch.quantize_per_tensor): torch's safe loader reads them.
    "QInt8Storage": ("qint8", 1), "QUInt8Storage": ("quint8", 1), "QInt32Storage": ("qint32", 4),
    "QUInt4x2Storage": ("quint4x2", 1), "QUInt2x4Storage": ("quint2x4", 1),
}  # fmt: skip
_REBUILD = {
    "_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter",
    "_rebuild_parameter_with_state", "_rebuild_meta_tensor_no_storage", "_rebuild_qtensor",
    "_rebuild_sparse_tensor", "_rebuild_nested_tensor", "_rebuild_wrapper_subclass",
    "_rebuild_device_tensor_from_cpu_tensor",
}  # fmt: skip
_DTYPES = {
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
    "complex128", "complex64", "float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64",
}  # fmt: skip
_QSCHEMES = {"per_tensor_affine", "per_tensor_symmetric", "per_channel_affine", "per_channel_symmetric",
             "per_channel_affine_float_qparams"}  # fmt: skip
_TORCH_NAMES = {"Size", "device", "Tensor", "strided", "sparse_coo"} | _DTYPES | set(STORAGE_ITEMSIZE) | _QSCHEMES
# Bytes per element of the dtypes _rebuild_tensor_v3 names (its storage is untyped).
DTYPE_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
                  "int8": 1, "uint8": 1, "bool": 1, "complex128": 16, "complex64": 8, "float8_e4m3fn": 1,
                  "float8_e5m2": 1, "uint16": 2, "uint32": 4, "uint64": 8}  # fmt: skip
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


def _allowed(module: str, name: str) -> bool:
    if module == "torch":
        return name in _TORCH_NAMES
    if module == "torch._utils":
        return name in _REBUILD
    return (module, name) in {
        ("torch.storage", "UntypedStorage"),  # float8 and uint16/32/64 tensors: _rebuild_tensor_v3 gives the dtype
        ("torch._tensor", "_rebuild_from_type_v2"),
        ("torch.nn.parameter", "Parameter"),
        ("torch.serialization", "_get_layout"),
        ("collections", "Counter"),
    }


# The pure-Python pickle classes, whose internals (stack, memo, dispatch tables) the readers and
# the writer below extend; typeshed describes only the public interface of the C ones.
_PyUnpickler: Any = pickle._Unpickler
_PyPickler: Any = pickle._Pickler


class _Reader(_PyUnpickler):  # type: ignore[misc]  # subclassing Any: see above
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
            needed = ", ".join(_refused_globals(self._data)) or f"{module}.{name}"
            raise UnsafeCheckpointError(
                f"{self._path} needs {needed} to load, which could run arbitrary code, so it was refused and "
                "nothing was executed. Only for a file you trust: load it with torch.load(..., weights_only=False)"
            )
        # One object per global, so the writer memoizes it exactly as the original did.
        return self._globals.setdefault((module, name), Global(module, name))

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


_STRING_OPS = frozenset(
    {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING", "STRING"}
)
_PUT_OPS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_GET_OPS = frozenset({"GET", "BINGET", "LONG_BINGET"})


def _refused_globals(data: bytes) -> list[str]:
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


class _LenientReader(_Reader):
    """The strict reader, except that a refused global becomes an `Opaque` placeholder."""

    dispatch: ClassVar[dict[int, Any]] = dict(_Reader.dispatch)

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
    def _load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        self.append(_new_opaque(cls, args) if isinstance(cls, Opaque) else cls.__new__(cls, *args))

    def _load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        cls = self.stack.pop()
        if isinstance(cls, Opaque) and kwargs:
            raise CheckpointFormatError(f"{self._path}: {cls.name} is built with keyword arguments; it cannot be kept")
        self.append(_new_opaque(cls, args) if isinstance(cls, Opaque) else cls.__new__(cls, *args, **kwargs))

    dispatch[pickle.NEWOBJ[0]] = _load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = _load_newobj_ex


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


def loads_lenient(data: bytes, path: str = "checkpoint", archive: TorchZip | None = None) -> tuple[Any, list[str]]:
    """Like `loads`, with refused globals read as inert `Opaque` placeholders.

    Returns the tree and the globals that were skipped. Nothing is imported or executed.
    """
    reader = _LenientReader(data, path)
    return _parse(reader, path, archive), reader.skipped


def loads(data: bytes, path: str = "checkpoint", archive: TorchZip | None = None) -> Any:
    """Parse a torch ``data.pkl`` into plain containers, `Call` and `StorageRef`.

    With ``archive`` (the zip it came from), every storage it names must have a record that
    holds all its bytes (`TorchZip.check_storages`).
    """
    return _parse(_Reader(data, path), path, archive)


def _parse(reader: _Reader, path: str, archive: TorchZip | None = None) -> Any:
    try:
        tree = reader.load()
    except (UnsafeCheckpointError, CheckpointFormatError):
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            RecursionError, MemoryError, struct.error) as err:  # fmt: skip
        raise CheckpointFormatError(f"{path}: data.pkl is corrupt ({type(err).__name__}: {err})") from err
    if archive is not None:
        archive.check_storages(reader.storages)
    return tree


class _LegacyReader(_Reader):
    """The strict reader for the pickles of a legacy (pre-1.6) file, noting storage sizes."""

    def __init__(self, data: bytes, path: str, sizes: dict[str, int]) -> None:
        super().__init__(data, path)
        self._sizes = sizes

    def persistent_load(self, pid: Any) -> Any:
        # ('storage', storage type, key, location, numel, view metadata) since torch 0.4.
        if (
            isinstance(pid, tuple)
            and len(pid) == 6
            and pid[0] == "storage"
            and isinstance(pid[1], Global)
            and type(pid[4]) is int
            and pid[4] >= 0
        ):
            itemsize = STORAGE_ITEMSIZE.get(pid[1].name, ("", 1))[1]
            key = str(pid[2])
            self._sizes[key] = max(self._sizes.get(key, 0), pid[4] * itemsize)
            return StorageRef(pid[1], key, str(pid[3]), pid[4])
        raise CheckpointFormatError(f"{self._path}: unexpected persistent id {pid!r} in a legacy torch file")


LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


class _Bounded:
    """A read-only view of a file whose reads never ask for more bytes than are left.

    ``f.read(n)`` on a real file allocates ``n`` bytes before reading; a pickle opcode can
    claim n = 4 GiB in a 10-byte file.
    """

    def __init__(self, handle: IO[bytes], size: int) -> None:
        self._f, self._size = handle, size

    def read(self, n: int | None = -1) -> bytes:
        left = max(0, self._size - self._f.tell())
        return self._f.read(left if n is None or n < 0 else min(n, left))

    def readline(self, limit: int = -1) -> bytes:
        return self._f.readline(limit)


def _next_pickle(handle: IO[bytes], size: int, path: str) -> bytes:
    """The bytes of the pickle starting at the handle's position, after checking it is complete.

    ``pickletools.genops`` walks the opcodes without building anything, so a length that points
    past the end of the file is found before any unpickler allocates it.
    """
    import pickletools

    start = handle.tell()
    try:
        for _ in pickletools.genops(cast(IO[bytes], _Bounded(handle, size))):  # read() and tell() suffice
            pass
    except (ValueError, EOFError, pickle.UnpicklingError, UnicodeDecodeError, OverflowError, struct.error) as err:
        if start == 0 and size == 0:
            raise CheckpointFormatError(
                f"{path} is empty (0 bytes): a save that never finished, or a copy cut short; pick another file"
            ) from err
        if start == 0:
            handle.seek(0)
            first = handle.read(8)
            if first[:1] != b"\x80":  # neither a zip nor a pickle of protocol 2+, as torch writes
                raise CheckpointFormatError(
                    f"{path} is not a torch checkpoint, or is corrupt: it starts with bytes {first.hex(' ')}, "
                    "neither a zip (PK) nor a pickle"
                ) from err
        raise CheckpointFormatError(
            f"{path} is truncated, corrupt or not a torch checkpoint (pickle at byte {start}: {err})"
        ) from err
    end = handle.tell()
    handle.seek(start)
    return handle.read(end - start)


def check_non_zip(handle: IO[bytes], size: int, path: str = "checkpoint") -> None:
    """Vet a non-zip torch file before ``torch.load`` reads it, decoding no tensor data.

    ``torch.load`` unpickles such a file as the legacy (pre-1.6) format: it reads one pickle
    (the magic number) and, if that matches, four more, then allocates every storage at the size
    the pickles claim before reading its bytes. Every pickle it would read is checked to be
    complete, and the storage sizes claimed are checked against the file's size, so a few hostile
    bytes cannot make it allocate gigabytes.

    Raises:
        UnsafeCheckpointError: a pickle names a global outside the allowlist.
        CheckpointFormatError: a pickle is cut short or corrupt, or the storages claimed do not
            fit in the file.
    """
    handle.seek(0)
    sizes: dict[str, int] = {}
    try:
        if loads(_next_pickle(handle, size, path), path) != LEGACY_MAGIC:
            return  # not a torch file: torch.load stops at "invalid magic number"
        for _ in range(2):  # the protocol version, system information
            loads(_next_pickle(handle, size, path), path)
        main = _next_pickle(handle, size, path)
        _LegacyReader(main, path, sizes).load()
        _next_pickle(handle, size, path)  # the storage keys
    except (UnsafeCheckpointError, CheckpointFormatError):
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            RecursionError, MemoryError, struct.error) as err:  # fmt: skip
        raise CheckpointFormatError(f"{path}: legacy torch file is corrupt ({type(err).__name__}: {err})") from err
    claimed = sum(sizes.values())
    if claimed > size:
        raise CheckpointFormatError(
            f"{path} claims {claimed} bytes of tensor data but holds {size} bytes in all "
            "(truncated or forged legacy torch file); re-save it or pick another file"
        )


class _Writer(_PyPickler):  # type: ignore[misc]  # the pure-Python pickler can be extended
    dispatch = _PyPickler.dispatch.copy()

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, StorageRef):
            return ("storage", obj.storage_type, obj.key, obj.location, obj.numel)
        return None

    def _save_global_ref(self, obj: Global) -> None:
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
        self.memoize(obj)

    def _save_call(self, obj: Call) -> None:
        self.save(obj.func)
        self.save(tuple(obj.args))
        self.write(pickle.REDUCE)
        self.memoize(obj)
        if obj.state is not None:
            self.save(obj.state)
            self.write(pickle.BUILD)

    def _save_opaque(self, obj: Opaque) -> None:
        # As the pickler wrote it: class, arguments, NEWOBJ or REDUCE, then items, then state.
        if obj.cls is None:
            self.write(pickle.GLOBAL + f"{obj.module}\n{obj.qualname}\n".encode())
            self.memoize(obj)
            return
        self.save(obj.cls)
        self.save(tuple(obj.args))
        self.write(pickle.NEWOBJ if obj.newobj else pickle.REDUCE)
        self.memoize(obj)
        for value in obj.listitems:
            self.save(value)
            self.write(pickle.APPEND)
        for key, value in obj.dictitems:
            self.save(key)
            self.save(value)
            self.write(pickle.SETITEM)
        if obj.state is not None:
            self.save(obj.state)
            self.write(pickle.BUILD)

    def _save_bytes(self, obj: bytes) -> None:
        # Protocol 2 writes b"" as a call of __builtin__.bytes, a global torch's safe loader (and
        # this reader) refuse; every bytes value goes as _codecs.encode(str, "latin1") instead,
        # which is how protocol 2 writes non-empty ones and what torch.save's pickles hold.
        self.save_reduce(_SAFE_REAL[("_codecs", "encode")], (str(obj, "latin1"), "latin1"), obj=obj)

    dispatch[Global] = _save_global_ref
    dispatch[bytes] = _save_bytes
    dispatch[Call] = _save_call
    dispatch[Opaque] = _save_opaque


def dumps(obj: Any) -> bytes:
    """Pickle a tree produced by `loads` back into a ``data.pkl`` torch can load."""
    buffer = io.BytesIO()
    _Writer(buffer, protocol=2).dump(obj)  # protocol 2, as torch.save writes
    return buffer.getvalue()


def is_tensor(node: Any) -> bool:
    """Whether a parsed node is a tensor (a call of one of torch's rebuild functions)."""
    return isinstance(node, Call) and (node.func.name in _REBUILD or node.func.name == "_rebuild_from_type_v2")


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
        CheckpointFormatError: nothing found (the message lists the entries and says to pass a key).
        KeyMismatchError: ``key`` does not exist.
    """
    leaf = is_leaf or is_tensor

    def weights(node: Any) -> bool:
        return isinstance(node, Mapping) and bool(node) and all(leaf(v) for v in node.values())

    if not isinstance(tree, Mapping):
        raise CheckpointFormatError(f"{path} holds a {type(tree).__name__}, not a dict of weights")
    if key is not None:
        parent: Any = None
        node: Any = tree
        for part in key.split("."):
            if not isinstance(node, Mapping) or part not in node:
                from .errors import KeyMismatchError

                raise KeyMismatchError(
                    f"{path} has no entry {key!r}; top-level entries are {sorted(map(str, tree))}", missing=[key]
                )
            parent, node = node, node[part]
        if not isinstance(node, Mapping):
            raise CheckpointFormatError(f"{path}: entry {key!r} is a {type(node).__name__}, not a dict of weights")
        return parent, key.split(".")[-1], node
    if weights(tree):
        return None, None, tree
    for candidate in WEIGHT_KEYS:
        if weights(tree.get(candidate)):
            return tree, candidate, tree[candidate]
    raise CheckpointFormatError(
        f"cannot find model weights in {path}: entries are {sorted(map(str, tree))[:20]}; "
        "pass key=... (--key on the command line) to name the entry that holds them"
    )


# --- the zip container ----------------------------------------------------------------------------


class TorchZip:
    """The records of a torch zip checkpoint: names, sizes, CRC-32s and where their data starts.

    Opening one checks the container as torch's reader (miniz and ``PyTorchStreamReader``) and
    ``torch.load`` check it, so that nothing ckptools reads without torch is a file torch refuses:
    one archive on one disk, no encryption, record names in UTF-8 and all in the folder of the
    first record, every record stored (uncompressed) and inside the file, a ``version`` record that
    torch supports, a ``byteorder`` of ``little`` or ``big``, an integer ``.storage_alignment``.
    ``handle`` (an open binary file) is read instead of opening ``path``.
    """

    # caffe2/serialize/versions.h: kMinSupportedFileFormatVersion, kMaxSupportedFileFormatVersion.
    VERSIONS = range(1, 11)

    def __init__(self, path: str, handle: IO[bytes] | None = None) -> None:
        self.path = path
        try:
            if handle is not None:
                self._scan(handle)
            else:
                with open(path, "rb") as f:
                    self._scan(f)
        except CheckpointFormatError:
            raise
        except FileNotFoundError as err:
            raise CheckpointNotFoundError(f"checkpoint {path} does not exist; check the path") from err
        except (zipfile.BadZipFile, ValueError, EOFError, OSError, NotImplementedError, struct.error) as err:
            # zipfile raises more than BadZipFile on damaged directories (UnicodeDecodeError for
            # a mangled name, ValueError for negative seeks, EOFError for short reads).
            raise CheckpointFormatError(
                f"{path} is truncated or not a torch zip checkpoint ({type(err).__name__}: {err})"
            ) from err

    def _scan(self, f: IO[bytes]) -> None:
        path = self.path
        self.size = size = f.seek(0, 2)
        f.seek(0)
        with zipfile.ZipFile(f) as archive:
            self.infos = archive.infolist()
            directory_at = archive.start_dir
        names = [info.filename for info in self.infos]
        if any(name.endswith("/constants.pkl") for name in names):  # torch's own test for TorchScript
            raise CheckpointLayoutError(
                f"{path} is a TorchScript archive (torch.jit.save), not a checkpoint: load it with "
                "torch.jit.load(path); its weights are torch.jit.load(path).state_dict()"
            )
        if any(name.endswith("/archive_format") for name in names):
            raise CheckpointLayoutError(
                f"{path} is a torch.export archive (.pt2), not a checkpoint: load it with torch.export.load(path)"
            )
        if not any(re.search(r"/(data\.pkl|data/\d+|version|byteorder)$", name) for name in names):
            # Nothing of torch's: another kind of zip file, not a damaged checkpoint.
            raise CheckpointLayoutError(f"{path} is a zip file but not a torch checkpoint (no data.pkl)")
        self._check_directory(f, directory_at)
        if not self.infos or "/" not in self.infos[0].filename:
            raise CheckpointFormatError(
                f"{path} is a zip file but not a torch checkpoint (no data.pkl in an archive folder)"
            )
        self.prefix = self.infos[0].filename.split("/", 1)[0] + "/"
        self.starts = []
        self.records: dict[str, tuple[int, int]] = {}
        for info in self.infos:
            name = info.filename
            # The name's bytes, as stored: zipfile decoded them as cp437 unless flagged UTF-8.
            raw = info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437")
            raw.decode("utf-8")  # torch reads names as UTF-8: UnicodeDecodeError, refused above
            if name.endswith("/"):
                raise CheckpointFormatError(f"{path}: record {name} is a folder; torch never writes one")
            if info.compress_type != zipfile.ZIP_STORED:
                raise CheckpointFormatError(f"{path}: record {name} is compressed; torch never does that")
            if not name.startswith(self.prefix):
                raise CheckpointFormatError(f"{path}: record {name} lies outside the archive folder {self.prefix}")
            f.seek(info.header_offset)
            header = f.read(30)
            if len(header) != 30 or header[:4] != b"PK\x03\x04":
                raise CheckpointFormatError(f"{path}: record {name} has a damaged header")
            flags, method = struct.unpack("<HH", header[6:10])
            n, m = struct.unpack("<HH", header[26:30])
            local = f.read(n + m)
            # The local header must describe the record the directory describes: torch takes the
            # data's start from it, so a damaged one shifts every byte read (found by fuzzing).
            if local[:n] != raw or (flags & ~_FLAGS or method != zipfile.ZIP_STORED or not _whole_blocks(local[n:])):
                raise CheckpointFormatError(f"{path}: record {name} has a damaged header")
            start = info.header_offset + 30 + n + m
            if start + info.file_size > size:
                raise CheckpointFormatError(f"{path}: record {name} runs past the end (truncated file)")
            self.starts.append(start)
            key = name[len(self.prefix) :]
            if key in self.records:
                raise CheckpointFormatError(f"{path}: the archive holds two records named {name}")
            self.records[key] = (start, info.file_size)
        if "data.pkl" not in self.records:
            raise CheckpointFormatError(f"{path} is a zip file but not a torch checkpoint (no data.pkl)")
        self.pkl_index = [i.filename for i in self.infos].index(self.prefix + "data.pkl")
        # The small records torch.load reads before any tensor, judged as torch judges them.
        version = self._small(f, "version")
        digits = re.match(rb"[ \t\n\v\f\r]*\+?([0-9]+)", version or b"")
        if version is None or digits is None or int(digits.group(1)) not in self.VERSIONS:
            raise CheckpointFormatError(
                f"{path}: the archive's version record is {'missing' if version is None else repr(version[:20])}; "
                f"torch reads versions {self.VERSIONS.start} to {self.VERSIONS.stop - 1}"
            )
        self.byteorder = self._small(f, "byteorder") or b"little"
        if self.byteorder not in (b"little", b"big"):
            raise CheckpointFormatError(f"{path}: unknown byte order {self.byteorder[:20]!r}")
        alignment = self._small(f, ".storage_alignment")
        if alignment is not None:
            try:
                int(alignment)  # as torch.load reads it
            except ValueError:
                raise CheckpointFormatError(f"{path}: .storage_alignment {alignment[:20]!r} is not a number") from None

        serialization_id = self._small(f, ".data/serialization_id")
        if serialization_id is not None:
            serialization_id.decode("utf-8")  # torch.load decodes it: UnicodeDecodeError, refused above

    def _check_directory(self, f: IO[bytes], directory_at: int) -> None:
        """The end records and the central directory as miniz reads them. Python's zipfile is
        more forgiving (it guesses where the zip64 end record is, ignores the disk fields, cuts
        comments short), so where the two could read a damaged file differently it is refused."""
        # What ZipFile itself parsed: [sig, disk, directory disk, entries here, entries, directory
        # size, directory offset, comment length, comment, end record location].
        end = zipfile._EndRecData(f)  # type: ignore[attr-defined]
        damaged = CheckpointFormatError(f"{self.path}: the zip directory is damaged (truncated or corrupt file)")
        if end is None or end[1] or end[2] or end[3] != end[4] or end[4] != len(self.infos) or end[6] != directory_at:
            raise damaged
        if end[0] == b"PK\x06\x06":  # zip64: the locator must point at the zip64 end record
            f.seek(end[9] - 20)
            signature, disk, where, disks = struct.unpack("<4sLQL", f.read(20))
            f.seek(where)
            head = f.read(12)
            if (
                signature != b"PK\x06\x07"
                or disk
                or disks != 1
                or where != end[9] - 20 - 56
                or head != (b"PK\x06\x06" + struct.pack("<Q", 44))
            ):
                raise damaged
        # Each entry as miniz reads it, from the raw bytes (zipfile's ZipInfo cuts short what runs past).
        f.seek(directory_at)
        directory = f.read(end[5])
        at = 0
        for info in self.infos:
            if directory[at : at + 4] != b"PK\x01\x02" or len(directory) < at + 46:
                raise damaged
            flags = struct.unpack_from("<H", directory, at + 8)[0]
            n, m, k, disk = struct.unpack_from("<4H", directory, at + 28)
            external = struct.unpack_from("<L", directory, at + 38)[0]
            # Flags other than "sizes follow the data" and "UTF-8 name" (encryption, patches), an
            # entry on another disk, the DOS directory attribute (miniz then reads nothing), a
            # stored size given twice differently: torch refuses or misreads each of them.
            if (
                flags & ~_FLAGS or disk or external & 0x10
                or (info.compress_type == zipfile.ZIP_STORED and info.compress_size != info.file_size)
                or at + 46 + n + m + k > len(directory) or not _whole_blocks(directory[at + 46 + n : at + 46 + n + m])
            ):  # fmt: skip
                raise damaged
            at += 46 + n + m + k
        if at != end[5]:
            raise damaged

    def _small(self, f: IO[bytes], name: str) -> bytes | None:
        if name not in self.records:
            return None
        start, length = self.records[name]
        if length > 4096:
            raise CheckpointFormatError(f"{self.path}: record {name} is {length} bytes; torch writes a few")
        f.seek(start)
        return f.read(length)

    def check_storages(self, storages: Iterable[StorageRef]) -> None:
        """Every storage the pickle names has a record holding all its bytes (torch reads past
        the end of a short record without noticing: uninitialised memory or the next record)."""
        for ref in storages:
            record = self.records.get("data/" + ref.key)
            if record is None:
                raise CheckpointFormatError(f"{self.path}: data.pkl names storage {ref.key!r}, which has no record")
            itemsize = STORAGE_ITEMSIZE.get(ref.storage_type.name, ("", 1))[1]
            if record[1] < ref.numel * itemsize:
                raise CheckpointFormatError(
                    f"{self.path}: record data/{ref.key} holds {record[1]} bytes, but its storage has "
                    f"{ref.numel * itemsize} (truncated or corrupt file)"
                )

    def read_pickle(self, handle: IO[bytes] | None = None) -> bytes:
        """``data.pkl``, its CRC-32 checked; read from ``handle`` when given, else from ``path``."""
        info, start = self.infos[self.pkl_index], self.starts[self.pkl_index]
        with open(self.path, "rb") if handle is None else contextlib.nullcontext(handle) as f:
            f.seek(start)
            data = f.read(info.file_size)
        if zlib.crc32(data) != info.CRC:
            raise CheckpointFormatError(f"{self.path}: record {info.filename} is damaged (CRC-32 mismatch)")
        return data

    def write_with_pickle(self, out: IO[bytes], pickle_bytes: bytes, *, force_zip64: bool = False) -> None:
        """Write this archive to ``out`` with ``data.pkl`` replaced; other records copied raw."""
        writer = _ZipWriter(out, force_zip64=force_zip64)
        with open(self.path, "rb") as src:
            for index, (info, start) in enumerate(zip(self.infos, self.starts)):
                if index == self.pkl_index:
                    writer.add(
                        info.filename, len(pickle_bytes), zlib.crc32(pickle_bytes), lambda: out.write(pickle_bytes)
                    )
                else:
                    writer.add(info.filename, info.file_size, info.CRC, _copier(src, out, start, info.file_size))
        writer.finish()


# The general-purpose flags torch's writer sets: sizes in a descriptor after the data, UTF-8 names.
_FLAGS = 0x0008 | 0x0800


def _whole_blocks(extra: bytes) -> bool:
    """Whether a zip extra field is a sequence of complete (id, length, data) blocks."""
    at = 0
    while at + 4 <= len(extra):
        at += 4 + int.from_bytes(extra[at + 2 : at + 4], "little")
    return at == len(extra)


def _copier(src: IO[bytes], out: IO[bytes], start: int, length: int) -> Any:
    def copy() -> None:
        copy_range(src, out, start, length)

    return copy


class _ZipWriter:
    """A minimal writer of stored (uncompressed) zip records, data 64-byte aligned, zip64 as needed."""

    ALIGN = 64
    LIMIT = 0xFFFFFFFF

    def __init__(self, out: IO[bytes], *, force_zip64: bool = False) -> None:
        self.out, self.force = out, force_zip64
        self.offset = 0
        self.entries: list[tuple[bytes, int, int, int]] = []

    def add(self, name: str, size: int, crc: int, write_data: Any) -> None:
        raw = name.encode("utf-8")
        zip64 = self.force or size >= self.LIMIT
        extra = struct.pack("<HHQQ", 1, 16, size, size) if zip64 else b""
        # A padding extra field (id 'FB', as torch's writer uses) puts the data on a 64-byte boundary.
        pad = -(self.offset + 30 + len(raw) + len(extra) + 4) % self.ALIGN
        extra += struct.pack("<HH", 0x4246, pad) + b"Z" * pad
        sizes = self.LIMIT if zip64 else size
        version = 45 if zip64 else 20
        fields = (0x04034B50, version, 0, 0, 0, 0x21, crc, sizes, sizes, len(raw), len(extra))
        header = struct.pack("<IHHHHHIIIHH", *fields)
        self.out.write(header + raw + extra)
        write_data()
        self.entries.append((raw, size, crc, self.offset))
        self.offset += len(header) + len(raw) + len(extra) + size

    def finish(self) -> None:
        cd_start = self.offset
        central = bytearray()
        for raw, size, crc, offset in self.entries:
            fields = []
            if self.force or size >= self.LIMIT:
                fields += [size, size]
            if self.force or offset >= self.LIMIT:
                fields.append(offset)
            extra = struct.pack("<HH", 1, 8 * len(fields)) + struct.pack(f"<{len(fields)}Q", *fields) if fields else b""
            sizes = self.LIMIT if (self.force or size >= self.LIMIT) else size
            local = self.LIMIT if (self.force or offset >= self.LIMIT) else offset
            version = 45 if fields else 20
            central += struct.pack(
                "<IHHHHHHIIIHHHHHII", 0x02014B50, 45, version, 0, 0, 0, 0x21, crc, sizes, sizes, len(raw), len(extra),
                0, 0, 0, 0, local,
            )  # fmt: skip
            central += raw + extra
        self.out.write(central)
        cd_size, count = len(central), len(self.entries)
        end = cd_start + cd_size
        if self.force or count >= 0xFFFF or cd_start >= self.LIMIT or cd_size >= self.LIMIT:
            self.out.write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, cd_size, cd_start))
            self.out.write(struct.pack("<IIQI", 0x07064B50, 0, end, 1))
            self.out.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, self.LIMIT, self.LIMIT, 0))
        else:
            self.out.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, cd_size, cd_start, 0))
