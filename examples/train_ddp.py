"""Reference DDP training loop with ckptools: correct checkpoints and bit-exact resume.

Launch (CPU, 2 processes; gloo):
    torchrun --standalone --nproc_per_node=2 examples/train_ddp.py --ckpt-dir runs/demo
Launch (8 GPUs; nccl, one GPU per process):
    torchrun --standalone --nproc_per_node=8 examples/train_ddp.py --ckpt-dir runs/demo --amp
Kill it at any time and run the same command again: it resumes from the newest good checkpoint
and ends with the same weights, bit for bit, as a run that was never interrupted. With
``torchrun --max-restarts=1 ... --fail-at-step 23`` one rank dies after step 23 and torchrun
restarts the job, which resumes by itself.

Preemption is handled by default: SIGTERM or SIGUSR1 (to torchrun, to one rank, to every
process) makes every rank stop at the same step, save it, and exit with code 143 (138 for
SIGUSR1); the same command then resumes from that very step. ``--async-save`` writes periodic
checkpoints in the background while training goes on.

What each part is for is said where it happens. The batch size is per rank: the global batch is
``--batch-size * world_size`` and the learning rate ``--lr`` is for that global batch (gradients
are averaged across ranks by DDP).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import logging
import os
import random
import signal
import sys
import time
import traceback
from typing import NoReturn

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

import ckptools as ck

IN_FEATURES, HIDDEN, CLASSES = 32, 128, 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--dataset-size", type=int, default=512)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--ckpt-dir", default="runs/train_ddp", help="local path or fsspec URL (s3://...)")
    p.add_argument("--resume", default="auto", help="auto (newest good checkpoint in --ckpt-dir), none, or a PATH")
    p.add_argument("--save-every-steps", type=int, default=5, help="0: no periodic or epoch-end saves")
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument(
        "--snapshot-every",
        type=int,
        default=0,
        help="steps between snapshots in node memory (manager.snapshot): a kill -9 of the job loses fewer steps",
    )
    p.add_argument(
        "--fail-at-step",
        type=int,
        nargs="+",
        default=[],
        help="one rank os._exit()s right after this step, in a launch that started fresh, on torchrun's first "
        "attempt; with several steps, torchrun's attempt k dies after the k-th (one launch, several crashes)",
    )
    p.add_argument("--fail-rank", type=int, default=None, help="which rank dies (default: the last)")
    p.add_argument("--amp", action=argparse.BooleanOptionalAction, default=False, help="fp16 on GPU, bf16 on CPU")
    p.add_argument("--amp-dtype", choices=["fp16", "bf16"], default=None, help="autocast's dtype with --amp")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--persistent-workers", action="store_true", help="DataLoader workers live across epochs")
    p.add_argument("--worker-start", choices=["fork", "spawn"], default=None, help="DataLoader workers' start method")
    p.add_argument(
        "--augment",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="random augmentation in __getitem__ (torch, python random and numpy draws)",
    )
    p.add_argument(
        "--seeded-dataset",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="wrap the dataset in ck.SeededDataset (--no-seeded-dataset shows what a resume is without it)",
    )
    p.add_argument(
        "--exact-reduce",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep DDP's gradient bucket layout fixed so a resume is bit-exact with 3+ ranks too",
    )
    p.add_argument("--log-every", type=int, default=8)
    p.add_argument("--async-save", action="store_true", help="periodic saves in the background (blocking=False)")
    p.add_argument(
        "--preemption",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on SIGTERM/SIGUSR1 every rank saves at the same step and exits with 128 + the signal number",
    )
    p.add_argument("--check-preemption-every", type=int, default=1, help="steps between preemption checks")
    p.add_argument("--hidden", type=int, default=HIDDEN, help="model width")
    p.add_argument("--depth", type=int, default=1, help="hidden layers (a bigger model for benchmarks)")
    p.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step: a slower model, for demos/tests")
    p.add_argument(
        "--record-samples",
        default=None,
        metavar="DIR",
        help="each rank appends 'step epoch index...' per step to DIR/samples-rankR-of-W.txt, and 'epoch index "
        "sha256' of each augmented sample to DIR/augmented-rankR-of-W.txt (data coverage tests)",
    )
    p.add_argument(
        "--pg-timeout",
        type=float,
        default=10.0,
        help="minutes a collective (a checkpoint save or load included) waits for a hung rank before every "
        "other rank raises; a rank that dies is noticed at once on gloo",
    )
    return p.parse_args(argv)


def log(*parts: object) -> None:
    # Rank 0 alone logs: N copies of every line help nobody.
    if ck.is_main_process():
        logging.getLogger("train_ddp").info(" ".join(map(str, parts)))


def setup_logging(rank: int) -> None:
    """One stream for this loop's lines, ckptools' own reports (each save and load: path, size,
    seconds, GB/s) and its warnings.

    ckptools configures no logging handler itself; its records go to the "ckptools" logger, at
    INFO on rank 0 only. Its warnings (a CheckpointWarning: a resume that will not be bit-exact,
    a damaged checkpoint skipped, ...) go through `warnings`; captureWarnings puts them in the
    same stream, and ckptools issues them on rank 0 only, so nothing is printed N times.
    """
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"[rank{rank} %(asctime)s] %(name)s: %(message)s", datefmt="%H:%M:%S"))
    for name in ("train_ddp", "ckptools", "py.warnings"):
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    logging.captureWarnings(True)


class SyntheticData(Dataset):
    """Synthetic classification data labelled by a fixed random teacher network (no downloads).

    Its own generator makes it identical on every rank and independent of the global RNG. Each
    item is ``(features, label, index)``; with ``augment`` the features are randomly augmented
    the way real pipelines are (a stand-in for RandomResizedCrop and friends): Gaussian noise
    from torch, a roll by ``random.randint``, a scale from ``np.random``. The index lets the
    loop record what it trained on.
    """

    def __init__(self, size: int, seed: int, augment: bool = True) -> None:
        g = torch.Generator().manual_seed(10_000 + seed)
        self.x = torch.randn(size, IN_FEATURES, generator=g)
        teacher_w1 = torch.randn(IN_FEATURES, 64, generator=g)
        teacher_w2 = torch.randn(64, CLASSES, generator=g)
        self.y = (torch.tanh(self.x @ teacher_w1) @ teacher_w2).argmax(dim=1)
        self.augment = augment

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        x = self.x[index]
        if self.augment:
            x = x + 0.1 * torch.randn(IN_FEATURES)
            x = torch.roll(x, random.randint(-2, 2)) * float(0.9 + 0.2 * np.random.rand())
        return x, self.y[index], index


def make_model(seed: int, hidden: int = HIDDEN, depth: int = 1) -> torch.nn.Module:
    # BatchNorm has per-rank statistics (SyncBatchNorm on GPU) and dropout makes the RNG state
    # part of what an exact resume must restore.
    torch.manual_seed(seed)  # same initial weights everywhere (DDP also broadcasts rank 0's)
    layers = [
        torch.nn.Linear(IN_FEATURES, hidden),
        torch.nn.BatchNorm1d(hidden),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),
    ]
    for _ in range(depth - 1):  # only for a bigger state (benchmarks); depth 1 is the model above
        layers += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(hidden, CLASSES))


def main(argv: list[str] | None = None) -> NoReturn:
    args = parse_args(argv)
    # cuBLAS needs this before CUDA starts to be deterministic; harmless on CPU.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)

    # nccl + cuda:LOCAL_RANK on GPUs, gloo + cpu otherwise; isolates torchrun restart attempts.
    device = ck.init_distributed(timeout=datetime.timedelta(minutes=args.pg_timeout))
    rank, world = ck.get_rank(), ck.get_world_size()
    setup_logging(rank)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    # Every rank says who it is once: on two nodes both have local rank 0, and only global
    # rank 0 writes checkpoints.
    print(f"[rank{rank}] local rank {ck.get_local_rank()}, writes checkpoints: {ck.is_main_process()}", flush=True)
    log(
        f"world size {world}, backend {dist.get_backend() if dist.is_initialized() else 'none'}, "
        f"device {device.type}, attempt {attempt}, global batch {args.batch_size * world}, lr {args.lr}"
    )

    # Installed first: a SIGTERM that comes while the job starts is caught too.
    preemption = ck.Preemption(check_every=args.check_preemption_every) if args.preemption else None
    model = make_model(args.seed, args.hidden, args.depth)
    if device.type == "cuda":
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    # DDP re-buckets gradients after the first backward of every launch, so a resumed run's
    # first step would reduce with a different bucket layout than the uninterrupted run used at
    # that step. Ring all-reduce sums each element in an order set by its offset in the bucket:
    # with 3+ ranks a different layout rounds differently (2 ranks: a + b is commutative, so it
    # never matters). find_unused_parameters=True keeps the initial layout for the whole run
    # (torch's Reducer only re-buckets without it), at the cost of one graph traversal per step.
    ddp = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        find_unused_parameters=args.exact_reduce and world > 2,
    )

    # Per-rank seeds: each rank's dropout masks differ, yet each is reproducible.
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    dataset = SyntheticData(args.dataset_size, args.seed, augment=args.augment)
    record = augmented = None
    if args.record_samples:
        os.makedirs(args.record_samples, exist_ok=True)
        record = open(os.path.join(args.record_samples, f"samples-rank{rank}-of-{world}.txt"), "a")  # noqa: SIM115
        augmented = open(os.path.join(args.record_samples, f"augmented-rank{rank}-of-{world}.txt"), "a")  # noqa: SIM115
    sampler = ck.ResumableDistributedSampler(dataset, shuffle=True, seed=args.seed, drop_last=True)
    # SeededDataset: sample i of epoch e is augmented with random numbers drawn from seeds of
    # (seed, e, i) alone, whichever worker fetches it, so a run resumed mid-epoch (with any number
    # of workers, on any world size) augments every sample as the uninterrupted run did.
    loader = DataLoader(
        ck.SeededDataset(dataset, sampler) if args.seeded_dataset else dataset,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=args.num_workers,
        persistent_workers=args.persistent_workers and args.num_workers > 0,
        multiprocessing_context=args.worker_start if args.num_workers > 0 else None,
        drop_last=True,
    )
    if preemption is not None:
        # Workers ignore the signals: torchrun's shutdown signals each rank's whole process
        # group, and a dead worker would kill the loop before it could save.
        loader = preemption.protect(loader)

    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.8)  # stepped per step
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[
        args.amp_dtype or ("fp16" if device.type == "cuda" else "bf16")
    ]
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp)
    loss_fn = torch.nn.CrossEntropyLoss()

    state = {"model": ddp, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler, "sampler": sampler}
    manager = ck.CheckpointManager(args.ckpt_dir, keep_last=args.keep_last)
    step = 0
    ckpt = None
    if args.resume == "auto":
        ckpt = manager.restore(state)  # every rank loads the checkpoint rank 0 chose
    elif args.resume != "none":
        ckpt = ck.load(args.resume, state)
    if ckpt is None:
        log("fresh start")
    else:
        step = int(ckpt["step"])
        log(
            f"resumed from step {step} (epoch {sampler.epoch}: {sampler.consumed} of its {len(dataset)} samples "
            f"consumed, {len(sampler)} left for each rank)"
        )

    def save(blocking: bool = True) -> bool:
        """Whether this step's save was made: a background one is skipped (with a warning) while the one
        before it is still being written to a storage slower than the loop saves."""
        # ckptools logs "saved PATH (size in s, GB/s)"; in the background too, when it is done.
        return manager.save({**state, "step": step}, step, blocking=blocking) == manager.path_for(step)

    last_saved = first_step = step
    started = time.monotonic()
    for epoch in range(sampler.epoch if ckpt is not None else 0, args.epochs):
        sampler.set_epoch(epoch)  # the restored epoch keeps its restored position
        ddp.train()
        # track() counts the batches the loop received (workers prefetch ahead of it) and lends
        # the DataLoader a seed of its own for the epoch (else iter(loader) draws one from the
        # global RNG, at a different point of the stream in a run resumed mid-epoch).
        for batch in sampler.track(loader):
            x, y = batch[0].to(device, non_blocking=True), batch[1].to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=amp_dtype, enabled=args.amp):
                loss = loss_fn(ddp(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1
            if record is not None and augmented is not None:
                indices = batch[2].tolist()
                record.write(f"{step} {epoch} {' '.join(map(str, indices))}\n")
                record.flush()
                for features, index in zip(batch[0], indices):
                    digest = hashlib.sha256(features.numpy().tobytes()).hexdigest()[:16]
                    augmented.write(f"{epoch} {index} {digest}\n")
                augmented.flush()
            if step % args.log_every == 0:
                log(f"epoch {epoch} step {step} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.5f}")
            # A simulated crash fires once per attempt listed: torchrun's attempt k dies after the
            # k-th step given, and a relaunch that resumed never dies, so `--max-restarts=0`
            # followed by the same command again recovers too.
            if _fails_now(args, attempt, step, fresh=ckpt is None) and rank == _fail_rank(args, world):
                print(f"[rank{rank}] simulated crash right after step {step}", flush=True)
                os._exit(17)  # abrupt: no cleanup, no save, like a killed process
            if args.step_seconds:
                time.sleep(args.step_seconds)
            if args.save_every_steps and step % args.save_every_steps == 0:
                if save(blocking=not args.async_save):
                    last_saved = step
            elif args.snapshot_every and step % args.snapshot_every == 0:
                # Into node memory: survives kill -9 of the whole job; restore() takes it when newest.
                manager.snapshot({**state, "step": step}, step)  # returns once the copy is whole
            # A step boundary: every rank asks together whether any rank was signalled.
            if preemption is not None and preemption.should_stop():
                name = signal.Signals(preemption.stop_signal).name
                if last_saved == step:  # this step's save was just made (or is being written)
                    in_flight = manager.pending  # not yet waited for; done() is a local poll
                    writing = "still being written" if in_flight and not in_flight.done() else "written"
                    log(f"preempted at step {step} ({name}): finishing its background save ({writing})")
                    manager.wait()
                else:
                    log(f"preempted at step {step} ({name}): saving it")
                    save()  # blocking; an older background save in flight is finished first
                preemption.exit()  # every rank leaves together, exit code 128 + signal number
        if args.save_every_steps and last_saved != step:  # epoch end (unless that step was just saved)
            # The run's last save blocks: a background one could be skipped behind a slow storage.
            save(blocking=not args.async_save and epoch + 1 < args.epochs)
            last_saved = step
    seconds = time.monotonic() - started
    closing = time.monotonic()
    manager.close()  # the last background save is complete, its snapshot memory freed
    log(
        f"trained {step - first_step} steps in {seconds:.2f} s ({(step - first_step) / max(seconds, 1e-9):.2f} "
        f"steps/s), then waited {time.monotonic() - closing:.2f} s for the last save"
    )

    # The weights alone, for inference: rank 0 writes, every rank waits for the complete file.
    final = ck.save_weights(f"{args.ckpt_dir.rstrip('/')}/final.safetensors", ddp)
    log(f"done after {step} steps; final weights: {final}")
    if record is not None and augmented is not None:
        record.close()
        augmented.close()
    # Leave from here, while `ddp` is still referenced: returning would free it, and freeing the
    # DDP model destroys the process group, which can hang (see ck.exit_process).
    ck.exit_process(0)


def _fails_now(args: argparse.Namespace, attempt: int, step: int, fresh: bool) -> bool:
    planned = args.fail_at_step
    return attempt < len(planned) and planned[attempt] == step and (fresh or attempt > 0)


def _fail_rank(args: argparse.Namespace, world: int) -> int:
    return world - 1 if args.fail_rank is None else args.fail_rank


if __name__ == "__main__":
    try:
        main()
    except SystemExit as err:  # argparse --help / usage errors
        ck.exit_process(err.code if isinstance(err.code, int) else 1, collective=False)
    except BaseException:  # noqa: BLE001 - printed, then the same exit path
        # The traceback still references main's frame (and the DDP model) here: exit now,
        # without waiting for ranks that may never come.
        traceback.print_exc()
        ck.exit_process(1, collective=False)
