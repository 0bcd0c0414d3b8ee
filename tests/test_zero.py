"""ZeroRedundancyOptimizer (issue 36): saved with no consolidation, every rank writing its own
partition into the one torch file; resumed at the same or another world size."""

from __future__ import annotations

import os

import pytest
import torch
from _dist import run_ranks
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import ckptools as ck

# Sizes that partition unevenly (the largest first, greedily): ranks own different counts.
SHAPES = ((96, 64), (96,), (64, 96), (64,), (32, 64), (32,), (8, 32), (8,))


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 96)
        self.b = torch.nn.Linear(96, 64)
        self.c = torch.nn.Linear(64, 32)
        self.d = torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(torch.relu(self.c(torch.relu(self.b(torch.relu(self.a(x)))))))


def _train(rank: int, steps: int, seed: int = 0):
    torch.manual_seed(seed)
    model = DistributedDataParallel(_Net())
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        _step(model, zero, rank, step)
    return model, zero


def _step(model, zero, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)
    zero.zero_grad()
    model(torch.randn(16, 64, generator=g)).square().mean().backward()
    zero.step()


def _forbid_consolidation(zero) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("consolidate_state_dict was called")

    zero.consolidate_state_dict = refuse


def _save_then_consolidate(rank: int, world: int, directory: str, how: str) -> dict:
    """Save with ckptools (consolidation forbidden), then torch's own consolidation, for comparison."""
    model, zero = _train(rank, 3)
    real = zero.consolidate_state_dict
    _forbid_consolidation(zero)
    path = os.path.join(directory, "zero.pt")
    if how == "async":
        ck.async_save(path, {"model": model, "optimizer": zero, "step": 3}).wait()
    elif how == "manager":
        ck.CheckpointManager(os.path.join(directory, "run")).save({"model": model, "optimizer": zero}, 3)
        path = os.path.join(directory, "run", "ckpt-0000000003.pt")
    else:
        ck.save(path, {"model": model, "optimizer": zero, "step": 3})
    real(to=0)
    reference = zero.state_dict() if rank == 0 else None
    if rank == 0:
        torch.save(reference, os.path.join(directory, "torch.pt"))
    return {"path": path}


@pytest.mark.parametrize("how", ["save", "async", "manager"])
def test_saved_without_consolidation_equals_torchs_consolidated_state(tmp_path, how):
    results = run_ranks(_save_then_consolidate, 2, str(tmp_path), how)
    ours = torch.load(results[0]["path"], weights_only=True)["optimizer"]
    theirs = torch.load(tmp_path / "torch.pt", weights_only=True)
    assert ours["param_groups"] == theirs["param_groups"]
    assert list(ours["state"]) == list(theirs["state"]) == list(range(len(SHAPES)))
    for index, values in theirs["state"].items():
        assert ours["state"][index].keys() == values.keys()
        for key, value in values.items():
            got = ours["state"][index][key]
            assert got.dtype == value.dtype and got.shape == value.shape and got.device.type == "cpu"
            assert got.numpy().tobytes() == value.numpy().tobytes(), (index, key)
    # A plain AdamW takes it as its own (ZeRO -> AdamW).
    net = _Net()
    plain = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    plain.load_state_dict(ours)


def _resume(rank: int, world: int, directory: str, steps_after: int) -> dict:
    """Restore the file (saved by 2 ranks after 3 steps) into ZeRO on ``world`` ranks, train on."""
    torch.manual_seed(0)
    model = DistributedDataParallel(_Net())
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    ck.load(os.path.join(directory, "zero.pt"), {"model": model, "optimizer": zero})
    # Every tensor of this rank's new partition equals what was saved.
    saved = torch.load(os.path.join(directory, "zero.pt"), weights_only=True)["optimizer"]["state"]
    own = 0
    for param, values in zero.optim.state.items():
        index = zero._param_to_index[param]
        for key, value in values.items():
            assert torch.equal(value, saved[index][key]), (index, key)
            own += 1
    for step in range(3, 3 + steps_after):
        _step(model, zero, rank, step)
    return {"own": own, "weights": {k: v.clone() for k, v in model.module.state_dict().items()}}


def _straight(rank: int, world: int, steps: int) -> dict:
    model, _ = _train(rank, steps)
    return {k: v.clone() for k, v in model.module.state_dict().items()}


