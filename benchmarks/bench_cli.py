"""`ckpt` commands against cp and the naive torch/safetensors paths, in one run.

Usage: python benchmarks/bench_cli.py [--gib 1.0] [--dir DIR]
Generates a checkpoint of 8 MiB fp32 tensors with the DDP prefix, then times each command as a
separate process (wall time, ratio to `cp` of the same file, peak RSS of that process).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

PY = sys.executable
CKPT = [PY, "-m", "ckptools"]

NAIVE_RENAME = """
import sys, torch
sd = torch.load(sys.argv[1], weights_only=True)
torch.save({k.removeprefix("module."): v for k, v in sd.items()}, sys.argv[2])
"""
NAIVE_CONVERT = """
import sys, torch, safetensors.torch
sd = torch.load(sys.argv[1], weights_only=True)
safetensors.torch.save_file({k.removeprefix("module."): v.contiguous() for k, v in sd.items()}, sys.argv[2])
"""
IMPORT_TORCH = "import torch"


def measure(cmd: list[str], repeat: int = 3, made: str | None = None) -> tuple[float, float]:
    """Best wall seconds and peak RSS (MiB) of a command over ``repeat`` runs."""
    runs = []
    for _ in range(repeat):
        runs.append(_once(cmd))
        if made:
            drop(made)
    return min(r[0] for r in runs), max(r[1] for r in runs)


def _once(cmd: list[str]) -> tuple[float, float]:
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr.read().decode() if proc.stderr else ''}")
    return wall, usage.ru_maxrss / 1024


def drop(path: str) -> None:
    if os.path.exists(path):
        os.remove(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="ckptools-cli-bench-", dir=args.dir or os.getcwd())
    src_pt, src_st = os.path.join(work, "ddp.pt"), os.path.join(work, "ddp.safetensors")
    n = max(1, int(args.gib * 1024 / 8))
    subprocess.run([PY, "-c", f"""
import torch, ckptools as ck
torch.manual_seed(0)
sd = {{f"module.layer{{i}}.weight": torch.randn(2048, 1024) for i in range({n})}}
torch.save(sd, {src_pt!r})
ck.convert_to_safetensors({src_pt!r}, {src_st!r}, strip=None)
"""], check=True)  # fmt: skip
    out = os.path.join(work, "out")
    rows = []
    try:
        # ckpt writes durably (fsync before the rename), so the fair baseline is cp + sync of the copy.
        cp_pt, _ = measure(["sh", "-c", f"cp {src_pt} {out}.pt && sync {out}.pt"], made=out + ".pt")
        cp_st, _ = measure(["sh", "-c", f"cp {src_st} {out}.safetensors && sync {out}.safetensors"],
                           made=out + ".safetensors")  # fmt: skip
        plain_cp, _ = measure(["cp", src_pt, out + ".pt"], made=out + ".pt")
        pt, st = out + ".pt", out + ".safetensors"

        def ckpt(*words: str) -> list[str]:
            return [*CKPT, *words]

        def naive(script: str, dst: str) -> list[str]:
            return [PY, "-c", script, src_pt, dst]

        # (label, command, the cp time it is compared with, output to delete afterwards)
        cases = [
            ("ckpt strip-module (.pt)", ckpt("strip-module", src_pt, "-o", pt), cp_pt, pt),
            ("naive: torch.load + rename + torch.save", naive(NAIVE_RENAME, pt), cp_pt, pt),
            ("ckpt strip-module (.safetensors)", ckpt("strip-module", src_st, "-o", st), cp_st, st),
            ("ckpt convert .pt -> .safetensors", ckpt("convert", src_pt, st), cp_pt, st),
            ("naive: torch.load + safetensors save_file", naive(NAIVE_CONVERT, st), cp_pt, st),
            ("ckpt verify (.pt)", ckpt("verify", src_pt), cp_pt, None),
            ("ckpt info (.pt)", ckpt("info", src_pt, "--json"), cp_pt, None),
            ("ckpt info (.safetensors)", ckpt("info", src_st, "--json"), cp_st, None),
            ("ckpt --help", ckpt("--help"), cp_pt, None),
            ("python -c 'import torch'", [PY, "-c", IMPORT_TORCH], cp_pt, None),
        ]
        for name, cmd, base, made in cases:
            wall, rss = measure(cmd, made=made)
            rows.append((name, wall, wall / base, rss))
        size = os.path.getsize(src_pt) / 2**30
        print(f"checkpoint: {n} x 8 MiB fp32 tensors ({size:.2f} GiB)")
        print(f"cp+sync .pt {cp_pt:.2f} s, cp+sync .safetensors {cp_st:.2f} s, cp .pt without sync {plain_cp:.2f} s")
        print("best of 3; ratios against cp+sync of the same input")
        print(f"{'command':<44}{'wall s':>8}{'x cp':>7}{'peak RSS MiB':>14}")
        for name, wall, ratio, rss in rows:
            print(f"{name:<44}{wall:>8.2f}{ratio:>7.2f}{rss:>14.0f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
