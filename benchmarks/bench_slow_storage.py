"""A training loop against slow and stuck storage (issue 68): what the loop loses, and what it is told.

Usage: python benchmarks/bench_slow_storage.py [--mib 64] [--steps 300] [--save-every 20] [--rate 10]
       [--freeze 60] [--step-ms 50] [--rounds 1]

One process. The state is ``--mib`` MiB of fp32 weights; a step is ``--step-ms`` of CPU work and an
update of every weight. Every step is a node-memory snapshot (``CheckpointManager.snapshot``), every
``--save-every`` steps an async durable save (``save(blocking=False)``) to a FUSE mount (tests/_slowfs.py,
so that every run pays the same passthrough) that is, run by run:

- ``fast``: not throttled (the baseline);
- ``slow``: throttled to ``--rate`` MB/s;
- ``frozen``: frozen ``--freeze`` seconds from a third of the way in, then thawed.

Printed for each: steps/s of the loop and its ratio to ``fast`` (the wait for the last save after the loop
apart); the longest single iteration against the median one (the longest stall the loop saw: the median of
the rounds' longest, and the step of the worst); the steps a kill at the worst moment would lose, from node
memory (the newest snapshot) and from the durable target alone (the newest checkpoint whole on the mount);
how many saves were taken and skipped; and every warning ckptools printed. The stall bound
(CKPTOOLS_STALL_TIMEOUT) is left at its default, 120 s, longer than the freeze: a freeze of 60 s is a slow
storage, not a stuck one.
Needs /dev/fuse, fusermount3 and mfusepy (`make fuse`); says so and exits 2 otherwise.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import threading
import time
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))

import torch
from _slowfs import slow_mount, why_not

import ckptools as ck


def _work(ms: float, weights: torch.Tensor, a: torch.Tensor) -> None:
    """A step: CPU work for about ``ms`` milliseconds, then every weight updated (the state changes)."""
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        a @ a
    weights.add_(1.0)


def run(kind: str, args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    weights = torch.zeros(args.mib << 18)  # fp32: 4 bytes each
    a = torch.randn(128, 128)
    shown: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-slow-") as tmp, slow_mount(pathlib.Path(tmp)) as fs:
        run_dir = fs.path / "run"
        if kind == "slow":
            fs.throttle(args.rate * 1e6)
        manager = ck.CheckpointManager(run_dir, keep_last=2, snapshot_dir=pathlib.Path(tmp) / "node")
        freeze_at = args.steps // 3
        timer: threading.Timer | None = None
        took: list[float] = []
        lost_memory = lost_disk = 0
        saves = skipped = 0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            started = time.perf_counter()
            for step in range(1, args.steps + 1):
                if kind == "frozen" and step == freeze_at:
                    fs.freeze()
                    timer = threading.Timer(args.freeze, fs.thaw)
                    timer.start()
                t0 = time.perf_counter()
                _work(args.step_ms, weights, a)
                state = {"w": weights, "step": step}
                manager.snapshot(state, step)
                if step % args.save_every == 0:
                    path = manager.save(state, step, blocking=False)
                    saves += 1
                    skipped += path != manager.path_for(step)
                took.append(time.perf_counter() - t0)
                # A kill now: the newest snapshot this node holds, and the newest whole checkpoint on the mount.
                durable = max((s for s, _ in manager.checkpoints()), default=0)
                lost_disk = max(lost_disk, step - durable)
                lost_memory = max(lost_memory, step - max((s for s, _ in manager.snapshots()), default=0))
            elapsed = time.perf_counter() - started
            waited = time.perf_counter()
            manager.wait()  # the save in flight at the end (the frozen run: until the storage is thawed)
            waited = time.perf_counter() - waited
        if timer is not None:
            timer.cancel()
            fs.thaw()
        manager.close()
        for w in caught:
            text = str(w.message)
            if text not in shown:
                shown.append(text)
    return {
        "steps/s": args.steps / elapsed,
        "longest": max(took),
        "longest_at": took.index(max(took)) + 1,
        "final_wait": waited,
        "median": statistics.median(took),
        "lost_memory": lost_memory,
        "lost_disk": lost_disk,
        "saves": saves,
        "skipped": skipped,
        "printed": shown,
    }


def _median(rs: list[dict]) -> dict:
    """Each figure's median over the rounds (steps lost: the most; the printed lines: every round's)."""
    out = {key: statistics.median(r[key] for r in rs) for key in ("steps/s", "median", "final_wait")}
    worst = max(rs, key=lambda r: r["longest"])
    out.update(longest=statistics.median(r["longest"] for r in rs), longest_at=worst["longest_at"])
    out.update({key: max(r[key] for r in rs) for key in ("lost_memory", "lost_disk", "saves", "skipped")})
    out["printed"] = list(dict.fromkeys(text for r in rs for text in r["printed"]))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--rate", type=float, default=10.0, help="MB/s of the slow run")
    parser.add_argument("--freeze", type=float, default=60.0, help="seconds the frozen run's storage stops")
    parser.add_argument("--step-ms", type=float, default=50.0)
    parser.add_argument("--only", nargs="*", default=["fast", "slow", "frozen"])
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds; medians are printed")
    args = parser.parse_args()
    if (why := why_not()) is not None:
        print(f"bench_slow_storage.py needs FUSE: {why} (make fuse)", file=sys.stderr)
        return 2
    print(f"state {args.mib} MiB, a step {args.step_ms:g} ms + a snapshot, an async save every {args.save_every} "
          f"steps, {args.steps} steps; slow: {args.rate:g} MB/s; frozen: {args.freeze:g} s; "
          f"CKPTOOLS_STALL_TIMEOUT={os.environ.get('CKPTOOLS_STALL_TIMEOUT', '120 (default)')}")  # fmt: skip
    rounds: dict[str, list[dict]] = {kind: [] for kind in args.only}
    for _ in range(args.rounds):  # interleaved: the disk and the machine drift between rounds
        for kind in args.only:
            rounds[kind].append(run(kind, args))
    results = {kind: _median(rs) for kind, rs in rounds.items()}
    base = results.get("fast", {}).get("steps/s")
    print("| storage | steps/s | vs fast | longest iteration (at step; median) | steps lost: node memory / disk "
          "alone | saves taken / skipped | the last save's wait after the loop |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for kind, r in results.items():
        ratio = f"{r['steps/s'] / base:.2f}x" if base else "-"
        print(f"| {kind} | {r['steps/s']:.2f} | {ratio} | {r['longest']:.3f} s ({r['longest_at']}; "
              f"{r['median']:.3f} s) | {r['lost_memory']} / {r['lost_disk']} | {r['saves'] - r['skipped']} / "
              f"{r['skipped']} | {r['final_wait']:.1f} s |")  # fmt: skip
    for kind, r in results.items():
        for text in r["printed"]:
            print(f"{kind}: printed: {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
