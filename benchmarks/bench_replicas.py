"""What comparing DDP's replicas costs a save or a snapshot (issue 58): the digests of one call, sampled (a
rotating 1/50 of the replicated bytes, a snapshot's default) and whole (``replicas="all"``, ``ck.check_replicas``),
against the copy floor (the replicated tensors copied once into buffers already allocated), for GiB-sized
and tiny states; medians of interleaved runs. One process in a gloo group of one (DDP wraps the model).

    python benchmarks/bench_replicas.py [--gib 1] [--repeat 9]

``--save``: what the full comparison every durable save now makes (issue 65) costs against the save itself:
``ck.save`` of the same DDP state to a local file (written and fsynced) with the comparison and without
(``replicas="off"``), and the full digests alone, interleaved; medians and ratios.

    python benchmarks/bench_replicas.py --save [--gib 1] [--repeat 7] [--dir DIR]

``--loop``: the steps/s of a DDP loop on 2 gloo ranks (spawned) that snapshots every step into node memory
(``manager.snapshot``, the budget off), with the comparison (the default) and without
(``replicas="off"``), in interleaved blocks of 20 steps; the medians and their ratio.

    python benchmarks/bench_replicas.py --loop [--mib 64] [--repeat 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from ckptools.write.replicas import SAMPLE_CALLS, replica_digests


def _state(numel: int, device: str = "cpu") -> dict:
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, max(numel // (1024 * 4), 1), bias=False) for _ in range(4)])
    return {"model": torch.nn.parallel.DistributedDataParallel(model.to(device))}


def _measure(state: dict, repeat: int) -> dict[str, float]:
    """Medians: the copy floor (into host buffers; from a GPU into pinned ones, as a snapshot copies) and the
    digests of one sampled call and of every byte."""
    tensors = [p.detach() for p in state["model"].parameters()]
    cuda = tensors[0].is_cuda
    buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in tensors]
    times: dict[str, list[float]] = {"floor": [], "sampled": [], "whole": []}
    for _ in range(repeat):
        start = time.perf_counter()
        for b, t in zip(buffers, tensors):
            b.copy_(t, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        times["floor"].append(time.perf_counter() - start)
        start = time.perf_counter()
        replica_digests(state, sample=True)
        times["sampled"].append(time.perf_counter() - start)
        start = time.perf_counter()
        replica_digests(state, sample=False)
        times["whole"].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def _save_cost(state: dict, repeat: int, folder: str) -> dict[str, float]:
    """Medians of interleaved rounds: ``ck.save`` compared (the default), not compared, and the digests."""
    import ckptools as ck

    path = os.path.join(folder, "bench-replicas.pt")
    times: dict[str, list[float]] = {"compared": [], "not": [], "digests": []}
    for _ in range(repeat):
        for name in ("compared", "not", "digests"):
            start = time.perf_counter()
            if name == "digests":
                replica_digests(state, sample=False)
            else:
                ck.save(path, state, replicas="all" if name == "compared" else "off")
            times[name].append(time.perf_counter() - start)
            if os.path.exists(path):
                os.unlink(path)
    return {k: statistics.median(v) for k, v in times.items()}


def _loop(rank: int, mib: float, repeat: int, folder: str, port: int, out: str) -> None:
    import ckptools as ck

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    width = max(int((mib * (1 << 20) / 4 / 4) ** 0.5), 8)  # four square layers of `mib` MiB in all
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(4)])
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    state = {"model": model, "opt": opt}
    manager = ck.CheckpointManager(os.path.join(folder, "run"), snapshot_dir=os.path.join(folder, "shm"))
    batch = torch.randn(16, width)
    rates: dict[bool, list[float]] = {True: [], False: []}
    step = 0
    for block in range(2 * repeat + 2):  # the first pair warms up
        check = block % 2 == 0
        dist.barrier()
        start = time.perf_counter()
        for _ in range(20):
            model(batch).sum().backward()
            opt.step()
            opt.zero_grad()
            manager.snapshot(state, step=step, budget=None, replicas="auto" if check else "off")
            step += 1
        manager.wait()
        if block >= 2:
            rates[check].append(20 / (time.perf_counter() - start))
    manager.close()
    if rank == 0:
        on, off = statistics.median(rates[True]), statistics.median(rates[False])
        with open(out, "w") as f:
            f.write(f"{mib:g} MiB of parameters, 2 ranks, a snapshot every step: {on:.1f} steps/s compared, "
                    f"{off:.1f} steps/s not: {on / off:.3f}x "
                    f"(medians of {repeat} interleaved blocks of 20 steps)\n")  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--repeat", type=int, default=9)
    p.add_argument("--loop", action="store_true")
    p.add_argument("--mib", type=float, default=64.0)
    p.add_argument("--save", action="store_true")
    p.add_argument("--dir", default=os.environ.get("TMPDIR", "/tmp"))
    args = p.parse_args()
    if args.loop:
        import tempfile

        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as folder:
            out = os.path.join(folder, "result.txt")
            mp.spawn(_loop, args=(args.mib, args.repeat, folder, 29578, out), nprocs=2)
            with open(out) as f:
                print(f.read(), end="")
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29577")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    if args.save:
        m = _save_cost(_state(int(args.gib * (1 << 30)) // 4), args.repeat, args.dir)
        print(f"{args.gib:g} GiB DDP state, ck.save to {args.dir}: compared {m['compared']:.3f} s, not compared "
              f"{m['not']:.3f} s ({(m['compared'] / m['not'] - 1) * 100:+.1f} %); the full digests alone "
              f"{m['digests'] * 1000:.0f} ms ({m['digests'] / m['not'] * 100:.1f} % of the save); medians of "
              f"{args.repeat} interleaved rounds", flush=True)  # fmt: skip
        dist.destroy_process_group()
        return
    for label, numel in ((f"{args.gib:g} GiB", int(args.gib * (1 << 30)) // 4), ("12 KiB", 3 * 1024)):
        m = _measure(_state(numel), args.repeat)
        print(f"{label}: copy floor {m['floor'] * 1000:.2f} ms; sampled digests {m['sampled'] * 1000:.2f} ms "
              f"({m['sampled'] / m['floor'] * 100:.1f} % of the floor; 1/{SAMPLE_CALLS} of the bytes); whole "
              f"{m['whole'] * 1000:.2f} ms ({m['whole'] / m['floor']:.2f}x the floor)", flush=True)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
