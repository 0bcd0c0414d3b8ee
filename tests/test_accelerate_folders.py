"""``ckpt verify`` of folders Accelerate's ``save_state`` wrote (issue 57): DAMAGED (exit 1) when a file it
writes is missing, cut short or a temporary is inside; never OK for what it did not check.

The folders are written by Accelerate itself (a fresh interpreter, an AdamW and a StepLR prepared, one
step), then torn the way a kill or a partial copy tears them. Needs accelerate: `make interop`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.versions, pytest.mark.interop]  # Accelerate's save_state folders

pytest.importorskip("accelerate")

WRITE = """
import sys, torch
from accelerate import Accelerator
accelerator = Accelerator(cpu=True)
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.AdamW(model.parameters())
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
model(torch.ones(1, 4)).sum().backward(); optimizer.step(); scheduler.step()
accelerator.save_state(sys.argv[1])
"""


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("accelerate") / "step_4")
    done = subprocess.run([sys.executable, "-c", WRITE, folder], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return folder


def _verify(folder: str) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", "ckptools", "verify", folder], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    return done.returncode, done.stdout + done.stderr


def _torn(whole: str, tmp_path, tear) -> str:  # type: ignore[no-untyped-def]
    folder = str(tmp_path / "torn")
    shutil.copytree(whole, folder)
    tear(folder)
    return folder


def _cut(path: str, keep: float) -> None:
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: int(len(data) * keep)])


def test_a_whole_save_state_folder_is_structure_ok_naming_what_was_not_checked(whole):
    code, said = _verify(whole)
    assert code == 0 and said.startswith("STRUCTURE OK"), said  # never OK: no manifest covers it
    assert "random_states_0.pkl complete" in said and "the number of processes" in said, said


TEARS = {
    "optimizer.bin missing": (lambda f: os.remove(os.path.join(f, "optimizer.bin")), "without any optimizer"),
    "the RNG file missing": (lambda f: os.remove(os.path.join(f, "random_states_0.pkl")), "no random_states"),
    "the RNG file empty": (lambda f: _cut(os.path.join(f, "random_states_0.pkl"), 0), "cut short"),
    "the RNG file cut in half": (lambda f: _cut(os.path.join(f, "random_states_0.pkl"), 0.5), "random_states_0.pkl"),
    "a rank's RNG file missing": (
        lambda f: shutil.copy(os.path.join(f, "random_states_0.pkl"), os.path.join(f, "random_states_2.pkl")),
        "random_states_1.pkl is missing",
    ),
    "a temporary file inside": (lambda f: open(os.path.join(f, "model.safetensors.tmp"), "wb").close(), "temporary"),
    "the model missing": (lambda f: os.remove(os.path.join(f, "model.safetensors")), "no model file"),
}


@pytest.mark.parametrize("tear", sorted(TEARS))
def test_a_torn_save_state_folder_is_damaged(whole, tmp_path, tear):
    how, words = TEARS[tear]
    code, said = _verify(_torn(whole, tmp_path, how))
    assert code == 1 and said.startswith("DAMAGED") and words in said, said
