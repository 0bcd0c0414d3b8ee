"""kill -9 a process that saves checkpoints in a loop, many times, and audit the directory each time."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field

import torch

import ckptools as ck
from ckptools.layouts.torch_io import verify_torch_file
from ckptools.storage import TMP_MARKER, get_filesystem, join, list_files

WRITER = os.path.join(os.path.dirname(__file__), "_crash_writer.py")


@dataclass
class Audit:
    kills: int = 0
    saves_completed: int = 0
    kills_mid_save: int = 0  # the writer had begun a save it never reported finished
    kills_mid_write: int = 0  # a temporary file of the killed save was found afterwards
    leftovers_cleaned: int = 0
    leftovers_pending: int = 0  # left by the last kills, after which no save completed
    corrupt: int = 0
    lost: int = 0
    problems: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"{self.kills} kills ({self.kills_mid_save} inside a save), {self.saves_completed} saves completed, "
            f"{self.kills_mid_write} kills left a partial temp file ({self.leftovers_cleaned} removed by the next "
            f"completed save, {self.leftovers_pending} left by the final kills), "
            f"corrupt={self.corrupt} lost={self.lost}"
        )


def _temp_files(directory: str) -> list[str]:
    return [name for name in list_files(directory) if TMP_MARKER in name]


def _run_once(
    directory: str, numel: int, keep_last: int, delay: float, env: dict[str, str], mode: list[str]
) -> tuple[list[str], int]:
    proc = subprocess.Popen(
        [sys.executable, WRITER, directory, str(numel), str(keep_last), *mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line.strip())
            if line.startswith("ready"):
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if not ready.wait(120):
        proc.kill()
        raise AssertionError(f"writer never became ready: {proc.stderr.read() if proc.stderr else ''}")  # type: ignore[union-attr]
    time.sleep(delay)
    proc.kill()  # SIGKILL: no handler, no cleanup, no flush
    proc.wait()
    reader.join(10)
    return lines, proc.pid


def kill_loop(
    directory: str,
    *,
    kills: int,
    numel: int,
    keep_last: int = 3,
    max_delay: float = 1.5,
    seed: int = 0,
    background: bool = False,
) -> Audit:
    """Start the writer, SIGKILL it after a random delay, audit; ``kills`` times.

    ``background``: the writer saves with ``blocking=False`` (see ``_crash_writer.py``)."""
    rng = random.Random(seed)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    audit = Audit()
    known: int | None = None  # newest step known to be complete
    outstanding: set[str] = set()  # temp files of killed saves, not yet seen removed
    expected_base = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    for _ in range(kills):
        mode = ["async"] if background else []
        lines, _pid = _run_once(directory, numel, keep_last, rng.uniform(0, max_delay), env, mode)
        audit.kills += 1
        saved = [int(line.split()[1]) for line in lines if line.startswith("saved ")]
        begun = [int(line.split()[1]) for line in lines if line.startswith("begin ")]
        audit.saves_completed += len(saved)
        audit.kills_mid_save += bool(begun) and (not saved or begun[-1] > saved[-1])
        if saved:
            # A killed writer's temporary file must be gone once a later save has completed.
            remaining = outstanding & set(_temp_files(directory))
            audit.leftovers_cleaned += len(outstanding - remaining)
            if remaining:
                audit.problems.append(f"leftovers not cleaned by the next save: {sorted(remaining)}")
            outstanding = set()
        # What this run restored was complete when it started. On S3 an upload whose completion the
        # killed writer had already sent may become visible only after the previous audit listed
        # the bucket (moto finishes the request): the restore then knows a newer step than the audit.
        ready = [int(line.split()[1]) for line in lines if line.startswith("ready ")]
        if ready and ready[0] and (known is None or ready[0] > known):
            known = ready[0]
        newest_reported = saved[-1] if saved else known
        manager = ck.CheckpointManager(directory, keep_last=keep_last)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # latest() warns when it skips a damaged file: that is corruption
            try:
                latest = manager.latest()
            except Warning as w:
                audit.corrupt += 1
                audit.problems.append(f"latest() skipped a damaged checkpoint: {w}")
                latest = manager.latest()
        steps = [s for s, _ in manager.checkpoints()]
        latest_step = None if latest is None else int(os.path.basename(latest)[5:15])
        # Newest completed step is there (or a later one begun, if the kill fell between its rename
        # and its print; with background saves the one before the last begun may be that one too).
        allowed = {newest_reported} | set(begun[-2:] if background else begun[-1:])
        if newest_reported is not None and latest_step not in allowed:
            audit.lost += 1
            audit.problems.append(f"latest is step {latest_step}, expected one of {allowed}; files {steps}")
        if latest is not None:
            ckpt = ck.load(latest, restore_rng=False)
            if ckpt["step"] != latest_step or not torch.equal(ckpt["w"], expected_base + latest_step):
                audit.corrupt += 1
                audit.problems.append(f"{latest} loads but holds the wrong data")
            # No earlier checkpoint lost: the keep_last newest steps up to latest are all there and verify.
            for step in range(max(1, latest_step - keep_last + 1), latest_step + 1):
                path = join(directory, f"ckpt-{step:010d}.pt")
                if step not in steps:
                    audit.lost += 1
                    audit.problems.append(f"step {step} missing (latest {latest_step}, files {steps})")
                    continue
                try:
                    verify_torch_file(path)
                except ck.CheckpointError as err:
                    audit.corrupt += 1
                    audit.problems.append(str(err))
            known = latest_step
        temps = set(_temp_files(directory)) - outstanding
        audit.kills_mid_write += bool(temps)
        outstanding |= temps
    audit.leftovers_pending = len(outstanding)
    return audit


def cleanup(directory: str) -> None:
    fs, path = get_filesystem(directory)
    if fs.exists(path):
        fs.rm(path, recursive=True)
