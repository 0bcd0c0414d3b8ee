"""Accelerate's ``examples/complete_cv_example.py``, in its shape, ported to ckptools with the smallest change.

Its loop as the example writes it: ``--checkpointing_steps`` (a number, or ``epoch``), ``--output_dir``,
``--resume_from_checkpoint``, a shuffled DataLoader with 2 workers and random augmentation (a crop and a
flip drawn in ``__getitem__``, as torchvision's transforms draw them), Adam(W) with a one-cycle schedule,
dropout; plus ``gradient_accumulation_steps=2`` through ``accelerator.accumulate``. Synthetic images stand
in for the Oxford pets, a small CNN for timm's ResNet (no downloads here). The lines marked ``# ckptools``
are the port; ``--accelerate-only`` runs the example's own resume instead (the folder's step number, the
epoch worked out from it, ``skip_first_batches``) for the guide's comparison; ``--snapshots`` adds ckptools'
node-memory snapshots every step (``--checkpointing_steps`` then spaces the durable folders out).

    accelerate launch --multi_gpu --num_processes 2 accelerate_cv.py OUTPUT_DIR [--accelerate-only]

Rank 0 prints ``resumed from NAME``, ``step N`` after each step's work (before its save: a kill on that
line may land inside the save) and writes the final weights to OUTPUT_DIR/final.pt. With
ACCELERATE_CV_PAUSE_AT=N every process stops after step N's snapshot is committed (rank 0 prints
``paused at N``), for a kill at a known step.
"""

import argparse
import os
import re
import time

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.optim.lr_scheduler import OneCycleLR
from torch.utils.data import DataLoader, Dataset

import ckptools as ck  # ckptools
from ckptools.integrations.accelerate import attach, latest_complete_state  # ckptools
from ckptools.integrations.accelerate_data import resumable  # ckptools
from ckptools.integrations.accelerate_snapshots import Snapshots  # ckptools (--snapshots)


class PetsDataset(Dataset):
    """Synthetic 3x20x20 images of 4 classes; each item randomly cropped to 16x16 and flipped."""

    def __init__(self, count, seed):
        g = torch.Generator().manual_seed(seed)
        self.images = torch.rand(count, 3, 20, 20, generator=g)
        self.labels = torch.randint(0, 4, (count,), generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, idx):
        top, left = torch.randint(0, 5, (2,)).tolist()  # RandomResizedCrop draws from torch's RNG
        image = self.images[idx, :, top : top + 16, left : left + 16]
        if torch.rand(()) < 0.5:
            image = image.flip(-1)
        return {"image": image, "label": self.labels[idx]}


def _die_inside_save(step, accelerator):
    """The tests' kill inside a save_state (ACCELERATE_CV_DIE_IN_SAVE=N): rank 0 is SIGKILLed in step N's
    save once its optimizer file is written (before any random_states file)."""
    import signal

    import accelerate.checkpointing

    own = accelerate.checkpointing.save

    def save(obj, f, *args, **kwargs):
        own(obj, f, *args, **kwargs)
        if accelerator.is_main_process and str(f).endswith("optimizer.bin") and f"step_{step}" in str(f):
            os.kill(os.getpid(), signal.SIGKILL)

    accelerate.checkpointing.save = save


