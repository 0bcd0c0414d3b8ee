"""`make gpu`: every CUDA test and the GPU benchmarks in one call, and one report of them.

Usage: python benchmarks/gpu_proof.py [--report-dir gpu-report] [--gib 1] [--repeat 5] [--test-seconds 330]

Without CUDA it prints one line and exits 0 (``GPU_DRY_RUN=1``: the tests that have a CPU form and the
benchmarks run on the CPU instead, to check this script and the tests before a GPU is lent; the report
says it proves nothing about CUDA). With CUDA:

1. The benchmarks, alone on the machine (a child process; nothing else runs beside them): a node-memory
   snapshot of a 1 GiB CUDA state against the pinned device-to-host floor, its commit, a restore onto the
   GPU from node memory and from disk against the host-to-device floor (bench_snapshot.py); the async
   save's stall against the same floor, a sync save and DCP's async_save (bench_async.py).
2. tests/test_gpu.py under pytest (4 workers), with a hard limit (--test-seconds).
3. The report: ``report.md`` and ``report.json`` (device, driver, torch, CUDA, each test's outcome and
   time, each figure with its floor and the ratio), beside the logs (``pytest.log``, ``junit.xml``,
   ``bench.log``), in ``--report-dir`` (``$GPU_REPORT_DIR``; default gpu-report/, git-ignored).

Exits 1 when a test failed or a benchmark did not run, 0 otherwise. Everything is bounded so that the
whole run stays under 8 minutes of wall time on one GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# How two ranks share one GPU where only one is lent: the decision the report states.
SHARING = (
    "Where the machine has fewer GPUs than a test has ranks, the ranks share them (rank r on cuda:r % GPUs) over "
    "gloo: nccl refuses two ranks on one device, and gloo moves CUDA tensors through host memory. "
    "ck.init_distributed makes the same choice, with a warning, when a node runs more ranks than it has GPUs."
)


def _device_facts(torch: Any) -> dict[str, Any]:
    facts: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }
    try:
        import ckptools

        facts["ckptools"] = ckptools.__version__
    except ImportError as err:
        facts["ckptools"] = f"not importable: {err}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        memory = round(props.total_memory / 2**30, 1)
        facts.update(gpu=props.name, gpu_memory_gib=memory, capability=f"{props.major}.{props.minor}")
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            facts["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
            facts["driver"] = smi.stdout.split(",")[1].strip() if smi.returncode == 0 else "unknown"
        except (OSError, subprocess.TimeoutExpired, IndexError) as err:
            facts["driver"] = f"nvidia-smi failed: {err}"
    return facts


# --- the benchmarks (run in a child process: `--figures-only`) -------------------------------------


def _figures(gib: float, repeat: int, out: str) -> None:
    """Measure and write the figures as JSON to ``out``; one process, no other load on the GPU."""
    import datetime as dt
    import shutil
    import socket
    import tempfile

    import torch
    import torch.distributed as dist

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_async
    import bench_snapshot

    device = "cuda" if torch.cuda.is_available() else "cpu"
    os.environ.setdefault("CKPTOOLS_KEEPER_GRACE", "1")
    notes: list[str] = []
    shm = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
    if shm < 3 * gib * 2**30:  # two slots and a restore's reads: a container's small /dev/shm cannot
        os.environ["CKPTOOLS_BENCH_MEMORY_DIR"] = tempfile.mkdtemp(prefix="ckptools-gpu-proof-memory-", dir=ROOT)
        notes.append(f"/dev/shm has {shm / 2**30:.1f} GiB free: the snapshots went to a disk folder (page cache)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # DCP's async_save wants a process group; one of one rank (ckptools needs none).
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=dt.timedelta(seconds=600))  # fmt: skip
    workdir = tempfile.mkdtemp(prefix="ckptools-gpu-proof-", dir=ROOT)  # the disk a run folder would be on
    figures: list[dict[str, Any]] = []
    errors: list[str] = []

    def add(name: str, seconds: float, floor_name: str | None = None, floor: float | None = None, goal: str = ""):
        row = {"name": name, "seconds": round(seconds, 5), "floor": floor_name,
               "floor_seconds": None if floor is None else round(floor, 5),
               "ratio": None if not floor else round(seconds / floor, 3), "goal": goal}  # fmt: skip
        figures.append(row)
        print(json.dumps(row), flush=True)

    try:
        m = bench_snapshot.bench(gib, repeat, workdir, device)
        d2h = "pinned device-to-host copy" if device == "cuda" else "copy into host buffers"
        h2d = "host-to-device copy from pinned memory" if device == "cuda" else "copy into host buffers"
        add(f"manager.snapshot stall, {gib:g} GiB", m["snapshot"], d2h, m["floor"], "<= 1.1x the floor")
        add("  its commit in the background (CRC-32s, headers, rename)", m["commit"])
        add("manager.snapshot(blocking=True)", m["blocking"], d2h, m["floor"])
        add("manager.save (sync, to disk)", m["save"], d2h, m["floor"])
        add("restore from node memory onto the device (the mapping registered with CUDA)", m["restore_mem"], h2d,
            m["restore_floor"], "<= 1.5x the floor (issue 56; 10.3x pageable before)")  # fmt: skip
        add("restore from disk (page cache) onto the device", m["restore_warm"], h2d, m["restore_floor"])
        add("restore from disk (evicted) onto the device", m["restore_cold"], h2d, m["restore_floor"])
    except Exception as err:  # noqa: BLE001 - reported; the other benchmark still runs
        errors.append(f"bench_snapshot: {type(err).__name__}: {err}")
    try:
        a = bench_async.bench(gib, max(3, repeat - 2), workdir, device)
        add(f"ck.async_save stall, {gib:g} GiB", a["ck_stall"], d2h, a["floor"])
        add("  ck.async_save until the file is complete", a["ck_done"])
        add("ck.save (sync)", a["sync"], d2h, a["floor"])
        add("DCP async_save stall (baseline)", a["dcp_stall"], d2h, a["floor"])
        add("  DCP async_save until the checkpoint is complete", a["dcp_done"])
        add("ck.async_save stall / DCP async_save stall", a["ck_stall"], "DCP async_save stall", a["dcp_stall"],
            "<= 0.5")  # fmt: skip
        add("ck.async_save stall / sync ck.save", a["ck_stall"], "ck.save (sync)", a["sync"], "<= 0.1")
    except Exception as err:  # noqa: BLE001
        errors.append(f"bench_async: {type(err).__name__}: {err}")
    try:  # issue 58: DDP's replicas compared, the digest computed where the tensors are
        import bench_replicas

        r = bench_replicas._measure(bench_replicas._state(int(gib * 2**30) // 4, device), max(3, repeat))
        add(f"replicas compared, one sampled call (1/{bench_replicas.SAMPLE_CALLS} of the bytes), {gib:g} GiB",
            r["sampled"], d2h, r["floor"], "<= 0.02x the floor (issue 58)")  # fmt: skip
        add("replicas compared, every byte (replicas='all')", r["whole"], d2h, r["floor"])
    except Exception as err:  # noqa: BLE001
        errors.append(f"bench_replicas: {type(err).__name__}: {err}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if os.environ.get("CKPTOOLS_BENCH_MEMORY_DIR"):
            shutil.rmtree(os.environ["CKPTOOLS_BENCH_MEMORY_DIR"], ignore_errors=True)
    with open(out, "w") as f:
        json.dump({"device": device, "gib": gib, "repeat": repeat, "figures": figures, "errors": errors,
                   "notes": notes}, f, indent=1)  # fmt: skip
    dist.destroy_process_group()


# --- the tests --------------------------------------------------------------------------------------


def _tests(report_dir: str, seconds: float, env: dict[str, str]) -> tuple[list[dict[str, Any]], str]:
    junit = os.path.join(report_dir, "junit.xml")
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n", "4", "-rA", "--timeout", "300",
           f"--junitxml={junit}", "tests/test_gpu.py"]  # fmt: skip
    started = time.monotonic()
    with open(os.path.join(report_dir, "pytest.log"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=seconds)
            note = f"pytest exited {proc.returncode} after {time.monotonic() - started:.0f} s"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            note = f"pytest killed at the {seconds:.0f} s limit"
    return _read_junit(junit), note


def _read_junit(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                text = (found.get("message") or found.text or "").strip()
                message = text.splitlines()[0][:300] if text else ""
                break
        rows.append({"test": case.get("name"), "outcome": outcome, "seconds": round(float(case.get("time", 0)), 1),
                     "message": message})  # fmt: skip
    return rows


# --- the report -------------------------------------------------------------------------------------


def _markdown(report: dict[str, Any]) -> str:
    facts = report["device"]
    lines = [f"# GPU proof, {report['date']}", ""]
    if report["dry_run"]:
        lines += ["**Dry run on the CPU** (GPU_DRY_RUN=1): checks this script and the tests' logic; proves nothing "
                  "about CUDA.", ""]  # fmt: skip
    lines += [
        f"- device: {facts.get('gpu', 'no GPU')} ({facts.get('gpu_memory_gib', '-')} GiB, capability "
        f"{facts.get('capability', '-')}), {facts['gpus']} GPU(s), driver {facts.get('driver', '-')}, "
        f"{facts['cpus']} CPUs",
        f"- torch {facts['torch']} (CUDA {facts['cuda_build']}), Python {facts['python']}, "
        f"ckptools {facts['ckptools']}",
        f"- wall time: {report['seconds']:.0f} s; tests: {report['tests_note']}",
        f"- two ranks on one GPU: {SHARING}",
        "",
        "## Tests",
        "",
        "| test | outcome | s | message |",
        "|---|---|---|---|",
    ]
    for t in report["tests"]:
        lines.append(f"| {t['test']} | {t['outcome']} | {t['seconds']} | {t['message'].replace('|', '/')} |")
    if not report["tests"]:
        lines.append("| (no results: see pytest.log) | | | |")
    fig = report["figures"]
    lines += ["", f"## Figures ({fig.get('device', '-')}, {fig.get('gib', '-')} GiB of fp32 tensors in 8 MiB "
              f"matrices, medians of {fig.get('repeat', '-')} interleaved rounds after warm-up)", "",
              "| what | seconds | floor | floor s | ratio | goal |", "|---|---|---|---|---|---|"]  # fmt: skip
    for f in fig.get("figures", []):
        floor = "" if f["floor_seconds"] is None else f"{f['floor_seconds']:.4f}"
        ratio = "" if f["ratio"] is None else f"{f['ratio']}x"
        lines.append(f"| {f['name']} | {f['seconds']:.4f} | {f['floor'] or ''} | {floor} | {ratio} | {f['goal']} |")
    for n in fig.get("notes", []):
        lines.append(f"\nNote: {n}")
    for e in fig.get("errors", []):
        lines.append(f"\n**benchmark failed**: {e}")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--report-dir", default=os.environ.get("GPU_REPORT_DIR") or "gpu-report")
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--test-seconds", type=float, default=330, help="hard limit on the tests' pytest run")
    p.add_argument("--figures-only", metavar="JSON", help=argparse.SUPPRESS)  # the child that measures
    args = p.parse_args()
    try:
        import torch
    except ImportError:
        print(f"make gpu: no GPU found ({sys.executable} has no torch; nothing run)")
        return 0
    if args.figures_only:
        _figures(args.gib, args.repeat, args.figures_only)
        return 0
    dry = os.environ.get("GPU_DRY_RUN") == "1"
    if not torch.cuda.is_available() and not dry:
        print(f"make gpu: no GPU found (torch {torch.__version__}, CUDA build {torch.version.cuda}); nothing run")
        return 0

    started = time.monotonic()
    report_dir = os.path.abspath(args.report_dir)
    os.makedirs(report_dir, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
        [ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]))  # fmt: skip
    if dry:
        env["CKPTOOLS_GPU_DRY_RUN"] = "1"
    facts = _device_facts(torch)
    print(f"make gpu: {facts.get('gpu', 'dry run on the CPU')}, torch {facts['torch']}; report in {report_dir}",
          flush=True)  # fmt: skip

    figures_json = os.path.join(report_dir, "figures.json")
    with open(os.path.join(report_dir, "bench.log"), "w") as log:
        cmd = [sys.executable, os.path.abspath(__file__), "--figures-only", figures_json, "--gib", str(args.gib),
               "--repeat", str(args.repeat)]  # fmt: skip
        try:
            subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=200)
        except subprocess.TimeoutExpired:
            print("make gpu: the benchmarks ran past 200 s and were stopped", file=log)
    try:
        with open(figures_json) as f:
            figures = json.load(f)
    except (OSError, ValueError):
        figures = {"figures": [], "errors": ["the benchmarks wrote no figures: see bench.log"]}
    print(f"make gpu: benchmarks done after {time.monotonic() - started:.0f} s", flush=True)

    tests, note = _tests(report_dir, args.test_seconds, env)
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "dry_run": dry and not torch.cuda.is_available(),
        "device": facts,
        "sharing": SHARING,
        "tests": tests,
        "tests_note": note,
        "figures": figures,
        "seconds": time.monotonic() - started,
    }
    with open(os.path.join(report_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    markdown = _markdown(report)
    with open(os.path.join(report_dir, "report.md"), "w") as f:
        f.write(markdown)
    print(markdown)
    bad = [t for t in tests if t["outcome"] in ("failed", "error")]
    return 1 if bad or not tests or figures.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
