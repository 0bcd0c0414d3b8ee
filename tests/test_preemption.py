"""ck.Preemption: every rank agrees at the same step, DataLoader workers survive, exit code, watchdog."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from _dist import run_ranks

import ckptools as ck

pytestmark = pytest.mark.versions  # signals in torch's DataLoader workers


def _stop_step(rank: int, world: int, signalled: list[int], at: int, check_every: int, signum: int) -> dict:
    preemption = ck.Preemption(check_every=check_every)
    try:
        for step in range(1, 50):
            if step == at and rank in signalled:
                os.kill(os.getpid(), signum)
                time.sleep(0.05 * rank)  # the signal lands on the ranks at different moments
            if preemption.should_stop():
                return {"step": step, "signal": preemption.stop_signal, "code": preemption.exit_code,
                        "received": preemption.received}  # fmt: skip
        return {"step": None}
    finally:
        preemption.close()


@pytest.mark.parametrize(
    ("signalled", "check_every", "signum", "expect_step"),
    [([1], 1, signal.SIGTERM, 5), ([0, 1, 2], 1, signal.SIGUSR1, 5), ([2], 3, signal.SIGTERM, 6)],
)
def test_every_rank_stops_at_the_same_step(signalled, check_every, signum, expect_step):
    results = run_ranks(_stop_step, 3, signalled, 5, check_every, signum)
    for rank, out in enumerate(results):
        assert out["step"] == expect_step, results
        assert out["signal"] == signum and out["code"] == 128 + signum
        assert out["received"] == (signum if rank in signalled else None)


def test_no_signal_never_stops_and_close_restores_the_handler():
    previous = signal.getsignal(signal.SIGTERM)
    preemption = ck.Preemption(check_every=2)
    assert signal.getsignal(signal.SIGTERM) != previous
    assert not any(preemption.should_stop() for _ in range(10))
    preemption.close()
    assert signal.getsignal(signal.SIGTERM) == previous
    with pytest.raises(ValueError, match="check_every"):
        ck.Preemption(check_every=0)


def test_a_closed_watchdog_never_reads_a_reused_descriptor(monkeypatch):
    # CI once hung here: a Preemption closed before its watchdog thread reached os.read left that
    # thread reading a descriptor number the next test's subprocess pipe then got, and the thread
    # swallowed the child's output. The watchdog's first read is held back to recreate that.
    import ckptools.training.preemption as module

    real_read = os.read
    held = threading.Event()

    def late_read(fd: int, n: int) -> bytes:
        if threading.current_thread().name == "ckptools-preemption" and not held.is_set():
            held.set()
            time.sleep(0.3)
        return real_read(fd, n)

    monkeypatch.setattr(module.os, "read", late_read)
    preemption = ck.Preemption()
    preemption.close()
    read_fd, write_fd = os.pipe()
    try:
        os.write(write_fd, b"ready\n")
        assert preemption._thread is not None
        preemption._thread.join(5)
        assert not preemption._thread.is_alive()
        os.set_blocking(read_fd, False)
        assert real_read(read_fd, 64) == b"ready\n"
    finally:
        os.close(read_fd)
        os.close(write_fd)


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def test_a_forked_child_does_not_keep_the_watchdog_alive():
    # DataLoader workers are forked while the Preemption is open; their copies of the pipe must
    # not keep the parent's watchdog waiting after close().
    import multiprocessing

    preemption = ck.Preemption()
    child = multiprocessing.get_context("fork").Process(target=_sleep, args=(20,))
    child.start()
    try:
        preemption.close()
        assert preemption._thread is not None
        preemption._thread.join(5)
        assert not preemption._thread.is_alive()
    finally:
        child.kill()
        child.join()


_LOADER_SCRIPT = """
import os, signal, sys, time, torch, ckptools as ck
from torch.utils.data import DataLoader, Dataset

class Slow(Dataset):
    def __len__(self): return 400
    def __getitem__(self, i):
        time.sleep(0.01)
        return torch.tensor([i])

def init(worker_id):  # the loader's own worker_init_fn still runs (a file: workers share stdout)
    open(os.path.join(sys.argv[2], f"init{worker_id}"), "w").close()

def main():
    # The stop comes up to 20 batches after the signal (as after a long step or a slow save): more
    # than the workers prefetched, so the loop needs live workers to get there.
    preemption = ck.Preemption(grace_seconds=60, check_every=20)
    loader = DataLoader(Slow(), batch_size=4, num_workers=2, worker_init_fn=init)
    if sys.argv[1] == "protect":
        loader = preemption.protect(loader)
    seen = 0
    for batch in loader:
        seen += 1
        if seen == 5:
            print("ready", flush=True)  # the test now signals the whole process group
            while not preemption.requested():  # however late the signal comes, it lands mid-epoch
                time.sleep(0.01)
        if preemption.should_stop():
            print("stopping after", seen, "batches", flush=True)
            preemption.exit()
    print("finished", flush=True)


if __name__ == "__main__":
    main()
