"""PyTorch's DDP tutorial launched with ``mp.spawn`` (ddp-tutorial-series/multigpu.py), ported to ckptools
with the smallest change: its ``ddp_setup`` (MASTER_ADDR and MASTER_PORT by hand,
``init_process_group(backend, rank=rank, world_size=world_size)``, gloo on the CPU here), its Trainer and
``mp.spawn(main, args=..., nprocs=world_size)`` as they are; the snapshot through a CheckpointManager
(a node-memory snapshot every step, a save every epoch), the sampler resumable, and the preemption
guide's three lines in the batch loop.

    python examples/train_spawn.py RUN_DIR PORT [--no-preemption]

With NODE and NNODES set, this launch is node NODE of NNODES (``rank = node * 2 + local``, as the
tutorial's multi-node form computes it), the others launched beside it with the same PORT.

Each rank prints ``[rank R pid P]`` once; rank 0 prints ``step N`` after each step and saves the final
weights to RUN_DIR/final.pt. STEP_PAUSE (seconds) slows each step: the tests signal it mid-epoch.
"""

import os
import sys

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed import init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

import ckptools as ck


class MyTrainDataset(Dataset):  # the tutorial's datautils.MyTrainDataset, with a fixed seed
    def __init__(self, size):
        g = torch.Generator().manual_seed(0)
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g)) for _ in range(size)]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index]


def ddp_setup(rank, world_size, port):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)
    init_process_group(backend="gloo", rank=rank, world_size=world_size)


class Trainer:
    def __init__(self, model, train_data, optimizer, gpu_id, save_every, run_dir, preemption):
        self.gpu_id = gpu_id
        self.model = DDP(model)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.preemption = preemption
        self.manager = ck.CheckpointManager(run_dir)
        self.state = {"model": self.model, "optimizer": optimizer, "sampler": train_data.sampler}
        self.steps = 0
        self.epochs_run = 0
        ckpt = self.manager.restore(self.state)
        if ckpt is not None:
            self.steps = ckpt["steps"]
            self.epochs_run = train_data.sampler.epoch
            print(f"[rank {torch.distributed.get_rank()}] resumed at step {self.steps}", flush=True)

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data.sampler.track(self.train_data):
            self._run_batch(source, targets)
            self.steps += 1
            self.manager.snapshot({**self.state, "steps": self.steps}, self.steps)
            if torch.distributed.get_rank() == 0:
                print("step", self.steps, flush=True)
            if self.preemption is not None and self.preemption.should_stop():
                self.manager.save({**self.state, "steps": self.steps}, self.steps)
                self.preemption.exit()

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if epoch % self.save_every == 0:
                self.manager.save({**self.state, "steps": self.steps}, self.steps)


def main(local, world_size, run_dir, port, preempt, total_epochs=4, batch_size=16):
    rank = int(os.environ.get("NODE", "0")) * 2 + local
    ddp_setup(rank, world_size, port)
    print(f"[rank {rank} pid {os.getpid()}]", flush=True)
    preemption = ck.Preemption() if preempt else None
    torch.manual_seed(0)
    dataset = MyTrainDataset(256)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, sampler=ck.ResumableDistributedSampler(dataset))
    trainer = Trainer(model, loader, optimizer, local, 1, run_dir, preemption)
    if os.environ.get("STEP_PAUSE"):  # slow steps, so that a signal lands mid-epoch
        import time

        trainer._run_batch = lambda s, t, run=trainer._run_batch: (time.sleep(float(os.environ["STEP_PAUSE"])),
                                                                    run(s, t))  # fmt: skip
    trainer.train(total_epochs)
    if rank == 0:
        torch.save(trainer.model.module.state_dict(), os.path.join(run_dir, "final.pt"))
    ck.exit_process(0)


if __name__ == "__main__":
    world_size = 2 * int(os.environ.get("NNODES", "1"))
    run_dir, port = sys.argv[1], int(sys.argv[2])
    mp.spawn(main, args=(world_size, run_dir, port, "--no-preemption" not in sys.argv), nprocs=2)
