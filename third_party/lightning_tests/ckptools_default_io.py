"""A pytest plugin: ckptools' Lightning plugin as every strategy's default CheckpointIO.

``CKPTOOLS_LIGHTNING_IO=sync`` puts `CkptoolsCheckpointIO`, ``async`` `AsyncCkptoolsCheckpointIO`,
where Lightning would make its ``TorchCheckpointIO``. The few tests that examine Lightning's own
``TorchCheckpointIO`` rather than what a checkpoint plugin does are deselected, each with why. A
background save still being written when a test ends is waited for before Lightning's check that no
thread outlives a test, as the interpreter waits for it at exit.
"""

from __future__ import annotations

import os
import threading

import pytest

import lightning_fabric.strategies.strategy as fabric_strategy
import pytorch_lightning.strategies.strategy as pl_strategy

from ckptools.integrations.lightning import AsyncCkptoolsCheckpointIO, CkptoolsCheckpointIO

_KIND = os.environ.get("CKPTOOLS_LIGHTNING_IO", "sync")
_IO = {"sync": CkptoolsCheckpointIO, "async": AsyncCkptoolsCheckpointIO}[_KIND]
pl_strategy.TorchCheckpointIO = _IO
fabric_strategy.TorchCheckpointIO = _IO

# node id (a prefix: every parameter) -> why it does not apply to another CheckpointIO
LIGHTNING_INTERNALS = {
    "tests_pytorch/checkpointing/test_checkpoint_callback_frequency.py::test_default_checkpoint_freq":
        "counts calls of torch.save, which TorchCheckpointIO makes and ckptools' writer does not",
    "tests_pytorch/checkpointing/test_checkpoint_callback_frequency.py::test_top_k":
        "counts calls of torch.save, which TorchCheckpointIO makes and ckptools' writer does not",
    "tests_pytorch/checkpointing/test_trainer_checkpoint.py::test_trainer_save_checkpoint_storage_options":
        "matches TorchCheckpointIO's own message for storage_options (refused by both, in other words)",
    "tests_pytorch/plugins/test_checkpoint_io_plugin.py::test_multi_wrapped_checkpoint_io_initialization":
        "asserts that the default CheckpointIO is TorchCheckpointIO",
    "tests_pytorch/checkpointing/test_model_checkpoint.py::test_model_checkpoint_path":
        "needs tensorboard (Lightning's default logger), which the interop extra does not install",
    "tests_pytorch/checkpointing/test_model_checkpoint.py::test_checkpoint_repeated_strategy_extended":
        "needs tensorboard (Lightning's default logger), which the interop extra does not install",
}
if _KIND == "async":
    LIGHTNING_INTERNALS["tests_pytorch/checkpointing/test_model_checkpoint.py::test_none_monitor_not_alternating"] = (
        "lists the folder during fit, where a background write's temporary file is, by design, until it is renamed"
    )
    for _name in ("test_none_monitor_saves_correct_best_model_path", "test_save_last_saves_correct_last_model_path"):
        LIGHTNING_INTERNALS[f"tests_pytorch/checkpointing/test_model_checkpoint.py::{_name}"] = (
            "saves with no trainer teardown, then lists the folder and loads the file at once: the background "
            "write may still be running then (its thread outlived the test twice in make interop, stop 53)"
        )


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    """Before the test's fixtures end (Lightning's conftest then checks that no thread outlives a test),
    wait for a background save still being written, as the interpreter does at exit: the writer thread
    is not a daemon by design, so that a script that returns with a save in flight still gets its file."""
    for thread in threading.enumerate():
        if thread.name == "ckptools-lightning-save":
            thread.join(timeout=120)
    yield


def pytest_collection_modifyitems(config, items):
    kept, dropped = [], []
    for item in items:
        (dropped if any(item.nodeid.startswith(n) for n in LIGHTNING_INTERNALS) else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_report_header(config):
    return f"ckptools: {_IO.__name__} is every strategy's default CheckpointIO; {len(LIGHTNING_INTERNALS)} tests deselected"
