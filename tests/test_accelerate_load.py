"""Accelerate's folders as Accelerate alone wrote them, loaded by an attached Accelerator (issue 65, 6.): a torn folder
(a file cut short, a folder of bare weights, a registered object's file missing) is a named `CheckpointFormatError` on
every process before anything is loaded; a snapshot inside an ``accelerator.accumulate`` window without the
Accelerator in the state is refused with the fix. In fresh interpreters (Accelerate's state is one per process).
Needs accelerate: `make interop`.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("accelerate")
pytestmark = [pytest.mark.versions, pytest.mark.slow, pytest.mark.interop]  # Accelerate's load_state, its windows

LOAD = """
import os, shutil, sys, torch
from accelerate import Accelerator
import ckptools as ck
from ckptools.integrations.accelerate import attach
root = sys.argv[1]
accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
model(torch.ones(3, 4)).sum().backward(); optimizer.step(); scheduler.step(); optimizer.zero_grad()
whole = os.path.join(root, "whole")
accelerator.save_state(whole)  # Accelerate's own, before attach: no manifest
attach(accelerator)
def cut(path, keep):
    data = open(path, "rb").read(); open(path, "wb").write(data[: int(len(data) * keep)])
def only_model(folder):
    for n in os.listdir(folder):
        if n != "model.safetensors": os.remove(os.path.join(folder, n))
TEARS = (
    ("whole copy", None),
    ("optimizer.bin cut short", lambda f: cut(os.path.join(f, "optimizer.bin"), 0.5)),
    ("only model.safetensors", only_model),
    ("scheduler.bin missing", lambda f: os.remove(os.path.join(f, "scheduler.bin"))),
)
for name, tear in TEARS:
    folder = os.path.join(root, name.replace(" ", "_"))
    shutil.copytree(whole, folder)
    if tear: tear(folder)
    with torch.no_grad():
        for p in model.parameters(): p.fill_(7.0)
    try:
        accelerator.load_state(folder); said = "loaded"
    except Exception as err:
        said = f"{type(err).__name__}: {err}"
    untouched = all(bool((p == 7.0).all()) for p in model.parameters())
    print(f"{name} | {said} | weights untouched: {untouched}")
"""

WINDOW = """
import os, sys, torch
from accelerate import Accelerator
import ckptools as ck
root = sys.argv[1]
accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
manager = ck.CheckpointManager(os.path.join(root, "run"), snapshot_dir=os.path.join(root, "shm"))
torch.manual_seed(0)
model = torch.nn.Linear(4, 2); optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
for i in range(3):
    with accelerator.accumulate(model):
        model(torch.ones(3, 4) * i).sum().backward(); optimizer.step(); optimizer.zero_grad()
    plain = {"model": model, "optimizer": optimizer}
    for name, state in (("without", plain), ("with", {**plain, "accelerator": accelerator})):
        try:
            manager.snapshot(state, step=10 * i + len(name), blocking=True); said = "taken"
        except ck.CheckpointError as err:
            said = "refused: " + str(err)
        print(i, name, said)
manager.close()
"""


def _python(code: str, root: str) -> str:
    done = subprocess.run([sys.executable, "-c", code, root], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_a_torn_folder_accelerate_wrote_alone_is_refused_before_loading(tmp_path):
    said = dict(line.split(" | ", 1) for line in _python(LOAD, str(tmp_path)).splitlines() if " | " in line)
    assert said["whole copy"].startswith("loaded |"), said  # the control: the copy loads
    for tear, missing in (("optimizer.bin cut short", "optimizer.bin"), ("only model.safetensors", "optimizer.bin"),
                          ("scheduler.bin missing", "scheduler.bin is missing")):  # fmt: skip
        assert said[tear].startswith("CheckpointFormatError") and missing in said[tear], said[tear]
        assert "nothing was loaded" in said[tear] and said[tear].endswith("weights untouched: True"), said[tear]


def test_a_snapshot_in_a_window_without_the_accelerator_is_refused(tmp_path):
    lines = _python(WINDOW, str(tmp_path)).splitlines()
    said = {tuple(line.split()[:2]): line for line in lines if line[:1].isdigit()}
    # Batch 0 and 2 open a window of 2: without the Accelerator refused, with it taken; batch 1 closes it.
    assert "refused" in said[("0", "without")] and "state['accelerator'] = accelerator" in said[("0", "without")]
    assert said[("0", "with")].endswith("taken") and said[("1", "without")].endswith("taken"), said
    assert "refused" in said[("2", "without")] and said[("2", "with")].endswith("taken"), said
