"""How long `CheckpointManager.snapshot` stalls the loop, against the copy floor and a sync save.

Usage: python benchmarks/bench_snapshot.py [--gib 1] [--repeat 5] [--dir DIR] [--ranks 2] [--loop] [--device cuda]

One process, per round, interleaved: the floor (copying the same tensors into host buffers
allocated and faulted in once), a snapshot into node memory (/dev/shm): its stall (the call's
return, the copy) and, apart, the commit that follows in the background (CRC-32s, headers,
rename); a ``blocking=True`` snapshot (returns once committed); a sync `manager.save` to --dir
(disk); then restores: from the snapshot, from the disk file (warm page cache, the best case for
disk), against the floor of a restore (the same copy, reversed). Prints medians and the ratio the
goal is stated in: snapshot stall / floor (goal <= 1.1 on CPU).

``--device cuda``: the state on the GPU; the floor is the copy into pinned host buffers, a restore's
floor the copy back from them (`make gpu` runs it).

``--ranks 2``: the same state as a DDP model on 2 local ranks (gloo): each rank's stall, which the
split should make about half of one rank's (and its own floor, half the state). Then a job of 2
ranks that dies after a snapshot is relaunched twice, restoring from memory, then from the disk
(the snapshot removed, the durable file evicted from the page cache): each rank's process start,
process-group set-up and restore, apart.

``--loop``: a training loop (a CPU MLP whose step takes >= 100x a snapshot's stall) run with no
snapshot, a snapshot every 10 steps and every step, interleaved: steps/s against none (goal >= 0.99).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import tempfile
import time

import torch

import ckptools as ck


def _state(gib: float, device: str = "cpu") -> dict[str, torch.Tensor]:
    n = max(1, int(gib * 1024 / 8))  # 8 MiB fp32 tensors, like a model's weight matrices
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(2048, 1024, generator=g).to(device) for i in range(n)}


def _module(state: dict[str, torch.Tensor]) -> torch.nn.Module:
    module = torch.nn.Module()
    for key, value in state.items():
        setattr(module, key.split(".")[0], torch.nn.Linear(value.shape[1], value.shape[0], bias=False))
    return module


def _memory_folder() -> str:
    """A node-memory folder in /dev/shm (CKPTOOLS_BENCH_MEMORY_DIR: under that folder instead)."""
    parent = os.environ.get("CKPTOOLS_BENCH_MEMORY_DIR") or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    return tempfile.mkdtemp(prefix="ckptools-bench-", dir=parent)


def _copy_all(state: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> float:
    """The copy floor: the same tensors into buffers allocated and faulted in before (host buffers
    pinned for CUDA tensors: the device-to-host floor; the other way round, a restore's floor)."""
    cuda = any(v.is_cuda or b.is_cuda for v, b in zip(state.values(), buffers.values()))
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    for k, v in state.items():
        buffers[k].copy_(v, non_blocking=cuda)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - started


def evict(path: str) -> None:
    """Drop ``path``'s pages from the page cache (written and synced, so they are clean)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def bench(gib: float, repeat: int, workdir: str, device: str = "cpu") -> dict[str, float]:
    """Medians of ``repeat`` interleaved rounds (after two to warm up), in seconds, and the ratios."""
    state = _state(gib, device)
    memory = _memory_folder()
    manager = ck.CheckpointManager(os.path.join(workdir, "run"), keep_last=1, snapshot_dir=memory)
    cuda = device.startswith("cuda")
    buffers = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=cuda) for k, v in state.items()}
    for b in buffers.values():
        b.fill_(0)
    # On CUDA a restore's floor is the host-to-device copy from pinned memory; on the CPU the same copy.
    back = {k: torch.empty_like(v) for k, v in state.items()} if cuda else None
    sync = torch.cuda.synchronize if cuda else (lambda: None)  # a restore counts once its copies are done
    keys = ("floor", "snapshot", "ratio", "commit", "blocking", "save", "restore_mem", "restore_warm", "restore_cold",
            "restore_floor")  # fmt: skip
    times: dict[str, list[float]] = {k: [] for k in keys}
    for i in range(repeat + 2):  # rounds 0 and 1 warm up (the two slots' pages, the page cache)
        keep = i > 1
        before = _copy_all(state, buffers)
        started = time.perf_counter()
        manager.snapshot({"model": state}, 3 * i + 1)
        snap = time.perf_counter() - started
        manager.wait()  # the commit in the background: CRC-32s, headers, rename
        commit = time.perf_counter() - started - snap
        # The floor on both sides of the snapshot: the memory bus is shared and noisy here.
        floor = (before + _copy_all(state, buffers)) / 2  # on the CPU also a restore's floor: the copy reversed
        restore_floor = _copy_all(buffers, back) if back is not None else floor
        started = time.perf_counter()
        manager.snapshot({"model": state}, 3 * i + 2, blocking=True)
        blocking = time.perf_counter() - started
        started = time.perf_counter()
        manager.save({"model": state}, 3 * i)
        save = time.perf_counter() - started
        target = {"model": _module(state).to(device)}  # restored in place: every tensor is copied into it
        started = time.perf_counter()
        ck.load(manager.snapshots()[-1][1], target)
        sync()
        mem = time.perf_counter() - started
        on_disk = manager.checkpoints()[-1][1]
        started = time.perf_counter()
        ck.load(on_disk, target)
        sync()
        warm = time.perf_counter() - started
        evict(on_disk)  # a relaunch on another node, or long after: read from the disk itself
        started = time.perf_counter()
        ck.load(on_disk, target)
        sync()
        cold = time.perf_counter() - started
        if keep:
            values = (floor, snap, snap / floor, commit, blocking, save, mem, warm, cold, restore_floor)
            for key, value in zip(keys, values):
                times[key].append(value)
    manager.close()
    shutil.rmtree(memory, ignore_errors=True)
    return {k: statistics.median(v) for k, v in times.items()}


def _rank(rank: int, world: int, port: int, gib: float, repeat: int, queue: object) -> None:
    """One of --ranks local ranks: a DDP model of the state, its snapshot stall and its floor."""
    from torch.nn.parallel import DistributedDataParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)  # the node's cores shared among its ranks, as torchrun would
    state = _state(gib)
    model = _module(state)
    model.load_state_dict(state)
    ddp = DistributedDataParallel(model)
    memory = os.environ["BENCH_SNAPSHOT_DIR"]
    manager = ck.CheckpointManager(os.environ["BENCH_RUN_DIR"], snapshot_dir=memory)
    params = [p for p in model.parameters()]
    mine = params[rank::world]  # about this rank's share: its floor
    buffers = [torch.empty_like(p).fill_(0) for p in mine]
    stalls, floors = [], []
    for i in range(repeat + 2):
        torch.distributed.barrier()
        started = time.perf_counter()
        with torch.no_grad():
            for b, p in zip(buffers, mine):
                b.copy_(p)
        floor = time.perf_counter() - started
        torch.distributed.barrier()
        started = time.perf_counter()
        manager.snapshot({"model": ddp}, i + 1)
        stall = time.perf_counter() - started
        manager.wait()
        if i > 1:
            stalls.append(stall)
            floors.append(floor)
    manager.close()
    queue.put((rank, statistics.median(stalls), statistics.median(floors)))  # type: ignore[attr-defined]
    torch.distributed.barrier()
    ck.exit_process(0)


def _crashed_rank(rank: int, world: int, port: int, gib: float, queue: object) -> None:
    """A job's rank that saves step 1 durably, snapshots step 2, then dies (no exit_process)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    model = _module(_state(gib))
    model.load_state_dict(_state(gib))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    manager = ck.CheckpointManager(os.environ["BENCH_RUN_DIR"], snapshot_dir=os.environ["BENCH_SNAPSHOT_DIR"])
    manager.save({"model": ddp}, 1)
    manager.snapshot({"model": ddp}, 2, blocking=True)
    torch.distributed.barrier()
    queue.put(rank)  # type: ignore[attr-defined]
    queue.close()  # type: ignore[attr-defined]
    queue.join_thread()  # type: ignore[attr-defined]  # sent before os._exit
    os._exit(0)  # a crash, as far as the snapshots know: they stay for the relaunch


def _relaunched_rank(rank: int, world: int, port: int, gib: float, launched: float, queue: object) -> None:
    """A relaunched rank: how long its start (interpreter, imports), the process group and the
    restore each took."""
    began = time.time()  # this function runs once the interpreter is up and torch and ckptools are imported
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    torch.distributed.barrier()
    grouped = time.time()
    model = _module(_state(gib))  # the model's set-up, not counted: a relaunch makes it either way
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    manager = ck.CheckpointManager(os.environ["BENCH_RUN_DIR"], snapshot_dir=os.environ["BENCH_SNAPSHOT_DIR"])
    torch.distributed.barrier()
    started = time.perf_counter()
    ckpt = manager.restore({"model": ddp})
    restored = time.perf_counter() - started
    assert ckpt is not None
    queue.put((rank, began - launched, grouped - began, restored, ckpt["__ckptools__"]["metadata"]["step"]))  # type: ignore[attr-defined]
    queue.close()  # type: ignore[attr-defined]
    queue.join_thread()  # type: ignore[attr-defined]  # sent before os._exit
    torch.distributed.barrier()
    manager.close()
    os._exit(0)  # not exit_process: its release would remove the snapshot the next relaunch reads


def bench_relaunch(gib: float, world: int, workdir: str) -> dict[str, list[tuple[int, float, float, float, int]]]:
    """A job of ``world`` local ranks dies after a snapshot; it is relaunched twice: reading the
    snapshot from memory, then (the snapshot removed, the durable file evicted from the page
    cache) reading the disk."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    memory = _memory_folder()
    run = os.path.join(workdir, "relaunch")
    # No keeper copy during the measurement (it would release the memory after its grace time).
    os.environ.update(BENCH_SNAPSHOT_DIR=memory, BENCH_RUN_DIR=run, CKPTOOLS_KEEPER_GRACE="3600")
    results = {}
    try:
        for phase in ("crash", "memory", "disk"):
            if phase == "disk":
                shutil.rmtree(memory)  # its keeper sees the folder gone and exits
                for name in os.listdir(run):
                    evict(os.path.join(run, name))
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            queue = context.Queue()
            launched = time.time()
            if phase == "crash":
                procs = [context.Process(target=_crashed_rank, args=(r, world, port, gib, queue)) for r in range(world)]
            else:
                procs = [
                    context.Process(target=_relaunched_rank, args=(r, world, port, gib, launched, queue))
                    for r in range(world)
                ]
            for p in procs:
                p.start()
            replies = sorted(queue.get(timeout=900) for _ in procs)
            for p in procs:
                p.join(timeout=120)
            if phase != "crash":
                results[phase] = replies
    finally:
        shutil.rmtree(memory, ignore_errors=True)
    return results


def bench_ranks(gib: float, repeat: int, world: int, workdir: str) -> list[tuple[int, float, float]]:
    import multiprocessing

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    memory = _memory_folder()
    os.environ.update(BENCH_SNAPSHOT_DIR=memory, BENCH_RUN_DIR=os.path.join(workdir, "ranks"))
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    procs = [context.Process(target=_rank, args=(r, world, port, gib, repeat, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=900) for _ in procs)
    for p in procs:
        p.join(timeout=120)
    shutil.rmtree(memory, ignore_errors=True)
    return results


def bench_loop(steps: int, rounds: int, workdir: str) -> dict[str, float]:
    """Steps/s of a CPU training loop with no snapshot, one every 10 steps and one every step."""
    torch.manual_seed(0)
    width = 2048
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])  # 64 MiB of weights
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)  # and 64 MiB of momentum
    data = torch.randn(4096, width)
    memory = _memory_folder()
    manager = ck.CheckpointManager(os.path.join(workdir, "loop"), snapshot_dir=memory)
    rates: dict[str, list[float]] = {"none": [], "every 10": [], "every step": []}
    stalls: list[float] = []
    every = {"none": 0, "every 10": 10, "every step": 1}
    step = 0
    for _ in range(rounds):
        for mode, k in every.items():
            manager.wait()
            started = time.perf_counter()
            for _ in range(steps):
                step += 1
                opt.zero_grad()
                model(data).square().mean().backward()
                opt.step()
                if k and step % k == 0:
                    t = time.perf_counter()
                    manager.snapshot({"model": model, "optimizer": opt, "step": step}, step)
                    stalls.append(time.perf_counter() - t)
            rates[mode].append(steps / (time.perf_counter() - started))
    manager.close()
    shutil.rmtree(memory, ignore_errors=True)
    # One step's time, alone: what the stall is compared with.
    started = time.perf_counter()
    for _ in range(3):
        opt.zero_grad()
        model(data).square().mean().backward()
        opt.step()
    step_time = (time.perf_counter() - started) / 3
    result = {mode: statistics.median(r) for mode, r in rates.items()}
    result.update(stall=statistics.median(stalls), step=step_time)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, nargs="+", default=[1.0])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dir", default=None, help="a folder on the disk the durable saves go to")
    p.add_argument("--ranks", type=int, default=0, help="also measure the per-rank stall with this many local ranks")
    p.add_argument("--loop", action="store_true", help="also measure a training loop's steps/s")
    p.add_argument("--device", default="cpu", help="where the state lives: cpu, or cuda (floor: pinned device-to-host)")
    args = p.parse_args()
    workdir = tempfile.mkdtemp(prefix="ckptools-bench-snapshot-", dir=args.dir)
    os.environ.setdefault("CKPTOOLS_KEEPER_GRACE", "1")
    try:
        for gib in args.gib:
            m = bench(gib, args.repeat, workdir, args.device)
            print(
                f"{gib:g} GiB, median of {args.repeat}: floor {m['floor']:.3f} s (measured before and after each "
                f"snapshot); snapshot stall {m['snapshot']:.3f} s ({m['ratio']:.2f}x the floor, median of the rounds' "
                f"ratios; goal <= 1.1), then its commit in the background {m['commit']:.3f} s; "
                f"snapshot(blocking=True) {m['blocking']:.3f} s ({m['blocking'] / m['floor']:.2f}x); sync save to "
                f"disk {m['save']:.3f} s ({m['save'] / m['snapshot']:.1f}x the stall)",
                flush=True,
            )
            print(
                f"  restore in place (ck.load): from memory {m['restore_mem']:.3f} s "
                f"({m['restore_mem'] / m['restore_floor']:.2f}x the floor), from disk {m['restore_warm']:.3f} s in "
                f"the page cache, {m['restore_cold']:.3f} s "
                f"evicted from it ({m['restore_cold'] / m['restore_mem']:.1f}x memory)",
                flush=True,
            )
            if args.ranks > 1:
                for rank, stall, floor in bench_ranks(gib, args.repeat, args.ranks, workdir):
                    print(
                        f"  {args.ranks} local ranks, rank {rank}: stall {stall:.3f} s "
                        f"({stall / m['snapshot']:.2f}x one rank's), its share's floor {floor:.3f} s "
                        f"({stall / floor:.2f}x)",
                        flush=True,
                    )
            if args.ranks > 1:
                relaunch = bench_relaunch(gib, args.ranks, workdir)
                for phase, replies in relaunch.items():
                    for rank, start, group, restore, step in replies:
                        print(
                            f"  relaunch of {args.ranks} local ranks, rank {rank}, restore from {phase} (step {step}): "
                            f"process start (interpreter, imports) {start:.2f} s, process group {group:.2f} s, "
                            f"restore {restore:.3f} s",
                            flush=True,
                        )
        if args.loop:
            r = bench_loop(10, 5, workdir)
            print(
                f"training loop (128 MiB of state, a step {r['step']:.3f} s = {r['step'] / r['stall']:.0f}x the "
                f"stall of {r['stall'] * 1000:.1f} ms): {r['none']:.2f} steps/s without snapshots, "
                f"{r['every 10']:.2f} with one every 10 steps ({r['every 10'] / r['none']:.3f}x), "
                f"{r['every step']:.2f} with one every step ({r['every step'] / r['none']:.3f}x); goal >= 0.99x",
                flush=True,
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
