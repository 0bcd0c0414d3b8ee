"""ZeroRedundancyOptimizer (issue 36): saved with no consolidation, every rank writing its own
partition into the one torch file; resumed at the same or another world size."""

from __future__ import annotations

import json
import os

import pytest
import torch
from _dist import counting_sent, run_ranks
from _faults import dies_midway
from _same import assert_same_tree
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel
from typer.testing import CliRunner

import ckptools as ck
from ckptools.cli import app
from ckptools.storage import TMP_MARKER

pytestmark = pytest.mark.versions  # ZeroRedundancyOptimizer's partition attributes

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
    assert list(ours["state"]) == list(range(len(SHAPES)))
    _assert_same_state(ours["state"], theirs["state"])
    # A plain AdamW takes it as its own (ZeRO -> AdamW).
    net = _Net()
    plain = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    plain.load_state_dict(ours)
    if how == "save":  # `ckpt info` shows it as it shows torch's consolidated state
        assert _info_tensors(results[0]["path"], "optimizer.") == _info_tensors(tmp_path / "torch.pt", "")


def _assert_same_state(ours: dict, theirs: dict) -> None:
    """Optimizer states equal key for key, tensor for tensor, bit for bit (tests/_same.py), all on the CPU."""
    assert list(ours) == list(theirs)
    assert_same_tree(ours, theirs, key_order=False)
    assert {v.device.type for values in ours.values() for v in values.values()} == {"cpu"}


def _info_tensors(path, prefix: str) -> list[dict]:
    result = CliRunner().invoke(app, ["info", "--json", str(path)])
    assert result.exit_code == 0, result.output
    rows = [dict(t, name=t["name"].removeprefix(prefix)) for t in json.loads(result.stdout)["tensors"]]
    return [t for t in rows if t["name"].startswith("state.")]


def _resume(rank: int, world: int, directory: str, steps_after: int, name: str = "zero.pt") -> dict:
    """Restore ``name`` (saved after 3 steps on 2 ranks) into ZeRO on ``world`` ranks, train on."""
    import ckptools.read.restoring as restoring

    torch.manual_seed(0)
    model = DistributedDataParallel(_Net())
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    asked: list[int] = []  # what the load asked the kernel to read ahead of the optimizer's state
    real = restoring.prefetch_partition
    restoring.prefetch_partition = lambda obj, entry: asked.append(real(obj, entry)) or asked[-1]
    ck.load(os.path.join(directory, name), {"model": model, "optimizer": zero})
    restoring.prefetch_partition = real
    # Every tensor of this rank's new partition equals what was saved.
    saved = torch.load(os.path.join(directory, "zero.pt"), weights_only=True)["optimizer"]["state"]
    own = spans = 0
    page = os.sysconf("SC_PAGE_SIZE")
    for param, values in zero.optim.state.items():
        index = zero._param_to_index[param]
        for key, value in values.items():
            assert torch.equal(value, saved[index][key]), (index, key)
            own += 1
            # On the CPU the partition is used where the file is mapped: its pages, from a page boundary.
            spans += value.data_ptr() % page + value.nbytes
    for step in range(3, 3 + steps_after):
        _step(model, zero, rank, step)
    return {
        "own": own,
        "spans": spans,
        "asked": asked,
        "weights": {k: v.clone() for k, v in model.module.state_dict().items()},
    }


def _straight(rank: int, world: int, steps: int) -> dict:
    model, _ = _train(rank, steps)
    return {k: v.clone() for k, v in model.module.state_dict().items()}


@pytest.mark.slow  # a whole-run scenario: make interop (make test stays within its 5 minutes)
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
        # The load asked the kernel to read ahead exactly the pages of the rank's own partition.
        for r in results:
            assert r["asked"] == [r["spans"]], r


