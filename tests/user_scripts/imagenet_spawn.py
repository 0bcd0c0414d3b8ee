"""The shape of pytorch/examples' ImageNet trainer (imagenet/main.py) under its own launcher, ported with the
smallest change: ``mp.spawn(main_worker, nprocs=ngpus_per_node, args=(ngpus_per_node, args))``,
``main_worker(gpu, ngpus_per_node, args)`` with ``args.rank = args.rank * ngpus_per_node + gpu`` and
``init_process_group(init_method=args.dist_url, ...)``, StepLR, a GradScaler (bfloat16 autocast on the CPU
here), ``--resume`` of ``checkpoint.pth.tar`` and ``shutil.copyfile`` of the best. The port: ``ck.save``
and ``ck.load`` on every rank instead of ``torch.save`` on the node's first rank and ``torch.load``, the
sampler resumable and in the checkpoint, and the preemption guide's lines in the batch loop (a SIGTERM to
the launching parent saves the step reached, mid-epoch).

    python imagenet_spawn.py OUTPUT_DIR --dist-url tcp://127.0.0.1:PORT [--resume OUTPUT_DIR/checkpoint.pth.tar]

Rank 0 prints ``step N``; the final weights go to OUTPUT_DIR/final.pt. STEP_PAUSE (seconds) slows each step.
"""

import argparse
import os
import shutil
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, TensorDataset

import ckptools as ck

parser = argparse.ArgumentParser()
parser.add_argument("output_dir")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--start-epoch", type=int, default=0)
parser.add_argument("-b", "--batch-size", type=int, default=16)
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--resume", default="")
parser.add_argument("--world-size", type=int, default=1)
parser.add_argument("--rank", type=int, default=0)
parser.add_argument("--dist-url", default="tcp://127.0.0.1:23456")
parser.add_argument("--dist-backend", default="gloo")

best_acc1 = 0.0


def main():
    args = parser.parse_args()
    ngpus_per_node = 2  # torch.cuda.device_count() in the original
    args.world_size = ngpus_per_node * args.world_size
    mp.spawn(main_worker, nprocs=ngpus_per_node, args=(ngpus_per_node, args))


def main_worker(gpu, ngpus_per_node, args):
    global best_acc1
    args.gpu = gpu
    args.rank = args.rank * ngpus_per_node + gpu
    dist.init_process_group(backend=args.dist_backend, init_method=args.dist_url, world_size=args.world_size,
                            rank=args.rank)  # fmt: skip
    print(f"[rank {args.rank} pid {os.getpid()}]", flush=True)  # for tests/_spawn_launch.py
    preemption = ck.Preemption()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.Flatten(),
        torch.nn.Dropout(0.2), torch.nn.Linear(8 * 6 * 6, 4),
    )  # fmt: skip
    model = torch.nn.parallel.DistributedDataParallel(model)
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    images, labels = torch.randn(192, 3, 8, 8, generator=g), torch.randint(0, 4, (192,), generator=g)
    train_dataset, val_dataset = TensorDataset(images, labels), TensorDataset(images[:32], labels[:32])
    train_sampler = ck.ResumableDistributedSampler(train_dataset, shuffle=True, seed=0)
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)
    val_loader = DataLoader(val_dataset, batch_size=16)
    state = {"state_dict": model, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler,
             "sampler": train_sampler}  # fmt: skip
    step = 0
    if args.resume and os.path.isfile(args.resume):
        checkpoint = ck.load(args.resume, state, restore_rng=True)
        args.start_epoch = checkpoint["epoch"]
        best_acc1, step = checkpoint["best_acc1"], checkpoint["step"]
        if args.rank == 0:
            print(f"=> loaded checkpoint '{args.resume}' (epoch {checkpoint['epoch']}, step {step})", flush=True)
    for epoch in range(args.start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for images, target in train_sampler.track(train_loader):
            if os.environ.get("STEP_PAUSE"):
                time.sleep(float(os.environ["STEP_PAUSE"]))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = criterion(model(images), target)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            step += 1
            if args.rank == 0:
                print("step", step, flush=True)
            if preemption.should_stop():  # mid-epoch: the sampler's position says where the epoch resumes
                save_checkpoint({**state, "epoch": epoch, "best_acc1": best_acc1, "step": step}, False, args)
                preemption.exit()
        acc1 = validate(val_loader, model)
        scheduler.step()
        is_best = acc1 > best_acc1
        best_acc1 = max(acc1, best_acc1)
        save_checkpoint({**state, "epoch": epoch + 1, "best_acc1": best_acc1, "step": step}, is_best, args)
    if args.rank == 0:
        torch.save(model.module.state_dict(), os.path.join(args.output_dir, "final.pt"))
    ck.exit_process(0)


def validate(val_loader, model):
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for images, target in val_loader:
            correct += (model(images).argmax(1) == target).sum().item()
            total += len(target)
    return 100.0 * correct / total


def save_checkpoint(state, is_best, args, filename="checkpoint.pth.tar"):
    path = os.path.join(args.output_dir, filename)
    ck.save(path, state)  # every rank: ckptools decides who writes
    if is_best and args.rank == 0:
        shutil.copyfile(path, os.path.join(args.output_dir, "model_best.pth.tar"))


if __name__ == "__main__":
    main()
