"""Adapters for training frameworks, each imported only when used (its framework is an optional extra).

- `ckptools.integrations.lightning`: a Lightning ``CheckpointIO`` plugin, sync and async.
- `ckptools.integrations.transformers`: a ``TrainerCallback`` sealing each ``checkpoint-N/`` with a
  manifest, and `latest_complete_checkpoint` for ``trainer.train(resume_from_checkpoint=...)``.
"""
