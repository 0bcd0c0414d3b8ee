"""End-to-end: the quick starts, as the docs show them, killed and relaunched, end bit-identical.

Each script is a code block itself, with its blanks filled in (a model with dropout, synthetic
data augmented at random in `__getitem__` with torch, python and numpy draws, the training step, a
small save interval, `num_workers`): the README's Quick start
and the full script of docs/getting-started.md (GradScaler, scheduler, async saves, DataLoader
workers). So this test breaks when either drifts. One rank dies right after step 25; the same command is launched again
and must resume from step 24 (the epoch's end the block saves after its batch loop; its periodic save
was at step 20) and end with exactly the weights of a run that never stopped,
without a single CheckpointWarning.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import torch
from _torchrun import computed_once, ok, torchrun

ROOT = Path(__file__).resolve().parent.parent
PAGES = {"readme": ROOT / "README.md", "guide": ROOT / "docs" / "getting-started.md"}
KILL_AT, SAVE_EVERY, EPOCHS = 25, 10, 4  # 512 samples, 2 ranks x 32 per batch: 8 steps per epoch, 32 in all

PRELUDE = f"""
import os
import random

import numpy as np
import torch

IN, CLASSES = 32, 8


def build_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(64, CLASSES)
    )


class Augmented(torch.utils.data.Dataset):  # random augmentation from torch, python and numpy
    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(512, IN, generator=g)
        self.y = (self.x @ torch.randn(IN, CLASSES, generator=g)).argmax(dim=1)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = torch.roll(self.x[i] + 0.1 * torch.randn(IN), random.randint(-2, 2))
        return x * float(0.9 + 0.2 * np.random.rand()), self.y[i]


dataset = Augmented()
epochs = {EPOCHS}
torch.manual_seed(100 + int(os.environ["RANK"]))  # per-rank dropout streams
"""

# The training step: it replaces the `...` line of the quick start's inner loop (the README's
# has no GradScaler or scheduler).
KILL = """
if ckpt is None and step + 1 == int(os.environ.get("KILL_AT", -1)) and ck.get_rank() == 1:
    os._exit(17)  # rank 1 dies abruptly right after that step, in a launch that started fresh
"""
STEPS = {
    "guide": """
x, y = x.to(device), y.to(device)
loss = torch.nn.functional.cross_entropy(model(x), y)
opt.zero_grad(set_to_none=True)
scaler.scale(loss).backward()
scaler.step(opt)
scaler.update()
sched.step()
"""
    + KILL,
    "readme": """
x, y = x.to(device), y.to(device)
loss = torch.nn.functional.cross_entropy(model(x), y)
opt.zero_grad(set_to_none=True)
loss.backward()
opt.step()
"""
    + KILL,
}

EPILOGUE = """
if ck.get_rank() == 0:
    weights = {k: v.detach().cpu() for k, v in ck.unwrap_model(model).state_dict().items()}
    torch.save({"weights": weights, "step": step}, "final.pt")
    print(f"resumed from {None if ckpt is None else ckpt['step']}, ended at step {step}", flush=True)
ck.exit_process(0)  # the guide's own last line, after what the test records
"""


def quickstart(page: str) -> str:
    """The first Python block of the page (under the README's "## Quick start" heading)."""
    text = PAGES[page].read_text()
    if page == "readme":
        text = text.split("## Quick start", 1)[1]
    block = re.search(r"```python\n(.*?)```", text, re.S)
    assert block, f"{PAGES[page].name} has no ```python block"
    return block.group(1)


def fill_in(code: str, num_workers: int, page: str = "guide") -> str:
    """The quick start with its blanks filled; each substitution must find exactly its one place."""
    placeholder = re.compile(r"^( *)\.\.\.( *#.*)?$", re.M)
    assert len(placeholder.findall(code)) == 1, "the Quick start's training step is one `...` line"
    code = placeholder.sub(lambda m: textwrap.indent(STEPS[page].strip("\n"), m.group(1)), code)
    if page == "guide":
        code, n = re.subn(r"num_workers=\d+", f"num_workers={num_workers}", code)
        assert n == 1, "the Quick start's DataLoader sets num_workers"
    code, n = re.subn(r"step % \d+ == 0", f"step % {SAVE_EVERY} == 0", code)
    assert n == 1, "the Quick start saves every N steps"
    code, n = re.subn(r"^ck\.exit_process\(0\).*$", "", code, flags=re.M)
    assert n == 1, "the Quick start ends with ck.exit_process(0)"
    return PRELUDE + code + EPILOGUE


def launch(script: Path, workdir: Path, *, kill: bool):
    env = {"KILL_AT": str(KILL_AT)} if kill else {}
    return torchrun(["--standalone", "--nproc-per-node=2", "--max-restarts=0", str(script)], cwd=workdir, env=env)


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """Final weights of a run that is never killed, per page, computed once per session (shared by
    xdist workers). With 0 DataLoader workers: SeededDataset makes the run with 2 the same run, so
    a killed run with 2 workers is held against this one too."""

    def get(page: str) -> dict:
        def run(work: Path) -> None:
            script = work / "train.py"
            script.write_text(fill_in(quickstart(page), 0, page))
            out = ok(launch(script, work, kill=False))
            assert "resumed from None, ended at step 32" in out

        return torch.load(computed_once(tmp_path_factory, f"uninterrupted-{page}", run) / "final.pt", weights_only=True)

    return get


# The guide's script is killed with 2 DataLoader workers and held against its run with 0 (the
# uninterrupted one); the README's runs with 0 both times. So each script and both worker
# counts are in, without a third pair of launches.
@pytest.mark.slow  # ~35 s each: make interop (make test stays within its 5 minutes)
@pytest.mark.parametrize(("page", "num_workers"), [("guide", 2), ("readme", 0)])
def test_quickstart_killed_and_relaunched_is_bit_exact(tmp_path, uninterrupted, page, num_workers):
    script = tmp_path / "train.py"
    script.write_text(fill_in(quickstart(page), num_workers, page))
    first = launch(script, tmp_path, kill=True)
    assert first.returncode != 0, "rank 1 dies after step 25, so the launch fails"
    again = ok(launch(script, tmp_path, kill=True))  # the same command: resumes, and does not die again
    assert "resumed from 24, ended at step 32" in again  # the save after epoch 2 (steps 17-24), the newest
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    expected = uninterrupted(page)
    assert final["step"] == expected["step"] == 32
    assert sorted(final["weights"]) == sorted(expected["weights"])
    for name, tensor in expected["weights"].items():
        assert final["weights"][name].numpy().tobytes() == tensor.numpy().tobytes(), name
    # The exact path is also the quiet one.
    assert "CheckpointWarning" not in first.stdout + first.stderr + again


def test_fill_in_fails_loudly_when_the_docs_drift():
    code = quickstart("guide")
    with pytest.raises(AssertionError, match="num_workers"):
        fill_in(code.replace("num_workers=4", "pin_memory=True"), 2)
    with pytest.raises(AssertionError, match="training step"):
        fill_in(code.replace("        ...", "        pass"), 2)
    with pytest.raises(AssertionError, match="exit_process"):
        fill_in(quickstart("readme").replace("ck.exit_process(0)", "ck.barrier()"), 0, "readme")
