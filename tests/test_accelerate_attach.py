"""``ckptools.integrations.accelerate.attach`` with Accelerate itself (issue 57): the script's own
``accelerator.save_state`` / ``load_state`` calls, whole or absent; automatic checkpoint naming and
``total_limit`` pruning only after the new folder is whole; a torn folder refused by ``load_state``
itself; an open accumulation window's gradients kept. One process per case, each in a fresh
interpreter (Accelerate's state is one per process). Needs accelerate: `make interop`.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("accelerate")
pytestmark = [
    pytest.mark.versions,
    pytest.mark.slow,
    pytest.mark.interop,
]  # fresh interpreters importing Accelerate: `make interop`
# versions: Accelerate's save_state and load_state


def _python(code: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


PREAMBLE = """
import os, shutil, sys, warnings, torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from ckptools import CheckpointFormatError
from ckptools.integrations.accelerate import attach
root = sys.argv[1]
def make(**kw):
    accelerator = attach(Accelerator(cpu=True, **kw))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return (accelerator, *accelerator.prepare(model, optimizer))
def batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(3, 4, generator=g)
"""

NAMING = (
    PREAMBLE
    + """
config = ProjectConfiguration(project_dir=root, automatic_checkpoint_naming=True, total_limit=2)
accelerator, model, optimizer = make(project_config=config)
for i in range(3):
    model(batch(i)).sum().backward(); optimizer.step(); optimizer.zero_grad()
    accelerator.save_state()
folder = os.path.join(root, "checkpoints")
print("after three:", sorted(os.listdir(folder)))
print("manifests:", all(os.path.exists(os.path.join(folder, n, "ckptools-manifest.json")) for n in os.listdir(folder)))
# Accelerate's own save killed inside checkpoint_3 before ckptools was attached: a torn folder of the next name.
shutil.copytree(os.path.join(folder, "checkpoint_2"), os.path.join(folder, "checkpoint_3"))
os.remove(os.path.join(folder, "checkpoint_3", "ckptools-manifest.json"))
os.remove(os.path.join(folder, "checkpoint_3", "random_states_0.pkl"))
try:
    accelerator.load_state(os.path.join(folder, "checkpoint_3"))
    print("loaded the torn folder")
except CheckpointFormatError as err:
    print("refused:", err)
again, model2, optimizer2 = make(project_config=ProjectConfiguration(
    project_dir=root, automatic_checkpoint_naming=True, total_limit=2))
with warnings.catch_warnings(record=True):
    warnings.simplefilter("always")
    again.load_state()
same = zip(model.state_dict().values(), model2.state_dict().values())
print("same weights:", all(torch.equal(a, b) for a, b in same))
print("next iteration:", again.save_iteration)
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    again.save_state()
print("replaced torn:", any("is not whole" in str(w.message) for w in said))
print("after the relaunch's save:", sorted(os.listdir(folder)))
print("whole:", os.path.exists(os.path.join(folder, "checkpoint_3", "random_states_0.pkl")))
"""
)


def test_automatic_naming_prunes_after_the_new_folder_is_whole_and_loads_the_newest_whole_one(tmp_path):
    out = _python(NAMING, str(tmp_path))
    assert "after three: ['checkpoint_1', 'checkpoint_2']" in out and "manifests: True" in out, out
    assert "refused:" in out and "no random_states_<rank>.pkl" in out and "nothing was loaded" in out, out
    # load_state() skipped the torn checkpoint_3 for the newest whole one, and numbers the next save after it.
    assert "same weights: True" in out and "next iteration: 3" in out, out
    assert "replaced torn: True" in out and "after the relaunch's save: ['checkpoint_2', 'checkpoint_3']" in out, out
    assert "whole: True" in out, out


WINDOW = (
    PREAMBLE
    + """
accelerator, model, optimizer = make(gradient_accumulation_steps=2)
for i in range(3):  # batches 0 and 1 close a window; batch 2 opens the next
    with accelerator.accumulate(model):
        model(batch(i)).sum().backward(); optimizer.step(); optimizer.zero_grad()
grads = [p.grad.clone() for p in model.parameters()]
accelerator.save_state(os.path.join(root, "step_3"))
print("files:", sorted(n for n in os.listdir(os.path.join(root, "step_3")) if n.startswith("ckptools-")))
with accelerator.accumulate(model):  # the window's second batch: the uninterrupted run's step
    model(batch(3)).sum().backward(); optimizer.step(); optimizer.zero_grad()
straight = [t.clone() for t in model.state_dict().values()]
torch.manual_seed(123)  # the relaunch: another process's RNG, restored by load_state
again, model2, optimizer2 = make(gradient_accumulation_steps=2)
again.load_state(os.path.join(root, "step_3"))
print("gradients back:", all(p.grad is not None and torch.equal(a, p.grad) for a, p in zip(grads, model2.parameters())))
print("step back:", again.step)
with again.accumulate(model2):
    model2(batch(3)).sum().backward(); optimizer2.step(); optimizer2.zero_grad()