@pytest.mark.compat  # ZeRO's partitions across world sizes
@pytest.mark.slow  # four ranks and two: in `make interop`
def test_saved_on_four_ranks_resumed_on_two(tmp_path):
    run_ranks(_save_then_consolidate, 4, str(tmp_path), "save")
    ours = torch.load(tmp_path / "zero.pt", weights_only=True)["optimizer"]
    _assert_same_state(ours["state"], torch.load(tmp_path / "torch.pt", weights_only=True)["state"])
    results = run_ranks(_resume, 2, str(tmp_path), 1)
    assert sum(r["own"] for r in results) == 3 * len(SHAPES)


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
    memory = os.path.join(directory, "memory")
    manager = ck.CheckpointManager(os.path.join(directory, "run"), snapshot_dir=memory)
    with pytest.raises(ck.CheckpointError) as err:
        manager.snapshot({"model": model, "optimizer": zero}, 1, writers="rank0")
    said.append(str(err.value))
    return said


def test_what_cannot_be_written_by_each_owner_is_refused_on_every_rank(tmp_path):
    for said in run_ranks(_refusals, 2, str(tmp_path)):
        assert "partitioned over the ranks" in said[0] and "writers='rank0'" in said[0]
        assert "overlap_with_ddp=True" in said[1]
        assert "snapshot" in said[2] and "writers='rank0' does not allow" in said[2], said[2]
    written = [os.path.join(d, f) for d, _, files in os.walk(tmp_path) for f in files]
    assert [f for f in written if not f.endswith("/memory/.node")] == []  # nothing but the node's token


def _owner_dies_or_fails(rank: int, world: int, directory: str, how: str) -> str:
    import ckptools.write.zip_writer as zip_writer

    model, zero = _train(rank, 2)
    manager = ck.CheckpointManager(directory)
    manager.save({"model": model, "optimizer": zero}, 2)
    if rank == 1:  # the owner of half the partitions: half a record written, then killed or out of space
        zip_writer.write_shares = dies_midway(how)
    _step(model, zero, rank, 2)
    with pytest.raises(ck.CheckpointError) as err:
        manager.save({"model": model, "optimizer": zero}, 3)
    return str(err.value)


@pytest.mark.parametrize("how", ["kill", "fail"])
def test_an_owner_killed_or_failing_mid_save_fails_it_on_every_rank_and_keeps_the_previous(tmp_path, how):
    may_die = frozenset({1} if how == "kill" else ())
    said = run_ranks(
        _owner_dies_or_fails, 2, str(tmp_path), how, may_die=may_die, pg_timeout=20, fresh="an owner is killed or fails"
    )
    if how == "kill":  # rank 0 learns of it from the broken group, not by waiting out a timeout
        assert "checkpoint collective with the other ranks failed" in said[0], said
    else:
        assert all("rank 1" in text and "No space left" in text for text in said), said
    assert sorted(n for n in os.listdir(tmp_path) if TMP_MARKER not in n) == ["ckpt-0000000002.pt"]
    ck.verify(str(tmp_path / "ckpt-0000000002.pt"))
    assert [n for n in os.listdir(tmp_path) if TMP_MARKER in n] == [], "rank 0 removed the partial file"


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


@pytest.mark.slow  # ~10 s of processes: make interop (make test stays within its 5 minutes)
def test_zero_to_plain_adamw_and_back_through_ck_load(tmp_path):
    run_ranks(_save_then_consolidate, 2, str(tmp_path), "save")
    # One process, a plain AdamW: what a user switching away from ZeRO does.
    net = _Net()
    plain = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    ck.load(tmp_path / "zero.pt", {"model": net, "optimizer": plain})
    ck.save(tmp_path / "plain.pt", {"model": net, "optimizer": plain})
    # And back into ZeRO on 2 ranks: every tensor of each partition is the one ZeRO saved.
    results = run_ranks(_resume, 2, str(tmp_path), 1, "plain.pt")
    assert sum(r["own"] for r in results) == 3 * len(SHAPES)


