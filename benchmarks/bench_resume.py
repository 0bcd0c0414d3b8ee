"""Memory and time of resuming: ck.load (memory-mapped) against torch.load + load_state_dict.

Usage: python benchmarks/bench_resume.py [--gib 1 4] [--rounds 3] [--plot docs/img/resume.png]
Saves a model + AdamW checkpoint of about --gib GiB (the model is a third of it), then, in a fresh
process per round and method, builds the model and a fresh optimizer and restores both:
- ck.load(path, {"model": m, "optimizer": opt})
- torch.load(path, weights_only=True), then m.load_state_dict(...), opt.load_state_dict(...)
It prints the time (and the time until every optimizer tensor was read once, as the first step
reads them: a mapped file is read then, not in the load), the growth of peak RSS (VmHWM: file
pages a mapping touched count too) and the growth of peak anonymous memory (RssAnon sampled every
2 ms: what cannot be reclaimed), over the process with its model and empty optimizer. Goal: no
more than the optimizer state plus one tensor. Median of --rounds; the file is in the page cache
(the second read of a resume).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = """
import json, sys, threading, time, torch
import ckptools as ck

def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))

layers, path, method = int(sys.argv[1]), sys.argv[2], sys.argv[3]
model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(layers)])
opt = torch.optim.AdamW(model.parameters())
if method == "save":
    model(torch.zeros(1, 4096)).sum().backward()
    opt.step()
    ck.save(path, {"model": model, "optimizer": opt})
    sys.exit(0)
hwm, anon = status("VmHWM"), status("RssAnon")
peak_anon = [anon]
done = threading.Event()

def sample():
    while not done.is_set():
        peak_anon[0] = max(peak_anon[0], status("RssAnon"))
        time.sleep(0.002)

thread = threading.Thread(target=sample, daemon=True)
thread.start()
t = time.perf_counter()
if method == "ck.load":
    ck.load(path, {"model": model, "optimizer": opt}, map_location="cpu")
else:
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    del ckpt
seconds = time.perf_counter() - t
# What the first optimizer step does: read every state tensor (a mapped file is read only now).
for s in opt.state.values():
    for v in s.values():
        if torch.is_tensor(v):
            v.sum()
first_use = time.perf_counter() - t
done.set()
thread.join()
state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
grown = {"hwm": status("VmHWM") - hwm, "anon": peak_anon[0] - anon, "opt": state}
print(json.dumps({"seconds": seconds, "first_use": first_use, **grown}))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, nargs="+", default=[1.0, 4.0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--plot", help="also draw time and memory against checkpoint size into this PNG")
    args = parser.parse_args()
    measured = []
    print(f"resume into a CPU model + fresh AdamW, median of {args.rounds} (fresh process each)")
    for gib in args.gib:
        layers = max(1, round(gib * 1024 / 3 / 64))  # a Linear(4096, 4096) is 64 MiB; AdamW adds 2x
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
            path = os.path.join(tmp, "ckpt.pt")
            subprocess.run([sys.executable, "-c", CHILD, str(layers), path, "save"], check=True)
            size = os.path.getsize(path)
            rows = {}
            for method in ("torch.load", "ck.load"):
                runs = []
                for _ in range(args.rounds):
                    out = subprocess.run([sys.executable, "-c", CHILD, str(layers), path, method],
                                         capture_output=True, text=True, check=True)  # fmt: skip
                    runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
                rows[method] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        g = 2**30
        print(f"  {size / g:.2f} GiB checkpoint (optimizer state {rows['ck.load']['opt'] / g:.2f} GiB, "
              f"one tensor 0.06 GiB):")  # fmt: skip
        for method, r in rows.items():
            print(f"    {method:10s} {r['seconds']:.2f} s ({r['first_use']:.2f} s with every optimizer tensor read "
                  f"once), peak RSS +{r['hwm'] / g:.2f} GiB, peak anonymous +{r['anon'] / g:.2f} GiB")  # fmt: skip
        measured.append((size, rows))
        t, c = rows["torch.load"], rows["ck.load"]
        print(f"    ck.load / torch.load: time {c['seconds'] / t['seconds']:.2f}x (read once: "
              f"{c['first_use'] / t['first_use']:.2f}x), peak RSS growth "
              f"{c['hwm'] / t['hwm']:.2f}x, anonymous {c['anon'] / max(t['anon'], 1):.2f}x")  # fmt: skip
    if args.plot:
        plot(measured, args.rounds, args.plot)


def plot(measured: list, rounds: int, path: str) -> None:
    """Resume time and the memory it cannot give back, against checkpoint size, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = 2**30
    sizes = [size / g for size, _ in measured]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4), constrained_layout=True)
    for method, style in (("torch.load", "o-"), ("ck.load", "s-")):
        label = "torch.load + load_state_dict" if method == "torch.load" else "ck.load (memory-mapped)"
        left.plot(sizes, [rows[method]["first_use"] for _, rows in measured], style, label=label)
        right.plot(sizes, [rows[method]["anon"] / g for _, rows in measured], style, label=label)
    left.set(xlabel="checkpoint (GiB)", ylabel="seconds", title="resume time (every tensor read once)")
    right.set(xlabel="checkpoint (GiB)", ylabel="GiB", title="peak anonymous memory growth")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    left.legend()
    fig.suptitle(f"Resuming a model + AdamW checkpoint on CPU (median of {rounds}, fresh process each)", fontsize=10)
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
