"""Peak memory and time of saving a checkpoint to S3 (moto's S3 server on 127.0.0.1).

Usage: python benchmarks/bench_s3.py [--gib 1] [--rounds 3]
In a fresh process per round: builds a --gib GiB state, notes its resident size, ck.save()s it to
s3://, and reports the process's peak RSS over the state's size (the goal is <= 1.2x: the state
plus a few upload parts), and the save time. Median of --rounds. Needs the s3 and dev extras.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

CHILD = """
import json, os, resource, sys, time, torch
import ckptools as ck

def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))

gib, url = float(sys.argv[1]), sys.argv[2]
state = {"model": {f"w{i}": torch.ones(4096, 4096) for i in range(int(gib * 16))}, "step": 1}  # 64 MiB each
nbytes = sum(t.numel() * 4 for t in state["model"].values())
before = rss()
t = time.perf_counter()
ck.save(url, state)
seconds = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"state": nbytes, "before": before, "peak": peak, "seconds": seconds}))
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    port = _port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}"}  # fmt: skip
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        code = "import s3fs; s3fs.S3FileSystem().mkdir('bench')"
        subprocess.run([sys.executable, "-c", code], env=env, check=True)
        results = []
        for i in range(args.rounds):
            out = subprocess.run([sys.executable, "-c", CHILD, str(args.gib), f"s3://bench/ckpt{i}.pt"], env=env,
                                 capture_output=True, text=True, check=True)  # fmt: skip
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    finally:
        server.kill()
        server.wait()
    state = results[0]["state"]
    growth = statistics.median((r["peak"] - r["before"]) for r in results)
    peak = statistics.median(r["peak"] for r in results)
    base = statistics.median(r["before"] for r in results)
    seconds = statistics.median(r["seconds"] for r in results)
    print(f"save of a {state / 2**30:.2f} GiB state to s3:// (moto on 127.0.0.1), median of {args.rounds}:")
    print(f"  peak RSS {peak / 2**30:.2f} GiB = process before the save ({base / 2**30:.2f} GiB, the state and torch) "
          f"+ {growth / 2**30:.2f} GiB during it; (state + growth) / state = {(state + growth) / state:.2f}x; "
          f"{seconds:.1f} s")  # fmt: skip


if __name__ == "__main__":
    main()
