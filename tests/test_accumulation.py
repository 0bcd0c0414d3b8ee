"""Saves and snapshots inside a gradient-accumulation window resume bit-identically (issue 56, item 2).

A DDP loop steps the optimizer every k batches, its first k-1 backwards under ``no_sync`` (each rank
sums its own gradients). Saved after every batch, each file resumed into fresh objects ends the run
with the weights of the run that was never interrupted, bit for bit; a save where the window is
closed holds no gradients. The same through ``CheckpointManager.snapshot`` and its restore, and with
the kills of real processes in tests/test_accumulation_kills.py (make interop).
"""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from _dist import run_ranks
from _same import tiny_net

import ckptools as ck
from ckptools.owned.gradients import GRADIENTS_KEY

pytestmark = pytest.mark.versions  # the optimizers' step hooks and DDP's gradient buckets

BATCHES = 7


def _objects(unused: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A DDP model and its optimizer. At 3 ranks and more the sum of an all-reduce depends on where each
    gradient sits in DDP's bucket, and DDP lays its buckets out again after a process's first step
    (unless ``find_unused_parameters``): a resumed process's first step sums in another order than the
    uninterrupted one's (the last bits differ, with or without ckptools: docs/guides/snapshots.md). The
    3-rank test keeps one layout with ``unused``; at 2 ranks the order cannot matter (a + b == b + a)."""
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(tiny_net(0), find_unused_parameters=unused)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def _batch(rank: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + b)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def _train(model, opt, start: int, k: int, zero_at_top: bool, after=None) -> None:  # type: ignore[no-untyped-def]
    """Batches ``start`` .. BATCHES-1, the optimizer stepped after every k-th; ``after(b)`` once each is done."""
    rank = torch.distributed.get_rank()
    for b in range(start, BATCHES):
        if zero_at_top and b % k == 0:
            opt.zero_grad(set_to_none=False)  # the window's first batch: the stale sums zeroed in place
        last = (b + 1) % k == 0
        x, y = _batch(rank, b)
        with contextlib.nullcontext() if last else model.no_sync():
            drop = torch.nn.functional.dropout(model(x), 0.1)  # the RNG counts too
            (torch.nn.functional.mse_loss(drop, y) / k).backward()
        if last:
            opt.step()
            if not zero_at_top:
                opt.zero_grad()
        if after is not None:
            after(b)


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in ck.unwrap_model(model).state_dict().items()}


def _saved_in_every_position(rank: int, world: int, folder: str, k: int, zero_at_top: bool) -> dict:
    torch.manual_seed(7 + rank)
    model, opt = _objects()
    kept: dict[int, bool] = {}

    def save(b: int) -> None:
        path = ck.save(os.path.join(folder, f"b{b}.pt"), {"model": model, "opt": opt})
        kept[b] = GRADIENTS_KEY in torch.load(path, weights_only=True, mmap=True)

    _train(model, opt, 0, k, zero_at_top, save)
    reference = _weights(model)
    differ = []
    for b in range(BATCHES - 1):
        torch.manual_seed(12345)  # whatever it is now: the restore puts the saved streams back
        model, opt = _objects()
        ck.load(os.path.join(folder, f"b{b}.pt"), {"model": model, "opt": opt}, restore_rng=True)
        _train(model, opt, b + 1, k, zero_at_top)
        if any(not torch.equal(reference[n], v) for n, v in _weights(model).items()):
            differ.append(b)
    return {"differ": differ, "kept": kept}


@pytest.mark.parametrize(("k", "zero_at_top"), [(2, False), (3, True)])
def test_a_save_after_every_batch_of_a_window_resumes_bit_identical(tmp_path, k, zero_at_top):
    results = run_ranks(_saved_in_every_position, 2, str(tmp_path), k, zero_at_top)
    for rank, result in enumerate(results):
        assert result["differ"] == [], f"rank {rank}: resumed from the saves after batches {result['differ']} differ"
        # Open windows keep each rank's sums; where the optimizer just stepped, nothing is kept.
        assert result["kept"] == {b: (b + 1) % k != 0 for b in range(BATCHES)}, result["kept"]


def _snapshot_in_every_position(rank: int, world: int, folder: str, k: int) -> list[int]:
    torch.manual_seed(7 + rank)
    model, opt = _objects(unused=True)
    _train(model, opt, 0, k, False)
    reference = _weights(model)
    manager = ck.CheckpointManager(os.path.join(folder, "run"), snapshot_dir=os.path.join(folder, "shm"))
    differ = []
    for at in range(k):  # every position in the first window, and the step that closes it
        torch.manual_seed(7 + rank)
        model, opt = _objects(unused=True)
        state = {"model": model, "opt": opt}

        def snapshot(b: int, at: int = at, state: dict = state) -> None:
            if b == at:
                manager.snapshot(state, step=b, blocking=True)
                raise StopIteration  # as a kill right after it: nothing of this process goes on

        with contextlib.suppress(StopIteration):
            _train(model, opt, 0, k, False, snapshot)
        torch.manual_seed(999)
        model, opt = _objects(unused=True)
        ckpt = manager.restore({"model": model, "opt": opt})
        _train(model, opt, ckpt["__ckptools__"]["metadata"]["step"] + 1, k, False)
        if any(not torch.equal(reference[n], v) for n, v in _weights(model).items()):
            differ.append(at)
    manager.close()
    return differ


def test_a_snapshot_in_every_position_of_a_window_restores_bit_identical_at_3_ranks(tmp_path):
    assert run_ranks(_snapshot_in_every_position, 3, str(tmp_path), 3) == [[], [], []]


def _async_and_rank0(rank: int, world: int, folder: str) -> dict:
    torch.manual_seed(7 + rank)
    model, opt = _objects()
    _train(model, opt, 0, 4, False)  # 7 batches, k=4: the second window is open after batch 6
    mine = {n: p.grad.clone() for n, p in ck.unwrap_model(model).named_parameters()}
    handle = ck.async_save(os.path.join(folder, "async.pt"), {"model": model, "opt": opt})
    for p in model.parameters():
        p.grad.mul_(3.0)  # at once, as the next backward would: the file keeps the sums as of the call
    handle.wait()
    refused = ""
    try:
        ck.save(os.path.join(folder, "rank0.pt"), {"model": model, "opt": opt}, writers="rank0")
    except ck.CheckpointError as err:
        refused = str(err)
    fresh, fresh_opt = _objects()
    ck.load(os.path.join(folder, "async.pt"), {"model": fresh, "opt": fresh_opt})
    back = {n: p.grad for n, p in ck.unwrap_model(fresh).named_parameters()}
    return {
        "same": all(torch.equal(mine[n], back[n]) for n in mine),
        "refused": refused,
        "written": os.path.exists(os.path.join(folder, "rank0.pt")),
    }


def test_an_async_save_keeps_each_ranks_sums_and_writers_rank0_refuses_inside_a_window(tmp_path):
    for rank, result in enumerate(run_ranks(_async_and_rank0, 2, str(tmp_path))):
        assert result["same"], f"rank {rank} did not get its own sums back"
        assert "gradient-accumulation window" in result["refused"] and "optimizer.step()" in result["refused"]
        assert not result["written"]


def test_one_process_keeps_its_open_window_too(tmp_path):
    torch.manual_seed(0)
    model = tiny_net(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    model(x).sum().backward()  # a window opened, not stepped
    path = ck.save(tmp_path / "one.pt", {"model": model, "opt": opt})
    fresh = tiny_net(1)
    ck.load(path, {"model": fresh})
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), fresh.parameters()))
    opt.step()
    path = ck.save(tmp_path / "stepped.pt", {"model": model, "opt": opt})
    assert GRADIENTS_KEY not in torch.load(path, weights_only=True)  # consumed by the step: not kept


def test_a_resumed_process_keeps_the_window_it_opened_before_its_first_step(tmp_path):
    """The second kill of a run: restored where a window had closed, the next window's first batch summed,
    saved before this process's first step. Its optimizer holds (restored) state and no step of this process
    consumed anything: the gradients are that window's sums, and the save keeps them."""
    import warnings

    torch.manual_seed(0)
    model = tiny_net(1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()  # a window closed
    closed = ck.save(tmp_path / "closed.pt", {"model": model, "opt": opt})
    fresh = tiny_net(2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    ck.load(closed, {"model": fresh, "opt": fresh_opt})
    fresh(x).sum().backward()  # the next window's first batch
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        path = ck.save(tmp_path / "open.pt", {"model": fresh, "opt": fresh_opt})
    kept = torch.load(path, weights_only=True)[GRADIENTS_KEY]["ckptools.per_rank"][0]["model"]
    assert all(torch.equal(kept[n], p.grad) for n, p in fresh.named_parameters()), sorted(kept)
    assert not any("no optimizer step was seen" in str(w.message) for w in said)


_LATE = """
import warnings, torch
stepped = torch.nn.Linear(3, 2); fresh = torch.nn.Linear(3, 2)
opt = torch.optim.SGD(list(stepped.parameters()) + list(fresh.parameters()), lr=0.1, momentum=0.9)
stepped(torch.ones(1, 3)).sum().backward(); opt.step()
stepped(torch.ones(1, 3)).sum().backward()  # a second window opened before ckptools watched any step
fresh(torch.ones(1, 3)).sum().backward()  # never stepped: whatever it holds, no step consumed it
import ckptools as ck  # no hook yet: importing registers nothing
from ckptools.owned.gradients import GRADIENTS_KEY
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    path = ck.save({path!r}, {{"stepped": stepped, "fresh": fresh, "opt": opt}})  # the watch starts here
kept = torch.load(path, weights_only=True)[GRADIENTS_KEY]["ckptools.per_rank"][0]
print(sorted(kept), sorted(kept["fresh"]), any("no optimizer step was seen" in str(w.message) for w in said))
"""


def test_gradients_before_ckptools_watched_a_step_are_said_and_a_never_stepped_model_keeps_its_own(tmp_path):
    import subprocess

    code = _LATE.format(path=str(tmp_path / "late.pt"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-2] == "['fresh'] ['bias', 'weight'] True", out.stdout + out.stderr[-2000:]


_HOOKS = """
import sys, tempfile, torch
from torch.optim.optimizer import _global_optimizer_post_hooks as hooks
import ckptools as ck
ck.CheckpointError, ck.PerRank  # names of the face, eager and lazy
print(len(hooks))
{call}
print(len(hooks))
"""


@pytest.mark.parametrize(
    "call",
    [
        "ck.init_distributed()",
        "ck.CheckpointManager(tempfile.mkdtemp())",
        "ck.ResumableDistributedSampler(range(8), num_replicas=1, rank=0)",
    ],
)
def test_importing_ckptools_registers_no_hook_and_the_calls_before_a_loop_do(call):
    """`import ckptools` (and names of its face) leave torch's optimizer hooks alone; the calls a loop
    makes before its first step register ckptools' one step hook, so a save inside a window knows
    what no step consumed."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", _HOOKS.format(call=call)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["0", "1"], out.stdout + out.stderr[-2000:]
