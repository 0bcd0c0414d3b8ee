"""The version of ckptools, in a module of its own: what imports it imports nothing else."""

__version__ = "0.4.0"
