"""Joining the job's process group: `init_distributed` (torchrun's environment, restart attempts
isolated, a group of one without a launcher) and which GPU a rank uses."""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch

from .. import log
from ..errors import CheckpointError
from .group import dist_ready, get_local_rank, local_world_size, set_timeout, settle_at_exit

__all__ = ["gpu_of", "init_distributed", "libc_prctl", "local_gpu", "spawn_parent"]


def _refuse_while_a_child_imports_main() -> None:
    """Raise when called by a process multiprocessing is still starting, as it imports the main script.

    A DataLoader worker (or any process) started with the ``spawn`` or ``forkserver`` method
    imports the main script again before it runs; a script without an ``if __name__ ==
    "__main__":`` guard then calls ``init_distributed`` in the worker, which joins the rendezvous
    as a rank that is already there and waits forever, with no message. multiprocessing marks
    that import (``_inheriting``; its own ``freeze_support`` check reads the same flag).
    """
    import multiprocessing
    import sys

    if not getattr(multiprocessing.current_process(), "_inheriting", False):
        return
    script = getattr(sys.modules.get("__mp_main__"), "__file__", None) or "the main script"
    raise CheckpointError(
        f"ckptools.init_distributed() was called while a process started by multiprocessing (a DataLoader worker "
        f"with the 'spawn' or 'forkserver' start method, or mp.spawn) was importing {script}: it would join the "
        "process group a second time and wait forever. Put the script's training code under "
        '`if __name__ == "__main__":` (workers import the script, and must not run it)'
    )


