"""A corpus of damaged and hostile checkpoint files, built on demand into a directory.

``build(directory)`` returns ``{file name: expected}`` where expected is ``"missing"``,
``"format"`` (damaged or not a checkpoint) or ``"unsafe"`` (a pickle that would run code).
Hostile pickles would create the file ``CANARY`` (beside the corpus) if anything executed them.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import pickle
import random
import struct
import zipfile
from collections import Counter

import torch
import torch._utils

CANARY = "CANARY"
CANARY_MODULE = "ckptools_canary_mod"  # importing it (from the corpus directory) writes the canary


def tensor_record_offsets(path: str | os.PathLike) -> list[tuple[int, int]]:
    """(start, size) of each tensor's raw bytes inside a torch zip file."""
    out = []
    with zipfile.ZipFile(path) as zf, open(path, "rb") as f:
        for info in zf.infolist():
            if "/data/" in info.filename and info.file_size:
                f.seek(info.header_offset + 26)
                name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
                out.append((info.header_offset + 30 + name_len + extra_len, info.file_size))
    return out


def _valid_pt(directory: str) -> bytes:
    torch.manual_seed(0)
    path = os.path.join(directory, ".valid.pt.src")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    torch.save({"model": model.state_dict(), "step": 3}, path)
    data = pathlib.Path(path).read_bytes()
    os.unlink(path)
    return data


def _valid_safetensors(directory: str) -> bytes:
    from safetensors.torch import save

    torch.manual_seed(0)
    return save({"a.weight": torch.randn(16, 8), "a.bias": torch.randn(16), "b": torch.arange(10)})


def _st(header: object, data: bytes = b"", *, raw: bytes | None = None, length: int | None = None) -> bytes:
    body = raw if raw is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(body) if length is None else length) + body + data


def _reduce_pickle(func_module: str, func_name: str, arg: str) -> bytes:
    """A protocol-2 pickle that calls ``module.name(arg)`` when loaded (hand-assembled opcodes)."""
    return (
        b"\x80\x02c" + f"{func_module}\n{func_name}\n".encode() + b"X" + struct.pack("<I", len(arg)) + arg.encode()
        + b"\x85R."
    )  # fmt: skip


def _global_pickle(module: str, name: str) -> bytes:
    """A pickle that merely names ``module.name``: loading it imports the module."""
    return b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"."


def _legacy_claiming(numel: int) -> bytes:
    """A well-formed legacy torch file whose one float storage claims ``numel`` elements (4 bytes here)."""

    class Forger(pickle.Pickler):
        def persistent_id(self, obj: object) -> object:
            return ("storage", torch.FloatStorage, "0", "cpu", numel, None) if obj == "STORAGE" else None

    buf = io.BytesIO()
    sys_info = {"protocol_version": 1001, "little_endian": True, "type_sizes": {"short": 2, "int": 4, "long": 4}}
    for obj in (0x1950A86A20F9469CFC6C, 1001, sys_info):
        pickle.dump(obj, buf, protocol=2)
    Forger(buf, protocol=2).dump({"w": "STORAGE"})
    pickle.dump(["0"], buf, protocol=2)
    buf.write(struct.pack("<q", 1) + b"\0" * 4)
    return buf.getvalue()


def _torch_save_calling(func: object, args: tuple) -> bytes:
    """``torch.save`` of weights beside an object that unpickles as ``func(*args)``."""

    class Call:
        def __reduce__(self) -> tuple:
            return (func, args)

    buffer = io.BytesIO()
    torch.save({"state_dict": {"w": torch.ones(3)}, "hyper_parameters": {"x": Call()}}, buffer)
    return buffer.getvalue()


def torch_save_building(target: object, slotstate: dict) -> bytes:
    """``torch.save`` of real weights beside a pickle ``BUILD`` that sets ``slotstate`` onto the global
    ``target`` itself (a class, a function): what a file made to change its reader's process holds.
    ``pickle.Unpickler`` (the C one too) would run ``setattr(target, k, v)``; torch's weights-only
    loader refuses it (issue 54: the own-snapshot reader did not)."""

    class Build:
        pass

    class Pickler(pickle._Pickler):  # the pure-Python pickler: its save() can write any opcode
        def save(self, obj: object, save_persistent_id: bool = True) -> None:
            if isinstance(obj, Build):
                super().save(target)  # GLOBAL (or the memo's copy of it)
                super().save((None, slotstate))  # (state, slotstate): slotstate is set with setattr
                self.write(pickle.BUILD)
                return
            super().save(obj, save_persistent_id)

    module = type(pickle)("build_pickler")
    module.Pickler = Pickler  # type: ignore[attr-defined]  # all torch.save takes of a pickle_module
    buffer = io.BytesIO()
    torch.save({"w": torch.arange(4.0), "x": Build()}, buffer, pickle_module=module)
    return buffer.getvalue()


