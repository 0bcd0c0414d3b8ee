"""A script that ends the way every DDP tutorial does: `dist.destroy_process_group()`, then Python
exits, the model and the optimizer still referenced at module level (freed during interpreter
finalization). Two ranks train with ZeroRedundancyOptimizer (`--zero`) or AdamW, save through the
manager, run three more steps and end. Such a rank aborted now and then (SIGABRT, "terminate called
without an active exception"): see tests/test_dist.py.

    torchrun --nproc-per-node=2 ends_with_destroy.py RUN_DIR [--zero]
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import ckptools as ck

ck.init_distributed()
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)))
if "--zero" in sys.argv:
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
else:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
manager = ck.CheckpointManager(sys.argv[1])
for step in range(1, 7):
    optimizer.zero_grad()
    model(torch.randn(16, 32)).square().mean().backward()
    optimizer.step()
    if step == 3:
        manager.save({"model": model, "optimizer": optimizer, "step": step}, step)
dist.destroy_process_group()
