"""End-to-end: the reference loop under real torchrun, killed and resumed, must end bit-identical."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import pytest
from _dist import free_port
from _torchrun import ok
from _torchrun import torchrun as _launch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "examples" / "train_ddp.py")


def torchrun(ckpt_dir, *args: str, nproc: int = 2, max_restarts: int = 0, launch: tuple[str, ...] = ()):
    launch = launch or ("--standalone",)
    return _launch([*launch, f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}", SCRIPT,
                    "--ckpt-dir", str(ckpt_dir), *args], cwd=ROOT)  # fmt: skip


def assert_bit_identical(a_dir, b_dir) -> None:
    a, b = load_file(str(Path(a_dir) / "final.safetensors")), load_file(str(Path(b_dir) / "final.safetensors"))
    assert sorted(a) == sorted(b) and not any(k.startswith("module.") for k in a)
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        diff = (a[key].double() - b[key].double()).abs().max().item() if a[key].numel() else 0.0
        assert a[key].numpy().tobytes() == b[key].numpy().tobytes(), f"{key}: max |delta| {diff}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted runs, computed once: {(nproc, amp): ckpt_dir}."""
    cache: dict[tuple[int, bool], Path] = {}

    def get(nproc: int = 2, amp: bool = False) -> Path:
        if (nproc, amp) not in cache:
            d = tmp_path_factory.mktemp(f"ref{nproc}{'amp' if amp else ''}")
            out = ok(torchrun(d, *(["--amp"] if amp else []), nproc=nproc))
            assert "fresh start" in out and "resumed" not in out
            cache[(nproc, amp)] = d
        return cache[(nproc, amp)]

    return get


@pytest.mark.parametrize(
    ("fail_at", "resumed_from"),
    # between two saves; right after a save; right before one; right after the epoch-end save
    [(23, 20), (26, 25), (24, 20), (17, 16)],
)
def test_killed_and_restarted_by_torchrun_is_bit_exact(tmp_path, reference, fail_at, resumed_from):
    out = ok(torchrun(tmp_path, "--fail-at-step", str(fail_at), max_restarts=1))
    assert f"simulated crash right after step {fail_at}" in out
    assert "attempt 1" in out and f"resumed from step {resumed_from}" in out
    assert_bit_identical(reference(), tmp_path)
    ckpts = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt-"))
    assert ckpts == ["ckpt-0000000040.pt", "ckpt-0000000045.pt", "ckpt-0000000048.pt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no temp leftovers"


def test_killed_with_dataloader_workers_is_bit_exact(tmp_path, reference):
    out = ok(torchrun(tmp_path, "--num-workers", "2", "--fail-at-step", "23", max_restarts=1))
    assert "resumed from step 20 (epoch 1, sample 64 of 256" in out
    assert_bit_identical(reference(), tmp_path)


def test_failed_launch_then_same_command_resumes(tmp_path, reference):
    failed = torchrun(tmp_path, "--fail-at-step", "23")
    assert failed.returncode != 0
    again = ok(torchrun(tmp_path, "--fail-at-step", "23"))
    assert "resumed from step 20" in again
    assert_bit_identical(reference(), tmp_path)


def test_amp_killed_and_restarted_is_bit_exact(tmp_path, reference):
    ok(torchrun(tmp_path, "--amp", "--fail-at-step", "23", max_restarts=1))
    assert_bit_identical(reference(amp=True), tmp_path)
    with pytest.raises(AssertionError):  # autocast really changed the numerics
        assert_bit_identical(reference(amp=False), tmp_path)


def test_three_processes_killed_and_restarted_is_bit_exact(tmp_path, reference):
    out = ok(torchrun(tmp_path, "--fail-at-step", "23", nproc=3, max_restarts=1))
    assert "world size 3" in out and "resumed from step 20" in out
    assert_bit_identical(reference(nproc=3), tmp_path)


def _two_nodes(ckpt_dir, *args: str) -> list[subprocess.CompletedProcess]:
    port = free_port()
    results: list = [None, None]

    def launch(node: int) -> None:
        results[node] = torchrun(
            ckpt_dir,
            *args,
            nproc=1,
            launch=("--nnodes=2", f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}"),
        )

    threads = [threading.Thread(target=launch, args=(n,)) for n in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_two_simulated_nodes(tmp_path, reference):
    first = _two_nodes(tmp_path, "--fail-at-step", "23")
    assert all(p.returncode != 0 for p in first), "the crash of node 1's rank fails both launches"
    node0, node1 = (ok(p) for p in _two_nodes(tmp_path, "--fail-at-step", "23"))
    assert "[rank0] local rank 0, writes checkpoints: True" in node0
    assert "[rank1] local rank 0, writes checkpoints: False" in node1
    assert "resumed from step 20" in node0
    assert_bit_identical(reference(), tmp_path)
