"""A ZeroRedundancyOptimizer's save: ckptools (every rank writes its partition into the one file)
against torch's ``consolidate_state_dict(to=0)`` + ``torch.save``, at 2 and 4 ranks, in one run.

Usage: python benchmarks/bench_zero.py [--gib 0.5] [--ranks 2 4] [--repeat 5] [--resume 2:1 2:3 4:2] [--dir DIR]

Each configuration launches N real processes (gloo on 127.0.0.1) holding ``--gib`` GiB of fp32
parameters (8 MiB tensors) under ``ZeroRedundancyOptimizer(AdamW)`` after one step: the optimizer
state (``exp_avg``, ``exp_avg_sq``) is twice the parameters, partitioned over the ranks. The
state saved is ``{"optimizer": zero}``. Per rank, interleaved, ``--repeat`` times (medians):

- ``ckptools``: ``ck.save`` (durable: fsync'd, renamed) from the call until every rank returned;
- ``own files at once``: every rank ``torch.save``s its own partition (``zero.optim.state_dict()``)
  to a file of its own and fsyncs it, all at the same time: the floor of writing every partition
  on this one disk (nothing joins them into one file);
- ``largest alone``: the rank with the largest partition does the same while the others wait;
- ``torch``: ``consolidate_state_dict(to=0)`` then rank 0's ``torch.save`` + fsync of
  ``zero.state_dict()``.

For each: the peak extra resident memory of each rank during the save (``/proc/self/statm``
sampled every 2 ms, minus the resident size before), and the bytes each rank handed to
torch.distributed's collectives (the tests' ``counting_sent``).

``--resume W:V``: the file saved by W ranks, its page cache dropped, loaded into a fresh ZeRO on V
ranks with ``ck.load``: the bytes each rank read from the disk (``/proc/self/io`` read_bytes)
against its new partition's size.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "tests"))
from bench_snapshot import evict  # noqa: E402  # drops a file's pages from the page cache

_PAGE = os.sysconf("SC_PAGE_SIZE")
MODES = ("ckptools", "own files at once", "largest alone", "torch")


class _PeakRss:
    """This process's peak resident memory above what it was when the block started."""

    def __init__(self) -> None:
        self.extra = 0

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE

    def __enter__(self) -> _PeakRss:
        self._base = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.002):
            self.extra = max(self.extra, self._rss() - self._base)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.extra = max(self.extra, self._rss() - self._base)


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def _durable_torch_save(obj: Any, path: str) -> None:
    import torch

    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _zero(gib: float, step: bool) -> Any:
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer

    n = max(1, int(gib * 1024 / 8))
    params = [torch.nn.Parameter(torch.full((2 << 20,), float(i))) for i in range(n)]
    zero = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=1e-3)
    if step:
        for p in params:
            p.grad = torch.full_like(p, 0.5)
        zero.step()
    return zero


def _own_bytes(zero: Any) -> int:
    import torch

    return sum(v.nbytes for s in zero.optim.state.values() if s for v in s.values() if torch.is_tensor(v))


def _join(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=datetime.timedelta(600)
    )


def _leave(queue: Any, result: Any) -> None:
    import torch.distributed as dist

    queue.put(result)
    queue.close()
    queue.join_thread()  # delivered before os._exit, which would drop what the feeder still holds
    dist.barrier()
    os._exit(0)  # see the reference loop guide: no gloo teardown at exit


def _save_rank(rank: int, world: int, port: int, args: Any, queue: Any) -> None:
    import torch.distributed as dist
    from _dist import counting_sent

    import ckptools as ck

    _join(rank, world, port)
    zero = _zero(args.gib, step=True)
    own = _own_bytes(zero)
    sizes: list[Any] = [None] * world
    dist.all_gather_object(sizes, own)
    largest = max(range(world), key=lambda r: (sizes[r], -r))
    work = args.workdir
    ours_path = os.path.join(work, f"zero-{world}.pt")
    measured: dict[str, dict[str, list[float]]] = {m: {"seconds": [], "extra": [], "sent": []} for m in MODES}

    def run(mode: str, i: int) -> None:
        dist.barrier()
        with _PeakRss() as peak, counting_sent() as sent:
            started = time.perf_counter()
            if mode == "ckptools":
                ck.save(ours_path, {"optimizer": zero})
            elif mode == "own files at once":
                _durable_torch_save(zero.optim.state_dict(), os.path.join(work, f"own-{rank}.pt"))
            elif mode == "largest alone":
                if rank == largest:
                    _durable_torch_save(zero.optim.state_dict(), os.path.join(work, f"own-{rank}.pt"))
            else:
                zero.consolidate_state_dict(to=0)
                if rank == 0:
                    _durable_torch_save(zero.state_dict(), os.path.join(work, "torch.pt"))
                zero._all_state_dicts = []  # torch keeps the consolidated partitions until the next call
            took = time.perf_counter() - started
        times: list[Any] = [None] * world
        dist.all_gather_object(times, took)  # a save ends when its slowest rank returns
        if i >= 0:
            measured[mode]["seconds"].append(max(times))
            measured[mode]["extra"].append(peak.extra)
            measured[mode]["sent"].append(sent[0])
        dist.barrier()
        if rank == 0:  # each write starts from a folder holding only the other worlds' files (--resume)
            for name in os.listdir(work):
                if not name.startswith("zero-") or name == os.path.basename(ours_path):
                    os.unlink(os.path.join(work, name))
        dist.barrier()

    for i in range(-1, args.repeat):  # the first round warms up and is not counted
        for mode in MODES:
            run(mode, i)
    ck.save(ours_path, {"optimizer": zero})  # the file --resume reads
    _leave(queue, (rank, own, measured))


