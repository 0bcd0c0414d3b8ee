"""The house's figures (issue 45): the largest modules, lines of prose per line of code, and how
often a load and a verify open the checkpoint file; the three walks of issue 55.

    python docs/tools/house_figures.py            # the package beside this folder
    python docs/tools/house_figures.py --opens    # and the opens (imports torch, writes a small file)
    python docs/tools/house_figures.py --walks [--package OTHER/ckptools]   # the walks, in that tree

A walk is what the calling thread's calls go through, traced (sys.setprofile), and again with those of
the threads it starts (threading.setprofile too): a writers="all" save
(a process group of one), a snapshot then a kill (os._exit) then a relaunch's restore, and
`ckpt verify RUN_DIR`. Its figures: the package's modules it enters, and its return trips: calls into
a module that is already on the stack below another module's frame (a callback or closure handed down
and called back: A -> B -> A).

Prose: docstring lines and lines that are only a comment; code: every other non-blank line.
"""

from __future__ import annotations

import argparse
import ast
import io
import os
import pathlib
import tempfile
import tokenize

ROOT = pathlib.Path(__file__).resolve().parents[2]


def lines(package: pathlib.Path) -> tuple[list[tuple[int, str]], int, int]:
    sizes, prose, code = [], 0, 0
    for path in sorted(package.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        rows = source.splitlines()
        sizes.append((len(rows), str(path.relative_to(package.parent))))
        docstring = set()
        for node in ast.walk(ast.parse(source)):
            body = getattr(node, "body", None)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
                first = body[0]
                value = getattr(first, "value", None)
                if isinstance(first, ast.Expr) and isinstance(value, ast.Constant) and isinstance(value.value, str):
                    docstring.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
        comment = {
            t.start[0] for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT
        }
        for number, row in enumerate(rows, 1):
            if not row.strip():
                continue
            if number in docstring or (number in comment and row.strip().startswith("#")):
                prose += 1
            else:
                code += 1
    return sorted(sizes, reverse=True), prose, code


def opens() -> dict[str, int]:
    """How often each call opens the file: os.open (how ckptools opens a file, then checks the
    descriptor: `ckptools.storage.open_local`), builtins.open, and torch.load's own."""
    import builtins

    import torch

    import ckptools as ck

    path = os.path.join(tempfile.mkdtemp(), "c.pt")
    ck.save(path, {"model": torch.nn.Linear(4, 4), "step": 3})
    counted: dict[str, int] = {}
    real_open, real_load, real_os_open = builtins.open, torch.load, os.open
    current = [""]  # the call being counted

    def counting_os_open(file, *args, **kwargs):  # type: ignore[no-untyped-def]
        if isinstance(file, (str, os.PathLike)) and os.fspath(file) == path:
            counted[current[0]] = counted.get(current[0], 0) + 1
        return real_os_open(file, *args, **kwargs)

    def counting_open(file, *args, **kwargs):  # type: ignore[no-untyped-def]
        if isinstance(file, (str, os.PathLike)) and os.fspath(file) == path:
            counted[current[0]] = counted.get(current[0], 0) + 1
        return real_open(file, *args, **kwargs)

    def counting_load(f, *args, **kwargs):  # type: ignore[no-untyped-def]
        if isinstance(f, (str, os.PathLike)) and os.fspath(f) == path:
            counted[current[0]] = counted.get(current[0], 0) + 1
            builtins.open, os.open = real_open, real_os_open  # torch's own open is torch.load's, counted once
            try:
                return real_load(f, *args, **kwargs)
            finally:
                builtins.open, os.open = counting_open, counting_os_open
        return real_load(f, *args, **kwargs)

    builtins.open, torch.load, os.open = counting_open, counting_load, counting_os_open
    try:
        for what, call in [
            ("ck.load", lambda: ck.load(path, {"model": torch.nn.Linear(4, 4)})),
            ("ck.load(verify=True)", lambda: ck.load(path, {"model": torch.nn.Linear(4, 4)}, verify=True)),
            ("ck.verify", lambda: ck.verify(path)),
        ]:
            current[0] = what
            call()
    finally:
        builtins.open, torch.load, os.open = real_open, real_load, real_os_open
    return counted


_WALKS = {
    "save": """
import torch, ckptools as ck
ck.init_distributed()
state = {"model": torch.nn.Linear(64, 64), "step": 1}
traced(lambda: ck.save(f"{where}/all.pt", state, writers="all"))
""",
    "snapshot": """
import os, torch, ckptools as ck
manager = ck.CheckpointManager(f"{where}/run", snapshot_dir=f"{where}/memory")
model = torch.nn.Linear(64, 64)
traced(lambda: manager.snapshot({"model": model, "step": 3}, 3, blocking=True))
""",
    "restore": """
import torch, ckptools as ck
manager = ck.CheckpointManager(f"{where}/run", snapshot_dir=f"{where}/memory")
traced(lambda: manager.restore({"model": torch.nn.Linear(64, 64)}))
""",
    "verify": """
import torch, ckptools as ck
from ckptools.cli import app
ck.save(f"{where}/runs/ckpt-0000000001.pt", {"model": torch.nn.Linear(8, 8), "step": 1})
ck.save(f"{where}/runs/ckpt-0000000002.pt", {"model": torch.nn.Linear(8, 8), "step": 2})
traced(lambda: app(["verify", f"{where}/runs"], standalone_mode=False))
""",
}

_TRACER = """
import json, os, sys, threading
sys.path.insert(0, {parent!r})
where = {where!r}
root = os.path.join({parent!r}, "ckptools") + os.sep

def traced(call):
    # A stack per thread: the threads the call starts (a save's watched write) are walked too.
    stacks, entered, trips, importing, visits = {{}}, [], {{}}, {{}}, {{}}
    def module(frame):
        name = frame.f_code.co_filename
        return name[len(root):] if name.startswith(root) else None
    def profile(frame, event, arg):
        me = threading.get_ident()
        stack = stacks.setdefault(me, [])
        if frame.f_code.co_name == "<module>" or importing.get(me):  # an import's module body: not the walk
            importing[me] = importing.get(me, 0) + {{"call": 1, "return": -1}}.get(event, 0)
            return
        if event == "call":
            here = module(frame)
            if here is not None and stack and stack[-1] != here and here in stack:
                below = [m for m in stack if m is not None]
                trip = below[below.index(here):] if False else [here, stack[-1], here]
                key = " -> ".join(trip)
                trips[key] = trips.get(key, 0) + 1
            if here is not None and (not stack or stack[-1] != here):
                visits[here] = visits.get(here, 0) + 1
            stack.append(here if here is not None else (stack[-1] if stack else None))
            if here is not None and here not in entered:
                entered.append(here)
        elif event == "return" and stack:
            stack.pop()
    if {threads!r}:
        threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        call()
    except SystemExit:
        pass
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    print(json.dumps({{"modules": entered, "trips": sum(trips.values()), "which": trips, "visits": visits}}))
"""


def walks(package: pathlib.Path, *, threads: bool = True) -> dict[str, dict[str, object]]:
    """Each walk run in a fresh process of its own against ``package``; the snapshot's process ends with
    os._exit (a kill: no close, no end of job) and the restore's is the relaunch. ``threads=False``: the
    calling thread's calls alone (how issue 55's and issue 66's bounds were taken)."""
    import json
    import subprocess
    import sys

    where = tempfile.mkdtemp(prefix="ckptools-walks-")
    found: dict[str, dict[str, object]] = {}
    env = {**os.environ, "PYTHONPATH": str(package.parent)}  # the keeper a snapshot starts: this tree's
    for name, body in _WALKS.items():
        code = _TRACER.format(parent=str(package.parent), where=where, threads=threads) + body
        if name == "snapshot":
            code += "\nsys.stdout.flush()\nos._exit(0)\n"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
        lines_out = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if not lines_out:
            raise SystemExit(f"the walk {name} failed:\n{done.stderr[-3000:]}")
        found[name] = json.loads(lines_out[-1])
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", default=str(ROOT / "ckptools"))
    parser.add_argument("--opens", action="store_true", help="also count the opens of a load and a verify")
    parser.add_argument("--walks", action="store_true", help="also the three walks (issue 55)")
    args = parser.parse_args()
    sizes, prose, code = lines(pathlib.Path(args.package))
    print("largest modules:", ", ".join(f"{name} {n}" for n, name in sizes[:5]))
    print(f"prose {prose} lines, code {code} lines: {prose / code:.2f} lines of prose per line of code")
    if args.opens:
        for call, n in opens().items():
            print(f"{call}: opens the file {n} times")
    if args.walks:
        for threads in (False, True):
            found = walks(pathlib.Path(args.package).resolve(), threads=threads)
            how = "with the threads it starts" if threads else "the calling thread"
            for name, walk in found.items():
                modules = walk["modules"]
                assert isinstance(modules, list)
                print(f"walk {name} ({how}): {len(modules)} modules, {walk['trips']} return trips")
            snapshot, restore = found["snapshot"]["modules"], found["restore"]["modules"]
            assert isinstance(snapshot, list) and isinstance(restore, list)
            both = len(set(snapshot) | set(restore))
            print(
                f"walk snapshot -> kill -> restore ({how}): {both} modules, "
                f"{int(str(found['snapshot']['trips'])) + int(str(found['restore']['trips']))} return trips"
            )


if __name__ == "__main__":
    main()
