"""ckptools beside the Hugging Face Trainer: manifests and the newest complete checkpoint (real transformers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers", reason="the interop extra (transformers) is not installed")

from ckptools.integrations.transformers import MANIFEST, latest_complete_checkpoint, write_manifest

_TRAIN = """
import os, signal, sys, torch
from transformers import Trainer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint
from ckptools.integrations.transformers import CkptoolsCallback

class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, x, labels=None):
        logits = self.lin(x)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}

g = torch.Generator().manual_seed(1)
xs = torch.randn(64, 4, generator=g)
data = [{"x": x, "labels": int(x.sum() > 0)} for x in xs]
out, kill_at, resume = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if kill_at:  # SIGKILL in the middle of that step's _save_checkpoint: model and optimizer written, not the rest
    real = Trainer._save_rng_state
    def dying(self, output_dir):
        if self.state.global_step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, output_dir)
    Trainer._save_rng_state = dying
args = TrainingArguments(out, max_steps=8, save_steps=2, per_device_train_batch_size=8, report_to=[], use_cpu=True,
                         logging_steps=100, save_total_limit=None, seed=0, disable_tqdm=True)
model = Tiny()
trainer = Trainer(model, args, train_dataset=data, callbacks=[CkptoolsCallback()])
trainer.train(resume_from_checkpoint=None if resume == "none" else resume)
torch.save({k: v for k, v in model.state_dict().items()}, os.path.join(out, "final.pt"))
"""


def _train(tmp_path, out, kill_at: int = 0, resume: str = "none") -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(_TRAIN)
    return subprocess.run([sys.executable, str(script), str(out), str(kill_at), resume], capture_output=True,
                          text=True, timeout=300)  # fmt: skip


@pytest.mark.slow  # three Trainer runs, each importing transformers: `make interop` runs it
def test_a_kill_mid_save_is_skipped_and_the_resume_ends_as_the_straight_run(tmp_path):
    straight = _train(tmp_path, tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert all((tmp_path / "straight" / f"checkpoint-{s}" / MANIFEST).exists() for s in (2, 4, 6, 8))
    killed = _train(tmp_path, tmp_path / "run", kill_at=4)
    assert killed.returncode == -9, killed.stderr[-3000:]
    torn = tmp_path / "run" / "checkpoint-4"
    assert torn.is_dir() and not (torn / "trainer_state.json").exists()  # what the kill left
    from transformers.trainer_utils import get_last_checkpoint

    # The Trainer's own choice (resume_from_checkpoint=True) is the torn folder; ours is not.
    assert get_last_checkpoint(str(tmp_path / "run")) == str(torn)
    chosen = latest_complete_checkpoint(str(tmp_path / "run"))
    assert chosen == str(tmp_path / "run" / "checkpoint-2")
    resumed = _train(tmp_path, tmp_path / "run", resume=chosen)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a = torch.load(tmp_path / "straight" / "final.pt", weights_only=True)
    b = torch.load(tmp_path / "run" / "final.pt", weights_only=True)
    assert all(a[k].numpy().tobytes() == b[k].numpy().tobytes() for k in a)


def test_latest_complete_checkpoint_skips_what_is_not_whole(tmp_path, caplog):
    def folder(step: int, state: bool = True) -> str:
        path = tmp_path / f"checkpoint-{step}"
        path.mkdir()
        torch.save({"state": {}}, path / "optimizer.pt")
        if state:
            (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        return str(path)

    assert latest_complete_checkpoint(str(tmp_path)) is None
    first = folder(10)
    write_manifest(first)
    assert latest_complete_checkpoint(str(tmp_path)) == first
    folder(20, state=False)  # killed before the trainer state: skipped
    assert latest_complete_checkpoint(str(tmp_path)) == first and "checkpoint-20" in caplog.text
    third = folder(30)  # no manifest (no callback), but whole: taken
    assert latest_complete_checkpoint(str(tmp_path)) == third
    optimizer = tmp_path / "checkpoint-30" / "optimizer.pt"
    data = bytearray(optimizer.read_bytes())
    data[len(data) // 2] ^= 0xFF
    optimizer.write_bytes(bytes(data))
    assert latest_complete_checkpoint(str(tmp_path)) == first  # damaged: skipped (verify=True)
    with open(os.path.join(first, "trainer_state.json"), "a") as f:
        f.write(" ")  # a file changed after the manifest sealed it
    assert latest_complete_checkpoint(str(tmp_path)) is None
    assert "trainer_state.json has" in caplog.text
