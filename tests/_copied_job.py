"""A job killed after a snapshot's copy and before its commit (tests/test_kill_matrix.py).

``take RANK PORT RUN FLAGS``: two ranks snapshot step 1 (committed), then step 2 with the commit
held back (its CRC-32s never come), make ``FLAGS/copied-RANK`` and wait to be killed.
``restore RANK PORT RUN FLAGS``: restore, print the step, whether every weight holds it, and whether
the snapshot restored from passes every CRC-32; then end normally (the node memory is released).
"""

from __future__ import annotations

import os
import sys
import threading
import time


def main(mode: str, rank: int, port: int, run: str, flags: str) -> None:
    import torch
    import torch.distributed as dist

    import ckptools as ck

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    manager = ck.CheckpointManager(run)
    if mode == "restore":
        state = {"w": torch.zeros(1 << 16)}
        got = manager.restore(state)
        assert got is not None
        whole = "unchecked"
        if got.get("step") == 2 and manager.snapshots():
            from ckptools.layouts import verify_torch_file

            verify_torch_file(manager.snapshots()[-1][1])  # every record's CRC-32: raises if one is wrong
            whole = "every CRC-32 matches"
        print(f"[rank{rank}] restored step {got['step']}, weights {bool((state['w'] == got['step']).all())}, "
              f"snapshot: {whole}", flush=True)  # fmt: skip
        ck.exit_process(0)
    manager.snapshot({"w": torch.full((1 << 16,), 1.0), "step": 1}, step=1, blocking=True)
    import ckptools.node.snapshot as taking

    taking.crc32s = lambda *_: threading.Event().wait()  # step 2's commit never gets its CRC-32s
    manager.snapshot({"w": torch.full((1 << 16,), 2.0), "step": 2}, step=2)
    open(os.path.join(flags, f"copied-{rank}"), "w").close()
    time.sleep(600)  # killed here


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
