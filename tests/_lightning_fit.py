"""A Lightning training script as a user writes one, and the harness that kills and relaunches it:
shared by tests/test_lightning_resume.py and benchmarks/resume_matrix.py (no Lightning imported here)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from typing import Any

# Argv: ROOT MODE DEVICES fresh|resume EPOCHS EVERY WORKERS SAMPLES DROPOUT SHUFFLE AUGMENT.
# MODE: "lightning" (Lightning alone), "plugin" (its CheckpointIO is ckptools'), "exact" (the recipe:
# ExactResume + ck.ResumableDataLoader, and the plugin), "snapshots" (the recipe and NodeSnapshots, resumed
# with ckpt_path="last"), "exact-last" (the recipe without NodeSnapshots, resumed with ckpt_path="last": the
# files Lightning itself finds), "exact-no-cuda-stream" (the recipe, with the
# CUDA stream left out of what ExactResume puts back: a control for the GPU test). The accelerator is
# FIT_ACCELERATOR's (default "cpu"); FIT_SCHEDULE=onecycle: OneCycleLR per step, sized with
# trainer.estimated_stepping_batches in configure_optimizers (Lightning's recipe), instead of StepLR per
# epoch. EVERY: a checkpoint every N steps (0: at each epoch's end, ModelCheckpoint's default).
# DROPOUT, SHUFFLE, AUGMENT: 0 or 1 (augmentation in __getitem__, of the training data in the workers
# and of the validation data in the main process).
# Rank 0 prints "step N" after each step; each rank logs [step, epoch, indices] of every batch to
# seen-RANK.jsonl and [step, epoch, lr] of every validation to validated-RANK.jsonl; rank 0 saves
# the final weights to final.pt.
FIT = """
import json, os, sys, time, torch, pytorch_lightning as pl
import ckptools as ck
from ckptools.integrations.lightning import CkptoolsCheckpointIO, ExactResume, NodeSnapshots

root, mode, devices, resume = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "resume"
epochs, every, workers, samples, dropout, shuffle, augment = (int(a) for a in sys.argv[5:12])


class Data(torch.utils.data.Dataset):
    def __init__(self, n):
        self.x = torch.randn(n, 8, generator=torch.Generator().manual_seed(1))
        self.y = (self.x.sum(1) > 0).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return (self.x[i] + 0.1 * torch.randn(8) if augment else self.x[i]), self.y[i], i


class NoCudaStream(ExactResume):
    def load_state_dict(self, state):
        for streams in state["rng"]:
            streams.pop("cuda", None)
        super().load_state_dict(state)


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

    def on_validation_epoch_end(self):
        if not self.trainer.sanity_checking:
            with open(os.path.join(root, f"validated-{self.global_rank}.jsonl"), "a") as f:
                lr = self.trainer.optimizers[0].param_groups[0]["lr"]
                f.write(json.dumps([self.global_step, self.current_epoch, lr]) + "\\n")

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        if os.environ.get("FIT_SCHEDULE") == "onecycle":  # Lightning's own recipe: sized by the trainer
            total = self.trainer.estimated_stepping_batches
            scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total)
            return [optimizer], [{"scheduler": scheduler, "interval": "step"}]
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)]

    def train_dataloader(self):
        if mode.startswith("exact") or mode == "snapshots":
            return ck.ResumableDataLoader(Data(samples), batch_size=8, shuffle=bool(shuffle), seed=5,
                                          num_workers=workers)
        return torch.utils.data.DataLoader(Data(samples), batch_size=8, shuffle=bool(shuffle), num_workers=workers)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(Data(16), batch_size=8)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.global_rank == 0:
            # FIT_PAUSE_AT=K: the first launch to reach step K waits there to be killed (a kill exactly
            # after step K, whatever the harness's lag in reading this output under load). The marker is
            # made before the line the harness kills at, or a relaunch that replays step K waits too.
            marker = os.path.join(root, "paused")
            pause = self.global_step == int(os.environ.get("FIT_PAUSE_AT", "0")) and not os.path.exists(marker)
            if pause:
                open(marker, "w").close()
            print("step", self.global_step, flush=True)
            if pause:
                time.sleep(600)


