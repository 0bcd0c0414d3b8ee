"""ckptools.integrations.accelerate with Accelerate itself (issue 57): ``save_state`` whole or absent, a kill
inside it never resumed from, ``load_state`` refusing a torn folder, ``total_limit`` pruning only after the
new folder is whole. 2 CPU processes under torchrun (tests/_accelerate_state_job.py). Needs accelerate:
`make interop`.
"""

from __future__ import annotations

import os
import re
import sys

import pytest

pytest.importorskip("accelerate")

sys.path.insert(0, os.path.dirname(__file__))

from _torchrun import ok, torchrun

pytestmark = [pytest.mark.versions, pytest.mark.interop]  # Accelerate's save_state and load_state

JOB = os.path.join(os.path.dirname(__file__), "_accelerate_state_job.py")


def _run(run_dir: str, die_at: int = -1):  # type: ignore[no-untyped-def]
    args = ["--standalone", "--nproc-per-node=2", "--max-restarts=0", JOB, run_dir, "12", str(die_at)]
    return torchrun(args, cwd=os.path.dirname(JOB))


def _weights(out: str) -> str:
    found = re.findall(r"^weights ([0-9a-f]{64})$", out, re.M)
    assert len(found) == 1, out[-3000:]
    return found[0]


@pytest.mark.compat  # Accelerate's save_state killed and resumed
@pytest.mark.slow
def test_a_save_state_killed_before_its_seal_is_never_resumed_from_and_the_relaunch_is_bit_identical(tmp_path):
    reference = _weights(ok(_run(str(tmp_path / "reference"))))
    assert sorted(os.listdir(tmp_path / "reference")) == ["step_12", "step_9"]  # total_limit=2, after each seal
    run = str(tmp_path / "run")
    assert _run(run, die_at=6).returncode != 0
    assert sorted(os.listdir(run)) == [".step_6.ckptools-partial", "step_3"]  # every file in, never named
    resumed = ok(_run(run))
    assert "resumed from step_3" in resumed and _weights(resumed) == reference
    assert sorted(os.listdir(run)) == ["step_12", "step_9"]


TORN = """
import os, shutil, sys, warnings, torch
from accelerate import Accelerator
from ckptools import CheckpointFormatError, CheckpointWarning
from ckptools.integrations.accelerate import latest_complete_state, load_state, save_state
root = sys.argv[1]
accelerator = Accelerator(cpu=True)
model = accelerator.prepare(torch.nn.Linear(2, 2))
whole = save_state(accelerator, os.path.join(root, "step_1"))
torn = os.path.join(root, "step_2")
shutil.copytree(whole, torn)
os.remove(os.path.join(torn, "random_states_0.pkl"))
try:
    load_state(accelerator, torn)
    print("loaded the torn folder")
except CheckpointFormatError as err:
    print("refused:", err)
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    print("latest:", os.path.basename(latest_complete_state(root)))
print("skipped:", any("skipping" in str(w.message) and "step_2" in str(w.message) for w in said))
with torch.no_grad():
    model.weight.zero_()
load_state(accelerator, whole)
print("restored:", bool(model.weight.abs().sum() > 0))
"""


def test_load_state_refuses_a_torn_folder_naming_what_is_missing(tmp_path):
    """In a fresh interpreter: Accelerate's state is one per process, and the HF Trainer's tests make their own."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", TORN, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "refused:" in out and "random_states_0.pkl is missing" in out and "nothing was loaded" in out, out
    assert "latest: step_1" in out and "skipped: True" in out and "restored: True" in out, out
