from __future__ import annotations

import json
import os

import pytest
import safetensors
import safetensors.torch
import torch

import ckptools as ck
from ckptools.safetensors_file import (
    ALIAS_KEY,
    CRC_KEY,
    load_safetensors,
    read_safetensors_header,
    rename_safetensors,
    verify_safetensors,
)


def _weights():
    torch.manual_seed(0)
    emb = torch.randn(10, 4)
    return {
        "module.emb.weight": emb,
        "module.head.weight": emb,  # tied
        "module.bn.num_batches_tracked": torch.tensor(7),
        "module.half": torch.randn(3, 5).half(),
        "module.bf": torch.randn(6).bfloat16(),
        "module.t": torch.randn(4, 6).t(),  # non-contiguous
        "module.empty": torch.zeros(0, 3),
        "module.flag": torch.tensor([True, False]),
    }


def test_convert_roundtrip_is_bit_exact_and_official_reader_agrees(tmp_path):
    w = _weights()
    torch.save({"model": w, "epoch": 3, "best": 0.5, "name": "run", "optimizer": {"state": {}}}, tmp_path / "c.pt")
    out = ck.convert_to_safetensors(tmp_path / "c.pt", tmp_path / "c.safetensors", metadata={"note": "x"})
    assert out == str(tmp_path / "c.safetensors")
    official = safetensors.torch.load_file(str(tmp_path / "c.safetensors"))
    assert "head.weight" not in official and "emb.weight" in official  # tied: stored once
    with safetensors.safe_open(str(tmp_path / "c.safetensors"), "pt") as f:
        meta = f.metadata()
    assert json.loads(meta["epoch"]) == 3 and json.loads(meta["best"]) == 0.5 and json.loads(meta["name"]) == "run"
    assert meta["note"] == "x" and meta["format"] == "pt"
    assert json.loads(meta[ALIAS_KEY]) == {"head.weight": "emb.weight"}
    assert set(json.loads(meta[CRC_KEY])) == set(official)
    back = load_safetensors(tmp_path / "c.safetensors")
    assert set(back) == {k.removeprefix("module.") for k in w}
    for k, v in w.items():
        got = back[k.removeprefix("module.")]
        assert got.dtype == v.dtype and got.shape == v.shape and torch.equal(got, v), k
    assert back["head.weight"] is back["emb.weight"]  # re-tied
    assert verify_safetensors(tmp_path / "c.safetensors") == len(official)


def test_no_strip_and_key(tmp_path):
    torch.save({"ema": {"module.w": torch.ones(2)}}, tmp_path / "c.pt")
    ck.convert_to_safetensors(tmp_path / "c.pt", tmp_path / "a.safetensors", key="ema", strip=None)
    assert list(safetensors.torch.load_file(str(tmp_path / "a.safetensors"))) == ["module.w"]
    with pytest.raises(ck.CheckpointFormatError, match="pass key="):
        ck.convert_to_safetensors(tmp_path / "c.pt", tmp_path / "b.safetensors")
    assert not (tmp_path / "b.safetensors").exists()


