"""Training throughput of the reference loop with no checkpoints, sync saves and async saves, and
what a preemption costs; all under real torchrun, in one run.

Usage: python benchmarks/bench_train.py [--nproc 2] [--hidden 4096] [--depth 4] [--every 20]
       [--epochs 1] [--dataset-size 2048] [--batch-size 16] [--repeat 1] [--step-seconds 0]
The model is the reference loop's with ``--depth`` hidden layers of ``--hidden`` (4096 x 4: about
200 MB of parameters, 400 MB of state with SGD momentum). Prints steps/s of each mode (median of
--repeat launches) and its ratio to no checkpoints (goal for async: >= 0.95 when a write fits
between two saves), then the time from SIGTERM to the job's exit and the steps lost (goal 0).
Steps/s is the training loop's, from its first step to its last; the wait for the last
background save to complete, once at the end of a run, is printed beside it.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "examples" / "train_ddp.py")


def launch(args: list[str], nproc: int, *, signal_when: str | None = None) -> tuple[str, float]:
    """Run the loop under torchrun; SIGTERM torchrun when ``signal_when`` is printed.

    Returns the output and the seconds from that SIGTERM to torchrun's exit (0 if none sent).
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", SCRIPT, *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // nproc)))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    lines: list[str] = []
    sent: list[float] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if signal_when and not sent and signal_when in line:
                sent.append(time.monotonic())
                proc.send_signal(signal.SIGTERM)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    code = proc.wait(timeout=3600)
    exited = time.monotonic()
    reader.join(30)
    out = "".join(lines)
    if code != 0 and not sent:
        raise SystemExit(f"launch failed ({code}):\n{out[-4000:]}")
    return out, (exited - sent[0]) if sent else 0.0


def rate(out: str) -> tuple[float, float]:
    match = re.search(r"trained (\d+) steps in ([\d.]+) s .*then waited ([\d.]+) s", out)
    if not match:
        raise SystemExit(f"no throughput line in the output:\n{out[-3000:]}")
    return int(match.group(1)) / float(match.group(2)), float(match.group(3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--every", type=int, default=20, help="steps between saves")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--dataset-size", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--step-seconds", type=float, default=0.0, help="extra time per step (a slower model)")
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="ckptools-bench-train-", dir=args.dir or os.getcwd())
    common = ["--hidden", str(args.hidden), "--depth", str(args.depth), "--epochs", str(args.epochs),
              "--dataset-size", str(args.dataset_size), "--batch-size", str(args.batch_size), "--log-every", "1000000",
              "--step-seconds", str(args.step_seconds)]  # fmt: skip
    modes = {
        "no checkpoints": ["--save-every-steps", "0"],
        f"sync save every {args.every} steps": ["--save-every-steps", str(args.every)],
        f"async save every {args.every} steps": ["--save-every-steps", str(args.every), "--async-save"],
    }
    try:
        rates: dict[str, float] = {}
        tails: dict[str, float] = {}
        size = ""
        for name, extra in modes.items():
            samples = []
            for i in range(args.repeat):
                d = os.path.join(work, f"{len(rates)}-{i}")
                out, _ = launch(["--ckpt-dir", d, *common, *extra], args.nproc)
                samples.append(rate(out))
                size = size or (re.findall(r"saved \S+ \(([^ ]+ [KMG]iB)", out) or [""])[0]
                shutil.rmtree(d, ignore_errors=True)
            rates[name] = statistics.median(r for r, _ in samples)
            tails[name] = statistics.median(t for _, t in samples)
        base = rates["no checkpoints"]
        print(f"reference loop, {args.nproc} ranks, hidden {args.hidden} x depth {args.depth}, checkpoint {size}, "
              f"step padded by {args.step_seconds} s; median of {args.repeat} launch(es)")  # fmt: skip
        for name, value in rates.items():
            tail = f"(then {tails[name]:.2f} s for the last save)"
            print(f"  {name:<28} {value:8.2f} steps/s  {value / base:6.3f}x  {tail}")

        # Preemption: SIGTERM to torchrun mid-epoch; then relaunch and read where it resumed.
        d = os.path.join(work, "preempted")
        extra = ["--ckpt-dir", d, *common, "--save-every-steps", "0", "--log-every", "1"]
        out, seconds = launch(extra, args.nproc, signal_when=" step 30 ")
        stopped = re.search(r"preempted at step (\d+)", out)
        if not stopped:
            raise SystemExit(f"the loop did not report a preemption:\n{out[-3000:]}")
        again, _ = launch(extra, args.nproc, signal_when="resumed from step")
        resumed = re.search(r"resumed from step (\d+)", again)
        lost = int(stopped.group(1)) - int(resumed.group(1)) if resumed else None
        print(f"  preemption: SIGTERM to torchrun at step ~30; stopped at step {stopped.group(1)}, torchrun exited "
              f"{seconds:.2f} s after the signal; relaunch resumed from step "
              f"{resumed.group(1) if resumed else '?'}: {lost} steps lost")  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
