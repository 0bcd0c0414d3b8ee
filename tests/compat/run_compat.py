"""`make compat`: the tests that depend on the versions, on both ends of the range ckptools declares,
each end in a venv of its own.

    python tests/compat/run_compat.py                  # both ends: the `versions` tests (make compat)
    python tests/compat/run_compat.py old              # one end
    python tests/compat/run_compat.py --full           # the fast suite and the slow integrations (compat-full)
    python tests/compat/run_compat.py old --pin pytorch-lightning==2.4.0   # an end with one release changed

Each end is a venv under ``build/compat/<end>`` holding exactly the pinned releases below (torch from
the package index: its CUDA build, ~2.5 GB, which runs on the CPU as well), ckptools installed from
this checkout (editable) with its test, docs and interop extras (the docs tests build the site).
A venv is reused while the pins and ``pyproject.toml`` are unchanged (a stamp file records both); an end
with a ``--pin`` gets a venv of its own beside it, the changed release installed over ckptools (whose declared
range may exclude it: a release below a floor is the point).

What runs (docs/development.md, "The versions we claim"): the fast tests marked ``versions`` (they exercise
torch's or a framework's internals that change between releases) and the whole-job tests marked
``compat`` (the scenario whose failure set each floor, one per framework and launcher). Every other test
runs once, in `make test` or `make interop`. ``--full`` runs what a release needs instead: the whole
fast suite and the frameworks' kill-and-resume tests (`FULL_SLOW`).
Prints, per end, the versions, the install time and each run's outcome; exits 1 if any run failed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
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

# What `make compat` runs at each end.
SELECTION = "(versions and not slow) or compat"

# `--full` (make compat-full, before a release): the fast suite, then the slow tests that exercise the
# frameworks' and torch's internals end to end.
FULL_SLOW = [
    "tests/test_lightning.py",
    "tests/test_lightning_resume.py",
    "tests/test_transformers.py",
    "tests/test_transformers_snapshots.py",
    "tests/test_train_ddp_e2e.py::test_kill_9_of_the_whole_job_resumes_from_node_memory_at_most_one_step_behind",
    "tests/test_zero.py::test_saved_on_four_ranks_resumed_on_two",
    "tests/test_accelerate_attach.py",
    "tests/test_accelerate_state.py",
    "tests/test_accelerate_folders.py",
    "tests/test_accelerate_snapshots.py",
    "tests/test_replicas_frameworks.py",
    "tests/test_user_scripts.py::test_a_ported_script_killed_at_random_steps_ends_bit_identical[accelerate_cv.py]",
]


def _run(cmd: list[str], **kw: object) -> int:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, **kw).returncode  # type: ignore[call-overload,no-any-return]


def pins(end: str, changed: list[str]) -> list[str]:
    """The releases of ``end``, each of ``changed`` (``name==version``) in place of its own."""
    names = {p.split("==")[0]: p for p in ENDS[end]}
    for pin in changed:
        name = pin.split("==")[0]
        if name not in names:
            raise SystemExit(f"compat: --pin {pin}: {name} is not one of {', '.join(names)}")
        names[name] = pin
    return list(names.values())


def venv_of(end: str, changed: list[str]) -> Path:
    if not changed:
        return ROOT / "build" / "compat" / end
    tag = hashlib.sha256(" ".join(sorted(changed)).encode()).hexdigest()[:8]
    return ROOT / "build" / "compat" / f"{end}-pinned-{tag}"


def _wanted(releases: list[str]) -> str:
    """What a venv's stamp records: its releases, the extras and ``pyproject.toml``."""
    return "\n".join([*releases, EXTRAS]) + "\n" + (ROOT / "pyproject.toml").read_text()


def _reused(releases: list[str], venv: Path) -> bool:
    stamp = venv / ".installed"
    return stamp.exists() and stamp.read_text() == _wanted(releases)


def install_torch(end: str, venv: Path) -> None:
    """The venv and the end's torch, alone: the part of an install that may run beside another end's
    (two pips on two cores; torch's wheel is most of the time)."""
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # Bytecode compiled at install (pip's default): where PYTHONDONTWRITEBYTECODE is set (it is here), nothing
    # else ever writes it, and every process of the tests would compile torch afresh.
    pip = [str(python), "-m", "pip", "install", "-q"]
    if _run([*pip, "--upgrade", "pip"]) or _run([*pip, ENDS[end][0]]):
        raise SystemExit(f"compat {end}: installing {ENDS[end][0]} failed")