def _traffic(rank: int, world: int, directory: str) -> dict:
    params = [torch.nn.Parameter(torch.randn(1 << 20, generator=torch.Generator().manual_seed(i))) for i in range(4)]
    zero = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    zero.step()
    own = sum(v.nbytes for s in zero.optim.state.values() for v in s.values() if torch.is_tensor(v))
    with counting_sent() as ours:
        ck.save(os.path.join(directory, "zero.pt"), {"optimizer": zero, "step": 1})
    with counting_sent() as theirs:  # the control: torch's consolidation, counted the same way
        zero.consolidate_state_dict(to=0)
    return {"own": own, "ours": ours[0], "theirs": theirs[0]}


@pytest.mark.slow  # ~10 s of processes: make interop (make test stays within its 5 minutes)
def test_a_save_sends_metadata_only_between_ranks(tmp_path):
    results = run_ranks(_traffic, 2, str(tmp_path))
    for r in results:
        assert r["own"] >= 16 << 20, r  # two 4 MiB tensors of AdamW state per parameter, two per rank
        assert r["ours"] < 64 << 10, r  # the exchange: RNG states, partition descriptions, outcomes
    assert results[1]["theirs"] >= results[1]["own"], results  # consolidation sends rank 1's partition
    loaded = torch.load(tmp_path / "zero.pt", weights_only=True)["optimizer"]["state"]
    assert sum(v.nbytes for s in loaded.values() for v in s.values()) == sum(r["own"] for r in results)


def _grown(rank: int, world: int, directory: str) -> dict:
    """A parameter group added after a save: the next save holds both, as torch's consolidation."""
    torch.manual_seed(0)
    model = DistributedDataParallel(_Net())
    net = model.module
    first = [*net.a.parameters(), *net.b.parameters()]
    zero = ZeroRedundancyOptimizer(first, optimizer_class=torch.optim.AdamW, lr=1e-2)
    _step(model, zero, rank, 0)
    ck.save(os.path.join(directory, "one-group.pt"), {"model": model, "optimizer": zero})
    zero.add_param_group({"params": [*net.c.parameters(), *net.d.parameters()], "lr": 5e-3})
    for step in (1, 2):
        _step(model, zero, rank, step)
    real = zero.consolidate_state_dict
    _forbid_consolidation(zero)
    ck.save(os.path.join(directory, "zero.pt"), {"model": model, "optimizer": zero})
    real(to=0)
    if rank == 0:
        torch.save(zero.state_dict(), os.path.join(directory, "torch.pt"))
    # A fresh ZeRO given the same groups before the load (torch's rule: the groups must match).
    again = ZeroRedundancyOptimizer(first, optimizer_class=torch.optim.AdamW, lr=1e-2)
    again.add_param_group({"params": [*net.c.parameters(), *net.d.parameters()], "lr": 5e-3})
    ck.load(os.path.join(directory, "zero.pt"), {"optimizer": again})
    same = all(
        torch.equal(again.optim.state[p][k], v) for p, values in zero.optim.state.items() for k, v in values.items()
    )
    # The file saved before the group was added needs the optimizer as it was then.
    with pytest.raises(ck.CheckpointError) as err:
        ck.load(os.path.join(directory, "one-group.pt"), {"optimizer": again})
    return {"same": same, "refusal": str(err.value)}


def test_a_parameter_group_added_after_a_save(tmp_path):
    results = run_ranks(_grown, 2, str(tmp_path))
    ours = torch.load(tmp_path / "zero.pt", weights_only=True)["optimizer"]
    theirs = torch.load(tmp_path / "torch.pt", weights_only=True)
    assert len(ours["param_groups"]) == 2 and ours["param_groups"] == theirs["param_groups"]
    _assert_same_state(ours["state"], theirs["state"])
    for r in results:
        assert r["same"], r
        assert "one-group.pt" in r["refusal"] and "add_param_group" in r["refusal"], r["refusal"]
