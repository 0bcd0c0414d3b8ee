"""The per-step cost of asking "did any rank get a signal?": Preemption.should_stop() on real ranks.

Usage: python benchmarks/bench_preemption.py [--nproc 2] [--calls 5000]
Spawns --nproc processes in a gloo group on 127.0.0.1 and times --calls calls of should_stop()
with check_every 1 and 10, next to one all-reduce of a 1 MiB tensor on the same group (a small
step's gradient sync, for scale). Prints microseconds per call (median of 5 rounds, rank 0).
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(rank: int, world: int, port: int, calls: int, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=datetime.timedelta(60)
    )
    import ckptools as ck

    results = {}
    for every in (1, 10):
        preemption = ck.Preemption(check_every=every)
        rounds = []
        for _ in range(5):
            dist.barrier()
            t = time.perf_counter()
            for _ in range(calls):
                preemption.should_stop()
            rounds.append((time.perf_counter() - t) / calls)
        preemption.close()
        results[f"should_stop(), check_every={every}"] = statistics.median(rounds)
    grad = torch.ones(1 << 18)  # 1 MiB of fp32
    rounds = []
    for _ in range(5):
        dist.barrier()
        t = time.perf_counter()
        for _ in range(max(1, calls // 50)):
            dist.all_reduce(grad)
        rounds.append((time.perf_counter() - t) / max(1, calls // 50))
    results["all_reduce of 1 MiB (for scale)"] = statistics.median(rounds)
    dist.barrier()
    if rank == 0:
        queue.put(results)
    queue.close()
    queue.join_thread()  # the result is in the pipe before the process goes
    os._exit(0)  # see examples/train_ddp.py: no gloo teardown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--calls", type=int, default=5000)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_run, args=(r, args.nproc, port, args.calls, queue)) for r in range(args.nproc)]
    for p in procs:
        p.start()
    results = queue.get(timeout=600)
    for p in procs:
        p.join(60)
    print(f"{args.nproc} ranks, gloo on 127.0.0.1, median of 5 rounds of {args.calls} calls")
    for name, seconds in results.items():
        print(f"  {name:<36} {seconds * 1e6:9.1f} us per call")


if __name__ == "__main__":
    main()
