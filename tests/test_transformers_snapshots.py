"""The HF Trainer with `CkptoolsCallback(snapshot_every=1)`: a step in node memory, written out as the
Trainer's own ``checkpoint-N/`` folder (issue 47; real transformers, real SIGKILL of the whole launch).

Whole Trainer launches, each importing transformers: `make interop` runs them.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the interop extra (transformers) is not installed")

from _same import TinyClassifier, assert_same_tree
from _torchrun import computed_once, keepers_left, kill_job

import ckptools as ck
from ckptools.integrations.trainer_snapshots import PREFIX
from ckptools.layouts import check_folder

pytestmark = [pytest.mark.versions, pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.interop]
# versions: the HF Trainer's save and resume

# Dropout, the Trainer's shuffled order, augmentation through ck.SeededDataset, AdamW with a warm-up
# schedule: every stream a resume must put back. 96 samples, batches of 8 per process; a durable
# checkpoint every 10 steps, a snapshot after every step. PAUSE_AT=N: rank 0 waits once step N's
# snapshot returned on every rank (the callback after CkptoolsCallback, a barrier), so that a kill lands
# exactly there.
_SCRIPT = """
import os, sys, time, torch
if os.environ.get("NODE_MEMORY_PER_RANK"):  # simulated nodes: each rank a node-memory folder of its own
    os.environ["CKPTOOLS_NODE_MEMORY"] = os.path.join(os.environ["NODE_MEMORY_PER_RANK"], "node" + os.environ["RANK"])
import ckptools as ck
from transformers import Trainer, TrainerCallback, TrainingArguments
from ckptools.integrations.transformers import CkptoolsCallback, latest_complete_checkpoint

out, mode, max_steps, save_steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
pause_at = int(os.environ.get("PAUSE_AT", "0"))


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 96

    def __getitem__(self, i):
        x = torch.randn(8, generator=torch.Generator().manual_seed(i))
        return {"x": x + 0.1 * torch.randn(8), "labels": (x.sum() > 0).long()}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                       torch.nn.Linear(64, 2))

    def forward(self, x, labels=None):
        logits = self.net(x)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