def test_resumed_at_the_same_world_size_bit_exact_and_on_one_or_three_ranks(tmp_path):
    run_ranks(_save_then_consolidate, 2, str(tmp_path), "save")
    resumed = run_ranks(_resume, 2, str(tmp_path), 2)
    straight = run_ranks(_straight, 2, 5)
    for key, value in straight[0].items():
        assert value.numpy().tobytes() == resumed[0]["weights"][key].numpy().tobytes(), key
    for world in (1, 3):
        results = run_ranks(_resume, world, str(tmp_path), 1)
        # Each rank holds its new partition only; together every parameter's state, once.
        assert sum(r["own"] for r in results) == 3 * len(SHAPES)  # AdamW: step, exp_avg, exp_avg_sq


def _refusals(rank: int, world: int, directory: str) -> list[str]:
    """Every way the partitions cannot be written by their owners is refused on every rank,
    before anything is written."""
    model, zero = _train(rank, 1)
    said = []
    with pytest.raises(ck.CheckpointError) as err:
        ck.save(os.path.join(directory, "rank0.pt"), {"model": model, "optimizer": zero}, writers="rank0")
    said.append(str(err.value))
    torch.manual_seed(0)
    overlapped = DistributedDataParallel(_Net())
    overlap = ZeroRedundancyOptimizer(
        overlapped.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2, overlap_with_ddp=True
    )
    with pytest.raises(ck.CheckpointError) as err:
        ck.save(os.path.join(directory, "overlap.pt"), {"model": overlapped, "optimizer": overlap})
    said.append(str(err.value))
    return said


def test_what_cannot_be_written_by_each_owner_is_refused_on_every_rank(tmp_path):
    for said in run_ranks(_refusals, 2, str(tmp_path)):
        assert "partitioned over the ranks" in said[0] and "writers='rank0'" in said[0]
        assert "overlap_with_ddp=True" in said[1]
    assert os.listdir(tmp_path) == []  # nothing written, no temporary left


def _owner_fails(rank: int, world: int, directory: str) -> str:
    from ckptools.write import zip_writer

    model, zero = _train(rank, 2)
    manager = ck.CheckpointManager(directory)
    manager.save({"model": model, "optimizer": zero}, 2)
    if rank == 1:  # the owner of half the partitions cannot write them

        def broken(plan, pairs):
            raise OSError("disk gone on rank 1")

        zip_writer.write_shares = broken
        import ckptools.write.shares as shares

        shares.zip_writer.write_shares = broken
    _step(model, zero, rank, 2)
    with pytest.raises(ck.CheckpointError) as err:
        manager.save({"model": model, "optimizer": zero}, 3)
    return str(err.value)


def test_an_owner_that_cannot_write_fails_the_save_on_every_rank_and_keeps_the_previous(tmp_path):
    said = run_ranks(_owner_fails, 2, str(tmp_path))
    assert all("rank 1" in text and "disk gone" in text for text in said), said
    assert sorted(os.listdir(tmp_path)) == ["ckpt-0000000002.pt"]
    ck.verify(str(tmp_path / "ckpt-0000000002.pt"))


def _snapshot_and_restore(rank: int, world: int, directory: str) -> bool:
    model, zero = _train(rank, 3)
    memory = os.path.join(directory, "memory")
    manager = ck.CheckpointManager(os.path.join(directory, "run"), snapshot_dir=memory)
    manager.snapshot({"model": model, "optimizer": zero}, 3, blocking=True)
    expected = {zero._param_to_index[p]: {k: v.clone() for k, v in s.items()} for p, s in zero.optim.state.items()}
    _step(model, zero, rank, 3)  # moves on; the restore brings step 3 back
    manager.restore({"model": model, "optimizer": zero})
    got = {zero._param_to_index[p]: s for p, s in zero.optim.state.items()}
    return got.keys() == expected.keys() and all(
        torch.equal(got[i][k], v) for i, values in expected.items() for k, v in values.items()
    )


def test_a_snapshot_in_node_memory_holds_every_partition_and_restores_it(tmp_path):
    assert run_ranks(_snapshot_and_restore, 2, str(tmp_path)) == [True, True]
