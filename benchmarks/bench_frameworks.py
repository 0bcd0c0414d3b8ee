"""What a snapshot per step costs inside the HF Trainer and Lightning (issue 47), one process on the CPU.

Usage: python benchmarks/bench_frameworks.py [--rounds 3] [--big-gib 1.0] [--batch 4096]

For each framework (`CkptoolsCallback(snapshot_every=1, budget=None)`, `NodeSnapshots(budget=None)`):

- **the fixed cost**: a tiny model (8-64-2, ~2 KiB with AdamW's state): the stall of each snapshot,
  timed around the callback's hook (what it adds to the step: the framework's own state gathering,
  `Trainer`'s dict or Lightning's ``dump_checkpoint``, then `manager.snapshot`);
- **the stall for a large state** (``--big-gib`` of weights, SGD without state): the same stall against
  the copy floor, the model's tensors copied into buffers allocated once, measured right before it;
- **steps/s**: a 4-layer 2048-wide MLP (64 MiB of weights, AdamW: 192 MiB of state) in batches of
  ``--batch`` (4096: a step about 130x its stall here; the goal is stated for a step >= 100x the
  stall, and the line says the measured multiple), after a warm-up run, with and without snapshots in
  interleaved runs of 8 steps: the median time per step from the third step on (the first two
  snapshots of a run fault in its two fresh node-memory slots, once per run, as in any training run),
  and the ratio (goal >= 0.98x).

Needs the interop extra (transformers, pytorch-lightning). Prints medians; docs/benchmarks.md has figures.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

import ckptools as ck
from ckptools import storage


def _mlp(width: int, depth: int, inputs: int, outputs: int = 2) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = [torch.nn.Linear(inputs, width), torch.nn.ReLU()]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, outputs))


class _Timed:
    """Wraps a hook: the time of each call, and (with ``floor_of``) the copy floor measured before it."""

    def __init__(self, hook: Callable[..., Any], floor_of: Callable[[], torch.nn.Module] | None = None) -> None:
        self.hook, self.floor_of = hook, floor_of
        self.stalls: list[float] = []
        self.floors: list[float] = []
        self._buffers: dict[str, torch.Tensor] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.floor_of is not None:
            state = self.floor_of().state_dict()
            if self._buffers is None:
                self._buffers = {k: torch.empty_like(v).fill_(0) for k, v in state.items()}
            started = time.perf_counter()
            for k, v in state.items():
                self._buffers[k].copy_(v)
            self.floors.append(time.perf_counter() - started)
        started = time.perf_counter()
        result = self.hook(*args, **kwargs)
        self.stalls.append(time.perf_counter() - started)
        return result


class _Data(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, inputs: int, n: int = 4096) -> None:  # n: several batches an epoch
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, inputs, generator=g)
        self.y = (self.x.sum(1) > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": self.x[i], "labels": self.y[i]}


class _HFNet(torch.nn.Module):
    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.net(x)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def hf_run(net: torch.nn.Module, inputs: int, steps: int, batch: int, snapshots: bool, workdir: str,
           optim: str = "adamw_torch", floor: bool = False) -> tuple[list[float], _Timed | None]:  # fmt: skip
    """One Trainer run; the time of each step after the first, and the timed snapshot hook."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from ckptools.integrations.transformers import CkptoolsCallback

    marks: list[float] = []

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            marks.append(time.perf_counter())

    model = _HFNet(net)
    args = TrainingArguments(tempfile.mkdtemp(dir=workdir), max_steps=steps, per_device_train_batch_size=batch,
                             save_strategy="no", report_to=[], logging_strategy="no", use_cpu=True, optim=optim,
                             disable_tqdm=True, dataloader_num_workers=0)  # fmt: skip
    callbacks: list[Any] = [Clock()]
    timed = None
    if snapshots:
        callback = CkptoolsCallback(snapshot_every=1, budget=None)
        timed = _Timed(callback.on_step_end, (lambda: model) if floor else None)
        callback.on_step_end = timed  # type: ignore[method-assign]
        callbacks.append(callback)
    Trainer(model, args, train_dataset=_Data(inputs, max(4096, 4 * batch)), callbacks=callbacks).train()
    return [b - a for a, b in zip(marks[WARM:], marks[WARM + 1 :])], timed