def _torch_zip_with(data_pkl: bytes, valid_pt: bytes) -> bytes:
    """A torch zip checkpoint whose data.pkl is replaced (every other record kept, CRCs valid)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(valid_pt)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            payload = data_pkl if info.filename.endswith("/data.pkl") else src.read(info)
            dst.writestr(info.filename, payload)
    return out.getvalue()


def build(directory: str) -> dict[str, str]:
    """Write the corpus into ``directory``; return ``{name: expected outcome}``."""
    os.makedirs(directory, exist_ok=True)
    canary = os.path.join(directory, CANARY)
    with open(os.path.join(directory, f"{CANARY_MODULE}.py"), "w") as f:
        f.write(f"open({canary!r}, 'w').write('imported')\nx = 1\n")
    files: dict[str, bytes] = {}
    expected: dict[str, str] = {}

    def add(name: str, data: bytes, kind: str = "format") -> None:
        files[name] = data
        expected[name] = kind

    pt = _valid_pt(directory)
    st = _valid_safetensors(directory)
    rng = random.Random(1234)

    add("valid.pt", pt, "valid")  # controls: every reader must accept these
    add("valid.safetensors", st, "valid")
    expected["missing.pt"] = "missing"
    expected["missing.safetensors"] = "missing"
    for name in ("a_directory.pt", "a_directory.safetensors"):
        os.makedirs(os.path.join(directory, name), exist_ok=True)
        expected[name] = "format"
    add("empty.pt", b"")
    add("empty.safetensors", b"")
    for size in (1, 7, 100, 4096, 65536):
        add(f"random_{size}.pt", rng.randbytes(size))
        add(f"random_{size}.safetensors", rng.randbytes(size))
    # Starts like a pickle: torch.load warns as well as fails on these.
    add("random_pickle_proto.pt", b"\x80\x02" + rng.randbytes(500))
    add("random_zip_magic.pt", b"PK\x03\x04" + rng.randbytes(500))

    # Truncated valid files, at the edges and all through.
    cuts = sorted({1, 4, 8, 30, 64, 100, 512, len(pt) // 2, len(pt) - 100, len(pt) - 22, len(pt) - 1})
    for cut in cuts:
        add(f"truncated_pt_{cut}.pt", pt[:cut])
    for cut in sorted({1, 7, 8, 9, 50, len(st) // 2, len(st) - 1}):
        add(f"truncated_st_{cut}.safetensors", st[:cut])

    # A zip that is not a torch checkpoint, and zips whose records lie about themselves.
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("archive/version", "3\n")
        zf.writestr("archive/data/0", b"\0" * 64)
    add("zip_without_data_pkl.pt", buf.getvalue())
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("archive/data.pkl", pickle.dumps({"a": 1}, protocol=2))
    add("zip_compressed.pt", buf.getvalue())
    lying = bytearray(pt)
    # Central directory entry of the last record claims a 4 GiB size: no reader may believe it.
    cd = lying.rfind(b"PK\x01\x02")
    lying[cd + 20 : cd + 24] = struct.pack("<I", 0xFFFFFFF0)
    lying[cd + 24 : cd + 28] = struct.pack("<I", 0xFFFFFFF0)
    add("zip_record_claims_4gib.pt", bytes(lying))

    # Legacy (pre-1.6) format: the magic number pickle, then garbage; and a real legacy file cut short.
    magic = pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2)
    add("legacy_magic_then_garbage.pt", magic + rng.randbytes(300))
    legacy = io.BytesIO()
    torch.save({"w": torch.ones(64)}, legacy, _use_new_zipfile_serialization=False)
    add("legacy_truncated.pt", legacy.getvalue()[: len(legacy.getvalue()) // 2])
    add("legacy_claims_8gib.pt", _legacy_claiming(2**31))
    # Pickle opcodes whose length fields claim ~4 GiB in a file of a few bytes.
    add("pickle_string_claims_4gib.pt", b"X" + struct.pack("<I", 0xFFFFFFF0) + b"abc")
    add("pickle_bytes_claims_4gib.pt", b"\x80\x03B" + struct.pack("<I", 0xFFFFFFF0) + b"abc")
    add("pickle_bytes8_claims_2_60.pt", b"\x80\x04\x8e" + struct.pack("<Q", 2**60) + b"abc")
    # A memo index of 2**31: an unpickler that sizes its memo table by it allocates 16 GiB.
    add("pickle_memo_index_2_31.pt", b"\x80\x02]r" + struct.pack("<I", 0x7FFFFFF0) + b".")

    # safetensors with bad headers.
    f32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    add("st_header_longer_than_file.safetensors", _st(None, raw=b"{}", length=10_000))
    add("st_header_len_2_63.safetensors", _st(None, raw=b"{}", length=2**63 + 5))
    add("st_header_len_max.safetensors", _st(None, raw=b"{}", length=2**64 - 1))
    add("st_invalid_json.safetensors", _st(None, raw=b'{"a": {"dtype": "F32", '))
    add("st_not_an_object.safetensors", _st([1, 2, 3]))
    add("st_not_utf8.safetensors", _st(None, raw=b'{"\xff\xfe": 1}'))
    add("st_overlapping.safetensors", _st({"a": f32, "b": {**f32, "data_offsets": [4, 12]}}, b"\0" * 12))
    add("st_out_of_range.safetensors", _st({"a": {**f32, "data_offsets": [0, 8000]}}, b"\0" * 8))
    add("st_negative_offset.safetensors", _st({"a": {**f32, "data_offsets": [-8, 0]}}, b"\0" * 8))
    add("st_shape_mismatch.safetensors", _st({"a": {**f32, "shape": [3]}}, b"\0" * 8))
    add("st_unknown_dtype.safetensors", _st({"a": {**f32, "dtype": "F128"}}, b"\0" * 8))
    add("st_huge_shape.safetensors", _st({"a": {**f32, "shape": [2**20, 2**20]}}, b"\0" * 8))
    add("st_float_offsets.safetensors", _st({"a": {**f32, "data_offsets": [0.0, 8.0]}}, b"\0" * 8))
    add("st_missing_offsets.safetensors", _st({"a": {"dtype": "F32", "shape": [2]}}, b"\0" * 8))
    add("st_bad_metadata.safetensors", _st({"__metadata__": {"k": 1}, "a": f32}, b"\0" * 8))
    add("st_dtype_is_a_list.safetensors", _st({"a": {**f32, "dtype": ["F32"]}}, b"\0" * 8))
    add("st_dtype_is_an_object.safetensors", _st({"a": {**f32, "dtype": {"F32": 1}}}, b"\0" * 8))
    add("st_dim_2_63_beside_0.safetensors", _st({"a": {"dtype": "F32", "shape": [2**63, 0], "data_offsets": [0, 0]}}))
    add("st_dims_overflow_int64.safetensors",
        _st({"a": {"dtype": "F32", "shape": [2**62, 4, 0], "data_offsets": [0, 0]}}))  # fmt: skip
    dup = b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}'  # noqa: E501
    add("st_duplicate_names.safetensors", _st(None, b"\0" * 8, raw=dup))
    deep = b"[" * 100_000 + b"]" * 100_000
    add("st_deeply_nested.safetensors", _st(None, raw=deep))

    # Pickles that would run code, as torch zip files (valid CRCs) and as legacy raw pickles.
    touch = f"import os; open({canary!r}, 'w').write('ran')"
    payloads = {
        "os_system": _reduce_pickle("os", "system", f"touch {canary}"),
        "builtins_eval": _reduce_pickle("builtins", "eval", touch),
        "builtins_exec": _reduce_pickle("builtins", "exec", touch),
        "subprocess_popen": _reduce_pickle("subprocess", "Popen", f"touch {canary}"),
        "import_module": _global_pickle(CANARY_MODULE, "x"),
        "posix_system": _reduce_pickle("posix", "system", f"touch {canary}"),
    }
    # Beside real weights, written by torch.save (protocol 2 names them __builtin__.eval, ...):
    # Python 2's name of a code-running builtin is as hostile as its Python 3 one, and weights
    # next to it are no reason for a lenient read.
    for what, func, args in (("eval", eval, (touch,)), ("exec", exec, (touch,)), ("getattr", getattr, ("x", "upper")),
                             ("import", __import__, (CANARY_MODULE,))):  # fmt: skip
        add(f"evil_{what}_beside_weights.pt", _torch_save_calling(func, args), "unsafe")
    # Globals torch's allowlist holds, their state set for the whole process (a BUILD onto them).
    rebuild = torch._utils._rebuild_tensor_v2
    add("evil_build_onto_rebuild_tensor.pt", torch_save_building(rebuild, {"__module__": "this"}), "unsafe")
    add("evil_build_onto_counter.pt", torch_save_building(Counter, {"most_common": None}), "unsafe")
    for what, payload in payloads.items():
        add(f"evil_{what}.pt", _torch_zip_with(payload, pt), "unsafe")
        add(f"evil_{what}_legacy.pt", payload, "unsafe")
        add(f"evil_{what}_after_magic.pt", magic + payload, "unsafe")

    for name, data in files.items():
        with open(os.path.join(directory, name), "wb") as f:
            f.write(data)
    return expected
