from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch
from _dist import _exit_now, free_port

import ckptools as ck


def test_no_process_group_is_rank_0_of_1(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert (ck.get_rank(), ck.get_world_size(), ck.get_local_rank(), ck.is_main_process()) == (0, 1, 0, True)
    ck.barrier()
    assert ck.init_distributed() == torch.device("cpu")
    assert not torch.distributed.is_initialized()


def test_bad_environment_is_explained(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(ValueError, match="LOCAL_RANK='x'"):
        ck.get_local_rank()
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        ck.init_distributed()


def _attempt_worker(env: dict, queue) -> None:
    os.environ.update(env)
    try:
        device = ck.init_distributed()
        t = torch.ones(1) * (ck.get_rank() + 1)
        torch.distributed.all_reduce(t)
        queue.put((ck.get_rank(), str(device), torch.distributed.get_backend(), t.item()))
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which fails the test
        queue.put((int(env["RANK"]), "error", repr(err), 0))
    # Attempt 0 "crashes" as under torchrun --max-restarts: no teardown, its keys stay in the store.
    _exit_now(queue)


def test_init_distributed_isolates_restart_attempts():
    # torchrun's agent hosts one store for every attempt; the failed attempt's keys stay in it.
    port = free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    try:
        for attempt in ("0", "1"):
            queue = ctx.Queue()
            procs = []
            for rank in range(2):
                env = {
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": "2",
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                    "TORCHELASTIC_USE_AGENT_STORE": "True",
                    "TORCHELASTIC_RESTART_COUNT": attempt,
                }
                procs.append(ctx.Process(target=_attempt_worker, args=(env, queue)))
                procs[-1].start()
                if attempt == "1" and rank == 0:
                    # Rank 0 of the new attempt reaches the store first and finds attempt 0's
                    # keys of rank 1 there (its dead address): without isolation it connects to
                    # a process that no longer exists.
                    time.sleep(3)
            results = sorted(queue.get(timeout=60) for _ in procs)
            for p in procs:
                p.join(timeout=30)
            assert results == [(0, "cpu", "gloo", 3.0), (1, "cpu", "gloo", 3.0)], results
        # Each attempt's keys live under their own prefix in the shared store.
        assert store.num_keys() > 0
    finally:
        del store