def test_convert_from_ckptools_checkpoint_keeps_step(tmp_path):
    model = torch.nn.parallel.DataParallel(torch.nn.Linear(2, 2))
    mgr = ck.CheckpointManager(tmp_path, keep_last=1)
    path = mgr.save({"model": model, "epoch": 1}, step=42)
    ck.convert_to_safetensors(path, tmp_path / "m.safetensors")
    with safetensors.safe_open(str(tmp_path / "m.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["step"]) == 42 and set(f.keys()) == {"weight", "bias"}


def test_rename_header_only(tmp_path):
    ck.convert_to_safetensors(_save(tmp_path), tmp_path / "c.safetensors", strip=None)
    changed = rename_safetensors(tmp_path / "c.safetensors", tmp_path / "s.safetensors", ck.strip_prefix)
    assert changed == 7
    header, meta, _, _ = read_safetensors_header(tmp_path / "s.safetensors")
    assert not any(k.startswith("module.") for k in header)
    assert json.loads(meta[ALIAS_KEY]) == {"head.weight": "emb.weight"}
    verify_safetensors(tmp_path / "s.safetensors")
    a = safetensors.torch.load_file(str(tmp_path / "c.safetensors"))
    b = safetensors.torch.load_file(str(tmp_path / "s.safetensors"))
    assert all(torch.equal(a[k], b[k.removeprefix("module.")]) for k in a)
    # In place, atomically.
    rename_safetensors(tmp_path / "s.safetensors", tmp_path / "s.safetensors", ck.add_prefix)
    assert set(safetensors.torch.load_file(str(tmp_path / "s.safetensors"))) == set(a)


def _save(tmp_path):
    torch.save(_weights(), tmp_path / "w.pt")
    return tmp_path / "w.pt"


def test_verify_catches_every_flipped_byte(tmp_path):
    ck.convert_to_safetensors(_save(tmp_path), tmp_path / "c.safetensors")
    path = tmp_path / "c.safetensors"
    data = path.read_bytes()
    _, _, start, size = read_safetensors_header(path)
    caught = 0
    for i in range(60):
        damaged = bytearray(data)
        pos = start + (i * 7919) % (size - start)
        damaged[pos] ^= 1 << (i % 8)
        path.write_bytes(bytes(damaged))
        with pytest.raises(ck.CheckpointFormatError, match="CRC-32"):
            verify_safetensors(path)
        caught += 1
    assert caught == 60


def _st_file(tmp_path, header: bytes, data: bytes = b"", length: int | None = None):
    path = tmp_path / "bad.safetensors"
    path.write_bytes((len(header) if length is None else length).to_bytes(8, "little") + header + data)
    return path


@pytest.mark.parametrize(
    ("header", "data", "length", "match"),
    [
        (b"{}", b"", 1 << 62, "claims"),
        (b"{}", b"", 2**64 - 1, "claims"),
        (b"{not json", b"", None, "not valid JSON"),
        (b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', b"\0" * 4, None, "do not fit"),
        (b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
         b"\0" * 4, None, "overlaps"),
        (b'{"a":{"dtype":"Q9","shape":[1],"data_offsets":[0,4]}}', b"\0" * 4, None, "unknown dtype"),
        (b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}',
         b"\0" * 8, None, "twice"),
        (b'{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}', b"\0" * 4, None, "invalid shape"),
    ],
)  # fmt: skip
def test_hostile_safetensors_headers(tmp_path, header, data, length, match):
    path = _st_file(tmp_path, header, data, length)
    with pytest.raises(ck.CheckpointFormatError, match=match):
        read_safetensors_header(path)
    with pytest.raises(ck.CheckpointFormatError):
        load_safetensors(path)


def test_truncated_safetensors(tmp_path):
    ck.convert_to_safetensors(_save(tmp_path), tmp_path / "c.safetensors")
    data = (tmp_path / "c.safetensors").read_bytes()
    for cut in (0, 5, 20, len(data) // 2, len(data) - 1):
        (tmp_path / "t.safetensors").write_bytes(data[:cut])
        with pytest.raises(ck.CheckpointFormatError):
            verify_safetensors(tmp_path / "t.safetensors")
    assert os.path.getsize(tmp_path / "c.safetensors") == len(data)


def test_zip_fast_path_copies_records_without_torch(tmp_path):
    import subprocess
    import sys

    torch.manual_seed(1)
    w = torch.randn(6, 4)
    weights = {
        "module.w": w,
        "module.tied": w,
        "module.rows": w[2:4],  # contiguous view at an offset into w's storage
        "module.h": torch.randn(3).half(),
        "module.b": torch.tensor([True, False, True]),
        "module.scalar": torch.tensor(2.5),
        "module.p": torch.nn.Parameter(torch.ones(2, 1)),
    }
    torch.save({"state_dict": weights, "epoch": 9}, tmp_path / "c.pt")
    src, dst = tmp_path / "c.pt", tmp_path / "c.safetensors"
    code = (
        "import sys, ckptools.convert as c; "
        f"c.convert_to_safetensors({str(src)!r}, {str(dst)!r}); print('torch' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "False", proc.stderr
    official = safetensors.torch.load_file(str(dst))
    assert set(official) == {"w", "rows", "h", "b", "scalar", "p"}  # w and tied: stored once (the first name)
    for name, tensor in weights.items():
        short = name.removeprefix("module.")
        got = load_safetensors(dst)[short]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape and torch.equal(got, tensor.detach()), name
    with safetensors.safe_open(str(dst), "pt") as f:
        assert json.loads(f.metadata()["epoch"]) == 9
    assert verify_safetensors(dst) == 6
