"""The shape many DDP scripts share: rank 0 saves every N steps, then every rank waits at a barrier
(`if rank == 0: torch.save(...)`; `dist.barrier()`). Ported as the docs say: the save on every rank
(ckptools decides who writes), the manager keeping the last few, `manager.restore` on start.

`--literal` keeps the `if rank == 0:` around the save, as a port of the tutorial's block reads: it
used to hang at the first save with no message; now every rank that came raises within
CKPTOOLS_ARRIVAL_TIMEOUT, naming the ranks that did not and the fix.

    torchrun --nproc-per-node=2 rank0_barrier.py RUN_DIR [--literal]
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import ckptools as ck


def main(run_dir, literal):
    ck.init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 2))
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(320, 10, generator=g), torch.randint(0, 2, (320,), generator=g))
    sampler = ck.ResumableDistributedSampler(dataset, seed=1)
    loader = DataLoader(dataset, batch_size=8, sampler=sampler)
    manager = ck.CheckpointManager(run_dir, keep_last=2)
    torch.manual_seed(100 + rank)  # dropout differs per rank
    state = {"model": model, "optimizer": optimizer, "sampler": sampler}
    ckpt = manager.restore(state)
    step = 0 if ckpt is None else ckpt["step"]
    for epoch in range(sampler.epoch, 3):
        sampler.set_epoch(epoch)
        for x, y in sampler.track(loader):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if rank == 0:
                print("step", step, flush=True)
            if step % 6 == 0:
                if literal:
                    if rank == 0:
                        manager.save({**state, "step": step}, step)
                else:
                    manager.save({**state, "step": step}, step)
                dist.barrier()
    if rank == 0:
        # The test harness's file, whole or absent: a kill that lands while it is written leaves a run
        # to resume, never a torn final.pt taken for the end of the run.
        torch.save(model.module.state_dict(), os.path.join(run_dir, "final.pt.partial"))
        os.replace(os.path.join(run_dir, "final.pt.partial"), os.path.join(run_dir, "final.pt"))
    ck.exit_process(0)


if __name__ == "__main__":
    main(sys.argv[1], "--literal" in sys.argv)
