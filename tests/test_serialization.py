from __future__ import annotations

import os
import zipfile

import pytest
import torch
from _corpus import tensor_record_offsets

from ckptools.errors import CheckpointFormatError, UnsafeCheckpointError
from ckptools.layouts.torch_io import load_file, save_file, verify_torch_file

pytestmark = pytest.mark.versions  # torch's file formats, the legacy one included


def test_verify_catches_every_flipped_byte_in_tensor_data(tmp_path):
    path = tmp_path / "c.pt"
    save_file(path, {"a": torch.randn(1000), "b": torch.randn(50, 50)})
    verify_torch_file(path)
    original = path.read_bytes()
    # Silently accepted by torch.load ...
    start, _ = tensor_record_offsets(path)[0]
    damaged = bytearray(original)
    damaged[start + 5] ^= 0x10
    path.write_bytes(bytes(damaged))
    torch.load(path, weights_only=True)
    # ... but caught by verify, every time.
    caught = 0
    records = tensor_record_offsets(tmp_path / "c.pt")
    for i in range(40):
        start, size = records[i % len(records)]
        damaged = bytearray(original)
        damaged[start + (i * 7919) % size] ^= 1 << (i % 8)
        path.write_bytes(bytes(damaged))
        with pytest.raises(CheckpointFormatError, match=r"data/\d+ is damaged"):
            verify_torch_file(path)
        caught += 1
    assert caught == 40


def test_verify_rejects_truncated_and_non_zip(tmp_path):
    path = tmp_path / "c.pt"
    save_file(path, {"a": torch.randn(1000)})
    data = path.read_bytes()
    for cut in (10, len(data) // 2, len(data) - 5):
        path.write_bytes(data[:cut])
        with pytest.raises(CheckpointFormatError, match="c.pt"):
            verify_torch_file(path)
    path.write_bytes(os.urandom(300))
    with pytest.raises(CheckpointFormatError, match="not a zip"):
        verify_torch_file(path)
    with zipfile.ZipFile(tmp_path / "other.zip", "w") as zf:
        zf.writestr("hello.txt", "hi")
    with pytest.raises(CheckpointFormatError, match="no data.pkl"):
        verify_torch_file(tmp_path / "other.zip")


def test_unsafe_globals_are_named(tmp_path):
    import fractions

    torch.save({"c": fractions.Fraction(1, 3)}, tmp_path / "frac.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"fractions\.Fraction.*weights_only=False"):
        load_file(tmp_path / "frac.pt")
    assert load_file(tmp_path / "frac.pt", weights_only=False)["c"] == fractions.Fraction(1, 3)


def test_legacy_format_still_loads(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    assert torch.equal(load_file(tmp_path / "old.pt")["w"], torch.ones(2))


def test_legacy_files_still_load_and_forged_sizes_are_refused(tmp_path):
    # A real pre-1.6-format file: several dtypes, a Parameter, a view sharing its base's storage.
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    sd = model.state_dict()
    sd["view"] = sd["0.weight"][1:]
    obj = {"sd": sd, "p": torch.nn.Parameter(torch.ones(2)), "h": torch.ones(3, dtype=torch.half)}
    path = tmp_path / "legacy.pt"
    torch.save(obj, path, _use_new_zipfile_serialization=False)
    loaded = load_file(path)
    assert torch.equal(loaded["sd"]["0.weight"], sd["0.weight"]) and loaded["h"].dtype == torch.half
    assert loaded["sd"]["view"].untyped_storage().data_ptr() == loaded["sd"]["0.weight"].untyped_storage().data_ptr()
    # The same layout, but the storage claims 8 GiB: refused before torch allocates it.
    from _corpus import _legacy_claiming

    forged = tmp_path / "forged.pt"
    forged.write_bytes(_legacy_claiming(2**31))
    with pytest.raises(CheckpointFormatError, match="claims 8589934592 bytes"):
        load_file(forged)
    # A trusted file (weights_only=False) is left to torch entirely.
    assert load_file(path, weights_only=False)["p"].requires_grad
