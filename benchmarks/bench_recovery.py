"""How long from kill -9 to training again: a 2-rank job killed whole, relaunched, its time split into parts.

Usage: python benchmarks/bench_recovery.py [--gib 1] [--nproc 2] [--steps 6] [--save-every 4] [--rounds 3]

The job (torchrun, gloo, one thread per process): a DDP model of ``--gib`` GiB of fp32 weights per rank
and SGD with momentum, a ``CheckpointManager`` snapshotting every step into node memory and saving to disk
every ``--save-every`` steps. After step ``--steps`` the launcher and every worker are SIGKILLed at once
(a job's processes all dying, the node staying up); the same command is run again and resumes. Each
worker writes the wall-clock time of its phases; the breakdown, the slowest rank's, median of
``--rounds``:

- launcher: from the kill (the relaunch starts at once: a scheduler's own delay is not counted) to the
  worker's first line (torchrun's start, its rendezvous, the worker's interpreter);
- import: ``import torch`` and ``import ckptools``;
- group: ``ck.init_distributed`` (the process group);
- model, DDP, optimizer: made (DDP's construction broadcasts the weights);
- CheckpointManager: made;
- restore: ``CheckpointManager.restore`` (from node memory, the newest step; ``--from-disk`` clears node
  memory first, as a job moved to new nodes finds it);
- first step: the first resumed training step (beside it, a step of the uninterrupted run, for scale).

And the floors the goal is stated in, measured in the same run: ``import torch`` + the process group of an
idle 2-rank torchrun job that does nothing else (launch to group), and the restore's floor, copying
the weights and their momentum into tensors allocated once. Goal (issue 67): kill -9 to the first resumed step at most
2 x (import + group) + 1.2 x the restore's floor.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

WORKER = r"""
import json, os, sys, time
marks = {"start": time.time()}
log = open(os.environ["BENCH_MARKS"] + f".{os.environ['RANK']}", "a")

def mark(name):
    marks[name] = time.time()

import torch
import ckptools as ck
mark("imported")
ck.init_distributed()
mark("group")
gib, steps, save_every = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
n = max(1, int(gib * 256))  # 4 MiB layers
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(n)])
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=1e-6, momentum=0.9)
mark("model")
manager = ck.CheckpointManager(os.environ["BENCH_RUN"], keep_last=2)
state = {"model": ddp, "optimizer": opt}
mark("built")
restored = manager.restore(state)
start = 0 if restored is None else int(restored["step"]) + 1
mark("restored")
x = torch.ones(1, 1024)

def step():
    opt.zero_grad(set_to_none=False)
    ddp(x).sum().backward()  # DDP all-reduces every gradient
    opt.step()