"""


@pytest.mark.parametrize("mode", ["protect", "unprotected"])
def test_dataloader_workers_survive_a_signal_to_the_process_group(tmp_path, mode):
    script = tmp_path / "loop.py"
    script.write_text(_LOADER_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), mode, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: the one signalled below
    )
    assert proc.stdout is not None
    before = ""
    for line in proc.stdout:
        before += line
        if line.startswith("ready"):
            break
    os.killpg(proc.pid, signal.SIGTERM)  # the trainer and its DataLoader workers at once
    out, err = proc.communicate(timeout=60)
    out = before + out
    if mode == "protect":
        assert proc.returncode == 143, err
        assert "stopping after" in out
        assert (tmp_path / "init0").exists() and (tmp_path / "init1").exists()
    else:  # what protect() prevents: the workers die and take the loop down before any save
        assert proc.returncode not in (0, 143)
        # torch says so ("DataLoader worker (pid X) is killed by signal"), or, when a worker died in the
        # middle of sending a batch, the loop's read of that worker's pipe fails (EOFError; torch 2.6 under load).
        died = ("DataLoader worker", "EOFError", "ConnectionResetError")
        assert any(s in err for s in died) and "stopping after" not in out, err


_STUCK_SCRIPT = """
import os, signal, time, logging, ckptools as ck
logging.basicConfig(level=logging.INFO)
preemption = ck.Preemption(grace_seconds=1.0)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(3)  # no step boundary comes: a rank stuck in a collective looks like this
print("received", preemption.received, flush=True)
"""


def test_watchdog_says_when_no_step_boundary_comes():
    out = subprocess.run([sys.executable, "-c", _STUCK_SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "rank 0 received SIGTERM: stopping at the next step boundary" in out.stderr
    assert "1 s after SIGTERM no step boundary was reached" in out.stderr
    assert "time.sleep(3)" in out.stderr or 'File "<string>", line 6' in out.stderr  # the main thread's stack
    assert f"received {int(signal.SIGTERM)}" in out.stdout


def _rank_dies_with_workers(rank: int, world: int, root: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    preemption = ck.Preemption()
    if rank == 1:
        started = _WorkerStarted(root)
        loader = DataLoader(torch.arange(64.0), batch_size=4, num_workers=2, worker_init_fn=started)
        batches = iter(preemption.protect(loader))
        next(batches)  # workers forked after init_process_group: they hold copies of this rank's sockets
        with open(os.path.join(root, "workers"), "w") as f:
            f.write(" ".join(str(w.pid) for w in batches._workers))
        deadline = time.monotonic() + 60
        while not all(os.path.exists(os.path.join(root, f"init{i}")) for i in range(2)):  # both past protect's init
            assert time.monotonic() < deadline, "the workers never started"
            time.sleep(0.01)
        dist.barrier()
        os._exit(17)  # a crash: no cleanup, the workers are left behind
    dist.barrier()
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
    except RuntimeError:
        return {"raised_after": time.monotonic() - start}
    return {"raised_after": None}


class _WorkerStarted:
    """A worker_init_fn (picklable) that says the worker ran its init functions."""

    def __init__(self, root: str) -> None:
        self.root = root

    def __call__(self, worker_id: int) -> None:
        open(os.path.join(self.root, f"init{worker_id}"), "w").close()


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] in ("Z", "X")  # a zombie holds no sockets
    except FileNotFoundError:
        return True


def test_a_dead_ranks_protected_workers_die_with_it_and_the_others_find_out_at_once(tmp_path):
    # Orphaned workers lingered until torch's watchdog noticed (it polls every 5 s), keeping what
    # they inherited from the rank open: in the reference loop (torchrun, 2 workers, a rank
    # crashing before a save) the survivor learned of the death ~5 s late (issue 22).
    results = run_ranks(
        _rank_dies_with_workers,
        2,
        str(tmp_path),
        may_die=frozenset({1}),
        timeout=60,
        fresh="rank 1 crashes with its workers",
    )
    assert results[0]["raised_after"] is not None and results[0]["raised_after"] < 2.0, results
    pids = [int(p) for p in (tmp_path / "workers").read_text().split()]
    assert len(pids) == 2
    # Killed with their rank: gone within a second (orphans would wait for torch's 5 s poll).
    deadline = time.monotonic() + 1.0
    while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(_gone(pid) for pid in pids), [pid for pid in pids if not _gone(pid)]


def test_protect_refuses_forkserver_workers_it_cannot_keep_alive(monkeypatch):
    import multiprocessing

    from torch.utils.data import DataLoader

    with ck.Preemption() as preemption:
        loader = DataLoader(range(8), num_workers=2, multiprocessing_context="forkserver")
        with pytest.raises(ValueError, match="forkserver.*'spawn' or 'fork'"):
            preemption.protect(loader)
        # The same when the program made forkserver its default start method.
        monkeypatch.setattr(multiprocessing, "get_start_method", lambda allow_none=False: "forkserver")
        with pytest.raises(ValueError, match="forkserver"):
            preemption.protect(DataLoader(range(8), num_workers=2))
        assert preemption.protect(DataLoader(range(8))) is not None  # no workers: nothing to start
