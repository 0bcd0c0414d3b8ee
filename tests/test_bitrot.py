"""Bit rot: random bytes flipped inside tensor data are caught, every time, by every check."""

from __future__ import annotations

import json
import os
import pathlib
import random
import shutil
import subprocess
import sys

import pytest
import torch
from _corpus import tensor_record_offsets
from typer.testing import CliRunner

import ckptools as ck
from ckptools.cli import app

FLIPS = int(os.environ.get("CKPTOOLS_FLIPS", "150"))
CKPT = shutil.which("ckpt") or os.path.join(os.path.dirname(sys.executable), "ckpt")


def _state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32))
    return {"model": model, "step": 7}


def _pt_regions(path) -> list[tuple[int, int]]:
    return [(start, start + size) for start, size in tensor_record_offsets(path)]


def _st_regions(path) -> list[tuple[int, int]]:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return [
        (8 + n + e["data_offsets"][0], 8 + n + e["data_offsets"][1]) for k, e in header.items() if k != "__metadata__"
    ]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bitrot")
    pt = str(d / "model.pt")
    ck.save(pt, _state())
    st = ck.convert_to_safetensors(pt, str(d / "model.safetensors"))
    return {"pt": (pt, _pt_regions(pt)), "safetensors": (st, _st_regions(st))}


def _flip(data: bytes, regions: list[tuple[int, int]], rng: random.Random) -> bytes:
    positions = [p for a, b in regions for p in range(a, b)]
    out = bytearray(data)
    for pos in rng.sample(positions, rng.choice([1, 1, 2, 3, 8])):
        out[pos] ^= rng.randrange(1, 256)  # never 0: the byte really changes
    return bytes(out)


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_every_flip_is_caught(tmp_path, files, fmt):
    src, regions = files[fmt]
    pristine = pathlib.Path(src).read_bytes()
    assert sum(b - a for a, b in regions) > 40_000  # the flips land in real tensor data
    rng = random.Random(fmt)
    runner = CliRunner()
    caught_cli = caught_lib = 0
    damaged = str(tmp_path / os.path.basename(src))
    for i in range(FLIPS):
        with open(damaged, "wb") as f:
            f.write(_flip(pristine, regions, rng))
        result = runner.invoke(app, ["verify", damaged])
        caught_cli += result.exit_code == 1 and "DAMAGED" in result.output
        try:
            if fmt == "pt":
                ck.load(damaged, verify=True, restore_rng=False)
            else:
                ck.load_state_dict(damaged, verify=True)
        except ck.CheckpointFormatError:
            caught_lib += 1
        if i == 0:  # the installed executable too (once: its wiring): exit 1, one DAMAGED line on stdout, no stderr
            proc = subprocess.run([CKPT, "verify", damaged], capture_output=True, text=True)
            assert proc.returncode == 1 and proc.stderr == "", proc.stderr
            assert len(proc.stdout.strip().splitlines()) == 1 and proc.stdout.startswith("DAMAGED "), proc.stdout
    print(f"\nbit rot ({fmt}): ckpt verify caught {caught_cli}/{FLIPS}, load(verify=True) caught {caught_lib}/{FLIPS}")
    assert caught_cli == FLIPS and caught_lib == FLIPS
    # The pristine file still passes both.
    assert runner.invoke(app, ["verify", src]).exit_code == 0


def test_latest_falls_back_past_a_rotten_checkpoint(tmp_path, files):
    manager = ck.CheckpointManager(tmp_path, keep_last=3)
    state = _state()
    manager.save(state, 1)
    manager.save(state, 2)
    newest = manager.path_for(2)
    data, regions = pathlib.Path(newest).read_bytes(), _pt_regions(newest)
    with open(newest, "wb") as f:
        f.write(_flip(data, regions, random.Random(1)))
    with pytest.warns(UserWarning, match="damaged"):
        assert manager.latest() == manager.path_for(1)
    with pytest.warns(UserWarning, match="damaged"):
        assert manager.restore(_state())["__ckptools__"]["metadata"]["step"] == 1
    with pytest.raises(ck.CheckpointFormatError, match="CRC-32"):
        ck.load(newest, verify=True)
