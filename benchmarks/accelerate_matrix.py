"""Which Accelerate resumes are exact, measured: Accelerate alone, and with ckptools' integration.

Usage: python benchmarks/accelerate_matrix.py [--dir DIR]   (needs accelerate)

The script is tests/user_scripts/accelerate_cv.py (Accelerate's complete_cv_example.py in its shape:
2 processes under ``accelerate launch --multi_gpu``, ``Accelerator(cpu=True)``, a shuffled loader with
2 workers and random augmentation, dropout, AdamW with a one-cycle schedule, 2 batches per
accumulation window, a ``save_state`` after every step; 3 epochs of 6 steps), run straight and then
killed and relaunched with ``--resume_from_checkpoint latest`` for each row: ``--accelerate-only`` is
the example's own resume (the newest ``step_N`` folder, ``skip_first_batches``), the other column the
ported script (`attach`, `resumable`, ``ck.SeededDataset``). A cell says whether the final weights are
bit-identical to the straight run's, and the most steps a kill lost (the last step the killed launch
printed, less the step the relaunch resumed from). The table is printed as Markdown
(docs/guides/accelerate.md holds it). ``--every N`` spaces the ``save_state`` folders N steps apart and
adds ckptools' node-memory snapshots every step to the second column (``--snapshots``).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import torch
from _same import same_tree
from test_user_scripts import _launch, _run  # the launcher and kill loop the tests use

SCRIPT = "accelerate_cv.py"
# (what the row is, SIGKILL of the whole launch at these steps, rank 0 killed inside this step's save_state)
ROWS: list[tuple[str, list[int], int | None]] = [
    ("killed after step 4 (a window closed), then after step 10", [4, 10], None),
    ("killed after step 3 and step 11 (inside accumulation windows)", [3, 11], None),
    ("killed after step 6 (an epoch's last batch, before its validation)", [6], None),
    ("rank 0 killed inside step 8's save_state (its optimizer file written, no RNG file)", [], 8),
]
MODES = {"Accelerate alone": ["--accelerate-only"], "with ckptools": []}


def _spaced(every: int) -> dict[str, list[str]]:
    """The columns of ``--every N``: a save_state every N steps, and with ckptools a snapshot every step."""
    spaced = ["--checkpointing_steps", str(every)]
    return {"Accelerate alone": ["--accelerate-only", *spaced], "with ckptools' snapshots": ["--snapshots", *spaced]}


def _lost(log: str) -> int:
    """The most steps a kill lost: per relaunch, the killed launch's last printed step less the resumed one."""
    worst = 0
    launches = log.split("--- launch ")[1:]
    for before, after in zip(launches, launches[1:]):
        printed = [int(n) for n in re.findall(r"^step (\d+)$", before, re.M)]
        resumed = re.search(r"^resumed from step_(\d+)$", after, re.M)
        start = int(resumed.group(1)) if resumed else 0
        worst = max(worst, (printed[-1] if printed else 0) - start)
    return worst


def _killed_in_save(run_dir: Path, extra: list[str], step: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", ACCELERATE_CV_DIE_IN_SAVE=str(step))
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "launches.txt", "a") as out:
        out.write(f"--- launch 0 (killed inside step {step}'s save)\n")
        out.flush()
        subprocess.run(_launch(SCRIPT, run_dir, 2, *extra), stdout=out, stderr=out, env=env, timeout=300)
    return _run(SCRIPT, run_dir, 2, [], *extra)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default=None)
    parser.add_argument("--rows", type=int, nargs="*", help="which rows (0-based; default: all)")
    parser.add_argument("--every", type=int, default=None, help="a save_state every N steps, snapshots every step")
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="accelerate-matrix-"))
    modes = _spaced(args.every) if args.every else MODES
    straight = {
        mode: _run(SCRIPT, root / f"straight-{i}", 2, [], *extra) for i, (mode, extra) in enumerate(modes.items())
    }
    print("| run | " + " | ".join(modes) + " |")
    print("|---|" + "---|" * len(modes))
    for r, (what, kills, in_save) in enumerate(ROWS):
        if args.rows and r not in args.rows:
            continue
        cells = []
        for i, (mode, extra) in enumerate(modes.items()):
            run_dir = root / f"row{r}-{i}"
            try:
                final = (
                    _killed_in_save(run_dir, extra, in_save)
                    if in_save is not None
                    else _run(SCRIPT, run_dir, 2, kills, *extra)
                )
            except AssertionError:  # a relaunch that does not end: say how it failed
                errors = re.findall(r"^\[rank0\]: (\w+Error: .*)$", (run_dir / "launches.txt").read_text(), re.M)
                cells.append(f"**the relaunch fails**: `{errors[-1] if errors else 'see launches.txt'}`")
                continue
            exact = same_tree(straight[mode], final, key_order=False)
            lost = _lost((run_dir / "launches.txt").read_text())
            cells.append(
                f"{'bit-identical' if exact else '**other weights**'}, ≤ {lost} step{'s' if lost != 1 else ''} lost"
            )
        print(f"| {what} | " + " | ".join(cells) + " |", flush=True)
    print(f"\n(folders in {root}; torch {torch.__version__})")


if __name__ == "__main__":
    main()
