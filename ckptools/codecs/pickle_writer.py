"""Writing a parsed ``data.pkl`` tree back as torch would, without torch (renames rewrite only it)."""

from __future__ import annotations

import codecs
import io
import pickle
from typing import Any

from .parsed import Call, Global, Opaque, StorageRef

_PyPickler: Any = pickle._Pickler


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
        self.save_reduce(codecs.encode, (str(obj, "latin1"), "latin1"), obj=obj)

    dispatch[Global] = _save_global_ref
    dispatch[bytes] = _save_bytes
    dispatch[Call] = _save_call
    dispatch[Opaque] = _save_opaque


def dumps(obj: Any) -> bytes:
    """Pickle a tree produced by `loads` back into a ``data.pkl`` torch can load."""
    buffer = io.BytesIO()
    _Writer(buffer, protocol=2).dump(obj)  # protocol 2, as torch.save writes
    return buffer.getvalue()
