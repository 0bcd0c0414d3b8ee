"""At scale, on S3: every rank uploading its share against rank 0 alone, and a restore read once
between the ranks against every rank reading it and rank 0 reading and sending it; 1, 2 and 4 ranks.

Usage: python benchmarks/bench_scale.py [--mib 64] [--ranks 1 2 4] [--rate-mib 16] [--repeat 3]

Storage: moto's S3 server on 127.0.0.1 behind a throttling proxy (in this process): each rank talks
to S3 through a port of its own, whose connections share ``--rate-mib`` MiB/s each way between them
(a client's bandwidth: what one node gets of an object store), so that the storage, not this machine's
2 cores, is the limit. The proxy also counts the bytes each phase read from the store.

Each configuration launches N real processes (gloo on 127.0.0.1) per phase, each holding the same
``--mib`` MiB of DDP parameters (fp32, 8 MiB tensors, frozen but one), and times on every rank, from
a barrier to the call's return (the slowest rank's time is the phase's):

- save, rank 0 alone (``writers="rank0"``: torch.save streamed into one multipart upload) and save,
  every rank (``writers="all"``: every rank uploads its share as parts of one upload);
- restore, every rank reading the whole object (``read="each"``), rank 0 reading it and sending it
  (``read="rank0"``), and read once (``read="once"``: each rank ranged GETs of its share, the rest
  exchanged); the exchange alone (`share_storages` of the same storages, after the restore) is
  timed apart, and the bytes the store sent are counted at the proxy.

Phases are interleaved; medians of ``--repeat`` rounds. Goals (issue 46): every rank uploading
>= 0.8 x N times as fast as rank 0 alone; read once <= 1.3 x file / (N x the rate) plus the exchange;
bytes read from the store per restore 1.0x the file.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

BUCKET = "bench-scale"
PHASES = ("save rank0", "save all", "load each", "load rank0", "load once")


class _Bucket:
    """A rate shared by every connection of one port, one direction: each chunk waits its turn."""

    def __init__(self, rate: float) -> None:
        self.rate, self.next = rate, 0.0

    async def take(self, n: int) -> None:
        now = time.monotonic()
        self.next = max(now, self.next) + n / self.rate
        await asyncio.sleep(max(0.0, self.next - now - 0.02))  # 20 ms of burst


class Proxy:
    """One port per rank in front of ``target``, ``rate`` bytes/s each way per port; bytes sent down counted."""

    def __init__(self, target: int, ports: int, rate: float) -> None:
        self.target, self.rate = target, rate
        self.ports: list[int] = []
        self.down = [0] * ports
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ports, ready), daemon=True).start()
        ready.wait()

    def _run(self, ports: int, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        for index in range(ports):
            up, down = _Bucket(self.rate), _Bucket(self.rate)
            server = self.loop.run_until_complete(
                asyncio.start_server(lambda r, w, i=index, u=up, d=down: self._serve(r, w, i, u, d), "127.0.0.1", 0)
            )
            self.ports.append(server.sockets[0].getsockname()[1])
        ready.set()
        self.loop.run_forever()

    async def _serve(self, reader: Any, writer: Any, index: int, up: _Bucket, down: _Bucket) -> None:
        try:
            far_reader, far_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.close()
            return

        async def pipe(src: Any, dst: Any, bucket: _Bucket, counted: bool) -> None:
            try:
                while data := await src.read(1 << 16):
                    await bucket.take(len(data))
                    dst.write(data)
                    await dst.drain()
                    if counted:
                        self.down[index] += len(data)
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, far_writer, up, False), pipe(far_reader, writer, down, True))


def _rank(rank: int, world: int, port: int, endpoint: str, phase: str, args: Any, url: str, queue: Any) -> None:
    os.environ.update(AWS_ENDPOINT_URL_S3=endpoint, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))  # fmt: skip
    import torch
    import torch.distributed as dist

    import ckptools as ck
    from ckptools.collective.tree import Skeleton, owners_of, share_storages

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=datetime.timedelta(600)
    )
    torch.manual_seed(0)
    layers = [torch.nn.Linear(1024, 2048, bias=False) for _ in range(max(1, args.mib // 8))]
    for layer in layers[1:]:
        layer.weight.requires_grad_(False)
    state = {"model": torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers)), "step": 1}
    result: dict[str, float] = {}
    dist.barrier()
    started = time.perf_counter()
    if phase.startswith("save"):
        ck.save(url, state, writers=phase.split()[1])
    else:
        loaded = ck.load(url, read=phase.split()[1], restore_rng=False)
    result["seconds"] = time.perf_counter() - started
    if phase == "load once":  # the exchange alone: the same storages, from the same owners
        parts = Skeleton(loaded)
        dist.barrier()
        started = time.perf_counter()
        share_storages(list(parts.storages), owners_of(parts.sizes(), world), comm_device=torch.device("cpu"))
        result["exchange"] = time.perf_counter() - started
    queue.put((rank, result))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _phase(world: int, phase: str, args: Any, proxy: Proxy, url: str) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    before = list(proxy.down)
    procs = [ctx.Process(target=_rank, args=(r, world, port, f"http://127.0.0.1:{proxy.ports[r]}", phase, args, url,
                                             queue)) for r in range(world)]  # fmt: skip
    for p in procs:
        p.start()
    results = [queue.get(timeout=900) for _ in range(world)]
    for p in procs:
        p.join(timeout=120)
        if p.exitcode != 0:
            raise SystemExit(f"{phase} at {world} ranks: a rank exited with {p.exitcode}")
    out = {"seconds": max(r["seconds"] for _, r in results), "read": sum(proxy.down) - sum(before)}
    if phase == "load once":
        out["exchange"] = max(r["exchange"] for _, r in results)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=64, help="MiB of DDP parameters (8 MiB tensors)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rate-mib", type=float, default=16.0, help="each client's MiB/s, each way")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    moto = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(moto)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{moto}", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
        import s3fs

        s3fs.S3FileSystem(endpoint_url=f"http://127.0.0.1:{moto}").mkdir(BUCKET)
        proxy = Proxy(moto, max(args.ranks), args.rate_mib * 2**20)
        _report(args, proxy)
    finally:
        server.kill()


def _report(args: Any, proxy: Proxy) -> None:
    times: dict[tuple[int, str], list[dict[str, float]]] = {}
    for round_ in range(args.repeat):
        for world in args.ranks:
            for phase in PHASES:
                url = f"s3://{BUCKET}/n{world}/{'rank0' if phase == 'save rank0' else 'all'}.pt"
                times.setdefault((world, phase), []).append(_phase(world, phase, args, proxy, url))
        print(f"round {round_ + 1} of {args.repeat} done", flush=True)
    mib, rate = args.mib, args.rate_mib
    file_bytes = None
    print(f"\n{mib} MiB of DDP parameters on S3 (moto), {rate:g} MiB/s per client each way (throttling proxy); "
          f"medians of {args.repeat} interleaved rounds\n")  # fmt: skip
    print(
        "| ranks | save rank 0 alone | save every rank | speed-up (goal >= 0.8 N) | load each | load rank 0 + send |"
        " load once (exchange apart) | floor file/(N x rate) | once / floor | bytes read: each, rank0, once |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for world in args.ranks:
        med = {p: statistics.median(r["seconds"] for r in times[(world, p)]) for p in PHASES}
        read = {p: statistics.median(r["read"] for r in times[(world, p)]) for p in PHASES if p.startswith("load")}
        exchange = statistics.median(r["exchange"] for r in times[(world, "load once")])
        file_bytes = file_bytes or read["load rank0"]
        floor = file_bytes / (world * rate * 2**20)
        ratios = ", ".join(f"{read[p] / file_bytes:.2f}x" for p in ("load each", "load rank0", "load once"))
        print(f"| {world} | {med['save rank0']:.2f} s | {med['save all']:.2f} s | "
              f"{med['save rank0'] / med['save all']:.2f}x | {med['load each']:.2f} s | {med['load rank0']:.2f} s | "
              f"{med['load once']:.2f} s ({exchange:.2f} s) | {floor:.2f} s | "
              f"{(med['load once'] - exchange) / floor:.2f}x | {ratios} |")  # fmt: skip


if __name__ == "__main__":
    main()
