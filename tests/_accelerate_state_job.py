"""An Accelerate loop that saves its state every 3 steps through ckptools.integrations.accelerate (torchrun, 2
CPU processes): ``python -m torch.distributed.run --nproc-per-node=2 _accelerate_state_job.py RUN_DIR STEPS DIE_AT``.

It resumes from ``latest_complete_state(RUN_DIR)``; with DIE_AT (a step; -1: never) rank 0 is killed
(SIGKILL) inside that step's save, after every process wrote its files and before the folder is sealed.
Rank 0 prints ``resumed from NAME`` and ``weights <sha256>`` at the end.
"""

import hashlib
import os
import signal
import sys

import torch
from accelerate import Accelerator

import ckptools.integrations.accelerate as acc_ck


def main() -> None:
    run_dir, steps, die_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(net.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    model, opt, sched = accelerator.prepare(net, opt, sched)
    start = 0
    latest = acc_ck.latest_complete_state(run_dir)
    if latest is not None:
        acc_ck.load_state(accelerator, latest)
        start = int(os.path.basename(latest).split("_")[-1])
        if accelerator.is_main_process:
            print(f"resumed from {os.path.basename(latest)}", flush=True)
    seal = acc_ck._seal
    for step in range(start + 1, steps + 1):
        g = torch.Generator().manual_seed(1000 * accelerator.process_index + step)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        sched.step()
        opt.zero_grad()
        if step % 3 == 0:
            if step == die_at:  # a kill between the files and the seal: the folder was never named
                acc_ck._seal = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
            acc_ck.save_state(accelerator, os.path.join(run_dir, f"step_{step}"), total_limit=2)
            acc_ck._seal = seal
    if accelerator.is_main_process:
        h = hashlib.sha256()
        for t in accelerator.unwrap_model(model).state_dict().values():
            h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
        print(f"weights {h.hexdigest()}", flush=True)
    accelerator.wait_for_everyone()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
