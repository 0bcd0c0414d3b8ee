"""What a file is, from its first bytes: the kinds people hand a checkpoint reader by mistake."""

from __future__ import annotations

import codecs

from .torchzip import ZIP_MAGIC

# Signatures of files people hand a checkpoint reader by mistake, and what to do about each.
_SIGNATURES = (
    (b"\x1f\x8b", "gzip-compressed (decompress it first: gunzip)"),
    (b"BZh", "bzip2-compressed (decompress it first: bunzip2)"),
    (b"\xfd7zXZ\x00", "xz-compressed (decompress it first: unxz)"),
    (b"(\xb5/\xfd", "zstd-compressed (decompress it first: unzstd)"),
    (b"\x93NUMPY", "a numpy array file (.npy: numpy.load)"),
    (b"\x89HDF\r\n\x1a\n", "an HDF5 file (Keras .h5: h5py or keras)"),
    (b"GGUF", "a GGUF model file (llama.cpp), not a PyTorch one"),
    (b"\x7fELF", "an executable (ELF)"),
)


def other_kind(head: bytes) -> str | None:
    """What a file that is no torch checkpoint is, from its first bytes (None: could be one).

    torch files are zips (``PK``) or, before 1.6, pickles starting with ``\\x80``; this names
    what people pass instead: text (an HTML error page saved by a download, a Git LFS pointer,
    JSON, a script), a misnamed safetensors file, compressed or other model formats.

    Examples:
        >>> other_kind(b"version https://git-lfs.github.com/spec/v1\\noid sha256:ab")
        'a Git LFS pointer, not the file itself (fetch it: git lfs pull)'
        >>> other_kind(b"\\x80\\x02\\x8a\\nl\\xfc\\x9cF\\xf9 j\\xa8") is None
        True
    """
    if len(head) < 8 or ZIP_MAGIC.startswith(head[:4]):
        return None  # empty, a few bytes, or a zip cut short: "truncated", not another kind
    for signature, kind in _SIGNATURES:
        if head.startswith(signature):
            return kind
    if len(head) >= 257 + 5 and head[257:262] == b"ustar":
        return "a tar archive (extract it first: tar xf)"
    if len(head) > 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < 100_000_000:
        return "a safetensors file named like a torch one (rename it to .safetensors)"
    if head[:1] == b"\x80":
        return None  # a pickle: torch's legacy format, read (and judged) as such
    try:
        # Incremental: a character cut by the 512-byte window is held back, not an error.
        text = codecs.getincrementaldecoder("utf-8")().decode(head)
    except UnicodeDecodeError:
        return None
    if not text or any(ord(c) < 32 and c not in "\t\r\n\f" for c in text):
        return None
    stripped = text.lstrip().lower()
    if stripped.startswith("version https://git-lfs"):
        return "a Git LFS pointer, not the file itself (fetch it: git lfs pull)"
    if stripped.startswith(("<!doctype html", "<html", "<?xml", "<head")):
        return "an HTML or XML page (a download that saved an error or login page? fetch the file again)"
    if stripped.startswith(("{", "[")):
        return "JSON text (a config or index? pass the checkpoint it names)"
    first = text.strip().splitlines()[0][:60] if text.strip() else ""
    return f"a text file (it starts {first!r})"
