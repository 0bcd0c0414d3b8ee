"""The shape of PyTorch's DDP tutorial (ddp-tutorial-series/multigpu_torchrun.py), ported to ckptools
as the docs say: a Trainer class with _save_snapshot/_load_snapshot, a save after every epoch, and
`for epoch in range(self.epochs_run, max_epochs)`; plus a scheduler stepped per epoch (what made a save
after the epoch resume inexactly: the restored sampler re-entered the saved epoch and stepped it again).

    torchrun --nproc-per-node=2 ddp_tutorial.py RUN_DIR
Rank 0 prints "step N" after each step and saves the final weights to RUN_DIR/final.pt.
"""

import os
import sys

import torch
import torch.nn.functional as F
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


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path):
        self.gpu_id = ck.get_local_rank()
        self.train_data = train_data
        self.optimizer = optimizer
        self.scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        self.save_every = save_every
        self.epochs_run = 0
        self.steps = 0
        self.model = DDP(model)
        self.manager = ck.CheckpointManager(snapshot_path)
        # What the tutorial's snapshot holds, and what an exact resume needs beside it.
        self.state = {
            "MODEL_STATE": self.model,
            "OPTIMIZER": optimizer,
            "SCHEDULER": self.scheduler,
            "SAMPLER": train_data.sampler,
        }
        self._load_snapshot()

    def _load_snapshot(self):
        snapshot = self.manager.restore(self.state)
        if snapshot is not None:
            self.epochs_run = self.train_data.sampler.epoch  # the epoch after the saved one, once it ended
            self.steps = snapshot["STEPS"]
            print(f"Resuming training from snapshot at Epoch {self.epochs_run}", flush=True)

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data.sampler.track(self.train_data):
            self._run_batch(source, targets)
            self.steps += 1
            if ck.is_main_process():
                print("step", self.steps, flush=True)

    def _save_snapshot(self, epoch):
        self.manager.save({**self.state, "EPOCHS_RUN": epoch, "STEPS": self.steps}, epoch)

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            self.scheduler.step()
            if epoch % self.save_every == 0:
                self._save_snapshot(epoch)


def main(run_dir, save_every=1, total_epochs=5, batch_size=16):
    ck.init_distributed()
    torch.manual_seed(0)
    dataset = MyTrainDataset(256)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(
        dataset, batch_size=batch_size, pin_memory=True, shuffle=False, sampler=ck.ResumableDistributedSampler(dataset)
    )
    trainer = Trainer(model, loader, optimizer, save_every, run_dir)
    trainer.train(total_epochs)
    if ck.is_main_process():
        # The test harness's file, whole or absent: a kill that lands while it is written leaves a run
        # to resume, never a torn final.pt taken for the end of the run.
        torch.save(trainer.model.module.state_dict(), os.path.join(run_dir, "final.pt.partial"))
        os.replace(os.path.join(run_dir, "final.pt.partial"), os.path.join(run_dir, "final.pt"))
    ck.exit_process(0)


if __name__ == "__main__":
    main(sys.argv[1])
