"""`make compat`: the test suite on both ends of the versions ckptools declares, each in a venv of its own.

    python tests/compat/run_compat.py            # both ends
    python tests/compat/run_compat.py old        # one

Each end is a venv under ``build/compat/<end>`` holding exactly the pinned releases below (torch from
the package index: its CUDA build, ~2.5 GB, which runs on the CPU as well), ckptools installed from
this checkout (editable) with its test, docs and interop extras (the docs tests build the site).
A venv is reused while the pins and ``pyproject.toml`` are unchanged (a stamp file records both).
In it run the fast suite (``-m "not slow"``) and the slow tests that depend on the frameworks'
internals most: Lightning's and the HF Trainer's killed-and-resumed fits, the reference loop
killed and resumed on 2 ranks, and a ZeRO optimizer saved on 4 ranks resumed on 2.
Prints, per end, the versions, the install time and each run's outcome; exits 1 if any run failed.
Why these ends: docs/development.md ("The versions we claim").
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The declared range's ends (pyproject.toml says the same lower bounds; the upper ones are the newest
# releases the package index here had when they were last raised).
ENDS: dict[str, list[str]] = {
    "old": ["torch==2.6.0", "pytorch-lightning==2.5.0", "transformers==5.0.0", "accelerate==1.7.0"],
    "new": ["torch==2.14.1", "pytorch-lightning==2.6.6", "transformers==5.24.0", "accelerate==1.15.0"],
}

# ckptools' extras each venv holds: the tests', S3's, the docs' (the docs tests build the site), the frameworks'.
EXTRAS = "dev,s3,docs,interop"

# The slow tests that exercise the frameworks' and torch's internals (loop counters, Trainer resume,
# torchrun and the DataLoader's iterator) end to end.
SLOW = [
    "tests/test_lightning.py",
    "tests/test_lightning_resume.py",
    "tests/test_transformers.py",
    "tests/test_transformers_snapshots.py",
    "tests/test_train_ddp_e2e.py::test_kill_9_of_the_whole_job_resumes_from_node_memory_at_most_one_step_behind",
    "tests/test_zero.py::test_saved_on_four_ranks_resumed_on_two",
    "tests/test_accelerate_attach.py",
    "tests/test_accelerate_state.py",
    "tests/test_accelerate_folders.py",
    "tests/test_user_scripts.py::test_a_ported_script_killed_at_random_steps_ends_bit_identical[accelerate_cv.py]",
]


def _run(cmd: list[str], **kw: object) -> int:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, **kw).returncode  # type: ignore[call-overload,no-any-return]


def install(end: str) -> float:
    """Make the venv of ``end`` hold exactly its pins; the seconds it took (0 when reused)."""
    venv = ROOT / "build" / "compat" / end
    python = venv / "bin" / "python"
    stamp = venv / ".installed"
    wanted = "\n".join([*ENDS[end], EXTRAS]) + "\n" + (ROOT / "pyproject.toml").read_text()
    if stamp.exists() and stamp.read_text() == wanted:
        return 0.0
    start = time.monotonic()
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    constraints = venv / "constraints.txt"
    constraints.write_text("\n".join(ENDS[end]) + "\n")
    pip = [str(python), "-m", "pip", "install", "-q"]
    # torch first, alone: everything after it is held to it by the constraints.
    if _run([*pip, "--upgrade", "pip"]) or _run([*pip, ENDS[end][0]]):
        raise SystemExit(f"compat {end}: installing {ENDS[end][0]} failed")
    if _run([*pip, "-c", str(constraints), "-e", f".[{EXTRAS}]", *ENDS[end][1:]]):
        raise SystemExit(f"compat {end}: installing ckptools with {' '.join(ENDS[end][1:])} failed")
    stamp.write_text(wanted)
    return time.monotonic() - start


def check(end: str) -> list[tuple[str, bool, float]]:
    """Run the fast suite and `SLOW` in the venv of ``end``: (what, passed, seconds) for each."""
    python = str(ROOT / "build" / "compat" / end / "bin" / "python")
    pytest = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "auto", "--dist", "load"]
    outcomes = []
    for what, args in (("fast suite", ["-m", "not slow", "--maxschedchunk", "2"]), ("slow integrations", SLOW)):
        start = time.monotonic()
        passed = _run([*pytest, *args]) == 0
        outcomes.append((what, passed, time.monotonic() - start))
    return outcomes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ends", nargs="*", help=f"which ends (default: all of {', '.join(ENDS)})")
    ends = p.parse_args().ends or list(ENDS)
    if set(ends) - set(ENDS):
        p.error(f"unknown end(s) {', '.join(sorted(set(ends) - set(ENDS)))}: choose from {', '.join(ENDS)}")
    os.environ.pop("CKPTOOLS_GOLDEN", None)  # the committed golden files
    summary, failed = [], False
    for end in ends:
        seconds = install(end)
        outcomes = check(end)
        failed |= not all(ok for _, ok, _ in outcomes)
        summary.append((end, seconds, outcomes))
    print("\ncompat summary")
    for end, seconds, outcomes in summary:
        installed = f"installed in {seconds:.0f} s" if seconds else "venv reused"
        print(f"  {end}: {' '.join(ENDS[end])} ({installed})")
        for what, ok, took in outcomes:
            print(f"    {what}: {'passed' if ok else 'FAILED'} in {took:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