pl.seed_everything(3)
model = Net()
when = dict(every_n_train_steps=every) if every else dict(every_n_epochs=1)
callbacks = [pl.callbacks.ModelCheckpoint(dirpath=root, save_last=True, **when)]
if mode.startswith("exact") or mode == "snapshots":
    callbacks.insert(0, NoCudaStream() if mode == "exact-no-cuda-stream" else ExactResume())
if mode == "snapshots":  # the recipe, and a snapshot in node memory after every step (no budget: every one)
    callbacks.append(NodeSnapshots(root, budget=None))
trainer = pl.Trainer(
    default_root_dir=root, max_epochs=epochs, accelerator=os.environ.get("FIT_ACCELERATOR", "cpu"), devices=devices,
    strategy="ddp" if devices > 1 else "auto", plugins=[] if mode == "lightning" else [CkptoolsCheckpointIO()],
    callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
    num_sanity_val_steps=1,
)
last = os.path.join(root, "last.ckpt")
if mode in ("snapshots", "exact-last"):  # the newest of the files and node memory; exact-last: Lightning's own "last"
    trainer.fit(model, ckpt_path="last" if resume else None)
else:
    trainer.fit(model, ckpt_path=last if resume and os.path.exists(last) else None)
if trainer.global_rank == 0:
    torch.save(model.state_dict(), os.path.join(root, "final.pt"))
"""


def run_killed(
    script: Any,
    root: Any,
    mode: str,
    devices: int,
    args: Any,
    kills: Any = (),
    *,
    final_devices: int | None = None,
    checkpoint: str = "last.ckpt",
    require_checkpoint: bool = False,
    to_the_end: bool = True,
) -> dict[str, Any] | None:
    """``script`` launched and SIGKILLed (every process of the launch, workers included) as rank 0
    reports each step of ``kills``, relaunched with ``resume`` whenever ``root/checkpoint`` exists,
    then once more to the end (on ``final_devices`` processes if given; not with ``to_the_end=False``,
    which returns None); the final weights. What launch N logged is moved to ``root/launch-N``.

    Raises:
        RuntimeError: a launch ended otherwise than killed (or, the last one, with 0), or, with
            ``require_checkpoint``, a kill came before any checkpoint; with the stderr's end.
    """
    import torch

    root = os.fspath(root)
    os.makedirs(root, exist_ok=True)
    for n, kill in enumerate([*kills, None] if to_the_end else kills):
        resume = os.path.exists(os.path.join(root, checkpoint))
        with open(os.path.join(root, "stderr.txt"), "a") as err:
            command = [sys.executable, os.fspath(script), root, mode,
                       str(final_devices if kill is None and final_devices else devices),
                       "resume" if resume else "fresh", *map(str, args)]  # fmt: skip
            proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            if kill is not None and line.strip() == f"step {kill}":
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                break
        code = proc.wait(timeout=900)
        with open(os.path.join(root, "stderr.txt")) as err:
            stderr = err.read()[-3000:]
        if code != (-signal.SIGKILL if kill is not None else 0):
            raise RuntimeError(f"launch {n} ended with {code}:\n{stderr}")
        if require_checkpoint and kill is not None and not os.path.exists(os.path.join(root, checkpoint)):
            raise RuntimeError(f"launch {n} was killed at step {kill}, before any checkpoint")
        os.makedirs(os.path.join(root, f"launch-{n}"))
        for name in os.listdir(root):
            if name.endswith(".jsonl"):
                os.rename(os.path.join(root, name), os.path.join(root, f"launch-{n}", name))
    return torch.load(os.path.join(root, "final.pt"), weights_only=True) if to_the_end else None


def logged(root: Any, launch: int, name: str) -> list[Any]:
    """Every row of ``name``-RANK.jsonl that launch ``launch`` wrote, on any rank (rank order)."""
    folder = os.path.join(os.fspath(root), f"launch-{launch}")
    paths = sorted(p for p in os.listdir(folder) if p.startswith(f"{name}-") and p.endswith(".jsonl"))
    return [json.loads(line) for path in paths for line in open(os.path.join(folder, path)).read().splitlines()]
