"""DDP replicas compared on the frameworks' own paths (issue 58): a job of 2 processes under torchrun, in
the shape each framework's users write, whose rank 1 changes its copy of the weights alone after step 3
(a rank-dependent update: every parameter + 1e-3), or never ("healthy").

Argv: FRAMEWORK ROOT corrupt|healthy. FRAMEWORK: lightning (ModelCheckpoint every 2 steps, ExactResume),
lightning-snapshots (NodeSnapshots every step, ExactResume), fabric (fabric.save every 2 steps, ExactResume
given the model and the optimizer), hf (the Trainer's save every 2 steps, CkptoolsCallback), hf-snapshots
(CkptoolsCallback(snapshot_every=1)), accelerate (attach, save_state every 2 steps), accelerate-snapshots
(Snapshots.take every step). Each process prints ``rank R caught at step S: WHERE`` when a
`ReplicaMismatchError` reaches it and exits 3 once every process has
(``ROOT.caught-R`` files); a healthy job prints ``rank R finished`` and exits 0.
"""

from __future__ import annotations

import os
import sys
import time

import torch

import ckptools as ck

FRAMEWORK, ROOT, MODE = sys.argv[1], sys.argv[2], sys.argv[3]
CORRUPT_AFTER = 3  # the step after which rank 1's copy changes alone
STEPS = 8
SEEN = {"step": 0}


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 2))


def data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 8, generator=g)
    return torch.utils.data.TensorDataset(x, (x.sum(1) > 0).long())


def after_step(step: int, module: torch.nn.Module) -> None:
    """Every process after each optimizer step: rank 1 changes its copy alone after CORRUPT_AFTER."""
    SEEN["step"] = step
    if MODE == "corrupt" and step == CORRUPT_AFTER and ck.get_rank() == 1:
        with torch.no_grad():
            for p in module.parameters():
                p.add_(1e-3)


def lightning(snapshots: bool) -> None:
    import pytorch_lightning as pl

    from ckptools.integrations.lightning import ExactResume, NodeSnapshots

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net()

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.AdamW(self.parameters(), lr=0.01)

    class Corrupt(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *_):  # type: ignore[no-untyped-def]
            after_step(trainer.global_step, pl_module)

    folder = os.path.join(ROOT, "ckpts")
    saves = pl.callbacks.ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1)
    callbacks = [Corrupt(), ExactResume(), NodeSnapshots(folder) if snapshots else saves]
    trainer = pl.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_steps=STEPS, callbacks=callbacks,
                         logger=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(Net(), torch.utils.data.DataLoader(data(), batch_size=8))


def fabric() -> None:
    import lightning_fabric as lf  # type: ignore[import-not-found,unused-ignore]

    from ckptools.integrations.lightning import CkptoolsCheckpointIO, ExactResume

    fab = lf.Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[CkptoolsCheckpointIO()])
    fab.launch()
    model = net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, optimizer = fab.setup(model, optimizer)
    loader = fab.setup_dataloaders(torch.utils.data.DataLoader(data(), batch_size=8))
    resume = ExactResume(compare={"model": model, "optimizer": optimizer})
    for step, (x, y) in enumerate(loader, start=1):
        fab.backward(torch.nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        after_step(step, model)
        if step % 2 == 0:
            fab.save(os.path.join(ROOT, f"step-{step}.ckpt"), {"model": model, "optimizer": optimizer, "rng": resume})
        if step == STEPS:
            break


def hf(snapshots: bool) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from ckptools.integrations.transformers import CkptoolsCallback

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net()

        def forward(self, x, labels=None):  # type: ignore[no-untyped-def]
            return {"loss": torch.nn.functional.cross_entropy(self.net(x), labels)}

    class Corrupt(TrainerCallback):  # before CkptoolsCallback in the list: as a user's callback may be
        def on_step_end(self, args, state, control, model=None, **kwargs):  # type: ignore[no-untyped-def]
            after_step(state.global_step, model)

    class Rows(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __init__(self) -> None:
            self.rows = data()

        def __len__(self) -> int:
            return len(self.rows)

        def __getitem__(self, i):  # type: ignore[no-untyped-def]
            x, y = self.rows[i]
            return {"x": x, "labels": y}

    args = TrainingArguments(ROOT, max_steps=STEPS, per_device_train_batch_size=8, save_steps=2, seed=3, report_to=[],
                             logging_strategy="no", use_cpu=True, learning_rate=0.01, disable_tqdm=True)  # fmt: skip
    callback = CkptoolsCallback(snapshot_every=1) if snapshots else CkptoolsCallback()
    Trainer(Net(), args, train_dataset=Rows(), callbacks=[Corrupt(), callback]).train()


def accelerate(snapshots: bool) -> None:
    from accelerate import Accelerator

    from ckptools.integrations.accelerate import attach
    from ckptools.integrations.accelerate_snapshots import Snapshots

    accelerator = attach(Accelerator(cpu=True))
    model = net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(data(), batch_size=8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    taker = Snapshots(accelerator, ROOT) if snapshots else None
    for step, (x, y) in enumerate(loader, start=1):
        accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        after_step(step, model)
        if taker is not None:
            taker.take(step, blocking=True)
        elif step % 2 == 0:
            accelerator.save_state(os.path.join(ROOT, f"step_{step}"))
        if step == STEPS:
            break
    if taker is not None:
        taker.close()


def say(line: str) -> None:
    os.write(1, f"{line}\n".encode())  # one write: the ranks' lines never mix (print writes the newline apart)


def main() -> None:
    kind, _, snapshots = FRAMEWORK.partition("-")
    try:
        if kind == "lightning":
            lightning(bool(snapshots))
        elif kind == "fabric":
            fabric()
        elif kind == "hf":
            hf(bool(snapshots))
        else:
            accelerate(bool(snapshots))
    except ck.ReplicaMismatchError as err:
        say(f"rank {ck.get_rank()} caught at step {SEEN['step']}: {err.where}")
        # torchrun stops the others once one process exits non-zero: each says what it caught first.
        open(f"{ROOT}.caught-{ck.get_rank()}", "w").close()
        deadline = time.monotonic() + 60
        while not all(os.path.exists(f"{ROOT}.caught-{r}") for r in range(2)) and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(3)  # every rank raised: nobody waits in a collective; skip the teardown
    say(f"rank {ck.get_rank()} finished")
    ck.exit_process(0)


if __name__ == "__main__":
    main()
