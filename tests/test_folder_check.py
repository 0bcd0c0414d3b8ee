"""`ckpt verify` of a folder judges every file in it, as the HF Trainer's resume does (issue 33, item 1).

The folders are what the Trainer's ``_save_checkpoint`` writes, file by file, with the real writers
(safetensors' ``save_file`` for the model, ``torch.save`` for the optimizer, json for the state);
test_transformers.py does the same against folders the real Trainer wrote and a kill left.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import safetensors.torch
import torch
from typer.testing import CliRunner

import ckptools as ck
from ckptools.cli import app
from ckptools.layouts.folder_check import MANIFEST, check_folder, write_manifest

CKPT = os.path.join(os.path.dirname(sys.executable), "ckpt")


def _run(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args])


def _trainer_folder(path, *, state: bool = True) -> str:
    """``checkpoint-N/`` as the Trainer writes it: model, optimizer, scheduler, RNG, then its state."""
    path.mkdir(parents=True)
    torch.manual_seed(0)
    safetensors.torch.save_file(
        {"lin.weight": torch.randn(2, 4), "lin.bias": torch.randn(2)}, path / "model.safetensors"
    )
    torch.save({"state": {0: {"exp_avg": torch.randn(64, 64)}}, "param_groups": [{"lr": 0.1}]}, path / "optimizer.pt")
    torch.save({"last_epoch": 4}, path / "scheduler.pt")
    if state:
        (path / "trainer_state.json").write_text(json.dumps({"global_step": 4}))
    return str(path)


def _flip(path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_whole_folder_is_structure_ok_naming_what_no_checksum_covers(tmp_path):
    folder = _trainer_folder(tmp_path / "checkpoint-4")
    result = _run("verify", folder)
    assert result.exit_code == 0, result.output
    line = result.stdout.strip()
    assert line.startswith(f"STRUCTURE OK {folder}: ") and "\n" not in line
    assert "optimizer.pt, scheduler.pt: every record's CRC-32 matches" in line
    assert "data not checksummed: model.safetensors (structure checked; no checksums stored)" in line
    assert "trainer_state.json (reads as JSON)" in line
    strict = _run("verify", "--strict", folder)
    assert (
        strict.exit_code == 1
        and strict.stdout.startswith(f"NOT CHECKSUMMED (--strict) {folder}: ")
        and strict.stderr == ""
    )
    with pytest.raises(ck.NotChecksummedError, match="model.safetensors"):
        ck.verify(folder, strict=True)
    assert "data not checksummed: model.safetensors" in ck.verify(folder)
    # sealed with a manifest, every byte is held against a CRC-32: OK, also with --strict
    write_manifest(folder)
    sealed = _run("verify", "--strict", folder)
    assert sealed.exit_code == 0 and sealed.stdout.startswith(f"OK {folder}: "), sealed.output
    assert f"{MANIFEST}: sizes and CRC-32s of 4 files match" in sealed.stdout
    assert ck.verify(folder, strict=True) == sealed.stdout.split(": ", 1)[1].strip()


@pytest.mark.parametrize(
    "damage",
    ["optimizer truncated", "model byte flipped under a manifest", "no trainer state", "state cut short", "no model"],
)
def test_a_damaged_folder_is_damaged_for_verify_and_for_the_resume_alike(tmp_path, damage):
    folder = tmp_path / "checkpoint-4"
    _trainer_folder(folder, state=damage != "no trainer state")
    if damage == "optimizer truncated":  # what issue 33 saw: "OK checkpoint-4: safetensors, 2 tensors, ..."
        with open(folder / "optimizer.pt", "r+b") as f:
            f.truncate(1000)
        said = "optimizer.pt is truncated"
    elif damage == "model byte flipped under a manifest":
        write_manifest(str(folder))
        _flip(folder / "model.safetensors", 0.9)  # in tensor data: the structure still reads
        said = "model.safetensors does not match its CRC-32 in the manifest"
    elif damage == "state cut short":
        (folder / "trainer_state.json").write_text('{"global_step": 4, "log_hi')
        said = "trainer_state.json (the Trainer's last file) does not read"
    elif damage == "no model":  # the kill came before the model was written
        (folder / "model.safetensors").unlink()
        said = "trainer_state.json (the Trainer's last file) is missing"
        (folder / "trainer_state.json").unlink()
    else:
        said = "trainer_state.json (the Trainer's last file) is missing"
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    result = _run("verify", folder)
    # DAMAGED is verify's answer, on stdout with the rest of its report (stderr is for what cannot be judged).
    assert result.exit_code == 1 and result.stderr == "", result.output
    assert result.stdout.startswith(f"DAMAGED {folder}: ") and said in result.stdout, result.stdout
    with pytest.raises(ck.CheckpointFormatError, match="not a whole checkpoint"):
        ck.verify(folder)
    report = json.loads(_run("verify", "--json", folder).stdout)
    assert report["status"] == "damaged" and said in report["line"] and report["exit_code"] == 1
    # the one judgement: what latest_complete_checkpoint skips (check_folder) is what verify calls damaged
    assert said in (check_folder(str(folder)).problem or "")
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before  # nothing was touched


def test_the_judgement_without_verify_reads_no_data(tmp_path):
    folder = _trainer_folder(tmp_path / "checkpoint-4")
    write_manifest(folder)
    _flip(tmp_path / "checkpoint-4" / "optimizer.pt")  # same size: only a CRC-32 sees it
    assert check_folder(folder, verify=False).problem is None
    assert "does not match its CRC-32" in (check_folder(folder).problem or "")


def test_files_say_ok_only_where_every_byte_carries_a_checksum(tmp_path):
    torch.save({"model": {"w": torch.ones(3)}, "step": 1}, tmp_path / "a.pt")
    ck.convert_to_safetensors(tmp_path / "a.pt", tmp_path / "ours.safetensors")  # ckptools stores CRC-32s
    safetensors.torch.save_file({"w": torch.ones(3)}, tmp_path / "theirs.safetensors")
    expected = {"a.pt": "ok", "ours.safetensors": "ok", "theirs.safetensors": "structure_ok"}
    for name, status in expected.items():
        report = ck.verify_report(tmp_path / name)
        assert report["status"] == status, report
        json_out = _run("verify", "--json", tmp_path / name)
        assert json_out.exit_code == 0 and json.loads(json_out.stdout)["status"] == status
    line = _run("verify", tmp_path / "theirs.safetensors").stdout
    assert line.startswith("STRUCTURE OK ") and "data not checksummed" in line and not line.startswith("OK")
    assert _run("verify", "--strict", tmp_path / "theirs.safetensors").exit_code == 1
    assert _run("verify", "--strict", tmp_path / "ours.safetensors").exit_code == 0
    assert ck.verify_report(tmp_path / "theirs.safetensors")["not_checksummed"] == {
        "theirs.safetensors": "structure checked; no checksums stored"
    }


def test_lines_in_a_pipe_are_not_wrapped(tmp_path):
    """Issue 33 saw "25 \\ntensors loaded" from `ckpt verify | ...`: rich wrapped at 80 columns."""
    deep = tmp_path / ("a-long-folder-name-" * 4) / "checkpoints"
    deep.mkdir(parents=True)
    path = deep / "step-000100.pt"
    torch.save({f"layer{i}.weight": torch.ones(2) for i in range(25)}, path)
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    # one real process (its stdout a pipe); info prints through the same console
    proc = subprocess.run([CKPT, "verify", str(path)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"OK {path}: torch zip, every record's CRC-32 matches, 25 tensors loaded\n"


def test_a_folder_the_trainer_did_not_write_needs_no_trainer_state(tmp_path):
    """model.safetensors and optimizer.pt in a folder of the user's own naming: whole, not "damaged"
    for lacking the Trainer's trainer_state.json (only checkpoint-N/ and the Trainer's own files say
    that the Trainer wrote it)."""
    folder = _trainer_folder(tmp_path / "my-export", state=False)
    result = _run("verify", folder)
    assert result.exit_code == 0 and result.stdout.startswith(f"STRUCTURE OK {folder}: "), result.output
    torch.save({"lr": 0.1}, tmp_path / "my-export" / "training_args.bin")  # a file only the Trainer writes
    assert _run("verify", folder).exit_code == 1
