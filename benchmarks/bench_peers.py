"""ckptools beside its peers on every row of issue 67, one process, measured in one run.

Usage: python benchmarks/bench_peers.py [--gib 0.25 1] [--repeat 5] [--rest 2] [--dir DIR] [--ranks 2]

Per state size (fp32 tensors of 8 MiB), each row's median over ``--repeat`` interleaved rounds (the
libraries in a rotating order each round, after one warm-up round; this disk is noisy):

- sync save: ``ck.save``, DCP's ``dcp.save``, ``torch.save`` + fsync, ``cp`` + ``sync`` of ckptools' file
  (the issue's floor; GNU cp copies in the kernel, ``copy_file_range``, and swings widely here), and the
  floor a save is held to: the file's bytes written from memory in 64 MiB pieces and fsynced;
- async stall (until the loop may change the state again) and time to durable: ``ck.async_save``,
  DCP's ``dcp.async_save`` with one reused ``DefaultStager`` (its working CPU options: no pinned or
  shared memory, no non-blocking copies); the floor is a copy into buffers allocated once;
- load into a model (``nn.Linear`` layers): ``ck.load``, ``dcp.load`` (in place), ``torch.load`` +
  ``load_state_dict``; the floor is
  reading the file (in the page cache, as the loads find it) into a buffer allocated once;
- a training step's time while each library's background persist runs, against a step with nothing in
  flight (the step: matrix products and a copy, the loop's own work on these cores);
- peak extra memory (resident, sampled every 2 ms) of each save.

``--ranks 2``: the DDP rows instead, on that many local ranks (gloo, one thread each): a DDP model of
``--gib`` per rank, each library's sync save, load into the model, async stall (the slowest rank's) and
time to durable, timed from a barrier to the last rank's end; beside ckptools, ckptools with
``replicas="off"`` (its comparison of the replicas, which DCP and torch_checkpointing do not make).
DCP writes each replicated tensor once (its planner's dedup), torch_checkpointing one file per rank.

torch_checkpointing (Meta's, torchtitan's next; ``pip install torch-checkpointing``, skipped with a line
when absent) in its working CPU configuration: ``LocalFileSystemStorageConfig(use_direct_io=False)`` (its
O_DIRECT writes fail on this ext4 with EINVAL), staging without pinned memory or non-blocking copies, one
``CheckpointManager`` per mode (sync; async with its writer process), its default layout (one
``model_0.pt`` per item and rank). Its async stall is the save call plus its staging (the state may change
once staged); it never fsyncs, so its "time to durable" is the time to its files' close. Its writer is
another process: the peak-memory row counts this process alone (and its shared-memory staging).
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

import ckptools as ck

PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class _Peak:
    """The largest resident size above the start while the block runs (a sampling thread)."""

    def __enter__(self) -> _Peak:
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def _model(gib: float, seed: int) -> torch.nn.Module:
    """Linear layers of 8 MiB weights each: ``layer<i>.weight``."""
    torch.manual_seed(seed)
    n = max(1, int(gib * 1024 / 8))
    return torch.nn.ModuleDict({f"layer{i}": torch.nn.Linear(1024, 2048, bias=False) for i in range(n)})


def _tc_version() -> str:
    try:
        from importlib.metadata import version

        return version("torch-checkpointing")
    except Exception:  # noqa: BLE001 - absent: its row says so
        return "not installed (pip install torch-checkpointing), not measured"


def _torch_checkpointing() -> dict[str, Any] | None:
    """torch_checkpointing's sync and async managers in its working CPU configuration; None when absent."""
    try:
        import torch_checkpointing as tcp
        from torch_checkpointing.staging import CheckpointStagerConfig
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
    except ImportError:
        return None
    storage = LocalFileSystemStorageConfig(use_direct_io=False)
    staging = CheckpointStagerConfig(use_pinned_memory=False, use_non_blocking_copy=False)
    config = tcp.CheckpointManager.Config
    return {
        "sync": config(save=tcp.SyncCheckpointSaverConfig(), storage_config=storage).build(),
        "async": config(save=tcp.AsyncCheckpointSaverConfig(staging_config=staging), storage_config=storage).build(),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fresh(path: str) -> None:
    """Remove a previous round's output and sync, so that no path is charged for another's write-back."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)
    os.sync()


def _step_fn() -> Callable[[], None]:
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    src, dst = torch.randn(8 << 20), torch.empty(8 << 20)  # 32 MiB copied: the loop's memory traffic

    def step() -> None:
        for _ in range(4):
            torch.mm(a, b)
        dst.copy_(src)

    return step


def _steps_while(step: Callable[[], None], busy: Callable[[], bool], limit: int = 400) -> list[float]:
    """Step times while ``busy()``; at least three steps."""
    times: list[float] = []
    while (busy() or len(times) < 3) and len(times) < limit:
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return times


def _start_async(
    who: str, path: str, ck_state: Any, state: Any, stager: Any, tc: dict[str, Any] | None, **ck_options: Any
) -> tuple[Callable[[], bool], Callable[[], Any]]:
    """Start ``who``'s async save of the model (ckptools: ``ck_state``; DCP and torch_checkpointing: the
    state dict ``state``) and return once the state may change again (staged): its ``done`` and ``finish``."""
    if who.startswith("ck"):
        handle = ck.async_save(path, ck_state, **ck_options)
        return handle.done, handle.wait
    if who == "dcp":
        response = dcp.async_save({"model": state}, checkpoint_id=path, async_stager=stager)
        staged = getattr(response, "staging_completion", None)
        if staged is not None:
            staged.result()  # the state may change once it is staged
        upload = getattr(response, "upload_completion", response)
        return upload.done, upload.result
    assert tc is not None
    written = tc["async"].save(path, {"model": state})
    tc["async"]._staging_future.result()  # staged: the state may change from here on
    return written.done, written.result


def bench(gib: float, repeat: int, rest: float, workdir: str) -> dict[str, dict[str, float]]:
    model, into = _model(gib, 0), _model(gib, 1)  # saved, and the model each load restores into
    state = model.state_dict()
    payload = {"model": state, "step": 1}
    step = _step_fn()
    count = iter(range(40))
    idle = statistics.median(_steps_while(step, lambda: next(count, None) is not None)[5:])
    options = StagingOptions(
        use_pinned_memory=False, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=False
    )
    stager = DefaultStager(options)
    floor_buffers = {k: torch.empty_like(v).fill_(0) for k, v in state.items()}
    paths = {
        "ck": os.path.join(workdir, "ck.pt"),
        "dcp": os.path.join(workdir, "dcp"),
        "torch": os.path.join(workdir, "torch.pt"),
        "copy": os.path.join(workdir, "copy.pt"),
        "write": os.path.join(workdir, "write.bin"),
    }
    rows: dict[str, dict[str, list[float]]] = {}
    tc = _torch_checkpointing()
    if tc is not None:
        paths["tc"] = os.path.join(workdir, "tc")

    def put(row: str, who: str, value: float) -> None:
        rows.setdefault(row, {}).setdefault(who, []).append(value)

    def sync_save(who: str) -> None:
        _fresh(paths[who])
        time.sleep(rest)
        with _Peak() as peak:
            t = time.perf_counter()
            if who == "ck":
                ck.save(paths["ck"], payload)
            elif who == "dcp":
                dcp.save(payload, checkpoint_id=paths["dcp"])
            elif who == "tc":
                tc["sync"].save(paths["tc"], {"model": state})
            elif who == "torch":
                with open(paths["torch"], "wb") as f:
                    torch.save(payload, f)
                    f.flush()
                    os.fsync(f.fileno())
            elif who == "copy":  # cp + sync of ckptools' file (cp copies in the kernel: copy_file_range)
                subprocess.run(["cp", paths["ck"], paths["copy"]], check=True)
                subprocess.run(["sync"], check=True)
            else:  # the floor: the file's bytes from memory, written in 64 MiB pieces, fsynced
                fd = os.open(paths["write"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    view = memoryview(load_buffer)
                    for start in range(0, len(view), 64 << 20):
                        os.write(fd, view[start : start + (64 << 20)])
                    os.fsync(fd)
                finally:
                    os.close(fd)
            put("sync save (s)", who, time.perf_counter() - t)
        if who not in ("copy", "write"):
            put("sync save: peak extra memory (MiB)", who, peak.extra / 2**20)

    def async_save(who: str) -> None:
        _fresh(paths[who])
        time.sleep(rest)
        t = time.perf_counter()
        if who == "copy":  # the floor: a copy into buffers allocated once
            for k, v in state.items():
                floor_buffers[k].copy_(v)
            put("async stall (s)", who, time.perf_counter() - t)
            return
        done, finish = _start_async(who, paths[who], payload, state, stager, tc)
        stall = time.perf_counter() - t
        steps = _steps_while(step, lambda: not done())
        finish()
        put("async stall (s)", who, stall)
        put("async: time to durable (s)", who, time.perf_counter() - t)
        put("a step during the persist / idle step", who, statistics.median(steps) / idle)

    def load(who: str) -> None:
        t = time.perf_counter()
        if who == "ck":
            ck.load(paths["ck"], {"model": into}, restore_rng=False)
        elif who == "dcp":
            dcp.load({"model": into.state_dict()}, checkpoint_id=paths["dcp"])  # in place, into its tensors
        elif who == "tc":
            tc["sync"].load(paths["tc"], {"model": into.state_dict()})  # in place, as DCP's
        elif who == "torch":
            into.load_state_dict(torch.load(paths["torch"], weights_only=True)["model"])
        else:  # the floor: the file read into one buffer allocated once
            with open(paths["ck"], "rb", buffering=0) as f:
                f.readinto(load_buffer)  # type: ignore[arg-type]
        put("load into the model (s)", who, time.perf_counter() - t)
        if who != "copy":
            assert all(torch.equal(a, b) for a, b in zip(into.parameters(), model.parameters())), who
            for p in into.parameters():
                p.data.zero_()  # the next load must write every byte again

    peers = ["ck", "dcp", *(["tc"] if tc is not None else []), "torch", "copy", "write"]
    sync_save("ck")
    load_buffer = bytearray(os.path.getsize(paths["ck"]))
    with open(paths["ck"], "rb", buffering=0) as f:
        f.readinto(load_buffer)  # type: ignore[arg-type]
    for round_ in range(repeat + 1):
        order = peers[round_ % len(peers) :] + peers[: round_ % len(peers)]
        for who in order:
            sync_save(who)
        for who in [w for w in order if w != "write"]:
            load(who)
        for who in [w for w in order if w not in ("torch", "write")]:
            async_save(who)
        if round_ == 0:
            rows.clear()  # the warm-up round: allocations, the page cache, DCP's planning
    ck.release_staging_buffers()
    if tc is not None:
        for manager in tc.values():
            manager.close()
    return {row: {who: statistics.median(v) for who, v in by.items()} for row, by in rows.items()}


def bench_ranks(rank: int, world: int, port: int, gib: float, repeat: int, rest: float, workdir: str) -> None:
    """``world`` ranks on this node (gloo), a DDP model of ``gib`` GiB on each (replicated, as DDP keeps it):
    each library's sync save, load into the model, async stall (the slowest rank's) and time to durable
    (the last rank's), interleaved rounds; rank 0 prints the medians. One process per rank, spawned."""
    os.environ.update(OMP_NUM_THREADS="1", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))  # one node
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(600))  # fmt: skip
    model, into = _model(gib, 0), _model(gib, 1)
    ddp, into_ddp = torch.nn.parallel.DistributedDataParallel(model), torch.nn.parallel.DistributedDataParallel(into)
    state = model.state_dict()
    tc = _torch_checkpointing()
    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=True,
                                          use_non_blocking_copy=False))  # fmt: skip
    # ck0: ckptools without its comparison of the replicas (replicas="off"), which neither peer makes
    who_all = ["ck", "ck0", "dcp", *(["tc"] if tc is not None else [])]
    paths = {who: os.path.join(workdir, who) for who in who_all}
    rows: dict[str, dict[str, list[float]]] = {}

    def slowest(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def timed(work: Callable[[], Any]) -> float:
        dist.barrier()
        t = time.perf_counter()
        work()
        return slowest(time.perf_counter() - t)  # from the common start to the last rank's end

    def fresh(who: str) -> None:
        if rank == 0:
            _fresh(paths[who] + (".pt" if who.startswith("ck") else ""))
        dist.barrier()
        time.sleep(rest)

    def save(who: str) -> None:
        if who.startswith("ck"):
            ck.save(paths[who] + ".pt", {"model": ddp}, replicas="off" if who == "ck0" else "auto")
        elif who == "dcp":
            dcp.save({"model": state}, checkpoint_id=paths["dcp"])
        else:
            tc["sync"].save(paths["tc"], {"model": state})  # type: ignore[index]

    def load(who: str) -> None:
        if who.startswith("ck"):
            ck.load(paths[who] + ".pt", {"model": into_ddp}, restore_rng=False)
        elif who == "dcp":
            dcp.load({"model": into.state_dict()}, checkpoint_id=paths["dcp"])
        else:
            tc["sync"].load(paths["tc"], {"model": into.state_dict()})  # type: ignore[index]

    def async_save(who: str) -> tuple[float, float]:
        t = time.perf_counter()
        path, replicas = paths[who] + (".pt" if who.startswith("ck") else ""), "off" if who == "ck0" else "auto"
        _, finish = _start_async(who, path, {"model": ddp}, state, stager, tc, replicas=replicas)
        stall = time.perf_counter() - t
        finish()
        dist.barrier()  # durable once every rank's part is
        return stall, time.perf_counter() - t

    def put(row: str, who: str, value: float) -> None:
        rows.setdefault(row, {}).setdefault(who, []).append(value)

    for round_ in range(repeat + 1):
        order = who_all[round_ % len(who_all) :] + who_all[: round_ % len(who_all)]
        for who in order:
            fresh(who)
            put("sync save (s)", who, timed(lambda who=who: save(who)))  # type: ignore[misc]
        for who in [w for w in order if w != "ck0"]:  # the same file as ck's
            put("load into the model (s)", who, timed(lambda who=who: load(who)))  # type: ignore[misc]
            assert all(torch.equal(a, b) for a, b in zip(into.parameters(), model.parameters())), who
            for p in into.parameters():
                p.data.zero_()
        for who in order:
            fresh(who)
            dist.barrier()
            stall, durable = async_save(who)
            put("async stall (s)", who, slowest(stall))
            put("async: time to durable (s)", who, slowest(durable))
        if round_ == 0:
            rows.clear()
    ck.release_staging_buffers()
    if tc is not None:
        for manager in tc.values():
            manager.close()
    if rank == 0:
        names = {"ck": "ckptools", "ck0": "ck, no cmp", "dcp": "DCP", "tc": "torch_ckpt"}
        print(f"\n{gib:g} GiB per rank, {world} ranks (DDP, gloo); medians of {repeat} rounds, the slowest rank")
        print(f"{'row':<40}" + "".join(f"{names[w]:>11}" for w in who_all) + f"{'ck/DCP':>8}{'ck/tc':>8}")
        for row, by in rows.items():
            med = {w: statistics.median(v) for w, v in by.items()}
            ratios = "".join(f"{med['ck'] / med[w]:>7.2f}x" if med.get(w) else f"{'':>8}" for w in ("dcp", "tc"))
            cells = "".join(f"{med[w]:>11.3f}" if w in med else f"{'—':>11}" for w in who_all)
            print(f"{row:<40}{cells}{ratios}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def niceness(gib: float, repeat: int, rest: float, workdir: str) -> None:
    """``ck.async_save``'s background write at the step's priority and 10 nicer (what ckptools does), in
    alternating rounds: a step's time during the persist over an idle step, and the time to durable."""
    from ckptools.write import writer_thread

    model = _model(gib, 0)
    payload = {"model": model.state_dict(), "step": 1}
    step = _step_fn()
    count = iter(range(40))
    idle = statistics.median(_steps_while(step, lambda: next(count, None) is not None)[5:])
    real = writer_thread.yield_to_the_step
    path = os.path.join(workdir, "ck.pt")
    found: dict[str, dict[str, list[float]]] = {
        "nicer": {"step": [], "durable": []},
        "same": {"step": [], "durable": []},
    }
    for round_ in range(2 * (repeat + 1)):
        how = "nicer" if round_ % 2 == 0 else "same"
        writer_thread.yield_to_the_step = real if how == "nicer" else (lambda niceness=0: None)  # type: ignore[misc]
        _fresh(path)
        time.sleep(rest)
        t = time.perf_counter()
        handle = ck.async_save(path, payload)
        steps = _steps_while(step, lambda handle=handle: not handle.done())  # type: ignore[misc]
        handle.wait()
        if round_ >= 2:  # the first of each is a warm-up
            found[how]["step"].append(statistics.median(steps) / idle)
            found[how]["durable"].append(time.perf_counter() - t)
    writer_thread.yield_to_the_step = real
    ck.release_staging_buffers()
    print(f"\n{gib:g} GiB, ck.async_save's background write: medians of {repeat} alternating rounds")
    for how, label in (("same", "at the step's priority"), ("nicer", "10 nicer (ckptools)")):
        print(f"  {label:<26} step during persist / idle {statistics.median(found[how]['step']):.2f}, "
              f"time to durable {statistics.median(found[how]['durable']):.2f} s")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, nargs="+", default=[0.25, 1.0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--rest", type=float, default=2.0, help="seconds of rest before each write")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir under cwd)")
    parser.add_argument("--niceness", action="store_true", help="only: the background write's priority, A/B")
    parser.add_argument("--ranks", type=int, default=1, help="more than 1: the DDP rows, that many ranks here")
    args = parser.parse_args()
    if args.ranks > 1:
        import torch.multiprocessing as mp

        workdir = tempfile.mkdtemp(prefix="ckptools-bench-peers-", dir=args.dir or os.getcwd())
        try:
            for gib in args.gib:
                mp.spawn(bench_ranks, args=(args.ranks, _free_port(), gib, args.repeat, args.rest, workdir),
                         nprocs=args.ranks)  # fmt: skip
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        return
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1, timeout=datetime.timedelta(600)
    )
    workdir = tempfile.mkdtemp(prefix="ckptools-bench-peers-", dir=args.dir or os.getcwd())
    names = {"ck": "ckptools", "dcp": "DCP", "tc": "torch_ckpt", "torch": "torch", "copy": "cp/copy", "write": "write"}
    if args.niceness:
        try:
            for gib in args.gib:
                niceness(gib, args.repeat, args.rest, workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            dist.destroy_process_group()
        return
    try:
        print(f"torch {torch.__version__}, ckptools {ck.__version__}, {os.cpu_count()} cores; medians of "
              f"{args.repeat} interleaved rounds after a warm-up; torch_checkpointing: {_tc_version()}")  # fmt: skip
        for gib in args.gib:
            result = bench(gib, args.repeat, args.rest, workdir)
            print(f"\n{gib:g} GiB, one process")
            print(
                f"{'row':<40}" + "".join(f"{names[w]:>11}" for w in names) + f"{'ck/DCP':>8}{'ck/tc':>8}{'ck/floor':>9}"
            )
            for row, by in result.items():
                cells = "".join(f"{by[w]:>11.3f}" if w in by else f"{'—':>11}" for w in names)
                ratios = "".join(f"{by['ck'] / by[w]:>7.2f}x" if by.get(w) else f"{'':>8}" for w in ("dcp", "tc"))
                floor = by.get("write") or by.get("copy")  # a save's floor: write + fsync; else the copy's
                print(f"{row:<40}{cells}{ratios}" + (f"{by['ck'] / floor:>8.2f}x" if floor else ""), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