def _resume_rank(rank: int, world: int, port: int, args: Any, path: str, prefetch: bool, queue: Any) -> None:
    import torch
    import torch.distributed as dist

    import ckptools as ck
    import ckptools.read.restoring

    if not prefetch:  # what a load read before ckptools prefetched each rank's own partition
        ckptools.read.restoring.prefetch_partition = lambda zero, entry: 0
    _join(rank, world, port)
    zero = _zero(args.gib, step=False)
    if rank == 0:
        evict(path)
    dist.barrier()
    before = _read_bytes()
    started = time.perf_counter()
    ck.load(path, {"optimizer": zero}, restore_rng=False)
    took = time.perf_counter() - started
    at_load = _read_bytes() - before
    # What the next step does: on the CPU the partition stays mapped and is read when touched (on a
    # GPU, ZeRO copies it to the device at load). Prefetched, every rank at once, as in training
    # (their ranges are disjoint). Without the prefetch a rank's faults also read its neighbours'
    # pages, which on one node another rank would then find cached: one rank at a time, the cache
    # dropped before each, is what a rank alone on its node reads.
    touched = 0
    for turn in range(1 if prefetch else world):
        if not prefetch and rank == 0:
            evict(path)
        dist.barrier()
        if prefetch or rank == turn:
            before = _read_bytes()
            for state in zero.optim.state.values():
                for value in (state or {}).values():
                    if torch.is_tensor(value):
                        value.sum()
            touched = _read_bytes() - before
        dist.barrier()
    _leave(queue, (rank, _own_bytes(zero), at_load, touched, took))


def _launch(target: Any, world: int, *args: Any) -> list[Any]:
    from _dist import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=3600) for _ in range(world))
    for p in procs:
        p.join(60)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=0.5, help="GiB of parameters (the AdamW state is twice that)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--resume", nargs="*", default=["2:1", "2:2", "2:3", "4:2", "4:4"], help="saved:restored ranks")
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    args.workdir = tempfile.mkdtemp(prefix="ckptools-bench-zero-", dir=args.dir or os.getcwd())
    mib = 2**20
    try:
        saved = {}
        for world in args.ranks:
            saved[world] = _launch(_save_rank, world, args)
        resumed = {}
        for pair in args.resume:
            world, again = (int(x) for x in pair.split(":"))
            if world in saved:
                for prefetch in (True, False):
                    path = os.path.join(args.workdir, f"zero-{world}.pt")
                    resumed[pair, prefetch] = _launch(_resume_rank, again, args, path, prefetch)
    finally:
        shutil.rmtree(args.workdir, ignore_errors=True)

    state_gib = 2 * args.gib
    print(f"ZeroRedundancyOptimizer(AdamW): {args.gib:g} GiB of parameters, {state_gib:g} GiB of optimizer state; "
          f"medians of {args.repeat} interleaved runs; seconds: until the slowest rank returned")  # fmt: skip
    for world, results in saved.items():
        owns = [own for _, own, _ in results]
        print(f"\n{world} ranks, partitions {' / '.join(f'{o / mib:.0f}' for o in owns)} MiB")
        print(f"{'':<20}{'seconds':>9}{'x own files':>13}{'x largest':>11}"
              f"{'peak extra MiB per rank':>28}{'sent MiB per rank':>26}")  # fmt: skip
        med = {m: statistics.median(results[0][2][m]["seconds"]) for m in MODES}
        for mode in MODES:
            extra = " / ".join(f"{statistics.median(r[2][mode]['extra']) / mib:.1f}" for r in results)
            sent = " / ".join(f"{statistics.median(r[2][mode]['sent']) / mib:.2f}" for r in results)
            print(f"{mode:<20}{med[mode]:>9.2f}{med[mode] / med['own files at once']:>13.2f}"
                  f"{med[mode] / med['largest alone']:>11.2f}{extra:>28}{sent:>26}")  # fmt: skip
        ratio = [statistics.median(r[2]["ckptools"]["extra"]) / own for r, own in zip(results, owns)]
        print(f"ckptools' peak extra / own partition: {' / '.join(f'{x:.3f}' for x in ratio)} (goal <= 1.1)")
    if resumed:
        print("\nck.load into a fresh ZeRO, page cache dropped: MiB each rank read (at load + touching its "
              "partition) of its new partition")  # fmt: skip
        for (pair, prefetch), results in resumed.items():
            cells = " | ".join(
                f"{read / mib:.1f} + {touched / mib:.1f} of {own / mib:.0f} ({(read + touched) / max(own, 1):.2f}x)"
                for _, own, read, touched, _ in results
            )
            how = "" if prefetch else " (page by page: no prefetch)"
            print(f"{pair:>5}: {cells}; load {max(r[4] for r in results):.2f} s{how}")


if __name__ == "__main__":
    main()
