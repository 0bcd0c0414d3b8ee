from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import os
import pathlib
import pickle
import random
import time
import warnings

import _torch_can as torch_can
import numpy as np
import pytest
import torch
from _dist import run_ranks

import ckptools as ck
from ckptools.codecs.record import META_KEY
from ckptools.storage import TMP_MARKER
from ckptools.storage import host as _host

# versions: torch.save and torch.load (weights_only), DDP, the optimizers', schedulers' and scalers' states
pytestmark = pytest.mark.versions


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 4, generator=g)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _equal_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = ck.unwrap_model(a).state_dict(), ck.unwrap_model(b).state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# --- single process -----------------------------------------------------------------------------


def test_roundtrip_restores_model_optimizer_scheduler_scaler(tmp_path):
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for i in range(3):
        _train_step(model, opt, i)
        sched.step()
    path = ck.save(
        tmp_path / "c.pt",
        {"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler, "step": 3, "ema": torch.arange(3.0)},
        metadata={"run": "a", "lr": 0.01},
    )
    assert path == str(tmp_path / "c.pt")

    model2 = _net()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    scaler2 = torch.amp.GradScaler("cpu")
    ema = torch.zeros(3)
    out = ck.load(path, {"model": model2, "optimizer": opt2, "scheduler": sched2, "scaler": scaler2, "ema": ema})
    assert _equal_state(model, model2)
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert sched2.last_epoch == 3
    assert scaler2.get_scale() == 1024.0
    assert torch.equal(ema, torch.arange(3.0))
    assert out["step"] == 3 and out[META_KEY]["metadata"] == {"run": "a", "lr": 0.01}
    # Continuing both gives the same result: the optimizer state really came back.
    _train_step(model, opt, 9)
    _train_step(model2, opt2, 9)
    assert _equal_state(model, model2)


def test_file_is_plain_torch_zip_readable_without_ckptools(tmp_path):
    model = torch.nn.parallel.DataParallel(_net())
    ck.save(tmp_path / "c.pt", {"model": model, "epoch": 2})
    raw = torch.load(tmp_path / "c.pt", weights_only=True)
    assert set(raw) == {"model", "epoch", META_KEY}
    assert not any(k.startswith("module.") for k in raw["model"])
    meta = raw[META_KEY]
    assert meta["format_version"] == 1 and meta["world_size"] == 1
    assert isinstance(meta["torch_version"], str) and type(meta["torch_version"]) is str
    assert len(meta["rng"]) == 1


def test_a_file_of_a_newer_ckptools_format_is_refused_naming_who_wrote_it_and_nothing_is_restored(tmp_path):
    # What a future ckptools writes: the record says format 2. Read as today's format it could restore
    # wrong streams or buckets silently; refused instead, before anything is put back, and not as damage.
    ck.save(tmp_path / "c.pt", {"model": _net(), "step": 7})
    raw = torch.load(tmp_path / "c.pt", weights_only=True)
    raw[META_KEY] = {**raw[META_KEY], "format_version": 2, "ckptools_version": "9.1.0"}
    torch.save(raw, tmp_path / "newer.pt")
    model = _net()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # other values than the file's
    before = {k: v.clone() for k, v in model.state_dict().items()}
    manager_dir = tmp_path / "run"
    manager_dir.mkdir()
    os.replace(tmp_path / "newer.pt", manager_dir / "ckpt-0000000007.pt")
    newer = str(manager_dir / "ckpt-0000000007.pt")
    with pytest.raises(ck.CheckpointVersionError, match=r"written by ckptools 9\.1\.0 in checkpoint format 2.*upgrade"):
        ck.load(newer, {"model": model})
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert isinstance(ck.CheckpointVersionError("x"), ck.CheckpointLayoutError)  # never called damage
    with pytest.raises(ck.CheckpointVersionError):  # not skipped as damaged: resuming older would lose steps
        ck.CheckpointManager(manager_dir).restore({"model": model})
    assert "every record's CRC-32 matches" in ck.verify(newer)  # whole as torch's zip: never called damaged


def test_save_does_not_advance_any_rng(tmp_path):
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    ck.save(tmp_path / "c.pt", {"model": _net()})  # _net() reseeds torch: capture after it
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    ck.save(tmp_path / "d.pt", {"x": torch.ones(2)})
    after = (random.getstate(), np.random.get_state()[1], torch.get_rng_state())
    assert before[0] == after[0] and np.array_equal(before[1], after[1]) and torch.equal(before[2], after[2])


def _draws():
    return (random.random(), float(np.random.rand()), torch.rand(2).tolist())


def test_load_restores_rng_only_when_resuming_training(tmp_path):
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    ck.save(tmp_path / "c.pt", {"model": model, "optimizer": opt})
    expected = _draws()
    # Looking at a file (no state, or just a model) leaves the streams going on where they were.
    for state in (None, {"model": model}):
        ck.load(tmp_path / "c.pt", state)
        assert _draws() != expected
    ck.load(tmp_path / "c.pt", {"model": model, "optimizer": opt}, restore_rng=False)
    assert _draws() != expected
    # An optimizer (or scheduler, scaler, sampler) in the state means a resume: RNG comes back.
    ck.load(tmp_path / "c.pt", {"model": model, "optimizer": opt})
    assert _draws() == expected
    ck.load(tmp_path / "c.pt", restore_rng=True)
    assert _draws() == expected


def test_save_refuses_reserved_and_unsafe_metadata(tmp_path):
    with pytest.raises(TypeError, match="reserved"):
        ck.save(tmp_path / "c.pt", {META_KEY: 1})
    with pytest.raises(TypeError, match=r"metadata\['when'\].*weights_only.*when\.item\(\)"):
        ck.save(tmp_path / "c.pt", {}, metadata={"when": np.float64(1.0)})
    assert not (tmp_path / "c.pt").exists()


@dataclasses.dataclass
class _Config:
    lr: float = 0.1


class _EMA:
    """An object with state_dict() whose state holds a value weights_only refuses."""

    def state_dict(self):
        return {"decay": 0.99, "started": datetime.date(2026, 1, 1)}


@pytest.mark.parametrize(
    ("entry", "where", "fix"),
    [
        (argparse.Namespace(lr=0.1), r"state\['args'\]", r"vars\(args\)"),
        ({"out": pathlib.Path("/runs/x")}, r"state\['args'\]\['out'\]", r"str\(out\)"),
        ([1, {"best": np.float32(0.5)}], r"state\['args'\]\[1\]\['best'\]", r"best\.item\(\)"),
        (np.zeros(3), r"state\['args'\]", r"torch\.from_numpy\(args\)"),
        (_Config(), r"state\['args'\]", r"dataclasses\.asdict\(args\)"),
        (_EMA(), r"state\['args'\]\.state_dict\(\)\['started'\]", r"started\.isoformat\(\)"),
        (lambda: 0, r"state\['args'\]", "cannot be pickled"),
    ],
)
def test_save_refuses_what_a_weights_only_load_would_refuse(tmp_path, entry, where, fix):
    model = _net()
    ck.save(tmp_path / "c.pt", {"model": model})
    before = (tmp_path / "c.pt").read_bytes()
    with pytest.raises(ck.UnsafeStateError, match=f"cannot save {where} .*weights_only=True.*{fix}"):
        ck.save(tmp_path / "c.pt", {"model": model, "args": entry})
    assert (tmp_path / "c.pt").read_bytes() == before and os.listdir(tmp_path) == ["c.pt"]


@pytest.mark.skipif(
    not (torch_can.SAFE_GLOBALS_CONTEXT and torch_can.load_safely({1, 2})),
    reason="torch before 2.5: no safe_globals, and its safe loader refuses sets and bytes",
)
def test_save_accepts_what_the_program_allowlisted(tmp_path):
    # add_safe_globals makes torch's own load accept the type: save agrees with it exactly.
    with torch.serialization.safe_globals([argparse.Namespace]):
        ck.save(tmp_path / "c.pt", {"args": argparse.Namespace(lr=0.5), "extra": {1, 2}, "b": b"x", "c": 1j})
        assert ck.load(tmp_path / "c.pt")["args"].lr == 0.5
    with pytest.raises(ck.UnsafeCheckpointError, match="argparse.Namespace"):
        ck.load(tmp_path / "c.pt")


def _save_namespace(rank: int, world: int, directory: str) -> str:
    manager = ck.CheckpointManager(directory)
    try:
        manager.save({"model": _net(), "args": argparse.Namespace(lr=0.1)}, step=2)
    except ck.UnsafeStateError as err:
        torch.distributed.all_reduce(torch.ones(1))  # the group still works
        return str(err)
    return "saved"


def test_refusal_is_raised_on_every_rank_before_any_io(tmp_path):
    manager = ck.CheckpointManager(tmp_path)
    manager.save({"model": _net()}, step=1)
    # A dead writer's leftover: a save that writes would remove it first; a refused one must not.
    leftover = tmp_path / f".ckpt-0000000002.pt{TMP_MARKER}{_host()}-999999999-abcd"
    leftover.write_bytes(b"partial")
    listing = sorted(os.listdir(tmp_path))
    errors = run_ranks(_save_namespace, 2, str(tmp_path))
    assert all("cannot save state['args'] (type argparse.Namespace)" in e and "vars(args)" in e for e in errors)
    assert errors[0] == errors[1]
    assert sorted(os.listdir(tmp_path)) == listing


def test_saves_and_loads_are_logged_on_the_ckptools_logger(tmp_path, caplog):
    model = _net()
    with caplog.at_level(logging.INFO, logger="ckptools"):
        ck.save(tmp_path / "c.pt", {"model": model})
        ck.load(tmp_path / "c.pt", {"model": model})
        ck.load_state_dict(tmp_path / "c.pt")
    saved, loaded, weights = caplog.records
    size = os.path.getsize(tmp_path / "c.pt")
    assert saved.name == "ckptools" and saved.levelno == logging.INFO
    assert saved.getMessage().startswith(f"saved {tmp_path / 'c.pt'} (") and "GB/s)" in saved.getMessage()
    assert saved.ckpt_bytes == loaded.ckpt_bytes == weights.ckpt_bytes == size and saved.ckpt_seconds > 0
    assert loaded.getMessage().startswith("loaded ") and weights.getMessage().startswith("loaded weights from ")
    # A library configures no handler: what is shown is the application's choice.
    assert logging.getLogger("ckptools").handlers == [] and logging.getLogger("ckptools").propagate


def _log_per_rank(rank: int, world: int, path: str) -> list[str]:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("ckptools")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    ck.save(path, {"model": _net()})
    ck.load(path, {"model": _net()})
    return records


def test_only_rank_0_logs(tmp_path):
    records = run_ranks(_log_per_rank, 2, str(tmp_path / "c.pt"))
    assert [r.split()[0] for r in records[0]] == ["saved", "loaded"] and records[1] == []


def test_failed_save_keeps_previous_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "c.pt"
    ck.save(path, {"v": torch.ones(3)})
    original = path.read_bytes()

    class Broken:
        def state_dict(self):
            raise RuntimeError("boom in state_dict")

    with pytest.raises(ck.CheckpointError, match=r"c\.pt failed on rank 0: RuntimeError: boom in state_dict"):
        ck.save(path, {"v": torch.zeros(3), "b": Broken()})
    assert path.read_bytes() == original
    assert os.listdir(tmp_path) == ["c.pt"]


def test_strict_mismatch_lists_keys(tmp_path):
    ck.save(tmp_path / "c.pt", {"model": torch.nn.Linear(2, 2)})
    other = torch.nn.Sequential(torch.nn.Linear(2, 2))
    # A different architecture: keys "0.weight" vs "weight".
    with pytest.raises(
        ck.KeyMismatchError, match=r"missing keys \[0\.bias, 0\.weight\].*unexpected keys \[bias, weight\]"
    ):
        ck.load(tmp_path / "c.pt", {"model": other})
    with pytest.raises(ck.KeyMismatchError, match="has no entry 'optimizer'"):
        ck.load(tmp_path / "c.pt", {"optimizer": torch.optim.SGD(other.parameters(), lr=1)})
    # strict=False loads what matches and skips missing entries.
    ck.load(tmp_path / "c.pt", {"model": other, "optimizer": torch.optim.SGD(other.parameters(), lr=1)}, strict=False)


def test_plain_torch_save_files_load(tmp_path):
    src = _net()
    torch.save(torch.nn.DataParallel(src).state_dict(), tmp_path / "bare.pt")
    torch.save({"model_state_dict": src.state_dict(), "epoch": 7}, tmp_path / "nested.pt")
    for name in ("bare.pt", "nested.pt"):
        dst = _net()
        with torch.no_grad():
            for p in dst.parameters():
                p.zero_()
        out = ck.load(tmp_path / name, {"model": dst})
        assert _equal_state(src, dst), name
    assert out["epoch"] == 7


def test_submodule_really_named_module_keeps_its_prefix(tmp_path):
    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.module = torch.nn.Linear(2, 2)

    src = Wrapper()
    ck.save(tmp_path / "c.pt", {"model": src})
    assert set(torch.load(tmp_path / "c.pt", weights_only=True)["model"]) == {"module.weight", "module.bias"}
    dst = Wrapper()
    ck.load(tmp_path / "c.pt", {"model": dst})
    assert _equal_state(src, dst)


def test_memory_url_roundtrip():
    model = _net()
    ck.save("memory://ckpt-test/run/a.pt", {"model": model})
    other = _net()
    with torch.no_grad():
        other[0].weight.add_(1)
    ck.load("memory://ckpt-test/run/a.pt", {"model": other})
    assert _equal_state(model, other)


def test_load_state_dict_finds_nested_weights(tmp_path):
    from safetensors.torch import save_file

    w = {"module.a": torch.ones(2), "module.b": torch.zeros(1)}
    torch.save({"state_dict": w, "epoch": 1}, tmp_path / "l.ckpt")
    torch.save({"ema": {"model": w}}, tmp_path / "deep.pth")
    save_file({"a": torch.ones(2)}, str(tmp_path / "m.safetensors"))
    assert list(ck.load_state_dict(tmp_path / "l.ckpt")) == ["a", "b"]
    assert list(ck.load_state_dict(tmp_path / "l.ckpt", strip=None)) == ["module.a", "module.b"]
    assert list(ck.load_state_dict(tmp_path / "deep.pth", key="ema.model")) == ["a", "b"]
    assert torch.equal(ck.load_state_dict(tmp_path / "m.safetensors")["a"], torch.ones(2))
    with pytest.raises(ck.CheckpointFormatError, match="pass key="):
        ck.load_state_dict(tmp_path / "deep.pth")
    with pytest.raises(ck.KeyMismatchError, match="no entry 'ema.nope'"):
        ck.load_state_dict(tmp_path / "deep.pth", key="ema.nope")


def test_bad_files_raise_the_right_error(tmp_path):
    good = tmp_path / "good.pt"
    ck.save(good, {"w": torch.ones(100)})
    data = good.read_bytes()
    (tmp_path / "trunc.pt").write_bytes(data[: len(data) // 2])
    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "random.pt").write_bytes(os.urandom(4096))
    (tmp_path / "dir.pt").mkdir()
    with pytest.raises(ck.CheckpointNotFoundError, match="missing.pt does not exist"):
        ck.load(tmp_path / "missing.pt")
    with pytest.raises(FileNotFoundError):  # also the builtin
        ck.load(tmp_path / "missing.pt")
    for name in ("trunc.pt", "empty.pt", "random.pt"):
        with pytest.raises(ck.CheckpointFormatError, match=name):
            ck.load(tmp_path / name)
    with pytest.raises(ck.CheckpointLayoutError, match="is a folder but not a checkpoint layout"):
        ck.load(tmp_path / "dir.pt")


class _Canary:
    path = ""

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_malicious_pickle_is_refused_and_nothing_runs(tmp_path):
    canary = tmp_path / "pwned"
    _Canary.path = str(canary)
    torch.save({"model": {"w": torch.ones(1)}, "evil": _Canary()}, tmp_path / "evil.pt")
    with pytest.raises(ck.UnsafeCheckpointError, match=r"evil\.pt needs .*system.*weights_only=False"):
        ck.load(tmp_path / "evil.pt")
    # The weights alone would not need it, but a file naming os.system is an attack, not a
    # checkpoint with a Path in it: even the reader that skips refused classes refuses it.
    for read in (ck.load_state_dict, ck.inspect, ck.verify):
        with pytest.raises(ck.UnsafeCheckpointError, match=r"evil\.pt needs .*system"):
            read(tmp_path / "evil.pt")
    assert not canary.exists()


def test_cuda_tagged_file_loads_on_cpu(tmp_path, cuda_tagged_file):
    # "auto" on a machine without CUDA is the CPU; the file's storages say cuda:1.
    model = torch.nn.Linear(3, 3)
    ck.load(cuda_tagged_file, {"model": model})
    assert torch.equal(model.weight, torch.full((3, 3), 2.0))
    assert ck.load(cuda_tagged_file, map_location={"cuda:1": "cpu"})["model"]["weight"].device.type == "cpu"


# --- several real processes ---------------------------------------------------------------------


def _ddp_save_and_sync(rank: int, world: int, path: str) -> dict:
    import ckptools.saving as cp

    writes = []
    real = cp.write_alone  # rank 0's writer of a whole local file
    cp.write_alone = lambda location, obj: (writes.append(str(location)), real(location, obj))[1]
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train_step(model, opt, rank)  # different data per rank; DDP keeps weights equal
    ptrs = [p.data_ptr() for p in model.parameters()]
    # Per-rank RNG streams that differ.
    random.seed(100 + rank), np.random.seed(100 + rank), torch.manual_seed(100 + rank)
    # Rank 0 alone writes (writers="all", where every rank writes its share, is tests/test_writers.py's).
    ck.save(path, {"model": model, "optimizer": opt, "step": 1}, writers="rank0")
    exists_on_return = os.path.exists(path)
    expected = (random.random(), float(np.random.rand()), torch.rand(1).item())
    # Still in DDP, same parameters, and gradient sync still works after the save.
    _train_step(model, opt, 10 + rank)
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.zeros_like(weights) for _ in range(world)]
    torch.distributed.all_gather(gathered, weights)
    # Each rank gets its own RNG back.
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    fresh = torch.nn.parallel.DistributedDataParallel(_net())
    ck.load(path, {"model": fresh}, restore_rng=True)
    got = (random.random(), float(np.random.rand()), torch.rand(1).item())
    # A DDP model loads a plain (unwrapped) checkpoint and a plain model loads a DDP one.
    plain = _net()
    ck.load(path, {"model": plain}, restore_rng=False)
    return {
        "writes": writes,
        "exists_on_return": exists_on_return,
        "ddp": isinstance(model, torch.nn.parallel.DistributedDataParallel),
        "same_params": ptrs == [p.data_ptr() for p in model.parameters()],
        "in_sync": all(torch.equal(gathered[0], g) for g in gathered),
        "rng_back": expected == got,
        "rng": expected,
        "plain_ok": _equal_state(plain, fresh),
    }


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_save_load(tmp_path, world):
    path = str(tmp_path / "ddp.pt")
    results = run_ranks(_ddp_save_and_sync, world, path)
    assert results[0]["writes"] == [path]
    assert all(r["writes"] == [] for r in results[1:]), "only global rank 0 writes"
    assert all(r["exists_on_return"] for r in results), "save returns only after the file exists"
    assert all(r["ddp"] and r["same_params"] and r["in_sync"] for r in results)
    assert all(r["rng_back"] for r in results)
    assert len({r["rng"] for r in results}) == world, "each rank has its own stream"
    assert all(r["plain_ok"] for r in results)
    raw = torch.load(path, weights_only=True)
    assert raw[META_KEY]["world_size"] == world and len(raw[META_KEY]["rng"]) == world
    assert not any(k.startswith("module.") for k in raw["model"])


def _rank0_failure(rank: int, world: int, directory: str) -> dict:
    blocker = os.path.join(directory, "not_a_dir")
    outcomes = {}

    class FailsOnRank0:
        def state_dict(self):
            raise ValueError("state_dict exploded")

    for case, path, state in (
        ("parent_is_file", os.path.join(blocker, "c.pt"), {"x": torch.ones(1)}),
        ("state_dict_raises", os.path.join(directory, "ok.pt"), {"x": torch.ones(1), "bad": FailsOnRank0()}),
    ):
        start = time.monotonic()
        try:
            ck.save(path, state)
            outcomes[case] = ("returned", 0.0)
        except ck.CheckpointError as err:
            outcomes[case] = (str(err), time.monotonic() - start)
    t = torch.ones(1) * (rank + 1)
    torch.distributed.all_reduce(t)  # the group still works
    outcomes["all_reduce"] = t.item()
    return outcomes


def test_rank0_failure_raises_on_every_rank_quickly(tmp_path):
    (tmp_path / "not_a_dir").write_text("a file")
    results = run_ranks(_rank0_failure, 2, str(tmp_path))
    for r in results:
        msg, seconds = r["parent_is_file"]
        assert "failed on rank 0" in msg and "not_a_dir" in msg and seconds < 10
        msg, seconds = r["state_dict_raises"]
        assert "state_dict exploded" in msg and seconds < 10
        assert r["all_reduce"] == 3.0
    assert sorted(os.listdir(tmp_path)) == ["not_a_dir"], "no partial or temporary file left"


def _load_fails_on_rank1(rank: int, world: int, path: str) -> str:
    ck.save(path, {"model": torch.nn.Linear(2, 2)})
    # Rank 1 asks for a model the file does not fit: it fails, rank 0 alone would succeed.
    model = torch.nn.Linear(2, 2) if rank == 0 else torch.nn.Linear(3, 3)
    try:
        ck.load(path, {"model": model})
    except ck.CheckpointError as err:
        return f"{type(err).__name__}: {err}"
    return "loaded"


def test_load_failure_on_one_rank_raises_on_all(tmp_path):
    r0, r1 = run_ranks(_load_fails_on_rank1, 2, str(tmp_path / "c.pt"))
    assert r0.startswith("CheckpointError: loading checkpoint") and "failed on rank 1" in r0
    assert r1.startswith("KeyMismatchError")


def _save_two_ranks(rank: int, world: int, path: str) -> None:
    model = _net()
    ck.save(path, {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)})


