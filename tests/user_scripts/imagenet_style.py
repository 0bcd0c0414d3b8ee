"""The shape of torchvision's classification reference (references/classification/train.py) and of the
ImageNet example, ported to ckptools as the docs say: main(args), a scheduler stepped per epoch,
validation after every epoch, `save_on_master(checkpoint, ...)` of {"model", "optimizer", "lr_scheduler",
"epoch", "args"} at every epoch's end, a copy of the best, and `args.start_epoch = checkpoint["epoch"] + 1`
on resume. The port: ck.save on every rank (ckptools decides who writes), the sampler in the checkpoint,
`vars(args)` instead of the Namespace (weights_only refuses it), batches through `sampler.track`.

    torchrun --nproc-per-node=2 imagenet_style.py RUN_DIR
"""

import argparse
import os
import shutil
import sys

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import ckptools as ck


def train_one_epoch(model, criterion, optimizer, loader, sampler, step):
    model.train()
    for image, target in sampler.track(loader):
        loss = criterion(model(image), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if ck.is_main_process():
            print("step", step, flush=True)
    return step


def evaluate(model, criterion, loader):
    model.eval()
    correct = total = 0
    with torch.inference_mode():
        for image, target in loader:
            correct += (model(image).argmax(1) == target).sum().item()
            total += len(target)
    return 100.0 * correct / max(total, 1)


def main(args):
    ck.init_distributed()
    g = torch.Generator().manual_seed(0)
    images, labels = torch.randn(192, 3, 8, 8, generator=g), torch.randint(0, 4, (192,), generator=g)
    dataset, dataset_test = TensorDataset(images, labels), TensorDataset(images[:32], labels[:32])
    train_sampler = ck.ResumableDistributedSampler(dataset, shuffle=True, seed=0)
    data_loader = DataLoader(dataset, batch_size=args.batch_size, sampler=train_sampler)
    data_loader_test = DataLoader(dataset_test, batch_size=16)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(8 * 6 * 6, 4),
    )
    model = DistributedDataParallel(model)
    model_without_ddp = model.module
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.1)
    best_acc1, step = 0.0, 0
    resume = os.path.join(args.output_dir, "checkpoint.pth")
    if os.path.exists(resume):
        checkpoint = ck.load(
            resume,
            {
                "model": model_without_ddp,
                "optimizer": optimizer,
                "lr_scheduler": lr_scheduler,
                "sampler": train_sampler,
            },
        )
        args.start_epoch = checkpoint["epoch"] + 1
        best_acc1, step = checkpoint["best_acc1"], checkpoint["step"]
    for epoch in range(args.start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        step = train_one_epoch(model, criterion, optimizer, data_loader, train_sampler, step)
        lr_scheduler.step()
        acc1 = evaluate(model, criterion, data_loader_test)
        is_best, best_acc1 = acc1 > best_acc1, max(acc1, best_acc1)
        checkpoint = {
            "model": model_without_ddp,
            "optimizer": optimizer,
            "lr_scheduler": lr_scheduler,
            "sampler": train_sampler,
            "epoch": epoch,
            "args": vars(args),
            "best_acc1": best_acc1,
            "step": step,
        }
        ck.save(os.path.join(args.output_dir, f"model_{epoch}.pth"), checkpoint)
        ck.save(resume, checkpoint)
        if is_best and ck.is_main_process():
            shutil.copyfile(resume, os.path.join(args.output_dir, "model_best.pth"))
    if ck.is_main_process():
        # The test harness's file, whole or absent: a kill that lands while it is written leaves a run
        # to resume, never a torn final.pt taken for the end of the run.
        torch.save(model_without_ddp.state_dict(), os.path.join(args.output_dir, "final.pt.partial"))
        os.replace(os.path.join(args.output_dir, "final.pt.partial"), os.path.join(args.output_dir, "final.pt"))
    ck.exit_process(0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--start-epoch", type=int, default=0)
    main(parser.parse_args(sys.argv[1:]))