def init_distributed(backend: str | None = None, *, timeout: datetime.timedelta | None = None) -> torch.device:
    """Initialise the default process group from torchrun's environment; return this rank's device.

    - Picks ``nccl`` and ``cuda:LOCAL_RANK`` (and calls ``torch.cuda.set_device``) when CUDA is
      available, else ``gloo`` and ``cpu``. ``backend`` overrides the choice. Where a node runs
      more ranks than it has GPUs (``torchrun --nproc-per-node=2`` on one GPU, for debugging),
      the ranks share the GPUs in turn over ``gloo`` (nccl refuses two ranks on one GPU), with a
      warning.
    - Isolates torchrun restart attempts: torchrun keeps one TCPStore across restarts and the
      failed attempt's keys stay in it (pytorch#135712), so a plain ``init_process_group`` after a
      restart can read stale keys and hang or fail. Every key of this attempt is put under a
      prefix derived from ``TORCHELASTIC_RESTART_COUNT``.
    - Without ``WORLD_SIZE`` in the environment (a plain ``python script.py``, for debugging) it
      makes a process group of one rank (an in-process store: no port, no launcher), so a script
      written for torchrun, DDP included, runs unchanged. ckptools' own calls need no group; a
      script that never calls this runs as rank 0 of 1 too.
    - If a default group already exists it is left alone.

    Args:
        backend: ``"nccl"``, ``"gloo"`` or None to choose by device.
        timeout: collective timeout; torch's default when None.

    Returns:
        The device this rank should put its model on.

    Raises:
        ValueError: the environment names a rank or world size that is not an integer, or
            ``MASTER_ADDR``/``MASTER_PORT`` are missing while ``WORLD_SIZE`` is set, or
            ``backend="nccl"`` is asked for while ranks share a GPU.
        CheckpointError: called while a spawned DataLoader worker imports a script that lacks an
            ``if __name__ == "__main__":`` guard (it would wait in the rendezvous forever).

    Examples:
        >>> import ckptools as ck, torch
        >>> device = ck.init_distributed()  # under torchrun: joins the group; run alone: a group of one
        >>> device.type, ck.get_world_size(), torch.distributed.is_initialized()
        ('cpu', 1, True)
        >>> torch.distributed.destroy_process_group()  # (a script leaves through ck.exit_process)
    """
    _refuse_while_a_child_imports_main()
    cuda = torch.cuda.is_available()
    local_rank = get_local_rank()
    shared = False
    if cuda:
        index, shared = gpu_of(local_rank, local_world_size(local_rank + 1), torch.cuda.device_count())
        device = torch.device("cuda", index)
        # Before any CUDA work: otherwise every rank's context lands on GPU 0.
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    if dist_ready():
        return device
    if "WORLD_SIZE" not in os.environ:  # no launcher: a group of one, so DDP and the collectives work
        alone: dict[str, Any] = {"backend": backend or ("nccl" if cuda else "gloo"), "rank": 0, "world_size": 1}
        alone["store"] = torch.distributed.HashStore()  # type: ignore[attr-defined]  # exported, not in __all__
        if timeout is not None:
            alone["timeout"] = timeout
        if alone["backend"] == "nccl":
            alone["device_id"] = device
        torch.distributed.init_process_group(**alone)
        settle_at_exit()
        set_timeout(timeout)
        return device

    env = {name: os.environ.get(name) for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    missing = [name for name, value in env.items() if value is None]
    if missing:
        raise ValueError(
            f"WORLD_SIZE is set but {', '.join(missing)} is not; launch with torchrun, or set "
            "RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT yourself"
        )
    try:
        rank, world_size, port = (int(env[name] or "") for name in ("RANK", "WORLD_SIZE", "MASTER_PORT"))
    except ValueError as err:
        raise ValueError(f"RANK/WORLD_SIZE/MASTER_PORT must be integers, got {env}") from err
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if shared:
        if backend == "nccl":
            raise ValueError(
                f"{local_world_size(local_rank + 1)} processes on this node share {torch.cuda.device_count()} GPU(s), "
                "and nccl refuses two ranks on one GPU: pass backend='gloo' (or None), or launch at most one "
                "process per GPU (torchrun --nproc-per-node)"
            )
        if backend is None and local_rank == 0:
            log.warn(
                f"{local_world_size(local_rank + 1)} processes on this node share {torch.cuda.device_count()} GPU(s): "
                f"rank {rank} uses {device}, and the process group is gloo (nccl refuses two ranks on one GPU; "
                "gloo moves CUDA tensors through host memory). Right for debugging and tests, slow for training",
                once="shared-gpu",
                all_ranks=True,
            )
        backend = backend or "gloo"
    backend = backend or ("nccl" if cuda else "gloo")
    store_timeout = timeout or datetime.timedelta(minutes=30)

    # Under torchrun the agent hosts the store and every worker is a client; launched by hand,
    # rank 0 hosts it (the same rule as torch.distributed.rendezvous._create_c10d_store).
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    base = torch.distributed.TCPStore(  # type: ignore[attr-defined]  # exported, not in __all__
        host_name=env["MASTER_ADDR"] or "",
        port=port,
        world_size=world_size,
        is_master=(not agent_store and rank == 0),
        timeout=store_timeout,
        wait_for_workers=False,
    )
    store = torch.distributed.PrefixStore(f"ckptools/attempt_{attempt}", base)  # type: ignore[attr-defined]
    kwargs: dict[str, Any] = {"backend": backend, "store": store, "rank": rank, "world_size": world_size}
    if timeout is not None:
        kwargs["timeout"] = timeout
    if backend == "nccl" and cuda:
        kwargs["device_id"] = device
    torch.distributed.init_process_group(**kwargs)
    settle_at_exit()
    set_timeout(timeout)
    return device


def local_gpu() -> int:
    """The index of this rank's GPU: ``LOCAL_RANK`` where the node has a GPU per rank, else the GPUs in
    turn (``LOCAL_RANK % device_count``; see `init_distributed`). Needs CUDA."""
    return get_local_rank() % torch.cuda.device_count()


def gpu_of(local_rank: int, local_world: int, gpus: int) -> tuple[int, bool]:
    """The GPU a local rank uses, and whether this node's ranks share GPUs (more ranks than GPUs).

    One GPU per rank where there are enough; otherwise the ranks take the GPUs in turn
    (``local_rank % gpus``), which nccl refuses and gloo allows.

    Examples:
        >>> gpu_of(1, 8, 8), gpu_of(1, 2, 1), gpu_of(3, 4, 2)
        ((1, False), (0, True), (1, True))
    """
    return local_rank % gpus, local_world > gpus


def libc_prctl() -> Any:
    """libc's ``prctl`` (Linux), looked up once per process, else None.

    Look it up before DataLoader workers are forked (`ckptools.Preemption.protect` does): ``ctypes.CDLL``
    is a ``dlopen``, which takes the dynamic loader's lock, and a worker forked while another thread of
    the rank held that lock would wait for it forever. A forked worker then only calls what it inherited.
    """
    if not _PRCTL:
        import ctypes

        try:
            _PRCTL.append(ctypes.CDLL(None, use_errno=True).prctl)
        except (OSError, AttributeError):
            _PRCTL.append(None)  # not Linux
    return _PRCTL[0]


_PRCTL: list[Any] = []


def spawn_parent() -> int | None:
    """The pid of the ``torch.multiprocessing.spawn`` parent that started this process, or None.

    torch's ``mp.spawn`` has each worker receive SIGINT when its parent dies (``PR_SET_PDEATHSIG``, set
    before the worker's function runs): that tells its workers from another launcher's children. Ask
    it from inside the worker's function, on its main thread (Linux; None elsewhere).

    Examples:
        >>> spawn_parent() is None  # not a worker of mp.spawn
        True
    """
    import ctypes
    import signal

    prctl = libc_prctl()
    if prctl is None:
        return None
    found = ctypes.c_int(0)
    if prctl(2, ctypes.byref(found), 0, 0, 0) != 0:  # PR_GET_PDEATHSIG
        return None
    parent = os.getppid()
    return parent if found.value == int(signal.SIGINT) and parent != 1 else None
