"""Which Lightning resumes are exact, measured: Lightning alone, with ckptools' CheckpointIO plugin,
and with ExactResume + ck.ResumableDataLoader, for runs with and without randomness.

Usage: python benchmarks/resume_matrix.py [--dir DIR] [--rows 1 2 ...]   (needs pytorch-lightning)

Each row is a training run (1 or 2 processes on the CPU, gloo; 96 samples in batches of 8; 3 epochs;
validation at every epoch's end) run twice for each column: once straight, and once SIGKILLed (the
whole launch, DataLoader workers included) as rank 0 reports a step past a checkpoint, then relaunched
with ``fit(ckpt_path="last")``. A cell says whether the final weights are bit-identical. The row on 3
processes resumes a 2-process run and counts, for each epoch, the samples trained on twice or never.
The table is printed as Markdown (docs/guides/lightning.md holds it).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Any

_FIT = """
import json, os, sys, torch, pytorch_lightning as pl
import ckptools as ck
from ckptools.integrations.lightning import CkptoolsCheckpointIO, ExactResume

root, mode, devices, resume = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "resume"
dropout, shuffle, augment, workers, every = (int(a) for a in sys.argv[5:10])


class Data(torch.utils.data.Dataset):
    def __init__(self, n):
        self.x = torch.randn(n, 8, generator=torch.Generator().manual_seed(1))
        self.y = (self.x.sum(1) > 0).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return (self.x[i] + 0.1 * torch.randn(8) if augment else self.x[i]), self.y[i], i


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2 * dropout),
                                       torch.nn.Linear(64, 2))

    def training_step(self, batch, _):
        x, y, i = batch
        with open(os.path.join(root, f"seen-{self.global_rank}.jsonl"), "a") as f:
            f.write(json.dumps([self.global_step, self.current_epoch, i.tolist()]) + "\\n")
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, _):
        x, y, _ = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self):
        if mode == "exact":
            return ck.ResumableDataLoader(Data(96), batch_size=8, shuffle=bool(shuffle), seed=5, num_workers=workers)
        return torch.utils.data.DataLoader(Data(96), batch_size=8, shuffle=bool(shuffle), num_workers=workers)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(Data(16), batch_size=8)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.global_rank == 0:
            print("step", self.global_step, flush=True)


pl.seed_everything(3)
model = Net()
every_steps = dict(every_n_train_steps=every) if every else dict(every_n_epochs=1)
callbacks = [pl.callbacks.ModelCheckpoint(dirpath=root, save_last=True, **every_steps)]
if mode == "exact":
    callbacks.insert(0, ExactResume())
trainer = pl.Trainer(
    default_root_dir=root, max_epochs=3, accelerator="cpu", devices=devices,
    strategy="ddp" if devices > 1 else "auto", plugins=[] if mode == "lightning" else [CkptoolsCheckpointIO()],
    callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
    num_sanity_val_steps=0,
)
last = os.path.join(root, "last.ckpt")
trainer.fit(model, ckpt_path=last if resume and os.path.exists(last) else None)
if trainer.global_rank == 0:
    torch.save(model.state_dict(), os.path.join(root, "final.pt"))
"""

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


def _launch(script: str, root: str, mode: str, devices: int, resume: bool, args: list[int]) -> subprocess.Popen[str]:
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "stderr.txt"), "a") as err:
        command = [sys.executable, script, root, mode, str(devices), "resume" if resume else "fresh", *map(str, args)]
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)


def _run(script: str, root: str, mode: str, devices: int, again: int, args: list[int], kills: list[int]) -> Any:
    import torch

    for n, kill in enumerate([*kills, None]):
        resume = os.path.exists(os.path.join(root, "last.ckpt"))
        proc = _launch(script, root, mode, again if kill is None else devices, resume, args)
        assert proc.stdout is not None
        for line in proc.stdout:
            if kill is not None and line.strip() == f"step {kill}":
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                break
        if proc.wait(timeout=900) not in (0, -signal.SIGKILL):
            return f"failed: {open(os.path.join(root, 'stderr.txt')).read()[-500:]}"
        if kill is not None and not os.path.exists(os.path.join(root, "last.ckpt")):
            return "failed: no checkpoint before the kill"
        os.makedirs(os.path.join(root, f"launch-{n}"))
        for name in os.listdir(root):
            if name.endswith(".jsonl"):
                os.rename(os.path.join(root, name), os.path.join(root, f"launch-{n}", name))
    return torch.load(os.path.join(root, "final.pt"), weights_only=True)


def _coverage(root: str, checkpoint_step: int) -> str:
    """Samples trained on twice or never in each epoch: before the checkpoint in the killed launch,
    then in the relaunch."""

    def rows(launch: int) -> list[Any]:
        folder = os.path.join(root, f"launch-{launch}")
        return [json.loads(line) for name in sorted(os.listdir(folder)) for line in open(os.path.join(folder, name))]

    seen = [row for row in rows(0) if row[0] < checkpoint_step] + rows(1)
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
        f.write(_FIT)
    print("| run | Lightning alone | with `CkptoolsCheckpointIO` | with `ExactResume` + `ck.ResumableDataLoader` |")
    print("|---|---|---|---|")
    try:
        for number in args.rows:
            what, devices, again, dropout, shuffle, augment, workers, every, kill = ROWS[number - 1]
            params = [dropout, shuffle, augment, workers, every]
            kills = [kill, 27] if "2 kills" in what else [kill]
            cells = []
            for mode in MODES:
                root = os.path.join(work, f"{number}-{mode}")
                resumed = _run(script, root + "-killed", mode, devices, again, params, kills)
                if isinstance(resumed, str):
                    cells.append(resumed.splitlines()[-1][:80])
                elif again != devices:
                    cells.append(_coverage(root + "-killed", (kill // every) * every))
                else:
                    straight = _run(script, root + "-straight", mode, devices, devices, params, [])
                    same = all(straight[k].numpy().tobytes() == resumed[k].numpy().tobytes() for k in straight)
                    diff = max(float((straight[k] - resumed[k]).abs().max()) for k in straight)
                    cells.append("**bit-identical**" if same else f"no (max diff {diff:.2g})")
            print(f"| {what} | " + " | ".join(cells) + " |", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