def install_rest(end: str, releases: list[str], venv: Path) -> None:
    """ckptools (editable, with its extras) and the end's frameworks, held to its torch by the constraints;
    then each release ``releases`` changes (``--pin``), over them. One end at a time: an editable install
    writes its metadata into this checkout."""
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "install", "-q"]
    constraints = venv / "constraints.txt"
    constraints.write_text("\n".join(ENDS[end]) + "\n")
    if _run([*pip, "-c", str(constraints), "-e", f".[{EXTRAS}]", *ENDS[end][1:]]):
        raise SystemExit(f"compat {end}: installing ckptools with {' '.join(ENDS[end][1:])} failed")
    changed = [pin for pin in releases if pin not in ENDS[end]]
    if changed:
        # Installed over ckptools, whose declared range may exclude them (the point: a floor's release
        # below it); pip says so and goes on. The constraints hold every other release where it was.
        pinned = venv / "constraints-pinned.txt"
        pinned.write_text("\n".join(releases) + "\n")
        if _run([*pip, "-c", str(pinned), *changed]):
            raise SystemExit(f"compat {end}: installing {' '.join(changed)} failed")
    names = [pin.split("==")[0] for pin in releases]
    code = f"import importlib.metadata as m; print(' '.join(f'{{n}}=={{m.version(n)}}' for n in {names!r}))"
    found = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    if [pin.split("+")[0] for pin in found] != releases:  # torch says 2.6.0+cu124
        raise SystemExit(f"compat {end}: the venv holds {' '.join(found)}, not {' '.join(releases)}")
    (venv / ".installed").write_text(_wanted(releases))


def install(ends: list[tuple[str, list[str], Path]]) -> dict[str, float]:
    """Make each venv hold exactly its releases; the seconds each end's install took (0 when reused).
    The torch installs run at once, one pip per end; the rest one end after the other."""
    todo = [(end, releases, venv) for end, releases, venv in ends if not _reused(releases, venv)]
    seconds = {end: 0.0 for end, _, _ in ends}
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=max(1, len(todo))) as pool:
        for future in [pool.submit(install_torch, end, venv) for end, _, venv in todo]:
            future.result()  # an install's SystemExit, raised here
    torch_done = time.monotonic()
    for end, releases, venv in todo:
        began = time.monotonic()
        install_rest(end, releases, venv)
        seconds[end] = (torch_done - start) + (time.monotonic() - began)
    return seconds


def check(venv: Path, full: bool) -> list[tuple[str, bool, float]]:
    """Run the selection (or, ``full``, the fast suite and `FULL_SLOW`) in ``venv``: (what, passed, seconds)."""
    python = str(venv / "bin" / "python")
    pytest = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "auto", "--dist", "load"]
    runs = (
        [("fast suite", ["-m", "not slow", "--maxschedchunk", "2"]), ("slow integrations", FULL_SLOW)]
        if full
        else [("versions", ["-m", SELECTION, "--maxschedchunk", "1", "tests"])]
    )
    outcomes = []
    for what, args in runs:
        start = time.monotonic()
        passed = _run([*pytest, *args]) == 0
        outcomes.append((what, passed, time.monotonic() - start))
    return outcomes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ends", nargs="*", help=f"which ends (default: all of {', '.join(ENDS)})")
    p.add_argument("--full", action="store_true", help="the whole fast suite and the slow integrations (a release)")
    p.add_argument("--pin", action="append", default=[], metavar="NAME==VERSION",
                   help="one release of the end changed (e.g. to show the tests fail below a floor)")  # fmt: skip
    args = p.parse_args()
    ends = args.ends or list(ENDS)
    if set(ends) - set(ENDS):
        p.error(f"unknown end(s) {', '.join(sorted(set(ends) - set(ENDS)))}: choose from {', '.join(ENDS)}")
    os.environ.pop("CKPTOOLS_GOLDEN", None)  # the committed golden files
    summary, failed = [], False
    chosen = [(end, pins(end, args.pin), venv_of(end, args.pin)) for end in ends]
    began = time.monotonic()
    seconds = install(chosen)
    installs = time.monotonic() - began
    for end, releases, venv in chosen:
        outcomes = check(venv, args.full)
        failed |= not all(ok for _, ok, _ in outcomes)
        summary.append((end, releases, seconds[end], outcomes))
    print("\ncompat summary")
    if any(seconds.values()):
        print(f"  installs: {installs:.0f} s (the torch installs side by side, then the rest one end at a time)")
    for end, releases, installed_in, outcomes in summary:
        installed = f"installed in {installed_in:.0f} s" if installed_in else "venv reused"
        print(f"  {end}: {' '.join(releases)} ({installed})")
        for what, ok, took in outcomes:
            print(f"    {what}: {'passed' if ok else 'FAILED'} in {took:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
