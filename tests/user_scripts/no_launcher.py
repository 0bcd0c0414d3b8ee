"""A script written for torchrun, run with plain `python` to debug it: no launcher, no WORLD_SIZE.
`ck.init_distributed()` makes a process group of one, so DDP works unchanged; the sampler is rank 0 of
1; the manager saves and restores as under torchrun.

    python no_launcher.py RUN_DIR
"""

import os
import sys

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import ckptools as ck


def main(run_dir):
    device = ck.init_distributed()  # no launcher: a group of one rank
    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1)).to(
            device
        )
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)  # per epoch
    g = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(120, 6, generator=g), torch.randn(120, 1, generator=g))
    sampler = ck.ResumableDistributedSampler(dataset, seed=2)  # no process group needed either
    loader = DataLoader(dataset, batch_size=8, sampler=sampler)
    manager = ck.CheckpointManager(run_dir)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "sampler": sampler}
    ckpt = manager.restore(state)
    step = 0 if ckpt is None else ckpt["step"]
    for epoch in range(sampler.epoch, 4):
        sampler.set_epoch(epoch)
        for x, y in sampler.track(loader):
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            print("step", step, flush=True)
            if step % 4 == 0:
                manager.save({**state, "step": step}, step)
        scheduler.step()
        manager.save({**state, "step": step}, step)  # and after every epoch
    # The test harness's file, whole or absent: a kill that lands while it is written leaves a run
    # to resume, never a torn final.pt taken for the end of the run.
    torch.save(model.module.state_dict(), os.path.join(run_dir, "final.pt.partial"))
    os.replace(os.path.join(run_dir, "final.pt.partial"), os.path.join(run_dir, "final.pt"))
    ck.exit_process(0)


if __name__ == "__main__":
    main(sys.argv[1])
