"""The training loop's side of a resume: what a loop uses between checkpoints.

``sampler.py`` (`ResumableDistributedSampler`), ``seeded.py`` (`SeededDataset`), ``preemption.py``
(`Preemption`: signals agreed on at a step boundary), ``process.py`` (`init_distributed`, `exit_process`).
"""