def lightning_run(net: torch.nn.Module, inputs: int, steps: int, batch: int, snapshots: bool, workdir: str,
                  sgd: bool = False, floor: bool = False) -> tuple[list[float], _Timed | None]:  # fmt: skip
    import pytorch_lightning as pl

    from ckptools.integrations.lightning import NodeSnapshots

    marks: list[float] = []

    class Module(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch: dict[str, torch.Tensor], _: int) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(self.net(batch["x"]), batch["labels"])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            params = self.parameters()
            return torch.optim.SGD(params, lr=1e-3) if sgd else torch.optim.AdamW(params, lr=1e-3)

        def on_train_batch_start(self, *_: Any) -> None:
            marks.append(time.perf_counter())

    module = Module()
    callbacks: list[Any] = []
    timed = None
    if snapshots:
        callback = NodeSnapshots(tempfile.mkdtemp(dir=workdir), budget=None)
        timed = _Timed(callback.on_train_batch_end, (lambda: module) if floor else None)
        callback.on_train_batch_end = timed  # type: ignore[method-assign]
        callbacks.append(callback)
    loader = torch.utils.data.DataLoader(_Data(inputs, max(4096, 4 * batch)), batch_size=batch)
    # NodeSnapshots is a checkpoint callback: checkpointing stays on, with a ModelCheckpoint that saves nothing.
    callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=tempfile.mkdtemp(dir=workdir), save_top_k=0, save_last=False))
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks, default_root_dir=workdir)  # fmt: skip
    trainer.fit(module, loader)
    return [b - a for a, b in zip(marks[WARM:], marks[WARM + 1 :])], timed


RUNS = {"HF Trainer": hf_run, "Lightning": lightning_run}
WARM = 2  # steps of a run not counted: their snapshots fault in the run's two fresh slots


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--big-gib", type=float, default=1.0)
    p.add_argument("--batch", type=int, default=4096, help="the MLP's batch: its step should be >= 100x the stall")
    args = p.parse_args()
    torch.manual_seed(0)
    workdir = tempfile.mkdtemp(prefix="ckptools-bench-frameworks-")
    for name, run in RUNS.items():
        _, tiny = run(_mlp(64, 1, 8), 8, 12, 8, True, workdir)
        assert tiny is not None
        print(f"{name}: a tiny model's snapshot stall (the fixed cost), median of 10: "
              f"{statistics.median(tiny.stalls[2:]) * 1e3:.2f} ms", flush=True)  # fmt: skip
        layers = max(1, int(args.big_gib * 64))  # 16 MiB weight matrices
        extra = {"optim": "sgd"} if name == "HF Trainer" else {"sgd": True}
        _, big = run(_mlp(2048, layers, 2048), 2048, 6, 4, True, workdir, floor=True, **extra)
        assert big is not None
        stall, floor = statistics.median(big.stalls[WARM:]), statistics.median(big.floors[WARM:])
        print(f"{name}: {args.big_gib:g} GiB of weights: stall {stall:.3f} s, floor {floor:.3f} s "
              f"({stall / floor:.2f}x), median of 4", flush=True)  # fmt: skip
        per_step: dict[bool, list[float]] = {False: [], True: []}
        stalls: list[float] = []
        run(_mlp(2048, 4, 2048), 2048, 3, args.batch, False, workdir)  # warm-up: allocator, threads, caches
        for _ in range(args.rounds):
            for snapshots in (False, True):
                steps, timed = run(_mlp(2048, 4, 2048), 2048, 8, args.batch, snapshots, workdir)
                per_step[snapshots] += steps
                stalls += timed.stalls[WARM:] if timed is not None else []
        without, with_ = statistics.median(per_step[False]), statistics.median(per_step[True])
        print(f"{name}: 4x2048 MLP, batches of {args.batch}, AdamW (192 MiB of state): {without:.3f} s a step "
              f"without snapshots, {with_:.3f} s with one every step (stall {statistics.median(stalls) * 1e3:.1f} "
              f"ms, the step {without / statistics.median(stalls):.0f}x it): {without / with_:.3f}x the steps/s "
              f"(goal >= 0.98), median of {len(per_step[True])} steps in {args.rounds} interleaved rounds (crc32: "
              f"{'ISA-L' if storage.FAST_CRC32 else 'zlib'})",
              flush=True)  # fmt: skip
    ck.exit_process(0)  # the node memory the snapshots held is released


if __name__ == "__main__":
    main()