print("bit-identical:", all(torch.equal(a, b) for a, b in zip(straight, model2.state_dict().values())))
"""
)


def test_a_save_state_inside_an_accumulation_window_keeps_its_gradients_and_resumes_bit_identical(tmp_path):
    out = _python(WINDOW, str(tmp_path))
    assert "files: ['ckptools-gradients-0.pt', 'ckptools-manifest.json']" in out, out
    assert "gradients back: True" in out and "step back: 3" in out and "bit-identical: True" in out, out


def test_without_the_gradients_the_same_resume_ends_with_other_weights(tmp_path):
    """The window's sums are what makes it exact: the same script with the gradients file removed."""
    code = WINDOW.replace(
        'again.load_state(os.path.join(root, "step_3"))',
        'os.remove(os.path.join(root, "step_3", "ckptools-gradients-0.pt")); '
        'os.remove(os.path.join(root, "step_3", "ckptools-manifest.json")); '
        'again.load_state(os.path.join(root, "step_3"))',
    )
    out = _python(code, str(tmp_path))
    assert "gradients back: False" in out and "bit-identical: False" in out, out


def test_the_module_functions_on_an_attached_accelerator_are_the_same_save_once(tmp_path):
    code = (
        PREAMBLE
        + """
from ckptools.integrations.accelerate import load_state, save_state
accelerator, model, optimizer = make()
save_state(accelerator, os.path.join(root, "step_1"))
load_state(accelerator, os.path.join(root, "step_1"))
print(sorted(os.listdir(root)), accelerator.save_iteration)
"""
    )
    assert "['step_1'] 1" in _python(code, str(tmp_path))  # one save_state ran: one iteration counted
    assert not os.path.exists(tmp_path / ".step_1.ckptools-partial")


class _Noisy(__import__("torch").utils.data.Dataset):
    """Random augmentation in __getitem__, as torchvision's transforms draw it."""

    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int):  # type: ignore[no-untyped-def]
        import torch

        return torch.tensor([float(i)]) + torch.rand(1)


def test_a_resumable_loader_resumes_mid_epoch_with_the_same_batches_and_the_next_epochs_order():
    """In one process, workers reading ahead: the batches after the 3 taken, and the whole next epoch, are
    those of a loader never stopped, bit for bit; the state is what custom_checkpoint_<i>.pkl holds."""
    import io

    import torch

    import ckptools as ck
    from ckptools.integrations.accelerate_data import ResumableLoader

    def loader():  # type: ignore[no-untyped-def]
        data = ck.SeededDataset(_Noisy(), seed=7)
        return torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, num_workers=2)

    straight = ResumableLoader(loader(), seed=7)
    whole = [[b.clone() for b in straight] for _ in range(2)]
    killed = ResumableLoader(loader(), seed=7)
    it = iter(killed)
    taken = [next(it).clone() for _ in range(3)]
    buffer = io.BytesIO()
    torch.save(killed.state_dict(), buffer)  # as Accelerate's save_custom_state writes it
    buffer.seek(0)
    resumed = ResumableLoader(loader(), seed=0)  # the seed comes back with the state
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert resumed.epoch == 0
    rest = [b.clone() for b in resumed]
    assert resumed.epoch == 1
    after = [b.clone() for b in resumed]
    assert [torch.equal(a, b) for a, b in zip(taken + rest, whole[0])] == [True] * 5 and len(rest) == 2
    assert len(after) == 5 and all(torch.equal(a, b) for a, b in zip(after, whole[1]))
    # Each epoch its own draws: item i's augmentation is seeded from (seed, epoch, i), the epoch carried by the index.
    assert not torch.equal(torch.cat(whole[0]).sort(0).values, torch.cat(whole[1]).sort(0).values)
    # Saved at the epoch's last batch, before the loop left it: the resumed pass is empty, the next is epoch 1.
    last = ResumableLoader(loader(), seed=7)
    it = iter(last)
    _ = [next(it) for _ in range(5)]
    at_end = ResumableLoader(loader(), seed=0)
    at_end.load_state_dict(last.state_dict())
    assert [b for b in at_end] == [] and at_end.epoch == 1
    assert all(torch.equal(a, b) for a, b in zip(list(at_end), whole[1]))


RESUMED = (
    PREAMBLE
    + """
accelerator, model, optimizer = make(gradient_accumulation_steps=2)
for i in range(2):  # one whole window
    with accelerator.accumulate(model):
        model(batch(i)).sum().backward(); optimizer.step(); optimizer.zero_grad()
accelerator.save_state(os.path.join(root, "step_2"))  # closed: nothing to keep
again, model2, optimizer2 = make(gradient_accumulation_steps=2)
again.load_state(os.path.join(root, "step_2"))
with again.accumulate(model2):  # the resumed process opens the next window; no step of its own yet
    model2(batch(2)).sum().backward(); optimizer2.step(); optimizer2.zero_grad()
again.save_state(os.path.join(root, "step_3"))
print("files:", sorted(n for n in os.listdir(os.path.join(root, "step_3")) if n.startswith("ckptools-")))
"""
)


def test_a_resumed_process_keeps_the_window_it_opened_before_its_first_step(tmp_path):
    """The second kill of a run: resumed from a closed window, killed after the next window's first batch.
    The optimizer holds (loaded) state and this process has not stepped: its gradients are still this
    window's sums (it was CI's accelerate_cv failure: the save at step 17 after a resume from step 16)."""
    out = _python(RESUMED, str(tmp_path))
    assert "files: ['ckptools-gradients-0.pt', 'ckptools-manifest.json']" in out, out