class Pause(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if args.process_index == 0:
            print("step", state.global_step, flush=True)
        if state.global_step == pause_at:
            if torch.distributed.is_initialized():
                torch.distributed.barrier()  # every rank's snapshot of this step has returned: its copy is whole
            if args.process_index == 0:
                print("paused", flush=True)
                time.sleep(600)


torch.manual_seed(3)
args = TrainingArguments(out, max_steps=max_steps, per_device_train_batch_size=8, save_steps=save_steps, seed=3,
                         report_to=[], logging_strategy="no", use_cpu=True, learning_rate=0.01, warmup_steps=5,
                         optim="adamw_torch", disable_tqdm=True)
callback = CkptoolsCallback(snapshot_every=1, budget=None)
trainer = Trainer(Net(), args, train_dataset=ck.SeededDataset(Data(), seed=args.seed),
                  callbacks=[callback, Pause()])
resume = latest_complete_checkpoint(out) if mode == "resume" else None
print(f"rank {args.process_index} resuming from {resume}", flush=True)  # one write: ranks' lines do not mix
if mode == "resume":
    from ckptools.integrations.trainer_snapshots import PREFIX
    memory = [step for step, _ in ck.CheckpointManager(out, prefix=PREFIX).snapshots()]
    print(f"node memory of rank {args.process_index} holds {memory}", flush=True)
trainer.train(resume_from_checkpoint=resume)
if args.process_index == 0:
    torch.save(trainer.model.state_dict(), os.path.join(out, "final.pt"))
if mode == "materialise":  # the newest snapshot written out beside the Trainer's own folder of that step
    from ckptools.integrations import trainer_snapshots
    from ckptools.integrations.transformers import newest_snapshot
    step, path = newest_snapshot(callback._manager)
    if args.local_process_index == 0:
        print("materialised", trainer_snapshots.snapshot_to_folder(path, os.path.join(out, "from-memory")), flush=True)
ck.exit_process(0)
"""


def _launch(script: Path, out: Path, mode: str, procs: int, steps: int, save_steps: int, pause_at: int = 0):
    """The script on ``procs`` processes (1: plain python, as most Trainer users run it; 2: torchrun)."""
    runner = [sys.executable] if procs == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                  f"--nproc-per-node={procs}"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PAUSE_AT=str(pause_at))
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    command = [*runner, str(script), str(out), mode, str(steps), str(save_steps)]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip


def _finished(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-5000:]
    return out


def _killed_at_pause(proc: subprocess.Popen) -> str:
    """Read until rank 0 pauses, then SIGKILL every process of the launch; what it printed."""
    said = []
    assert proc.stdout is not None
    for line in proc.stdout:
        said.append(line)
        if line.strip() == "paused":
            kill_job(proc.pid)
            break
    proc.wait(timeout=60)
    assert "paused\n" in said, "".join(said)[-5000:]
    return "".join(said)


def _script(tmp_path: Path) -> Path:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    return script


@pytest.mark.parametrize("procs", [1, 2])
def test_a_folder_written_from_node_memory_is_the_trainers_own_at_that_step(tmp_path, procs):
    """Step 4's snapshot, written out, against the folder the Trainer itself saved at step 4: the same
    files (all but training_args.bin, a pickled TrainingArguments no resume reads), each equal: weights,
    optimizer, scheduler, every process's random streams, trainer_state.json."""
    from safetensors.torch import load_file

    try:
        from transformers.trainer_pt_utils import safe_globals  # what the Trainer's own resume reads them with
    except ImportError:  # older releases: torch's allowlist for numpy's random state
        safe_globals = _numpy_globals

    out = tmp_path / "run"
    said = _finished(_launch(_script(tmp_path), out, "materialise", procs, 4, 4))
    own, made = out / "checkpoint-4", out / "from-memory" / "checkpoint-4"
    assert f"materialised {made}" in said, said[-3000:]
    files = sorted(p.name for p in own.iterdir() if p.name != "training_args.bin")
    assert sorted(p.name for p in made.iterdir()) == files
    assert [f for f in files if f.startswith("rng_state")] == (
        ["rng_state.pth"] if procs == 1 else ["rng_state_0.pth", "rng_state_1.pth"]
    )
    assert_same_tree(load_file(own / "model.safetensors"), load_file(made / "model.safetensors"), key_order=False)
    for name in [f for f in files if f.endswith((".pt", ".pth"))]:
        with safe_globals():
            theirs, ours = (torch.load(f / name, weights_only=True) for f in (own, made))
        assert_same_tree(theirs, ours, name, key_order=False)
    assert json.loads((own / "trainer_state.json").read_text()) == json.loads((made / "trainer_state.json").read_text())
    assert check_folder(str(made), verify=True).problem is None


def _numpy_globals():
    """The numpy globals a pickled random state needs, allowed for torch.load(weights_only=True)."""
    import numpy

    allowed = [numpy.ndarray, numpy.dtype, numpy.core.multiarray._reconstruct, type(numpy.dtype(numpy.uint32))]
    return torch.serialization.safe_globals(allowed)


def _straight(tmp_path_factory, procs: int) -> dict:
    def run(folder: Path) -> None:
        _finished(_launch(_script(folder), folder / "run", "fresh", procs, 24, 10))

    folder = computed_once(tmp_path_factory, f"hf-snapshots-straight-{procs}", run)
    return torch.load(folder / "run" / "final.pt", weights_only=True)


def _resumes_on_several_cpu_processes() -> bool:
    """Whether this transformers' Trainer can resume a CPU run of several processes from any folder: older
    releases (5.0.0) load the optimizer with map_location=args.device, "cpu:0", which torch refuses
    ("don't know how to restore data location ... cpu:0"), for the Trainer's own folders as for ours."""
    import inspect

    from transformers import Trainer

    return 'device.type != "cpu"' in inspect.getsource(Trainer._load_optimizer_and_scheduler)


# compat (one process): the Trainer's state in node memory, killed and relaunched
@pytest.mark.parametrize("procs", [pytest.param(1, marks=pytest.mark.compat), 2])
def test_killed_and_relaunched_the_run_resumes_from_the_step_it_died_at_bit_identical(tmp_path_factory, tmp_path,
                                                                                     procs):  # fmt: skip
    """SIGKILL of the whole launch after a random step (not a checkpoint step, after one): the relaunch's
    latest_complete_checkpoint writes that step's snapshot out as checkpoint-N/, the Trainer resumes from
    it, and the run ends with the weights of a run never killed, bit for bit. Without snapshots it
    would resume from checkpoint-10 or -20, up to 9 steps behind."""
    if procs > 1 and not _resumes_on_several_cpu_processes():
        pytest.skip("this transformers cannot resume a CPU run of several processes from any folder (map_location "
                    "'cpu:0', which torch refuses), the Trainer's own included")  # fmt: skip
    kill = random.Random(int(os.environ.get("CKPTOOLS_KILL_SEED", "0")) or None).choice(
        [s for s in range(11, 24) if s % 10]
    )
    script, out = _script(tmp_path), tmp_path / "run"
    _killed_at_pause(_launch(script, out, "fresh", procs, 24, 10, pause_at=kill))
    assert os.path.isdir(out / f"checkpoint-{10 if kill < 20 else 20}") and not os.path.exists(
        out / f"checkpoint-{kill}"
    )
    said = _finished(_launch(script, out, "resume", procs, 24, 10))
    assert f"resuming from {out / f'checkpoint-{kill}'}" in said, (kill, said[-3000:])
    final = torch.load(out / "final.pt", weights_only=True)
    assert_same_tree(_straight(tmp_path_factory, procs), final, f"kill {kill}", key_order=False)


def test_on_two_nodes_every_rank_resumes_from_one_step_and_a_replaced_node_receives_it(tmp_path_factory, tmp_path,
                                                                                     monkeypatch):  # fmt: skip
    """Two simulated nodes (each rank a node-memory folder of its own) killed after step 13, then one node
    replaced (its memory gone). The relaunch's latest_complete_checkpoint agrees over the process group:
    rank 0 chooses step 13, the replaced node receives that snapshot into its memory, every rank resumes
    from checkpoint-13, and the run ends bit-identical. Before, each node decided from its own memory,
    and the replaced one resumed from checkpoint-10 beside the other's 13."""
    if not _resumes_on_several_cpu_processes():
        pytest.skip("this transformers cannot resume a CPU run of several processes from any folder (map_location "
                    "'cpu:0', which torch refuses), the Trainer's own included")  # fmt: skip
    nodes = tmp_path / "nodes"
    monkeypatch.setenv("NODE_MEMORY_PER_RANK", str(nodes))
    # The relaunch comes first, and reads node memory: under load it starts later than the default grace
    # (10 s), and the keeper had persisted checkpoint-13/ and released node memory before it looked.
    monkeypatch.setenv("CKPTOOLS_KEEPER_GRACE", "60")
    script, out, kill = _script(tmp_path), tmp_path / "run", 13
    _killed_at_pause(_launch(script, out, "fresh", 2, 24, 10, pause_at=kill))
    assert sorted(os.listdir(nodes)) == ["node0", "node1"]
    shutil.rmtree(nodes / "node1")  # node 1 was replaced: its memory is gone
    said = _finished(_launch(script, out, "resume", 2, 24, 10))
    for rank in (0, 1):
        assert f"rank {rank} resuming from {out / f'checkpoint-{kill}'}" in said, said[-3000:]
    assert "node memory of rank 1 holds [13]" in said, said[-3000:]  # received from node 0
    assert "differs between ranks" not in said, said[-3000:]  # every rank's snapshot holds the same Trainer state
    assert_same_tree(_straight(tmp_path_factory, 2), torch.load(out / "final.pt", weights_only=True), key_order=False)


def test_killed_and_never_relaunched_the_keeper_writes_the_step_out_as_the_trainers_folder(tmp_path_factory, tmp_path,
                                                                                          monkeypatch):  # fmt: skip
    """Nobody relaunches: within the keeper's grace + 30 s, checkpoint-N/ of the step the job died at is in
    the output folder, complete (every file's CRC-32), node memory is released and no keeper is left; a
    later run resumes from it (plain resume_from_checkpoint) and ends bit-identical."""
    monkeypatch.setenv("CKPTOOLS_KEEPER_GRACE", "2")
    script, out, kill = _script(tmp_path), tmp_path / "run", 17
    _killed_at_pause(_launch(script, out, "fresh", 1, 24, 10, pause_at=kill))
    memory = ck.CheckpointManager(out, prefix=PREFIX).snapshot_dir
    deadline = time.monotonic() + 32
    while os.path.exists(memory) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not os.path.exists(memory), "node memory still held 32 s after the job was gone"
    assert keepers_left(memory) == []
    folder = out / f"checkpoint-{kill}"
    assert check_folder(str(folder), verify=True).problem is None, sorted(os.listdir(out))
    said = _finished(_launch(script, out, "resume", 1, 24, 10))
    assert f"resuming from {folder}" in said, said[-3000:]
    assert_same_tree(_straight(tmp_path_factory, 1), torch.load(out / "final.pt", weights_only=True), key_order=False)


def test_a_tiny_models_snapshots_keep_within_the_budget_by_skipping_steps(tmp_path, monkeypatch, caplog):
    """A budget of 2 % of the loop's time with a model whose step is a few ms, about as long as a snapshot's
    fixed cost: most steps are skipped, alike on every rank, and the log says the cadence and its bound."""
    import logging

    from transformers import Trainer, TrainingArguments

    from ckptools.integrations.transformers import CkptoolsCallback

    taken, real = [], ck.CheckpointManager.snapshot

    def counted(self, *args, **kwargs):
        path = real(self, *args, **kwargs)
        taken.append(path is not None)
        return path

    monkeypatch.setattr(ck.CheckpointManager, "snapshot", counted)
    data = [{"x": torch.randn(4), "labels": i % 2} for i in range(64)]
    args = TrainingArguments(str(tmp_path / "run"), max_steps=120, per_device_train_batch_size=8, report_to=[],
                             save_strategy="no", logging_strategy="no", use_cpu=True, disable_tqdm=True)  # fmt: skip
    callback = CkptoolsCallback(snapshot_every=1, budget=0.02)  # the default is no budget: every step
    try:
        with caplog.at_level(logging.INFO, logger="ckptools"):
            Trainer(TinyClassifier(), args, train_dataset=data, callbacks=[callback]).train()
    finally:
        if callback._manager is not None:
            memory = callback._manager.snapshot_dir
            callback._manager.close()
            import shutil

            shutil.rmtree(memory, ignore_errors=True)
    print(f"{sum(taken)} of {len(taken)} steps snapshotted")
    assert len(taken) == 120 and 2 <= sum(taken) <= 60, (sum(taken), taken)  # most are skipped
    assert "snapshots: one call in" in caplog.text and "a kill loses at most" in caplog.text, caplog.text[-2000:]
    assert CkptoolsCallback().budget is None  # the one default of every snapshot taker
