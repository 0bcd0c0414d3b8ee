"""Accelerate with ckptools' node-memory snapshots (issue 57): Accelerate's complete_cv_example in its shape
(tests/user_scripts/accelerate_cv.py --snapshots: a save_state every 6 steps, a snapshot every step, 2
processes under accelerate launch) killed with SIGKILL (every process of the launch) at random steps
resumes at most one step behind and ends bit-identical; killed and never relaunched, the keeper writes the
step out as the folder save_state writes, which ckpt verify says OK of and a later run resumes from. Needs
accelerate: `make interop`.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _same import same_tree
from _torchrun import keepers_left, kill_job
from test_user_scripts import _launch, _run

import ckptools as ck
from ckptools.layouts import ACCELERATE, check_folder

pytest.importorskip("accelerate")
pytestmark = [pytest.mark.versions, pytest.mark.slow, pytest.mark.interop]
# versions: Accelerate's state and its loaders

SCRIPT, EVERY = "accelerate_cv.py", ["--snapshots", "--checkpointing_steps", "6"]


def _relaunches(log: str) -> list[tuple[int, int]]:
    """(the last step a killed launch printed, the step its relaunch resumed from) for each relaunch."""
    launches = log.split("--- launch ")[1:]
    found = []
    for before, after in zip(launches, launches[1:]):
        printed = [int(n) for n in re.findall(r"^step (\d+)$", before, re.M)]
        resumed = re.search(r"^resumed from step_(\d+)$", after, re.M)
        found.append((printed[-1] if printed else 0, int(resumed.group(1)) if resumed else 0))
    return found


# Repeats test_a_relaunch_after_kill_9_... below (the same script killed after a step's snapshot, resumed from
# it) and tests/test_user_scripts.py's accelerate_cv.py killed at random steps: `make stress`.
@pytest.mark.stress
@pytest.mark.timeout(900)
def test_killed_at_random_steps_resumes_at_most_one_step_behind_bit_identical(tmp_path):
    seed = int(os.environ.get("CKPTOOLS_KILL_SEED", random.randrange(1 << 30)))
    print(f"kill steps drawn with CKPTOOLS_KILL_SEED={seed}")
    kills = sorted(random.Random(seed).sample(range(2, 17), 2))
    straight = _run(SCRIPT, tmp_path / "straight", 2, [], *EVERY)
    resumed = _run(SCRIPT, tmp_path / "resumed", 2, kills, *EVERY)
    assert same_tree(straight, resumed, key_order=False), f"killed at steps {kills}: not bit-identical"
    relaunches = _relaunches((tmp_path / "resumed" / "launches.txt").read_text())
    assert relaunches and all(printed - start <= 1 for printed, start in relaunches), (kills, relaunches)


def _killed_when_paused(out: Path, step: int) -> None:
    """One launch into ``out``, every process SIGKILLed once all stopped after step ``step``'s snapshot."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", ACCELERATE_CV_PAUSE_AT=str(step))
    with open(out / "launches.txt", "a") as log:
        log.write(f"--- launch 0 (killed when paused at {step})\n")
        proc = subprocess.Popen(_launch(SCRIPT, out, 2, *EVERY), stdout=subprocess.PIPE, stderr=log, text=True,
                                env=env, start_new_session=True)  # fmt: skip
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            if line.strip() == f"paused at {step}":
                kill_job(proc.pid)
                break
        assert proc.wait(timeout=120) == -signal.SIGKILL, (out / "launches.txt").read_text()[-3000:]


def test_a_relaunch_after_kill_9_resumes_from_the_snapshot_of_the_last_step_not_the_last_folder(tmp_path, monkeypatch):
    """Step 9's snapshot, 3 steps past the durable step_6/: the relaunch writes it out as step_9/ and resumes there."""
    monkeypatch.setenv("CKPTOOLS_KEEPER_GRACE", "60")  # the relaunch comes first, and reads node memory
    out = tmp_path / "run"
    _killed_when_paused(out, 9)
    assert sorted(n for n in os.listdir(out) if n.startswith("step_")) == ["step_6"]
    memory = ck.CheckpointManager(str(out), prefix=ACCELERATE.prefix).snapshot_dir
    assert [step for step, _ in ck.CheckpointManager(str(out), prefix=ACCELERATE.prefix).snapshots()][-1:] == [9]
    resumed = _run(SCRIPT, out, 2, [], *EVERY)
    assert "resumed from step_9" in (out / "launches.txt").read_text()
    assert not os.path.exists(memory)  # released at the relaunch's normal end
    assert same_tree(_run(SCRIPT, tmp_path / "straight", 2, [], *EVERY), resumed, key_order=False)


@pytest.mark.timeout(600)
def test_killed_and_never_relaunched_the_keeper_writes_the_step_out_as_accelerates_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTOOLS_KEEPER_GRACE", "2")
    out = tmp_path / "run"
    _killed_when_paused(out, 9)
    memory = ck.CheckpointManager(str(out), prefix=ACCELERATE.prefix).snapshot_dir
    deadline = time.monotonic() + 32
    while os.path.exists(memory) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not os.path.exists(memory), "node memory still held 32 s after the job was gone"
    assert keepers_left(memory) == []
    folder = out / "step_9"
    assert check_folder(str(folder), verify=True).problem is None, sorted(os.listdir(out))
    verified = subprocess.run([sys.executable, "-m", "ckptools", "verify", str(folder)], capture_output=True,
                              text=True, timeout=120)  # fmt: skip
    assert verified.returncode == 0 and verified.stdout.startswith("OK"), verified.stdout + verified.stderr
    resumed = _run(SCRIPT, out, 2, [], *EVERY)  # node memory is gone: the keeper's folder is the newest
    assert "resumed from step_9" in (out / "launches.txt").read_text()
    assert same_tree(_run(SCRIPT, tmp_path / "straight", 2, [], *EVERY), resumed, key_order=False)
