"""The shape of nanoGPT's train.py, ported to ckptools as the docs say: the batch is fetched ahead of
the step (`X, Y = get_batch("train")` at the end of each micro-step), gradient accumulation with
`require_backward_grad_sync`, an evaluation every `eval_interval` on random batches by rank 0, and a
checkpoint {model, optimizer, iter_num, best_val_loss} saved there (`if master_process: torch.save(...)`
before). The port: ck.save on every rank; the batch fetched ahead in the checkpoint as ck.PerRank (each
rank draws its own); get_batch's random stream comes back with the checkpoint (ckptools restores it per
rank); no manual `_orig_mod.` strip (ck.load takes either); and the evaluation that preceded the save,
in the middle of the iteration, is not run again in the iteration the relaunch resumes in (it would
draw from the restored stream a second time).

    torchrun --nproc-per-node=2 gpt_style.py RUN_DIR
"""

import math
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import ckptools as ck

block_size, batch_size, vocab = 16, 4, 32
gradient_accumulation_steps, eval_interval, eval_iters, max_iters = 2, 5, 3, 40
learning_rate, warmup_iters, min_lr = 3e-3, 5, 3e-4
data = {
    "train": torch.randint(0, vocab, (4000,), generator=torch.Generator().manual_seed(0)),
    "val": torch.randint(0, vocab, (800,), generator=torch.Generator().manual_seed(1)),
}


def get_batch(split):
    d = data[split]
    ix = torch.randint(len(d) - block_size, (batch_size,))
    x = torch.stack([d[i : i + block_size] for i in ix])
    y = torch.stack([d[i + 1 : i + 1 + block_size] for i in ix])
    return x, y


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, 32)
        self.drop = torch.nn.Dropout(0.1)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
        self.lm_head = torch.nn.Linear(32, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as GPT's are

    def forward(self, idx, targets):
        x = self.drop(self.wte(idx))
        logits = self.lm_head(x + self.mlp(x))
        return logits, F.cross_entropy(logits.view(-1, vocab), targets.view(-1))


@torch.no_grad()
def estimate_loss(model):
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            losses[k] = model(X, Y)[1].item()
        out[split] = losses.mean().item()
    model.train()
    return out


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    ratio = (it - warmup_iters) / (max_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


def main(out_dir):
    ck.init_distributed()
    rank = ck.get_rank()
    master_process = rank == 0
    torch.manual_seed(1337 + rank)  # nanoGPT: 1337 + seed_offset
    raw = TinyLM()
    optimizer = torch.optim.AdamW(raw.parameters(), lr=learning_rate, weight_decay=0.1)
    model = DDP(raw)
    ckpt_path = os.path.join(out_dir, "ckpt.pt")
    iter_num, best_val_loss = 0, 1e9
    prefetched = ck.PerRank()
    resumed = os.path.exists(ckpt_path)
    if resumed:  # init_from == "resume"
        checkpoint = ck.load(ckpt_path, {"model": raw, "optimizer": optimizer, "batch": prefetched})
        iter_num, best_val_loss = checkpoint["iter_num"], checkpoint["best_val_loss"]
        X, Y = prefetched.value
    else:
        X, Y = get_batch("train")  # fetch the very first batch
    while True:
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if iter_num % eval_interval == 0 and not resumed:  # the resumed iteration's came before its save
            if master_process:
                losses = estimate_loss(model)
                best_val_loss = min(best_val_loss, losses["val"])
            if iter_num > 0:  # always_save_checkpoint, on every rank: ckptools decides who writes
                batch = ck.PerRank((X, Y))
                state = {"model": raw, "optimizer": optimizer, "iter_num": iter_num, "best_val_loss": best_val_loss}
                ck.save(ckpt_path, {**state, "batch": batch})
        resumed = False
        for micro_step in range(gradient_accumulation_steps):
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
            _, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
            X, Y = get_batch("train")  # the next batch, fetched while this one's backward runs
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
        if master_process:
            print("step", iter_num, flush=True)
        if iter_num >= max_iters:
            break
    if master_process:
        # The test harness's file, whole or absent: a kill that lands while it is written leaves a run
        # to resume, never a torn final.pt taken for the end of the run.
        torch.save(raw.state_dict(), os.path.join(out_dir, "final.pt.partial"))
        os.replace(os.path.join(out_dir, "final.pt.partial"), os.path.join(out_dir, "final.pt"))
    ck.exit_process(0)


if __name__ == "__main__":
    main(sys.argv[1])
