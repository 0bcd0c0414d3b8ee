"""A job whose torchrun agent and store die in an order the test chooses (tests/test_kill_matrix.py).

``store PORT``: hosts the job's key-value store (torchrun's agent holds it; here a process of its own,
so that the test can take the store away while the agent still lives). ``agent PORT RUN FLAGS``:
starts two ranks as its children, in sessions of their own as torchrun does, and waits.
``worker RANK PORT RUN FLAGS``: snapshots steps 1, 2, 3 into node memory, each once the test has
made the file ``FLAGS/go-STEP`` (the first at once), and prints what each call did.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time


def _wait_for(path: str) -> None:
    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit(f"{path} never came")
        time.sleep(0.05)


def store(port: int) -> None:
    import torch.distributed as dist

    held = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)  # noqa: F841 - serves while alive
    print("store up", flush=True)
    time.sleep(600)


def agent(port: int, run: str, flags: str) -> None:
    env = dict(os.environ, TORCHELASTIC_RUN_ID="orphan-test", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    ranks = []
    for r in range(2):
        command = [sys.executable, __file__, "worker", str(r), str(port), run, flags]
        ranks.append(subprocess.Popen(command, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), start_new_session=True))
    for rank in ranks:
        rank.wait()


def worker(rank: int, port: int, run: str, flags: str) -> None:
    import torch
    import torch.distributed as dist

    import ckptools as ck

    client = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
    dist.init_process_group("gloo", store=client, rank=rank, world_size=2)
    manager = ck.CheckpointManager(run)
    for step in (1, 2, 3):
        if step > 1:
            _wait_for(os.path.join(flags, f"go-{step}"))
        state = {"w": torch.full((1024,), float(step)), "step": step}
        try:
            manager.snapshot(state, step=step, blocking=step == 1)  # the first is whole before the store goes
        except ck.CheckpointError as err:
            print(f"[rank{rank}] step {step} raised: {err}", flush=True)
            raise
        print(f"[rank{rank}] step {step} snapshot returned", flush=True)
        open(os.path.join(flags, f"done-{step}-{rank}"), "w").close()


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    if mode == "store":
        store(int(args[0]))
    elif mode == "agent":
        agent(int(args[0]), args[1], args[2])
    else:
        worker(int(args[0]), int(args[1]), args[2], args[3])
