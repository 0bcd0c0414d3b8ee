"""Write the interop golden files with the real libraries: ``make interop`` runs this.

Every artifact is written by the library that owns its format (transformers' ``save_pretrained``,
Accelerate's ``save_state``, Lightning's ``Trainer.save_checkpoint``, with an OmegaConf config as
Hydra users have, torch's DCP and ``torch.compile``, ``torch.save`` of a whole module), from tiny
models built from configs (nothing is downloaded). Beside each, the weights the library held in
memory are written with the official ``safetensors`` library as ``reference/<name>.safetensors``:
the tests compare what ckptools reads with those, bit for bit.
``VERSIONS.json`` records the library versions that made the files.

transformers 5 writes safetensors only, so the ``pytorch_model-0000k-of-0000n.bin`` shards and
``pytorch_model.bin.index.json`` that many Hub models still carry come from transformers 4,
installed beside it (``--transformers4 DIR``, a ``pip install --target`` folder; ``make interop``
makes it) and run in a subprocess.

Usage: python tests/interop/make_golden.py OUT_DIR [--transformers4 DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys
import warnings

import safetensors.torch
import torch


def _reference(out: str, name: str, state_dict: dict) -> None:
    # Tied tensors are one storage; safetensors refuses shared storages, so each is cloned.
    tensors = {k: v.detach().clone().contiguous() for k, v in state_dict.items()}
    os.makedirs(os.path.join(out, "reference"), exist_ok=True)
    safetensors.torch.save_file(tensors, os.path.join(out, "reference", f"{name}.safetensors"))


def _tiny_gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, tie_word_embeddings=True,
                        bos_token_id=0, eos_token_id=0)  # fmt: skip
    return GPT2LMHeadModel(config).eval()


def transformers_files(out: str) -> None:
    model = _tiny_gpt2()
    model.save_pretrained(os.path.join(out, "hf_single"))
    model.save_pretrained(os.path.join(out, "hf_sharded"), max_shard_size="20KB")
    _reference(out, "hf", model.state_dict())


_BIN_SHARDS = """
import sys, torch, safetensors.torch, transformers
from transformers import GPT2Config, GPT2LMHeadModel
out = sys.argv[1]
torch.manual_seed(0)
config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, tie_word_embeddings=True,
                    bos_token_id=0, eos_token_id=0)
