"""`make demo`: train on 2 CPU processes, crash one rank mid-run, let torchrun restart the job,
then train again without a crash and check that the final weights are bit-identical.

Usage: python examples/demo.py [--workdir runs/demo] [--fail-at-step 23]
Exit status 0 only if both runs succeed and their final weights match bit for bit.
"""

from __future__ import annotations

import argparse
import os
import shutil
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
    if line.startswith("[rank0]: RuntimeError"):  # the surviving rank notices its peer is gone
        return line[:150] + ("..." if len(line) > 150 else "")
    return None


def run(title: str, ckpt_dir: Path, launcher: list[str], script: list[str]) -> float:
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
    for line in proc.stdout:
        shown = _interesting(line.rstrip())
        if shown:
            print("  " + shown, flush=True)
    code = proc.wait()
    if code != 0:
        raise SystemExit(f"demo: {title} failed with exit code {code}")
    return time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", default="runs/demo")
    parser.add_argument("--fail-at-step", default="23")
    args = parser.parse_args()
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    crashed, clean = work / "crashed_and_resumed", work / "uninterrupted"

    t1 = run(
        f"run 1: rank 1 dies after step {args.fail_at_step}; torchrun restarts the job, ckptools resumes it",
        crashed,
        ["--max-restarts=1"],
        ["--fail-at-step", args.fail_at_step],
    )
    t2 = run("run 2: the same training, never interrupted", clean, [], [])

    from safetensors.torch import load_file

    a = load_file(str(crashed / "final.safetensors"))
    b = load_file(str(clean / "final.safetensors"))
    same_keys = sorted(a) == sorted(b)
    differing = [k for k in a if not same_keys or a[k].numpy().tobytes() != b[k].numpy().tobytes()]
    max_delta = max(((a[k].double() - b[k].double()).abs().max().item() for k in a if k in b), default=0.0)
    print(f"\n=== result ({t1:.1f}s + {t2:.1f}s) ===")
    print(f"{len(a)} tensors compared, max |delta| = {max_delta}")
    if same_keys and not differing:
        print("final weights are BIT-IDENTICAL: the crash and the resume changed nothing")
        return 0
    print(f"final weights DIFFER in {differing}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
