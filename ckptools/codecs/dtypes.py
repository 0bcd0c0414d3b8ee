"""The one dtype table: torch's name, bytes per element, torch's storage class and safetensors' code.

Every other table (a storage class's dtype, a safetensors code's torch name, ...) is derived
from `ROWS` here, so a new dtype is one line.
"""

from __future__ import annotations

# torch dtype name, bytes per element, legacy typed storage class (None: only untyped storages
# hold it), safetensors dtype code (None: safetensors cannot store it).
ROWS: tuple[tuple[str, int, str | None, str | None], ...] = (
    ("float64", 8, "DoubleStorage", "F64"),
    ("float32", 4, "FloatStorage", "F32"),
    ("float16", 2, "HalfStorage", "F16"),
    ("bfloat16", 2, "BFloat16Storage", "BF16"),
    ("int64", 8, "LongStorage", "I64"),
    ("int32", 4, "IntStorage", "I32"),
    ("int16", 2, "ShortStorage", "I16"),
    ("int8", 1, "CharStorage", "I8"),
    ("uint8", 1, "ByteStorage", "U8"),
    ("bool", 1, "BoolStorage", "BOOL"),
    ("complex128", 16, "ComplexDoubleStorage", None),
    ("complex64", 8, "ComplexFloatStorage", "C64"),
    ("float8_e4m3fn", 1, None, "F8_E4M3"),
    ("float8_e5m2", 1, None, "F8_E5M2"),
    ("uint16", 2, None, "U16"),
    ("uint32", 4, None, "U32"),
    ("uint64", 8, None, "U64"),
)
# Only in safetensors files (torch's pickles of them are not read by ckptools' reader).
SAFETENSORS_ONLY: tuple[tuple[str, int, str], ...] = (
    ("float8_e4m3fnuz", 1, "F8_E4M3FNUZ"),
    ("float8_e5m2fnuz", 1, "F8_E5M2FNUZ"),
    ("float8_e8m0fnu", 1, "F8_E8M0"),
)
# Storages with no plain dtype row: untyped bytes, and quantized tensors (torch's safe loader reads them).
OTHER_STORAGES = {
    "UntypedStorage": ("uint8", 1),
    "QInt8Storage": ("qint8", 1), "QUInt8Storage": ("quint8", 1), "QInt32Storage": ("qint32", 4),
    "QUInt4x2Storage": ("quint4x2", 1), "QUInt2x4Storage": ("quint2x4", 1),
}  # fmt: skip

# Bytes per element of the dtypes torch's pickles name (``_rebuild_tensor_v3``: its storage is untyped).
DTYPE_ITEMSIZE = {name: size for name, size, _, _ in ROWS}
# A storage class's dtype and bytes per element.
STORAGE_ITEMSIZE = {
    **{storage: (name, size) for name, size, storage, _ in ROWS if storage is not None},
    **OTHER_STORAGES,
}
# safetensors dtype code -> bytes per element, and -> torch's dtype name.
ITEMSIZE = {
    **{code: size for _, size, _, code in ROWS if code is not None},
    **{code: size for _, size, code in SAFETENSORS_ONLY},
}
TORCH_NAMES = {
    **{code: name for name, _, _, code in ROWS if code is not None},
    **{code: name for name, _, code in SAFETENSORS_ONLY},
}
# A typed storage class -> the safetensors code its tensors are written as.
STORAGE_TO_SAFETENSORS = {storage: code for _, _, storage, code in ROWS if storage is not None and code is not None}
