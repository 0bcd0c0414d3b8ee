"""Killed after a snapshot in every position of a gradient-accumulation window, a relaunch ends
bit-identical to the run that was never killed (issue 56, item 2): a plain DDP loop (``no_sync``) and an
Accelerate loop (``accumulate``), k = 2 and 3, 2 ranks under torchrun, SIGKILL of every rank.

Slow (a launch and a relaunch per position): `make interop`. The in-process forms, every save and
snapshot position at 2 and 3 ranks, run in `make test` (tests/test_accumulation.py).
"""

from __future__ import annotations

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from _torchrun import ok, torchrun

JOB = os.path.join(os.path.dirname(__file__), "_accumulate_job.py")
BATCHES = 7


def _launch(mode: str, k: int, run_dir: str, die_after: int):  # type: ignore[no-untyped-def]
    args = ["--standalone", "--nproc-per-node=2", "--max-restarts=0", JOB, mode, str(k), str(BATCHES), run_dir]
    return torchrun([*args, str(die_after)], cwd=os.path.dirname(JOB))


def _weights(out: str) -> str:
    found = re.findall(r"^weights ([0-9a-f]{64})$", out, re.M)
    assert len(found) == 1, out[-3000:]
    return found[0]


@pytest.mark.slow
# k = 3 kills at a window's first, middle and closing batch; k = 2's first and closing positions repeat two of
# them (`make stress` runs both).
@pytest.mark.parametrize("k", [pytest.param(2, marks=pytest.mark.stress), 3])
@pytest.mark.parametrize("mode", ["plain", "accelerate"])
def test_killed_after_the_snapshot_of_every_position_in_a_window_ends_bit_identical(tmp_path, mode, k):
    if mode == "accelerate":
        pytest.importorskip("accelerate")
    reference = _weights(ok(_launch(mode, k, str(tmp_path / "reference"), -1)))
    for position in range(k):  # the window's first batch .. the one whose step closes it
        run_dir = str(tmp_path / f"killed-{position}")
        killed = _launch(mode, k, run_dir, position)
        assert killed.returncode != 0, killed.stdout[-2000:]
        resumed = ok(_launch(mode, k, run_dir, -1))
        assert f"resumed at batch {position + 1}" in resumed, resumed[-3000:]
        assert _weights(resumed) == reference, (
            f"{mode}, k={k}: killed after batch {position}, resumed with other weights"
        )
