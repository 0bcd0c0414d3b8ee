"""`make demo`: train on 2 CPU processes, crash one rank mid-run, let torchrun restart the job,
then train again without a crash, then preempt a third run with SIGTERM mid-epoch and relaunch
it, then kill -9 a fourth run's whole job (torchrun, both ranks, their workers) that snapshots
into node memory every step and relaunch it; check that the final weights of all four are
bit-identical, that the preempted run lost no step and the killed one at most one.

The loop's dataset augments every sample at random in ``__getitem__`` (torch, python and numpy
draws) through ``ck.SeededDataset``: run 1 fetches in 2 DataLoader workers, run 2 in the main
process, run 3 in 2 workers and, relaunched, in 1; all end with the same weights.

Usage: python examples/demo.py [--workdir runs/demo] [--fail-at-step 23]
Exit status 0 only if every run succeeds, the preempted one lost no step, the killed one at most
one, and the final weights match bit for bit.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _interesting(line: str) -> str | None:
    """The lines a newcomer should see: our log, the crash, and torchrun's reaction to it."""
    if line.startswith("[rank0 ") or "simulated crash" in line:
        return line
    if "failed (exitcode" in line or "Restarting worker group" in line or "closing signal" in line:
        return "[torchrun] " + line.split("] ", 1)[-1]
    if "death signal" in line:
        return "[torchrun] " + line.split("] ", 1)[-1]
    if line.startswith("[rank0]: RuntimeError"):  # the surviving rank notices its peer is gone
        return line[:150] + ("..." if len(line) > 150 else "")
    return None


