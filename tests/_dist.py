"""Run a function on N real processes joined in a gloo process group on 127.0.0.1."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import random
import socket
import traceback
from collections.abc import Callable, Iterator
from typing import Any

# Ports for test servers come from below the kernel's ephemeral range (32768-60999 by default), so
# the port a test picked cannot be handed meanwhile to an outgoing connection (a gloo peer's, a
# moto client's), and from a block of its own per pytest-xdist worker, so two tests running side by
# side never pick the same one. Within a block, each call moves on to the next port.
_BLOCK = 2000
_XDIST = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
_FIRST = 20000 + (int(_XDIST) % 6 if _XDIST.isdigit() else 0) * _BLOCK
_next = _FIRST + random.randrange(_BLOCK)


def free_port() -> int:
    """A loopback TCP port free now, from this test process's own block (see above)."""
    global _next
    for _ in range(_BLOCK):
        port, _next = _next, _FIRST + (_next + 1 - _FIRST) % _BLOCK
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use (or in TIME_WAIT): the next one
            return port
    raise RuntimeError(f"no free port in {_FIRST}-{_FIRST + _BLOCK - 1}")


def _context() -> Any:
    """Ranks start from a forkserver that has imported torch and ckptools once per test process: a
    fresh, single-threaded process forked per rank (as clean as ``spawn``), without each rank paying
    the ~1.4 s of CPU that importing torch costs (dozens of ranks per ``make test``)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


# What the forkserver imports once, so that no rank imports it again: torch, ckptools, and what
# the first DDP model imports lazily (torch._dynamo and the FSDP and DTensor modules it pulls in:
# ~1.8 s of CPU per rank otherwise), pytest (every test module imports it).
_PRELOAD = ["torch", "torch.distributed", "numpy", "ckptools", "ckptools.saving", "ckptools.read",
            "ckptools.manager", "torch._dynamo", "torch.nn.parallel.distributed", "torch.optim", "pytest",
            "fsspec.implementations.memory", "_dist", "_warm"]  # fmt: skip


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple,
    queue: Any,
    pg_timeout: float = 60,
    env: dict[str, str] | None = None,
    leave: Any = None,
) -> None:
    import datetime

    import torch.distributed as dist

    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    # A rank under torchrun is a plain process whose DataLoader workers fork; a forkserver's child
    # would start them from a forkserver of its own.
    mp.set_start_method("fork", force=True)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which fails the test
        queue.put((rank, "error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
    _exit_now(queue, leave)


def _exit_now(queue: Any, leave: Any = None) -> None:
    """Deliver the result, then leave without destroying the gloo group.

    Destroying a gloo group (or a DDP model holding it) joins its worker threads with the GIL
    held, which can deadlock against a worker releasing a collective's Python tensors; see the
    reference loop guide's Teardown note (docs/guides/reference-loop.md). The parent only needs the result.
    Every rank waits for ``leave`` (set by the parent once each rank reported): rank 0 hosts the
    group's store, and a rank whose function made no collective could otherwise finish and take the
    store away while another rank is still joining the group (seen under load: "Failed to recv").
    """
    queue.close()
    queue.join_thread()
    if leave is not None:
        leave.wait(120)
    os._exit(0)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    timeout: float = 120,
    may_die: frozenset[int] = frozenset(),
    pg_timeout: float = 60,
    fresh: str | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks of one gloo group; return results by rank.

    ``fn`` must be a module-level function (it is pickled by name). Any exception on any rank, or a
    rank that does not report within ``timeout`` seconds, fails the calling test.

    By default the ranks are this test process's warm ones (`_warm`: started once, reused by every
    test, put back as a fresh rank between tests). ``fresh="why"`` starts new processes for this
    call instead, for a test whose subject is a process's end or its group's making: ranks in
    ``may_die`` may vanish without reporting (their result is None; the others are waited for), and
    ``pg_timeout`` is the group's collective timeout in seconds; either needs a ``fresh`` reason.
    ``CKPTOOLS_TEST_FRESH_RANKS=1`` makes every call fresh (to tell a test's fault from the pool's).
    A pooled call ends as a job that ended normally (`ckptools.lifecycle.end_job`: its node memory
    released), a fresh one as a job whose processes died (``os._exit``: node memory and its keeper
    left for a relaunch); a test whose next call relaunches onto that memory makes this one fresh.
    """
    if (may_die or pg_timeout != 60) and not fresh:
        raise TypeError("run_ranks: may_die and pg_timeout need fresh ranks: say why with fresh='...'")
    if not fresh and os.environ.get("CKPTOOLS_TEST_FRESH_RANKS") != "1":
        import _warm

        return _warm.run(fn, world_size, args, timeout)
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    env = dict(os.environ)  # as now: the forkserver started with the environment of its own first use
    leave = ctx.Event()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, args, queue, pg_timeout, env, leave))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        pending = set(range(world_size)) - set(may_die)
        while pending:
            rank, status, value = queue.get(timeout=timeout)
            pending.discard(rank)
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank}: {value}")
    finally:
        leave.set()  # every rank that reported may go now (see _exit_now)
        for rank, p in enumerate(procs):
            # A rank allowed to die (or to hang: the scenario under test) is not waited for once
            # every other rank has reported; the others get 10 s to leave.
            p.join(timeout=1 if rank in may_die else 10)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results.get(r) for r in range(world_size)]


@contextlib.contextmanager
def counting_sent() -> Iterator[list[int]]:
    """Bytes this rank hands to torch.distributed's collectives inside the block (``[n]``): patched
    in both namespaces (ckptools calls ``torch.distributed.X``; torch's object collectives and
    ZeRO's consolidation reach ``distributed_c10d.X``)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    sent = [0]
    rank = dist.get_rank()

    def nbytes(t) -> int:
        return sum(x.nbytes for x in t) if isinstance(t, (list, tuple)) else t.nbytes

    # The argument each collective sends from this rank (broadcast: only from its source).
    sends = {
        "broadcast": lambda t, src=0, *a, **k: nbytes(t) if (k.get("src", src) == rank) else 0,
        "all_gather": lambda out, t, *a, **k: nbytes(t),
        "all_gather_into_tensor": lambda out, t, *a, **k: nbytes(t),
        "all_reduce": lambda t, *a, **k: nbytes(t),
        "reduce": lambda t, *a, **k: nbytes(t),
        "gather": lambda t, *a, **k: nbytes(t),
        "scatter": lambda out, lst=None, *a, **k: nbytes(lst or []),
        "send": lambda t, *a, **k: nbytes(t),
        "isend": lambda t, *a, **k: nbytes(t),
        "all_to_all_single": lambda out, t, *a, **k: nbytes(t),
        "reduce_scatter_tensor": lambda out, t, *a, **k: nbytes(t),
    }
    real = {name: getattr(c10d, name) for name in sends}

    def counted(name):
        def call(*args, **kwargs):
            sent[0] += sends[name](*args, **kwargs)
            return real[name](*args, **kwargs)

        return call

    for name in sends:
        setattr(dist, name, counted(name))
        setattr(c10d, name, counted(name))
    try:
        yield sent
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
            setattr(c10d, name, fn)
