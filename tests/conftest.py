from __future__ import annotations

import contextlib
import os
import sys

# Multi-process helpers live beside the tests; spawned children import them by module name.
sys.path.insert(0, os.path.dirname(__file__))
# Two cores here: keep torch from oversubscribing them with intra-op threads in every process.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
from _s3 import s3_env  # noqa: F401  # the moto S3 server fixture, for test_s3 and test_lightning


@pytest.fixture
def cuda_tagged_file(tmp_path):
    """A checkpoint whose storages are tagged ``cuda:1``, as if saved on a GPU machine.

    torch.save asks ``torch.serialization.location_tag`` where each storage lives; answering
    "cuda:1" writes exactly what a save from GPU 1 writes, without needing a GPU.
    """
    import torch.serialization as ts

    path = tmp_path / "from_gpu1.pt"
    real = ts.location_tag
    ts.location_tag = lambda storage: "cuda:1"
    try:
        torch.save({"model": {"weight": torch.full((3, 3), 2.0), "bias": torch.zeros(3)}, "step": 4}, path)
    finally:
        ts.location_tag = real
    return path


@pytest.fixture
def gloo_group():
    """A real one-process gloo group in this process (for APIs such as DDP that need one)."""
    import torch.distributed as dist
    from _dist import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _fresh_warnings_once():
    """ckptools warns about a hazard once per process; each test starts with none warned yet."""
    from ckptools import log as _log

    _log._warned.clear()
    yield
    _log._warned.clear()


@pytest.fixture(autouse=True)
def _no_async_save_left():
    """An async save a test left in flight is finished (and its buffers freed) before the next test."""
    yield
    from ckptools.write import async_save as background

    handle = background.pending()
    if handle is not None and not torch.distributed.is_initialized():
        with contextlib.suppress(Exception):  # the test that left it saw (or ignored) its failure
            handle.wait()
    background.SAVES.stager.release()


# The slowest tests run first: those marked `slow` (whole jobs, 20-110 s each), then the files of the
# longest fast ones (launches under torchrun, kill loops, moto). With pytest-xdist the last minutes of a
# run are then short tests that spread over every worker, instead of one worker finishing a long
# end-to-end run while the others idle (`make compat` collected Lightning's 107 s kill loop late, `make
# interop` ended on the ported scripts' 40 s kills). The Makefile hands tests out in this order
# (`--dist load`, one or two at a time): `worksteal` gave the first half of the list, every slow test,
# to one worker, and the other stole from its end.
_SLOW_FIRST = ("test_train_ddp_e2e.py", "test_quickstart_e2e.py", "test_s3.py", "test_crash.py", "test_faults.py")


def pytest_collection_modifyitems(config, items):
    items.sort(
        key=lambda item: (
            item.get_closest_marker("slow") is None,
            item.nodeid.split("::")[0].rsplit("/", 1)[-1] not in _SLOW_FIRST,
        )
    )