def _job(pid: int) -> list[int]:
    """``pid`` and every process under it (torchrun starts its ranks in sessions of their own)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        try:
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as f:
                    todo.extend(int(child) for child in f.read().split())
        except OSError:
            continue
    return found


def run(
    title: str,
    ckpt_dir: Path,
    launcher: list[str],
    script: list[str],
    *,
    sigterm_at: str | None = None,
    kill_at: str | None = None,
) -> tuple[float, str, float]:
    """Launch the reference loop; with ``sigterm_at``, SIGTERM torchrun once a line contains it;
    with ``kill_at``, SIGKILL every process of the job at once (no warning, no handler runs).

    Returns the seconds it ran, its output, and the seconds from the SIGTERM to its exit.
    """
    print(f"\n=== {title} ===", flush=True)
    args = ["--standalone", "--nproc-per-node=2", *launcher, str(HERE / "train_ddp.py"), "--ckpt-dir", str(ckpt_dir)]
    args += script
    print("$ torchrun " + " ".join(args), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    output, sent = [], None
    for line in proc.stdout:
        output.append(line)
        shown = _interesting(line.rstrip())
        if shown:
            print("  " + shown, flush=True)
        if sigterm_at and sent is None and sigterm_at in line:
            print("  [demo] sending SIGTERM to torchrun (as Kubernetes or scancel would)", flush=True)
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
        if kill_at and sent is None and kill_at in line:
            print("  [demo] kill -9 of torchrun, both ranks and their DataLoader workers", flush=True)
            sent = time.monotonic()
            for pid in _job(proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    code = proc.wait()
    ended = time.monotonic()
    text = "".join(output)
    # A preempted torchrun exits non-zero (it re-raises the signal); the ranks' own exit is
    # what says the save happened.
    if code != 0 and not (sent and ("every rank leaves with exit code 143" in text or kill_at)):
        raise SystemExit(f"demo: {title} failed with exit code {code}")
    return ended - start, text, (ended - sent) if sent else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", default="runs/demo")
    parser.add_argument("--fail-at-step", default="23")
    args = parser.parse_args()
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    crashed, clean = work / "crashed_and_resumed", work / "uninterrupted"

    preempted = work / "preempted_and_relaunched"
    t1, _, _ = run(
        f"run 1: rank 1 dies after step {args.fail_at_step}; torchrun restarts the job, ckptools resumes it",
        crashed,
        ["--max-restarts=1"],
        ["--fail-at-step", args.fail_at_step, "--num-workers", "2"],
    )
    t2, _, _ = run("run 2: the same training, never interrupted, no DataLoader workers", clean, [], [])
    # Slowed to 50 ms a step (numerics unchanged) so the signal lands mid-epoch, not after the end.
    t3, out3, exit_seconds = run(
        "run 3: SIGTERM mid-epoch; every rank saves the step it reached and exits",
        preempted,
        [],
        ["--step-seconds", "0.05", "--log-every", "6", "--num-workers", "2"],
        sigterm_at=" step 18 ",
    )
    stopped = re.search(r"preempted at step (\d+)", out3)
    t4, out4, _ = run(
        "run 3, relaunched: the same command again, with 1 DataLoader worker instead of 2",
        preempted,
        [],
        ["--log-every", "6", "--num-workers", "1"],
    )
    resumed = re.search(r"resumed from step (\d+)", out4)
    if not stopped or not resumed:
        raise SystemExit("demo: run 3 did not stop and resume as it should")
    lost = int(stopped.group(1)) - int(resumed.group(1))
    killed = work / "killed_and_relaunched"
    snapshots = ["--save-every-steps", "1000", "--snapshot-every", "1", "--log-every", "1", "--num-workers", "2"]
    t5, out5, _ = run(
        "run 4: a snapshot into node memory every step, durable saves only at epoch ends; kill -9 of the whole job",
        killed,
        [],
        [*snapshots, "--step-seconds", "0.05"],
        kill_at=" step 23 loss",
    )
    t6, out6, _ = run("run 4, relaunched: the same command again", killed, [], snapshots)
    last = max(int(n) for n in re.findall(r" step (\d+) loss", out5))
    resumed4 = re.search(r"resumed from step (\d+)", out6)
    if not resumed4:
        raise SystemExit("demo: run 4 did not resume")
    lost4 = last - int(resumed4.group(1))
    # The keeper copies the snapshot into the folder only if no relaunch came within its grace time.
    source = "node memory" if "restoring from the snapshot in node memory" in out6 else "the keeper's copy of it"

    from safetensors.torch import load_file

    ok = True
    reference = load_file(str(clean / "final.safetensors"))
    print(f"\n=== result ({t1:.1f}s + {t2:.1f}s + {t3:.1f}s + {t4:.1f}s + {t5:.1f}s + {t6:.1f}s) ===")
    print(
        f"preempted at step {stopped.group(1)}, torchrun exited {exit_seconds:.2f} s after SIGTERM; "
        f"relaunch resumed from step {resumed.group(1)}: {lost} steps lost"
    )
    print(
        f"killed (kill -9, whole job) after step {last}, the last durable checkpoint at step 16; relaunch resumed "
        f"from step {resumed4.group(1)} ({source}): {lost4} steps lost"
    )
    runs = (("run 1 (crashed, restarted)", crashed), ("run 3 (preempted, relaunched)", preempted),
            ("run 4 (killed, relaunched)", killed))  # fmt: skip
    for name, run_dir in runs:
        other = load_file(str(run_dir / "final.safetensors"))
        same_keys = sorted(other) == sorted(reference)
        differing = [k for k in other if not same_keys or other[k].numpy().tobytes() != reference[k].numpy().tobytes()]
        max_delta = max(
            ((other[k].double() - reference[k].double()).abs().max().item() for k in other if k in reference),
            default=0.0,
        )
        if same_keys and not differing:
            print(f"{name}: {len(other)} tensors, max |delta| = {max_delta}: BIT-IDENTICAL to run 2")
        else:
            print(f"{name}: final weights DIFFER from run 2 in {differing}")
            ok = False
    if ok and lost == 0 and lost4 <= 1:
        print("the crash, the preemption, the kill -9 and the resumes changed nothing")
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
