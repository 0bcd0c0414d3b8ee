"""Which Lightning resumes are exact, measured: Lightning alone, with ckptools' CheckpointIO plugin,
and with ExactResume + ck.ResumableDataLoader, for runs with and without randomness.

Usage: python benchmarks/resume_matrix.py [--dir DIR] [--rows 1 2 ...]   (needs pytorch-lightning)

Each row is a training run (tests/_lightning_fit.py's script, which tests/test_lightning_resume.py
kills too: 1 or 2 processes on the CPU, gloo; 96 samples in batches of 8; 3 epochs; validation and a
StepLR step at every epoch's end) run twice for each column: once straight, and once SIGKILLed (the
whole launch, DataLoader workers included) as rank 0 reports a step past a checkpoint, then relaunched
with ``fit(ckpt_path="last")``. A cell says whether the final weights are bit-identical. The row on 3
processes resumes a 2-process run and counts, for each epoch, the samples trained on twice or never.
The table is printed as Markdown (docs/guides/lightning.md holds it).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from _lightning_fit import FIT, logged, run_killed  # the script the tests kill too

# (what the row is, processes, relaunched on, dropout, shuffle, augmentation, workers, checkpoint every
# N steps (0: every epoch's end, ModelCheckpoint's default), the step after which it is killed)
ROWS: list[tuple[str, int, int, int, int, int, int, int, int]] = [
    ("no randomness, killed after an epoch-end checkpoint", 1, 1, 0, 0, 0, 0, 0, 14),
    ("no randomness, killed mid-epoch", 1, 1, 0, 0, 0, 0, 4, 7),
    ("dropout, killed after an epoch-end checkpoint", 1, 1, 1, 0, 0, 0, 0, 14),
    ("shuffling on one process, killed after an epoch-end checkpoint", 1, 1, 0, 1, 0, 0, 0, 14),
    ('shuffling under `strategy="ddp"` (2 processes), killed after an epoch-end checkpoint', 2, 2, 0, 1, 0, 0, 0, 8),
    ("dropout + shuffling + augmentation in 2 workers, killed mid-epoch", 1, 1, 1, 1, 1, 2, 4, 7),
    ("the same, 2 DDP processes", 2, 2, 1, 1, 1, 2, 4, 7),
    ("the same, checkpoints at each epoch's last batch (`every_n_train_steps=12`), 2 kills", 1, 1, 1, 1, 1, 2, 12, 14),
    ("the same, 2 processes relaunched on 3 (every sample once per epoch?)", 2, 3, 1, 1, 1, 2, 4, 6),
]
MODES = ("lightning", "plugin", "exact")


def _coverage(root: str, checkpoint_step: int) -> str:
    """Samples trained on twice or never in each epoch: before the checkpoint in the killed launch,
    then in the relaunch."""
    seen = [row for row in logged(root, 0, "seen") if row[0] < checkpoint_step] + logged(root, 1, "seen")
    cells = []
    for epoch in range(3):
        count = collections.Counter(i for row in seen if row[1] == epoch for i in row[2])
        twice, never = sum(n - 1 for n in count.values()), 96 - len(count)
        cells.append(f"{twice}/{never}")
    return "twice/never by epoch: " + ", ".join(cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--rows", type=int, nargs="*", default=list(range(1, len(ROWS) + 1)))
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="ckptools-resume-matrix-", dir=args.dir)
    script = os.path.join(work, "fit.py")
    with open(script, "w") as f:
        f.write(FIT)
    print("| run | Lightning alone | with `CkptoolsCheckpointIO` | with `ExactResume` + `ck.ResumableDataLoader` |")
    print("|---|---|---|---|")
    try:
        for number in args.rows:
            what, devices, again, dropout, shuffle, augment, workers, every, kill = ROWS[number - 1]
            params = [3, every, workers, 96, dropout, shuffle, augment]
            kills = [kill, 27] if "2 kills" in what else [kill]
            cells = []
            for mode in MODES:
                root = os.path.join(work, f"{number}-{mode}")
                try:
                    resumed = run_killed(script, root + "-killed", mode, devices, params, kills, final_devices=again,
                                         require_checkpoint=True)  # fmt: skip
                except RuntimeError as err:
                    cells.append(f"failed: {str(err).splitlines()[-1][:80]}")
                    continue
                if again != devices:
                    cells.append(_coverage(root + "-killed", (kill // every) * every))
                else:
                    straight = run_killed(script, root + "-straight", mode, devices, params)
                    same = all(straight[k].numpy().tobytes() == resumed[k].numpy().tobytes() for k in straight)
                    diff = max(float((straight[k] - resumed[k]).abs().max()) for k in straight)
                    cells.append("**bit-identical**" if same else f"no (max diff {diff:.2g})")
            print(f"| {what} | " + " | ".join(cells) + " |", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