took = []
for i in range(start, steps + 1):
    t = time.perf_counter()
    step()
    took.append(time.perf_counter() - t)
    if start == 0 and i >= 2:  # the uninterrupted run's own step time (median after the first), for scale
        log.write(json.dumps({"steady_step": sorted(took[1:])[len(took[1:]) // 2], "fresh_first": took[0]}) + "\n")
        log.flush()
    if i == start and start > 0:
        mark("first_step")
        marks["resumed_from"] = start - 1
        log.write(json.dumps(marks) + "\n")
        log.flush()
    manager.snapshot({**state, "step": i}, i, blocking=True)
    if save_every and i % save_every == 0:
        manager.save({**state, "step": i}, i)
    print(f"BENCH step {i} done", flush=True)
    if start > 0:
        break  # the resumed run's first step is what is measured
manager.close()
ck.barrier()
os._exit(0)
"""

IDLE = r"""
import json, os, time
start = time.time()
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
marks = {"start": start, "group": time.time()}
with open(os.environ["BENCH_MARKS"] + f".{os.environ['RANK']}", "a") as f:
    f.write(json.dumps(marks) + "\n")
dist.barrier()
os._exit(0)
"""


def _launch(script: str, args: list[str], nproc: int, env: dict[str, str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script, *args]
    variables = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=variables,
                            start_new_session=True)  # fmt: skip


def _marks(path: str, nproc: int, key: str = "start") -> list[dict[str, float]]:
    """Each rank's last line of marks holding ``key``."""
    rows = []
    for rank in range(nproc):
        with open(f"{path}.{rank}") as f:
            rows.append([m for m in map(json.loads, f.read().splitlines()) if key in m][-1])
    return rows


def _kill_after(proc: subprocess.Popen, step: int, worker: str) -> float:
    """SIGKILL the launcher and its workers once step ``step`` is done; the time of the kill."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(f"BENCH step {step} done"):
            killed = time.time()
            os.killpg(proc.pid, signal.SIGKILL)
            for pid in _workers(worker):  # torchrun's workers sit in sessions of their own
                os.kill(pid, signal.SIGKILL)
            proc.wait()
            return killed
    raise RuntimeError(f"the job ended before step {step} (exit {proc.wait()})")


def _workers(worker: str) -> list[int]:
    """The processes running ``worker``."""
    out = subprocess.run(["pgrep", "-f", worker], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out if int(p) != os.getpid()]


def _restore_floor(gib: float) -> float:
    import torch

    n = max(1, int(gib * 1024 / 8))
    src = [torch.randn(2048, 1024) for _ in range(n)]
    dst = [torch.empty_like(s).fill_(0) for s in src]
    times = []
    for _ in range(3):
        t = time.perf_counter()
        for d, s in zip(dst, src):
            d.copy_(s)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6, help="the step after which the job is killed")
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--from-disk", action="store_true", help="clear node memory before the relaunch")
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="ckptools-bench-recovery-", dir=args.dir or os.getcwd())
    worker, idle = os.path.join(work, "worker.py"), os.path.join(work, "idle.py")
    with open(worker, "w") as f:
        f.write(WORKER)
    with open(idle, "w") as f:
        f.write(IDLE)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else work  # node memory, as a job finds it
    parts = ("launcher", "import", "group", "model, DDP, optimizer", "CheckpointManager", "restore", "first step")
    extra = ("total", "idle import + group", "steady step", "fresh first step")
    rows: dict[str, list[float]] = {p: [] for p in (*parts, *extra)}
    job_args = [str(args.gib), str(args.steps + 2), str(args.save_every)]
    try:
        for round_ in range(args.rounds):
            run, memory = os.path.join(work, f"run{round_}"), tempfile.mkdtemp(prefix="ckptools-bench-", dir=shm)
            env = {"BENCH_RUN": run, "BENCH_MARKS": os.path.join(work, f"marks{round_}"),
                   "CKPTOOLS_NODE_MEMORY": memory}  # fmt: skip
            killed = _kill_after(_launch(worker, job_args, args.nproc, env), args.steps, worker)
            if args.from_disk:
                shutil.rmtree(memory, ignore_errors=True)
                os.makedirs(memory)
            relaunch = _launch(worker, job_args, args.nproc, env)
            out, _ = relaunch.communicate(timeout=600)
            if relaunch.returncode != 0:
                raise RuntimeError(f"the relaunch failed (exit {relaunch.returncode}):\n{out[-3000:]}")
            marks = _marks(env["BENCH_MARKS"], args.nproc)
            steady = _marks(env["BENCH_MARKS"], args.nproc, "steady_step")
            rows["steady step"].append(max(m["steady_step"] for m in steady))
            rows["fresh first step"].append(max(m["fresh_first"] for m in steady))
            resumed = {int(m["resumed_from"]) for m in marks}
            slowest = max(marks, key=lambda m: m["first_step"])
            edges = [killed, slowest["start"], slowest["imported"], slowest["group"], slowest["model"],
                     slowest["built"], slowest["restored"], slowest["first_step"]]  # fmt: skip
            for name, a, b in zip(parts, edges, edges[1:]):
                rows[name].append(b - a)
            rows["total"].append(slowest["first_step"] - killed)
            # the floor: an idle job's launch to its process group
            idle_env = {"BENCH_MARKS": os.path.join(work, f"idle{round_}")}
            launched = time.time()
            proc = _launch(idle, [], args.nproc, idle_env)
            proc.communicate(timeout=300)
            rows["idle import + group"].append(
                max(m["group"] for m in _marks(idle_env["BENCH_MARKS"], args.nproc)) - launched
            )
            shutil.rmtree(memory, ignore_errors=True)
            print(f"round {round_}: resumed from step {sorted(resumed)}, total {rows['total'][-1]:.2f} s", flush=True)
        floor = _restore_floor(2 * args.gib)  # the weights and their momentum
        medians = {k: statistics.median(v) for k, v in rows.items()}
        source = "disk (node memory cleared)" if args.from_disk else "node memory"
        print(f"\n{args.nproc} ranks, {args.gib:g} GiB of weights per rank (+ momentum), restored from {source}; "
              f"medians of {args.rounds}, the slowest rank")  # fmt: skip
        for name in (*parts, "total"):
            print(f"  {name:<34}{medians[name]:>8.2f} s")
        goal = 2 * medians["idle import + group"] + 1.2 * floor
        print(f"  {'(a step of the uninterrupted run)':<34}{medians['steady step']:>8.2f} s")
        print(f"  {'(its first step, not resumed)':<34}{medians['fresh first step']:>8.2f} s")
        print(f"  {'idle job: launch to group':<34}{medians['idle import + group']:>8.2f} s")
        print(f"  {'restore floor (copy)':<34}{floor:>8.2f} s")
        print(f"  goal 2 x idle + 1.2 x floor = {goal:.2f} s: total / goal = {medians['total'] / goal:.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
