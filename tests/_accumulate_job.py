"""A DDP loop with gradient accumulation that snapshots after every batch (torchrun, gloo, CPU).

    python -m torch.distributed.run --nproc-per-node=2 _accumulate_job.py MODE K BATCHES RUN_DIR DIE_AFTER

MODE ``plain``: the optimizer steps after every K-th batch, the others' backwards under ``no_sync``.
MODE ``accelerate``: Accelerate's ``Accelerator(gradient_accumulation_steps=K)`` and ``accumulate``, the
Accelerator itself in the state. Dropout, AdamW and a warmup schedule in both. Every rank is killed
(SIGKILL) right after the snapshot of batch DIE_AFTER (-1: never); a relaunch resumes from the
newest snapshot. Rank 0 prints ``weights <sha256>`` of the final weights and optimizer state.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import sys

import torch
import torch.distributed as dist

import ckptools as ck


def _batch(rank: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + b)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def _digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for tensor in ck.unwrap_model(model).state_dict().values():
        h.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    for values in opt.state_dict()["state"].values():
        for value in values.values():
            if isinstance(value, torch.Tensor):
                h.update(value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    mode, k, batches, run_dir, die_after = (
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
        int(sys.argv[5]),
    )
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(net.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    accelerator = None
    if mode == "accelerate":
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=k)
        model, opt, sched = accelerator.prepare(net, opt, sched)
        state = {"model": model, "opt": opt, "sched": sched, "accelerator": accelerator}
    else:
        ck.init_distributed("gloo")
        model = torch.nn.parallel.DistributedDataParallel(net)
        state = {"model": model, "opt": opt, "sched": sched}
    rank = dist.get_rank()
    manager = ck.CheckpointManager(run_dir, snapshot_dir=run_dir + "-shm")
    ckpt = manager.restore(state)
    start = 0 if ckpt is None else ckpt["__ckptools__"]["metadata"]["step"] + 1
    print(f"[rank{rank}] resumed at batch {start}", flush=True)
    for b in range(start, batches):
        x, y = _batch(rank, b)
        if accelerator is not None:
            with accelerator.accumulate(model):
                accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                opt.step()
                sched.step()
                opt.zero_grad()
        else:
            last = (b + 1) % k == 0
            with contextlib.nullcontext() if last else model.no_sync():
                (torch.nn.functional.mse_loss(model(x), y) / k).backward()
            if last:
                opt.step()
                sched.step()
                opt.zero_grad()
        manager.snapshot(state, step=b)
        if b == die_after:
            dist.barrier()  # every rank's copy is whole: the step counts (the relaunch seals its commit)
            os.kill(os.getpid(), signal.SIGKILL)
    manager.wait()
    if rank == 0:
        print(f"weights {_digest(model, opt)}", flush=True)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # as the reference loop leaves: no gloo teardown with the model still referenced


if __name__ == "__main__":
    main()