def training_function(config, args):
    accelerator = Accelerator(cpu=args.cpu, gradient_accumulation_steps=2)
    if os.environ.get("ACCELERATE_CV_DIE_IN_SAVE"):
        _die_inside_save(int(os.environ["ACCELERATE_CV_DIE_IN_SAVE"]), accelerator)
    if not args.accelerate_only:
        accelerator = attach(accelerator)  # ckptools: save_state whole or absent, load_state refuses a torn one
    lr, num_epochs, seed, batch_size = (
        config["lr"],
        int(config["num_epochs"]),
        int(config["seed"]),
        config["batch_size"],
    )
    checkpointing_steps = (
        int(args.checkpointing_steps) if args.checkpointing_steps.isdigit() else args.checkpointing_steps
    )

    np.random.seed(seed)
    torch.manual_seed(seed)
    set_seed(seed)
    train_dataset = PetsDataset(96, seed)
    eval_dataset = PetsDataset(32, seed + 1)
    if not args.accelerate_only:
        train_dataset = ck.SeededDataset(train_dataset, seed=seed)  # ckptools: each item's crop from (seed, epoch, i)
    train_dataloader = DataLoader(train_dataset, shuffle=True, batch_size=batch_size, num_workers=2)
    eval_dataloader = DataLoader(eval_dataset, shuffle=False, batch_size=batch_size, num_workers=2)

    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(4), torch.nn.Flatten(),
        torch.nn.Dropout(0.2), torch.nn.Linear(128, 4),
    )  # fmt: skip
    model = model.to(accelerator.device)
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=lr / 25)
    lr_scheduler = OneCycleLR(optimizer=optimizer, max_lr=lr, epochs=num_epochs, steps_per_epoch=len(train_dataloader))
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    if not args.accelerate_only:
        train_dataloader = resumable(accelerator, train_dataloader)  # ckptools: the epoch's place is in the state

    snapshots = Snapshots(accelerator, args.output_dir) if args.snapshots else None  # ckptools: node memory

    overall_step = 0
    starting_epoch = 0
    resume_step = None
    if args.resume_from_checkpoint:
        path = args.resume_from_checkpoint
        if path == "latest" and snapshots is not None:
            path = snapshots.latest()  # ckptools: node memory's newer step written out as step_N/ first
        elif path == "latest":
            path = latest_complete_state(args.output_dir) if not args.accelerate_only else _newest(args.output_dir)
        if path is not None:
            accelerator.load_state(path)
            accelerator.print(f"resumed from {os.path.basename(path)}")
            training_difference = os.path.basename(path)
            if "epoch" in training_difference:
                starting_epoch = int(training_difference.replace("epoch_", "")) + 1
                overall_step = starting_epoch * len(train_dataloader)
            else:
                overall_step = int(training_difference.replace("step_", ""))
                starting_epoch = overall_step // len(train_dataloader)
                resume_step = overall_step - starting_epoch * len(train_dataloader)
            if not args.accelerate_only:
                starting_epoch, resume_step = train_dataloader.epoch, None  # ckptools: it knows where it was

    for epoch in range(starting_epoch, num_epochs):
        model.train()
        if resume_step is not None and epoch == starting_epoch:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        for batch in active_dataloader:
            with accelerator.accumulate(model):
                inputs = batch["image"].to(accelerator.device)
                outputs = model(inputs)
                loss = torch.nn.functional.cross_entropy(outputs, batch["label"].to(accelerator.device))
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            overall_step += 1
            accelerator.print(f"step {overall_step}")
            if isinstance(checkpointing_steps, int) and overall_step % checkpointing_steps == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{overall_step}"))
            if snapshots is not None:
                snapshots.take(overall_step)  # ckptools: every step, into node memory
            if overall_step == int(os.environ.get("ACCELERATE_CV_PAUSE_AT", -1)):  # the tests' kill at a known step
                if snapshots is not None:
                    snapshots.manager.wait()
                accelerator.print(f"paused at {overall_step}")
                time.sleep(3600)
        model.eval()
        accurate, num_elems = 0, 0
        for batch in eval_dataloader:
            with torch.no_grad():
                predictions = model(batch["image"].to(accelerator.device)).argmax(dim=-1)
            accurate_preds = accelerator.gather(predictions) == accelerator.gather(
                batch["label"].to(accelerator.device)
            )
            num_elems += accurate_preds.shape[0]
            accurate += int(accurate_preds.long().sum())
        accelerator.print(f"epoch {epoch}: {100 * accurate / num_elems:.2f}")
        if checkpointing_steps == "epoch":
            accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch}"))

    if snapshots is not None:
        snapshots.close()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        final = os.path.join(args.output_dir, "final.pt")  # whole or absent: the test harness's file
        torch.save(accelerator.unwrap_model(model).state_dict(), final + ".partial")
        os.replace(final + ".partial", final)
    accelerator.wait_for_everyone()
    ck.exit_process(0)


def _newest(output_dir):
    """The example's "most recent checkpoint": the highest-numbered folder, whole or not."""
    found = (
        [n for n in os.listdir(output_dir) if re.fullmatch(r"(step|epoch)_\d+", n)] if os.path.isdir(output_dir) else []
    )
    return os.path.join(output_dir, max(found, key=lambda n: int(n.split("_")[1]))) if found else None


def main():
    parser = argparse.ArgumentParser(description="complete_cv_example.py's shape, ported to ckptools.")
    parser.add_argument("output_dir")
    parser.add_argument("--cpu", action="store_true", default=True)
    parser.add_argument("--checkpointing_steps", type=str, default="1")
    parser.add_argument("--resume_from_checkpoint", type=str, default="latest")
    parser.add_argument("--accelerate-only", dest="accelerate_only", action="store_true")
    parser.add_argument("--snapshots", action="store_true", help="ckptools' node-memory snapshots every step")
    args = parser.parse_args()
    os.makedirs(args.output_dir, exist_ok=True)
    training_function({"lr": 3e-2, "num_epochs": 3, "seed": 42, "batch_size": 8}, args)


if __name__ == "__main__":
    main()
