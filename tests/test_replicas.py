"""DDP replicas that stopped being identical are caught before they are saved (issue 58): a bit flipped on one
rank in a parameter, an optimizer moment or a parameter group's lr makes save, snapshot and check_replicas raise
`ReplicaMismatchError` on every rank, naming the tensor and the ranks, with nothing written; a healthy run
with BatchNorm, dropout and per-rank batches raises nothing. Real gloo ranks."""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from _dist import run_ranks

import ckptools as ck

pytestmark = pytest.mark.versions  # DDP's replicas, the GradScaler, ZeRO's partitions


def _trained(rank: int, steps: int = 2):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                              torch.nn.Linear(16, 4))  # fmt: skip
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    torch.manual_seed(100 + rank)  # per-rank batches and dropout
    for _ in range(steps):
        model(torch.randn(8, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _flip(tensor: torch.Tensor) -> None:
    with torch.no_grad():
        tensor.view(-1)[3:4].view(torch.int32).bitwise_xor_(1 << 20)


def _caught(rank: int, world: int, folder: str, what: str) -> dict:
    model, opt = _trained(rank)
    state = {"model": model, "opt": opt}
    manager = ck.CheckpointManager(os.path.join(folder, "run"), snapshot_dir=os.path.join(folder, "shm"))
    manager.save(state, step=1)  # healthy: compared, written
    if rank == 1:
        if what == "parameter":
            _flip(model.module[0].weight)
        elif what == "moment":
            _flip(opt.state[opt.param_groups[0]["params"][0]]["exp_avg"])
        else:
            opt.param_groups[0]["lr"] = 0.0100001
    said: dict[str, object] = {}
    try:
        ck.check_replicas(state)
    except ck.ReplicaMismatchError as err:
        said["check"] = (err.where, err.differ, str(err))
    # A durable save compares every replicated byte by default: refused at its first call (issue 65).
    for name, call in (("save", lambda: manager.save(state, step=2)),
                       ("all", lambda: ck.save(os.path.join(folder, "all.pt"), state, writers="all"))):  # fmt: skip
        try:
            call()
        except ck.ReplicaMismatchError as err:
            said[name] = err.where
    for calls, step in enumerate(range(3, 3 + 55), start=1):  # the default: a rotating sample, every byte in 50
        try:
            manager.snapshot(state, step=step, blocking=True)
        except ck.ReplicaMismatchError as err:
            said["snapshot"] = (err.where, calls)
            break
    said["files"] = sorted(os.listdir(os.path.join(folder, "run")))
    said["snapshots"] = [s for s, _ in manager.snapshots()]
    manager.close()
    return said


def _check(results: list[dict], where: str, world: int) -> None:
    agree = ", ".join(str(r) for r in range(world) if r != 1)
    for said in results:
        check_where, differ, text = said["check"]
        assert check_where.startswith(where) and differ == [1], said
        assert "rank(s) 1 disagree with rank 0" in text and f"rank(s) {agree} agree" in text, text
        assert said["save"].startswith(where) and said["all"].startswith(where), said
        assert said["snapshot"][0].startswith(where) and said["snapshot"][1] <= 50, said
        assert said["files"] == ["ckpt-0000000001.pt"], said  # nothing of the refused saves
        caught_at = 2 + said["snapshot"][1]  # the step whose snapshot found it: not taken, the one before the newest
        assert said["snapshots"][-1:] == ([caught_at - 1] if caught_at > 3 else []), said


@pytest.mark.slow  # ~10 s of processes: make interop (make test stays within its 5 minutes)
def test_a_bit_flipped_in_one_ranks_parameter_is_caught_on_every_rank_at_3_ranks(tmp_path):
    _check(run_ranks(_caught, 3, str(tmp_path), "parameter"), "model.0.weight", 3)


def _relaunched(rank: int, world: int, folder: str) -> tuple[int, int]:
    """A relaunch after the refusal: the step it restores, and the digests `check_replicas` then compares."""
    model, opt = _trained(rank, steps=0)
    state = {"model": model, "opt": opt}
    manager = ck.CheckpointManager(os.path.join(folder, "run"), snapshot_dir=os.path.join(folder, "shm"))
    restored = manager.restore(state)
    assert restored is not None
    compared = ck.check_replicas(state)  # every rank loaded the same checkpoint: the replicas agree again
    manager.close()
    return int(restored["__ckptools__"]["metadata"]["step"]), compared


@pytest.mark.slow  # a whole-run scenario: make interop (make test stays within its 5 minutes)
def test_a_bit_flipped_in_an_optimizer_moment_is_caught_and_a_relaunch_restores_the_last_step_taken(tmp_path):
    results = run_ranks(
        _caught,
        2,
        str(tmp_path),
        "moment",
        fresh="its ranks die with the job unended: the relaunch "
        "restores from the node memory they leave (a pooled run's end releases it)",
    )
    _check(results, "opt.state[0].exp_avg", 2)
    caught_at = 2 + results[0]["snapshot"][1]
    last_taken = caught_at - 1 if caught_at > 3 else 1  # the snapshot before the refused one, or the save of step 1
    assert [step for step, _ in run_ranks(_relaunched, 2, str(tmp_path))] == [last_taken, last_taken]


def test_a_learning_rate_changed_on_one_rank_is_caught_at_the_first_call(tmp_path):
    results = run_ranks(_caught, 2, str(tmp_path), "lr")
    _check(results, "opt.param_groups", 2)
    assert all(r["snapshot"][1] == 1 for r in results), results  # parameter groups: every call


def _healthy(rank: int, world: int, folder: str) -> list[str]:
    import warnings

    model, opt = _trained(rank, steps=0)
    manager = ck.CheckpointManager(os.path.join(folder, "run"), snapshot_dir=os.path.join(folder, "shm"))
    torch.manual_seed(100 + rank)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for step in range(20):
            model(torch.randn(8, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            manager.snapshot({"model": model, "opt": opt}, step=step)
        manager.save({"model": model, "opt": opt}, step=20)
        assert ck.check_replicas({"model": model, "opt": opt}) > 0
    manager.close()
    return [str(w.message) for w in said]


def test_a_healthy_run_with_batchnorm_dropout_and_per_rank_batches_raises_and_warns_nothing(tmp_path):
    assert run_ranks(_healthy, 2, str(tmp_path)) == [[], []]


def _amp(rank: int, world: int, folder: str) -> list[str]:
    """Mixed precision as a CPU user writes it: bfloat16 autocast and a GradScaler in the state."""
    import warnings

    model, opt = _trained(rank, steps=0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    state = {"model": model, "opt": opt, "scaler": scaler}
    manager = ck.CheckpointManager(os.path.join(folder, "run"), snapshot_dir=os.path.join(folder, "shm"))
    torch.manual_seed(100 + rank)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for step in range(20):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(8, 8)).float().sum()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            manager.snapshot(state, step=step)
        manager.save(state, step=20, replicas="all")
    manager.close()
    return [str(w.message) for w in said]


@pytest.mark.slow  # ~10 s of processes: make interop (make test stays within its 5 minutes)
def test_a_healthy_mixed_precision_run_with_a_grad_scaler_raises_and_warns_nothing(tmp_path):
    assert run_ranks(_amp, 2, str(tmp_path)) == [[], []]


def _zero(rank: int, world: int, folder: str) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model, _ = _trained(rank, steps=0)
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
    torch.manual_seed(100 + rank)
    for _ in range(2):
        model(torch.randn(8, 8)).sum().backward()
        zero.step()
        zero.zero_grad()
    state = {"model": model, "opt": zero}
    said: dict[str, object] = {"healthy": ck.check_replicas(state)}
    if rank == 1:  # a moment of rank 1's own partition: each rank's own, never compared
        own = next(iter(zero.optim.state.values()))
        _flip(own["exp_avg"])
    said["partition flipped"] = ck.check_replicas(state)
    ck.save(os.path.join(folder, "zero.pt"), state, replicas="all")  # written: nothing replicated differs
    if rank == 1:
        _flip(model.module[4].weight)
    try:
        ck.save(os.path.join(folder, "zero-2.pt"), state, replicas="all")
    except ck.ReplicaMismatchError as err:
        said["caught"] = (err.where, err.differ)
    said["files"] = sorted(os.listdir(folder))
    return said


def test_zero_partitions_are_never_compared_and_the_replicated_parameters_are(tmp_path):
    for said in run_ranks(_zero, 2, str(tmp_path)):
        assert said["healthy"] > 0 and said["partition flipped"] == said["healthy"], said
        assert said["caught"] == ("model.4.weight", [1]), said
        assert "zero-2.pt" not in said["files"] and "zero.pt" in said["files"], said


def _switch(rank: int, world: int, folder: str) -> dict:
    """One switch, ``replicas=``, on a save and a snapshot whose replicas differ (rank 1's last layer), and
    the old spellings it replaced, each warned about at the caller's line."""
    import warnings

    model, opt = _trained(rank)
    state = {"model": model, "opt": opt}
    if rank == 1:
        _flip(model.module[4].weight)
    manager = ck.CheckpointManager(os.path.join(folder, "run"), snapshot_dir=os.path.join(folder, "shm"))
    said: dict[str, object] = {}
    calls = {
        "save off": lambda: ck.save(os.path.join(folder, "off.pt"), state, replicas="off"),
        "save auto": lambda: ck.save(os.path.join(folder, "auto.pt"), state),
        "manager all": lambda: manager.save(state, step=1, replicas="all"),
        "snapshot all": lambda: manager.snapshot(state, step=2, replicas="all", blocking=True),
        "snapshot off": lambda: manager.snapshot(state, step=3, replicas="off", blocking=True),
        "old check_replicas=False": lambda: ck.save(os.path.join(folder, "old-off.pt"), state, check_replicas=False),
        "old verify_replicas=True": lambda: manager.save(state, step=4, verify_replicas=True),
        "old snapshot check_replicas=False": lambda: manager.snapshot(state, step=5, check_replicas=False),
    }
    for name, call in calls.items():
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            try:
                call()
                outcome = "written"
            except ck.ReplicaMismatchError as err:
                outcome = f"refused at {err.where}"
        old = [(str(w.message), os.path.basename(w.filename)) for w in warned if w.category is DeprecationWarning]
        said[name] = (outcome, old)
    manager.close()
    said["files"] = sorted(n for n in os.listdir(folder) if n.endswith(".pt"))
    said["checkpoints"] = sorted(os.listdir(os.path.join(folder, "run")))
    return said


def test_one_switch_says_how_much_is_compared_and_the_old_names_still_work_with_a_warning(tmp_path):
    here = os.path.basename(__file__)
    for said in run_ranks(_switch, 2, str(tmp_path)):
        refused = ("refused at model.4.weight", [])
        assert said["save off"] == ("written", []) and said["snapshot off"] == ("written", []), said
        assert said["save auto"] == refused and said["manager all"] == refused, said
        assert said["snapshot all"] == refused, said  # every byte at its first call, not 1/50 of them
        for name, new in (("old check_replicas=False", "'off'"), ("old verify_replicas=True", "'all'"),
                          ("old snapshot check_replicas=False", "'off'")):  # fmt: skip
            outcome, old = said[name]
            assert outcome == ("refused at model.4.weight" if new == "'all'" else "written"), (name, said)
            assert len(old) == 1 and old[0][1] == here, (name, old)  # the line of the caller, not ckptools'
            assert "deprecated and goes in 0.6" in old[0][0] and f"replicas={new}" in old[0][0], old
        assert said["files"] == ["off.pt", "old-off.pt"], said
        assert said["checkpoints"] == [], said  # the manager's saves were refused; snapshots are in node memory


def test_a_word_the_switch_does_not_know_is_refused_before_anything_is_written(tmp_path):
    model = torch.nn.Linear(2, 2)
    for kwargs, says in (({"replicas": "some"}, "replicas must be one of 'auto', 'all', 'sample', 'off'"),
                         ({"replicas": True}, "replicas must be one of"),
                         ({"replicas": "all", "check_replicas": False}, "contradicts replicas='all'")):  # fmt: skip
        warned = pytest.warns(DeprecationWarning) if "check_replicas" in kwargs else contextlib.nullcontext()
        with warned, pytest.raises(ValueError, match=says):
            ck.save(tmp_path / "never.pt", {"model": model}, **kwargs)
    assert list(tmp_path.iterdir()) == []
    assert ck.save(tmp_path / "sample.pt", {"model": model}, replicas="sample") == str(tmp_path / "sample.pt")