def test_a_notebook_look_at_a_two_rank_file_is_quiet(tmp_path):
    path = str(tmp_path / "c.pt")
    run_ranks(_save_two_ranks, 2, path)
    model = _net()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ck.CheckpointWarning)
        ck.load(path, {"model": model})  # looking at weights: no RNG, so nothing to say about world sizes
    with pytest.warns(ck.CheckpointWarning, match="saved by 2 ranks and is loaded by 1.*not bit-exactly"):
        ck.load(path, {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)})


class _LitLike(torch.nn.Module):
    """What a LightningModule holding ``self.model`` saves: every key under ``model.``."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.model = net


@pytest.mark.parametrize("wrap", ["compile", "ddp+compile", "lightning", "lightning+compile"])
def test_compile_and_lightning_prefixes_load_into_the_plain_model(tmp_path, gloo_group, wrap):
    src = _net()
    if wrap == "compile":
        saved = torch.compile(src).state_dict()  # keys "_orig_mod.0.weight", made by torch itself
    elif wrap == "ddp+compile":
        saved = torch.nn.parallel.DistributedDataParallel(torch.compile(src)).state_dict()
    elif wrap == "lightning":
        saved = _LitLike(src).state_dict()
    else:
        saved = _LitLike(torch.compile(src)).state_dict()
    prefix = {"compile": "_orig_mod.", "ddp+compile": "module._orig_mod.", "lightning": "model.",
              "lightning+compile": "model._orig_mod."}[wrap]  # fmt: skip
    assert all(k.startswith(prefix) for k in saved)
    path = tmp_path / "foreign.ckpt"
    torch.save({"state_dict": saved, "epoch": 3}, path)
    target = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    ck.load(path, {"model": target}, map_location="cpu")  # strict: every key must have matched
    assert _equal_state(target, src)
    if "lightning" not in wrap:  # weights-only reads drop every wrapper's prefix by default
        assert sorted(ck.load_state_dict(path)) == sorted(src.state_dict())


def test_a_submodule_really_named_orig_mod_keeps_its_name(tmp_path):
    model = torch.nn.Module()
    model._orig_mod = torch.nn.Linear(2, 2)  # a real child, not a compile wrapper's attribute
    model.head = torch.nn.Linear(2, 2)
    ck.save(tmp_path / "m.pt", {"model": model})
    other = torch.nn.Module()
    other._orig_mod = torch.nn.Linear(2, 2)
    other.head = torch.nn.Linear(2, 2)
    ck.load(tmp_path / "m.pt", {"model": other}, map_location="cpu")
    assert torch.equal(other._orig_mod.weight, model._orig_mod.weight)


def test_load_a_safetensors_file_into_a_model(tmp_path):
    from safetensors.torch import save_file

    src = _net()
    save_file(dict(torch.compile(src).state_dict()), str(tmp_path / "w.safetensors"))  # valid, and "_orig_mod."
    target = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    ckpt = ck.load(tmp_path / "w.safetensors", {"model": target}, map_location="cpu", verify=True)
    assert _equal_state(target, src)
    assert "__ckptools__" not in ckpt  # bare weights: nothing else was restored


def test_weights_come_out_of_a_file_whose_other_entries_need_refused_classes(tmp_path):
    # A Lightning-style checkpoint whose hyper_parameters hold a Path and a Namespace (what
    # save_hyperparameters() stores from a script's argparse args), written by torch.save.
    net = _net()
    tied = torch.nn.Linear(2, 2)
    weights = {f"model.{k}": v for k, v in net.state_dict().items()}
    weights.update({"a.weight": tied.weight, "b.weight": tied.weight})
    hparams = {"args": argparse.Namespace(lr=0.1, out=pathlib.Path("/runs/x")), "root": pathlib.Path("/data")}
    path = tmp_path / "lightning.ckpt"
    torch.save({"state_dict": weights, "hyper_parameters": hparams, "epoch": 2}, path)
    with pytest.raises(pickle.UnpicklingError, match="argparse.Namespace"):
        torch.load(path, weights_only=True)  # what torch itself does
    with pytest.warns(ck.CheckpointWarning, match=r"argparse\.Namespace, pathlib\.PosixPath.*nothing was executed"):
        got = ck.load_state_dict(path)
    assert sorted(got) == sorted(weights)
    for k, v in weights.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    assert got["a.weight"].data_ptr() == got["b.weight"].data_ptr()  # tied in the file, tied here
    # ck.load restores what state names; an entry that needs a refused class cannot be restored.
    with pytest.raises(
        ck.UnsafeCheckpointError, match=r"entry 'hyper_parameters' needs (argparse\.Namespace|pathlib\.PosixPath)"
    ):
        ck.load(path, {"hyper_parameters": net})
    with pytest.raises(ck.UnsafeCheckpointError, match=r"name what to restore"):
        ck.load(path)  # the whole checkpoint, asked for as such: refused, saying what works


def test_save_weights_writes_plain_weights_once_per_tie(tmp_path):
    import safetensors.torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    net[1].weight = net[0].weight  # tied, as a language model's head and embedding
    wrapped = torch.nn.DataParallel(net)  # names carry 'module.'
    path = ck.save_weights(tmp_path / "w.safetensors", wrapped, metadata={"run": "a"})
    stored = safetensors.torch.load_file(path)
    assert list(stored) == ["0.weight"]  # the first tied name, once, without 'module.'
    assert torch.equal(stored["0.weight"], net[0].weight.detach())
    with safetensors.safe_open(path, "pt") as f:
        assert f.metadata()["format"] == "pt" and f.metadata()["run"] == "a"
    fresh = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    ck.load(path, {"model": fresh})  # ties restored from ckptools' aliases
    assert torch.equal(fresh[1].weight, net[0].weight)
    # any other suffix: a torch file of the plain state dict
    ck.save_weights(tmp_path / "w.pt", wrapped.state_dict())
    assert list(torch.load(tmp_path / "w.pt", weights_only=True)) == ["0.weight", "1.weight"]
    with pytest.raises(TypeError, match="module or a state dict"):
        ck.save_weights(tmp_path / "x.safetensors", 3)
    assert not (tmp_path / "x.safetensors").exists()


def _save_weights_then_exit(rank: int, world: int, folder: str) -> None:
    import logging
    import logging.handlers

    # A buffering handler that only writes when flushed: exit_process must flush it.
    target = logging.FileHandler(os.path.join(folder, f"log-{rank}.txt"))
    buffered = logging.handlers.MemoryHandler(capacity=1000, flushLevel=logging.CRITICAL, target=target)
    logger = logging.getLogger("script")
    logger.addHandler(buffered)
    logger.setLevel(logging.INFO)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    target_dir = folder if rank == 0 else os.path.join(folder, "missing")  # only rank 0's path matters
    ck.save_weights(os.path.join(target_dir, "final.safetensors"), model)
    logger.info("rank %d left", rank)
    ck.exit_process(3 + rank)  # the model is still referenced: no teardown, no hang


def test_exit_process_flushes_and_leaves_with_the_code_on_every_rank(tmp_path):
    import multiprocessing as mp

    from _dist import _worker, free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(_save_weights_then_exit, r, 2, port, (str(tmp_path),), queue, 60))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [3, 4]  # exit_process's codes: _worker's own exit never ran
    assert (tmp_path / "final.safetensors").exists()
    assert [(tmp_path / f"log-{r}.txt").read_text() for r in range(2)] == ["rank 0 left\n", "rank 1 left\n"]
