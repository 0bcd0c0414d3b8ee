from __future__ import annotations

import os

import pytest
import torch
from _corpus import tensor_record_offsets
from _dist import run_ranks
from _same import filled_linear

import ckptools as ck
from ckptools.storage import host as _host


def _model(value: float) -> torch.nn.Module:
    return filled_linear(3, value)


def _weight(path) -> float:
    return torch.load(path, weights_only=True)["model"]["weight"][0, 0].item()


@pytest.mark.parametrize("directory", ["local", "memory://mgr-test/run"])
def test_keep_last_and_latest(tmp_path, directory):
    directory = str(tmp_path / "run") if directory == "local" else directory
    mgr = ck.CheckpointManager(directory, keep_last=2)
    assert mgr.latest() is None
    assert mgr.restore({"model": _model(0)}) is None
    for step in (10, 20, 30):
        path = mgr.save({"model": _model(step), "step": step}, step)
        assert path.endswith(f"ckpt-{step:010d}.pt")
    assert [s for s, _ in mgr.checkpoints()] == [20, 30]
    assert mgr.latest() == mgr.path_for(30)
    target = _model(0)
    out = mgr.restore({"model": target})
    assert out["step"] == 30 and out["__ckptools__"]["metadata"]["step"] == 30
    assert target.weight[0, 0].item() == 30


def test_only_owned_files_are_touched(tmp_path):
    (tmp_path / "final.safetensors").write_bytes(b"x")
    (tmp_path / "notes.pt").write_bytes(b"y")
    (tmp_path / "other-0000000001.pt").write_bytes(b"z")
    mgr = ck.CheckpointManager(tmp_path, keep_last=1)
    for step in range(3):
        mgr.save({"v": torch.ones(1)}, step)
    assert sorted(os.listdir(tmp_path)) == [
        "ckpt-0000000002.pt",
        "final.safetensors",
        "notes.pt",
        "other-0000000001.pt",
    ]


def test_crash_leftovers_are_ignored_and_cleaned(tmp_path):
    mgr = ck.CheckpointManager(tmp_path, keep_last=3)
    mgr.save({"model": _model(1)}, 1)
    # What a save killed mid-write leaves: a temp name with half a file.
    good = (tmp_path / "ckpt-0000000001.pt").read_bytes()
    # Its writer (this host, a pid above pid_max) is gone; a live writer's file is kept.
    dead = tmp_path / f".ckpt-0000000002.pt.ckptools-tmp-{_host()}-{2**22 + 1}-abcd1234"
    alive = tmp_path / f".ckpt-0000000004.pt.ckptools-tmp-{_host()}-{os.getpid()}-abcd1234"
    for leftover in (dead, alive):
        leftover.write_bytes(good[: len(good) // 3])
    assert mgr.latest() == mgr.path_for(1)
    mgr.save({"model": _model(3)}, 3)
    assert not dead.exists()
    assert alive.exists()
    assert mgr.latest() == mgr.path_for(3)


def _flip_tensor_byte(path) -> None:
    start = next(start for start, size in tensor_record_offsets(path) if size > 8)
    with open(path, "r+b") as f:
        pos = start + 3
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0x04]))


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_newest_falls_back_with_warning(tmp_path, damage):
    mgr = ck.CheckpointManager(tmp_path, keep_last=3)
    mgr.save({"model": _model(1)}, 1)
    newest = mgr.save({"model": _model(2)}, 2)
    if damage == "flip":
        _flip_tensor_byte(newest)
        torch.load(newest, weights_only=True)  # torch alone would not notice
    else:
        with open(newest, "r+b") as f:
            f.truncate(os.path.getsize(newest) - 100)
    with pytest.warns(UserWarning, match="skipping damaged checkpoint.*ckpt-0000000002"):
        assert mgr.latest() == mgr.path_for(1)
    target = _model(0)
    with pytest.warns(UserWarning):
        mgr.restore({"model": target})
    assert target.weight[0, 0].item() == 1


def test_resuming_from_an_earlier_checkpoint_drops_the_abandoned_timeline(tmp_path):
    mgr = ck.CheckpointManager(tmp_path, keep_last=1)
    mgr.save({"model": _model(10)}, 10)
    ck.save(mgr.path_for(20), {"model": _model(20)})  # e.g. damaged or deliberately skipped
    with pytest.warns(UserWarning, match="abandoned"):
        mgr.save({"model": _model(15)}, 15)
    assert [s for s, _ in mgr.checkpoints()] == [15]


def test_failed_save_keeps_previous_checkpoints(tmp_path):
    mgr = ck.CheckpointManager(tmp_path, keep_last=1)
    mgr.save({"model": _model(1)}, 1)

    class Broken:
        def state_dict(self):
            raise RuntimeError("nope")

    with pytest.raises(ck.CheckpointError, match="nope"):
        mgr.save({"model": _model(2), "b": Broken()}, 2)
    assert [s for s, _ in mgr.checkpoints()] == [1] and mgr.latest() == mgr.path_for(1)


def test_bad_arguments():
    with pytest.raises(ValueError, match="keep_last"):
        ck.CheckpointManager("/tmp/x", keep_last=0)
    with pytest.raises(ValueError, match="prefix"):
        ck.CheckpointManager("/tmp/x", prefix="a/b")
    with pytest.raises(ValueError, match="step"):
        ck.CheckpointManager("/tmp/x").path_for(-1)


def _restore_everywhere(rank: int, world: int, directory: str) -> tuple:
    mgr = ck.CheckpointManager(directory, keep_last=2)
    fresh = mgr.restore({"model": _model(0)})
    for step in (1, 2):
        mgr.save({"model": _model(step * 10)}, step)
    if rank == 0:
        # Damage the newest on disk only: rank 0 decides, every rank follows.
        _flip_tensor_byte(mgr.path_for(2))
    ck.barrier()
    target = _model(0)
    out = mgr.restore({"model": target})
    return fresh is None, out["__ckptools__"]["metadata"]["step"], target.weight[0, 0].item()


def test_restore_is_collective_and_ranks_agree(tmp_path):
    results = run_ranks(_restore_everywhere, 2, str(tmp_path))
    assert results == [(True, 1, 10.0), (True, 1, 10.0)]


def test_restore_is_a_resume_and_brings_the_rng_back(tmp_path):
    mgr = ck.CheckpointManager(tmp_path)
    torch.manual_seed(3)
    mgr.save({"model": _model(1)}, step=1)
    expected = torch.rand(3)
    torch.manual_seed(4)
    mgr.restore({"model": _model(0)})  # only a model, yet restoring is resuming
    assert torch.equal(torch.rand(3), expected)
    torch.manual_seed(4)
    mgr.restore({"model": _model(0)}, restore_rng=False)
    assert not torch.equal(torch.rand(3), expected)
