"""Every rank comes to a collective call of ckptools, or every rank that came raises (issue 44): the
literal port of `if rank == 0: torch.save(...)` never hangs silently. Real gloo ranks; the bound set
through CKPTOOLS_ARRIVAL_TIMEOUT so that the tests take seconds."""

from __future__ import annotations

import os
import time

import pytest
import torch
from _dist import run_ranks

import ckptools as ck
from ckptools.collective import arrival


def _state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "step": 1}


def _timed_save(directory: str, state: dict) -> dict:
    """``ck.save`` into ``directory``: its error (None when it saved) and how long it took."""
    started = time.monotonic()
    try:
        ck.save(os.path.join(directory, "ckpt.pt"), state)
    except ck.CheckpointError as err:
        return {"error": str(err), "seconds": time.monotonic() - started}
    return {"error": None, "seconds": time.monotonic() - started}


def _rank0_alone(rank: int, world: int, directory: str, then: str) -> dict:
    """The literal port: `if rank == 0: ck.save(...)`; the other ranks go on (``then``: "leave",
    or "barrier": into torch's own barrier, as the tutorial's next line is)."""
    state = _state()
    if rank == 0:
        return _timed_save(directory, state)
    if then == "barrier":
        try:
            torch.distributed.barrier()  # waits for rank 0, which is in ck.save: until rank 0 gives up
        except RuntimeError:
            return {"barrier": "broken when rank 0 left"}
    return {"left": True}


@pytest.mark.parametrize("then", ["leave", "barrier"])
def test_a_save_under_if_rank_0_raises_within_the_bound_naming_the_ranks_and_the_fix(tmp_path, monkeypatch, then):
    monkeypatch.setenv(arrival.ENV, "3")
    results = run_ranks(
        _rank0_alone,
        3,
        str(tmp_path),
        then,
        may_die=frozenset({1, 2}),
        timeout=60,
        fresh="ranks 1 and 2 never reach the save: they leave",
    )
    got = results[0]
    assert got["error"] is not None and 3.0 <= got["seconds"] < 6.0, got
    for said in ("ck.save is collective", "Rank(s) 0 came to it, rank(s) 1, 2 (of 3) did not within 3 s",
                 "not under `if rank == 0:`", "CKPTOOLS_ARRIVAL_TIMEOUT="):  # fmt: skip
        assert said in got["error"], got
    assert not os.listdir(tmp_path), "nothing written"


def _different_calls(rank: int, world: int, directory: str) -> dict:
    state = _state()
    started = time.monotonic()
    try:
        if rank == 0:
            ck.save(os.path.join(directory, "ckpt.pt"), state)
        else:
            ck.Preemption(signals=()).should_stop()  # the step boundary, as the loop goes on
    except ck.CheckpointError as err:
        return {"error": str(err), "seconds": time.monotonic() - started}
    return {"error": None}


def test_ranks_at_different_ckptools_calls_both_raise_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv(arrival.ENV, "30")
    results = run_ranks(_different_calls, 2, str(tmp_path), timeout=60)
    for got in results:
        assert got["seconds"] < 10, got  # at once, not after the bound
        assert "different collective calls of ckptools" in got["error"], got
        assert "rank 0 ck.save, rank 1 Preemption.should_stop" in got["error"], got


def _staggered(rank: int, world: int, directory: str, late: list[float]) -> dict:
    """Rank r comes ``late[r]`` seconds after every rank left one barrier (their processes come up at
    different moments, seconds apart under load: a wall-clock start 6 s ahead was already past when they
    were up, in a loaded `make test`, and both came at once). None: never."""
    state = _state()
    torch.distributed.barrier()
    if late[rank] is None:
        return {"came": False}
    time.sleep(late[rank])
    started = time.monotonic()
    try:
        ck.save(os.path.join(directory, "ckpt.pt"), state)
    except ck.CheckpointError as err:
        return {"error": str(err), "at": time.monotonic(), "seconds": time.monotonic() - started}
    return {"error": None, "seconds": time.monotonic() - started}


def test_a_rank_that_is_only_slower_within_the_bound_saves_normally(tmp_path, monkeypatch):
    monkeypatch.setenv(arrival.ENV, "6")
    results = run_ranks(_staggered, 2, str(tmp_path), [0.0, 2.0], timeout=60)
    assert [r["error"] for r in results] == [None, None]
    assert results[0]["seconds"] >= 1.5  # rank 0 waited for rank 1
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] == 1


def test_every_rank_that_came_raises_at_the_bound_of_the_first_arrival(tmp_path, monkeypatch):
    """Rank 0 comes at once, rank 1 two seconds later, rank 2 never: ranks 0 and 1 raise together,
    when rank 0's bound is up (rank 1 waited two seconds less)."""
    monkeypatch.setenv(arrival.ENV, "4")
    results = run_ranks(
        _staggered,
        3,
        str(tmp_path),
        [0.0, 2.0, None],
        may_die=frozenset({2}),
        timeout=60,
        fresh="rank 2 leaves without saving",
    )
    first, second = results[0], results[1]
    assert "Rank(s) 0, 1 came to it, rank(s) 2 (of 3) did not within 4 s" in first["error"], first
    assert second["error"] == first["error"]
    assert abs(first["at"] - second["at"]) < 1.0 and second["seconds"] < first["seconds"] - 1.0, results


def _dies_mid_check_in(rank: int, world: int, directory: str) -> dict:
    """Rank 1 writes its name at the check-in and dies before counting itself in (as a rank killed
    right there does): rank 0 must notice, not wait the bound out and say that every rank came."""
    state = _state()
    if rank == 1:
        real = arrival.default_store()

        class DiesAtTheCount:
            def __getattr__(self, name):
                return getattr(real, name)

            def add(self, key, amount):
                os._exit(1)

        arrival.default_store = lambda: DiesAtTheCount()
    return _timed_save(directory, state)


def test_a_rank_that_dies_in_the_middle_of_its_check_in_is_noticed_within_seconds(tmp_path, monkeypatch):
    monkeypatch.setenv(arrival.ENV, "30")
    results = run_ranks(
        _dies_mid_check_in, 2, str(tmp_path), may_die=frozenset({1}), timeout=60, fresh="rank 1 dies mid check-in"
    )
    got = results[0]
    assert "ck.save is collective, and rank(s) 1 died before every rank had come to it" in got["error"], got
    assert got["seconds"] < 10, got  # noticed, not the 30 s bound
    assert not os.listdir(tmp_path), "nothing written"


def test_the_bound_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv(arrival.ENV, raising=False)
    assert arrival.arrival_timeout() == 60.0
    monkeypatch.setenv(arrival.ENV, "0")  # the process group's timeout instead
    assert arrival.arrival_timeout() == 30 * 60
    monkeypatch.setenv(arrival.ENV, "soon")
    with pytest.raises(ValueError, match="CKPTOOLS_ARRIVAL_TIMEOUT='soon' is not a number of seconds"):
        arrival.arrival_timeout()
