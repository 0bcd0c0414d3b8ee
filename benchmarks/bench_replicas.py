"""What comparing DDP's replicas costs a save or a snapshot (issue 58): the digests of one call, sampled (a
rotating 1/25 of the replicated bytes, the default) and whole (``verify_replicas``, ``ck.check_replicas``),
against the copy floor (the replicated tensors copied once into buffers already allocated), for GiB-sized
and tiny states; medians of interleaved runs. One process in a gloo group of one (DDP wraps the model).

    python benchmarks/bench_replicas.py [--gib 1] [--repeat 9]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from ckptools.write.replicas import SAMPLE_CALLS, replica_digests


def _state(numel: int) -> dict:
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, max(numel // (1024 * 4), 1), bias=False) for _ in range(4)])
    return {"model": torch.nn.parallel.DistributedDataParallel(model)}


def _measure(state: dict, repeat: int) -> dict[str, float]:
    tensors = [p.detach() for p in state["model"].parameters()]
    buffers = [torch.empty_like(t) for t in tensors]
    times: dict[str, list[float]] = {"floor": [], "sampled": [], "whole": []}
    for _ in range(repeat):
        start = time.perf_counter()
        for b, t in zip(buffers, tensors):
            b.copy_(t)
        times["floor"].append(time.perf_counter() - start)
        start = time.perf_counter()
        replica_digests(state, sample=True)
        times["sampled"].append(time.perf_counter() - start)
        start = time.perf_counter()
        replica_digests(state, sample=False)
        times["whole"].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--repeat", type=int, default=9)
    args = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29577")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    for label, numel in ((f"{args.gib:g} GiB", int(args.gib * (1 << 30)) // 4), ("12 KiB", 3 * 1024)):
        m = _measure(_state(numel), args.repeat)
        print(f"{label}: copy floor {m['floor'] * 1000:.2f} ms; sampled digests {m['sampled'] * 1000:.2f} ms "
              f"({m['sampled'] / m['floor'] * 100:.1f} % of the floor; 1/{SAMPLE_CALLS} of the bytes); whole "
              f"{m['whole'] * 1000:.2f} ms ({m['whole'] / m['floor']:.2f}x the floor)", flush=True)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