model = GPT2LMHeadModel(config).eval()
model.save_pretrained(out + "/hf_bin_sharded", safe_serialization=False, max_shard_size="20KB")
tensors = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
safetensors.torch.save_file(tensors, out + "/reference/hf_bin.safetensors")
print(transformers.__version__)
"""


def transformers4_bin_files(out: str, site: str) -> str:
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([site, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _BIN_SHARDS, out], env=env, capture_output=True, text=True, check=True)
    return done.stdout.strip().splitlines()[-1]


def accelerate_files(out: str) -> None:
    from accelerate import Accelerator

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    accelerator = Accelerator(cpu=True)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    loss = model(torch.randn(4, 8)).pow(2).mean()
    accelerator.backward(loss)
    optimizer.step()
    scheduler.step()
    accelerator.save_state(os.path.join(out, "accelerate_state"))
    _reference(out, "accelerate", accelerator.unwrap_model(model).state_dict())


def lightning_files(out: str) -> None:
    import pytorch_lightning as pl

    class Classifier(pl.LightningModule):
        def __init__(self, root: pathlib.Path, args: argparse.Namespace) -> None:
            super().__init__()
            # A Path and a Namespace in hyper_parameters: what torch's safe loader refuses.
            self.save_hyperparameters()
            self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

        def training_step(self, batch: torch.Tensor, _: int) -> torch.Tensor:
            return self.model(batch).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(2)
    module = Classifier(pathlib.Path("/data/runs"), argparse.Namespace(lr=0.1, depth=2))
    loader = torch.utils.data.DataLoader(torch.randn(8, 8), batch_size=4)
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=out)  # fmt: skip
    trainer.fit(module, loader)
    trainer.save_checkpoint(os.path.join(out, "lightning.ckpt"))
    _reference(out, "lightning", module.model.state_dict())  # the inner network's own names


def hydra_lightning_files(out: str) -> None:
    """A Lightning checkpoint as Hydra users write it: the config is an OmegaConf DictConfig
    (lists, nested dicts, interpolation), so its pickle names omegaconf classes and Python 2's
    ``__builtin__.list``/``dict``/``long``."""
    import pytorch_lightning as pl
    from omegaconf import DictConfig, OmegaConf

    class HydraModule(pl.LightningModule):
        def __init__(self, cfg: DictConfig) -> None:
            super().__init__()
            self.save_hyperparameters(cfg)
            width = cfg.model.width
            self.model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 4))

        def training_step(self, batch: torch.Tensor, _: int) -> torch.Tensor:
            return self.model(batch).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=self.hparams.optim.lr)

    cfg = OmegaConf.create({
        "model": {"width": 16, "layers": [8, 16, 4], "name": "mlp"},
        "optim": {"lr": 1e-3, "betas": [0.9, 0.999]},
        "data": {"root": "/data", "train": "${data.root}/train", "batch_size": 4},
        "seed": 5, "tags": ["hydra", "omegaconf"],
    })  # fmt: skip
    torch.manual_seed(5)
    module = HydraModule(cfg)
    loader = torch.utils.data.DataLoader(torch.randn(8, 8), batch_size=4)
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=out)  # fmt: skip
    trainer.fit(module, loader)
    trainer.save_checkpoint(os.path.join(out, "lightning_hydra.ckpt"))
    _reference(out, "lightning_hydra", module.model.state_dict())


def torch_files(out: str) -> None:
    """What torch.save users publish besides state dicts: a whole pickled module (its class from
    a module the reader may not have) and a training checkpoint with the weights nested."""
    sys.path.insert(0, os.path.dirname(__file__))
    from golden_models import TinyNet

    torch.manual_seed(6)
    net = TinyNet()
    net(torch.randn(4, 4))  # BatchNorm's running statistics move off their initial values
    torch.save(net, os.path.join(out, "whole_model.pt"))
    _reference(out, "whole_model", net.state_dict())
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.randn(4, 4)).sum().backward()
    optimizer.step()
    torch.save({"model": {"state_dict": net.state_dict(), "arch": "TinyNet"}, "optimizer": optimizer.state_dict(),
                "epoch": 3}, os.path.join(out, "nested_training.pt"))  # fmt: skip
    _reference(out, "nested_training", net.state_dict())


def dcp_files(out: str) -> None:
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving in a single process"
        dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                 checkpoint_id=os.path.join(out, "dcp"))  # fmt: skip
    _reference(out, "dcp", model.state_dict())


def compile_files(out: str) -> None:
    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    compiled = torch.compile(model)  # state_dict() names carry _orig_mod.
    torch.save(compiled.state_dict(), os.path.join(out, "compiled.pt"))
    wrapped = torch.nn.DataParallel(compiled)  # what DDP(torch.compile(m)) names: module._orig_mod.
    torch.save({"model": wrapped.state_dict(), "step": 7}, os.path.join(out, "ddp_compiled.pt"))
    _reference(out, "compiled", model.state_dict())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--transformers4", help="a folder holding transformers 4 (pip install --target)")
    args = parser.parse_args()
    out = args.out
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    transformers_files(out)
    accelerate_files(out)
    lightning_files(out)
    hydra_lightning_files(out)
    torch_files(out)
    dcp_files(out)
    compile_files(out)
    bin_version = transformers4_bin_files(out, args.transformers4) if args.transformers4 else None
    import accelerate
    import omegaconf
    import pytorch_lightning
    import transformers

    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "accelerate": accelerate.__version__, "pytorch-lightning": pytorch_lightning.__version__,
                "safetensors": safetensors.__version__, "omegaconf": omegaconf.__version__}  # fmt: skip
    if bin_version:
        versions["transformers (pytorch_model.bin shards)"] = bin_version
    with open(os.path.join(out, "VERSIONS.json"), "w") as f:
        json.dump(versions, f, indent=2, sort_keys=True)
        f.write("\n")
    total = sum(p.stat().st_size for p in pathlib.Path(out).rglob("*") if p.is_file())
    print(f"wrote {out}: {total} bytes; {versions}")


if __name__ == "__main__":
    main()
