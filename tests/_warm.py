"""Warm ranks: N processes joined in one gloo group once per test process, reused by every
multi-process test that does not end a process (torch's ``MultiProcContinuousTest`` shape).

`_dist.run_ranks` ships each test's function to a pool of its world size (`run`); each rank runs it
on its main thread, reports, then puts back what a test may leave behind and compares the process
with the state it had before its first test. What it cannot put back, or does not find as it was,
ends the pool: the next test gets fresh ranks. So a pooled test sees what a freshly forked rank
sees (the same environment, directory, RNG streams, signal handlers, ckptools state, one clean
group), or a fresh rank.

Put back before each test: the caller's environment (as a fresh rank gets it), the working
directory, ``sys.path``, the umask, the RNG states of torch, numpy and ``random`` (those of a rank
freshly forked from the forkserver), signal handlers, warnings filters and their once-registries,
the ``logging`` handlers and levels, torch's global switches (default dtype, grad mode,
deterministic algorithms, anomaly mode, threads).
Put back after each test: ckptools' end of a job (`lifecycle.end_job`: the save in flight finished,
node memory released, the keeper told to leave), every module attribute a test rebound (a fault
injected as ``zip_writer.write_shares = dies_midway(...)``) in ckptools, fsspec, torch.distributed,
torch.serialization and the os/time/signal modules, the contents of their module- and class-level
containers (``_NODE``, fsspec's registry and memory store), and ``sys.modules`` without the
packages the test imported.
Compared after each test (a difference ends the pool): the default group (still there, the same
object, no group added, the same number of collectives on every rank, and a collective that
carries the right sum), threads, child processes, mapped files, ckptools modules imported, signal
handlers that cannot be put back from Python.
A rank whose function raised reports and exits at once (its peers then fail fast in their next
collective, as with fresh ranks); the parent kills what is left of that pool.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import datetime
import gc
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import random
import re
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import _dist

# What one test process's pools did, for the tests of the pool and the closing line of a session.
STATS: dict[str, Any] = {"started": 0, "runs": 0, "reused": 0, "ended": collections.Counter()}

# Modules whose attributes a test may rebind in a rank (fault injection), and whose module- and
# class-level containers hold process-wide state; their attributes and those containers' contents
# are put back after each test.
_WATCHED = (
    "ckptools",
    "fsspec",
    "torch.distributed.distributed_c10d",
    "torch.distributed",
    "torch.serialization",
    "os",
    "os.path",
    "time",
    "signal",
    "shutil",
)
# Attributes that change by themselves and carry nothing from one test to the next.
_UNWATCHED = {
    "ckptools.collective.group._HELD",  # the Work of the last collectives, held for their release on this thread
}
# Threads a rank starts once and keeps for its life, as a fresh rank does from its first use on.
_LASTING_THREADS = (
    "ckptools-snapshot",  # node memory's commit thread (ckptools.node.commits)
    "fsspecIO",  # fsspec's event loop for s3fs, and its executor's threads
    "asyncio_",
)
_CLEAN_TIMEOUT = 30.0  # the seconds a rank may take to put its process back after a test
_LIMIT = 2  # pools kept per test process (a 2- and a 3-rank one, say): each rank holds ~0.5 GB


def _watched(name: str) -> bool:
    return any(name == w or name.startswith(w + ".") for w in _WATCHED) and not name.startswith("ckptools.integrations")


def _container(value: Any) -> bool:
    return isinstance(value, (list, dict, set, collections.deque, collections.OrderedDict, bytearray))


def _copy(value: Any) -> Any:
    return value.copy() if not isinstance(value, collections.deque) else collections.deque(value, value.maxlen)


def _put_back(container: Any, saved: Any) -> None:
    if isinstance(container, (dict, collections.OrderedDict)):
        container.clear()
        container.update(saved)
    elif isinstance(container, set):
        container.clear()
        container |= saved
    else:  # list, deque, bytearray
        container.clear()
        container.extend(saved)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (dict, collections.OrderedDict)):
        return isinstance(b, dict) and a.keys() == b.keys() and all(a[k] is b[k] for k in a)
    if isinstance(a, set):
        return a == b
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


class _Attributes:
    """Every attribute of the watched modules and of the classes defined in them, and the
    contents of their containers, as they are now; `put_back` undoes what a test changed."""

    def __init__(self) -> None:
        with warnings.catch_warnings():  # a deprecated name's object warns when looked at (torch.distributed.reduce_op)
            warnings.simplefilter("ignore")
            self._take()

    def _take(self) -> None:
        self.modules: dict[str, dict[str, Any]] = {}
        self.contents: list[tuple[Any, Any, str]] = []
        self.classes: list[tuple[type, dict[str, Any]]] = []
        for name, module in list(sys.modules.items()):
            if module is None or not _watched(name):
                continue
            attrs = dict(vars(module))
            self.modules[name] = attrs
            for attr, value in attrs.items():
                where = f"{name}.{attr}"
                if where in _UNWATCHED:
                    continue
                if _container(value):
                    self.contents.append((value, _copy(value), where))
                elif isinstance(value, type) and value.__module__ == name:
                    self.classes.append((value, dict(vars(value))))
                    for cattr, cvalue in vars(value).items():
                        if _container(cvalue):
                            self.contents.append((cvalue, _copy(cvalue), f"{where}.{cattr}"))

    def put_back(self) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._put_back()

    def _put_back(self) -> None:
        for name, attrs in self.modules.items():
            module = sys.modules.get(name)
            if module is None:
                continue
            now = vars(module)
            for attr, value in attrs.items():
                if f"{name}.{attr}" not in _UNWATCHED and now.get(attr, _MISSING) is not value:
                    setattr(module, attr, value)
            for attr in [a for a in now if a not in attrs and not a.startswith("__")]:
                # A name a test added to a module; a submodule imported meanwhile stays (torch's and
                # the libraries' modules are imported once per process, as in a fresh rank's life).
                if not isinstance(now[attr], type(sys)):
                    delattr(module, attr)
        for cls, attrs in self.classes:
            now = dict(vars(cls))
            for attr, value in attrs.items():
                if now.get(attr, _MISSING) is not value:
                    with contextlib.suppress(AttributeError, TypeError):
                        setattr(cls, attr, value)
            for attr in now.keys() - attrs.keys():
                if not attr.startswith("__"):
                    with contextlib.suppress(AttributeError, TypeError):
                        delattr(cls, attr)
        for container, saved, _ in self.contents:
            if not _same(container, saved):
                _put_back(container, saved)


_MISSING = object()


def _children() -> list[int]:
    """The pids of this process's children (of every thread)."""
    found = []
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/children") as f:
            found += [int(p) for p in f.read().split()]
    return sorted(found)


_LIBRARIES = re.compile(r"\.so(\.[0-9.]+)?$")


def _mapped_files() -> set[str]:
    """The data files this process maps (node memory's slots, a file torch.load mapped), not the
    shared libraries an import loads."""
    found = set()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[5].startswith("/") and not _LIBRARIES.search(fields[5].strip()):
                found.add(fields[5].strip())
    return found


_TESTS = os.path.dirname(os.path.abspath(__file__))


def _dropped(module: Any) -> bool:
    """Whether a module a test imported leaves ``sys.modules`` after it: the tests' own modules
    (their module-level state starts afresh, as in a fresh rank) and modules made at run time."""
    spec = getattr(module, "__spec__", None)
    origin = getattr(spec, "origin", None) or getattr(module, "__file__", None)
    return origin is None or os.path.abspath(origin).startswith(_TESTS + os.sep)


def _handlers() -> dict[int, Any]:
    handlers = {}
    for sig in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            handlers[sig] = signal.getsignal(sig)
    return handlers


def _warm_up(rank: int, world: int) -> None:
    """What most tests do first in a fresh rank, done once: the imports torch makes lazily (DDP
    brings in torch._dynamo, ~1.8 s), every ckptools module, a DDP step, a save and a load."""
    import pkgutil
    import tempfile

    import fsspec.implementations.local
    import fsspec.implementations.memory  # noqa: F401
    import numpy  # noqa: F401
    import pytest  # noqa: F401  # every test module imports it
    import torch

    import ckptools as ck

    for info in pkgutil.walk_packages(ck.__path__, "ckptools."):
        if not info.name.startswith(("ckptools.integrations.", "ckptools.__main__")):
            with contextlib.suppress(ImportError):
                __import__(info.name)
    from ckptools.owned.gradients import track

    track()  # what a loop's ck.init_distributed does before its first step: the save below warns of nothing
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    folder = tempfile.mkdtemp(prefix="warm-") if rank == 0 else None
    box = [folder]
    torch.distributed.broadcast_object_list(box, 0)
    state = {"model": model, "optimizer": opt}
    ck.save(os.path.join(box[0], "w.pt"), state, writers="all")
    ck.load(os.path.join(box[0], "w.pt"), state)
    ck.barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(box[0], ignore_errors=True)
    del model, opt, state
    gc.collect()


class _Process:
    """What a rank puts back before each test, and what it compares after it."""

    def __init__(self, rank: int, world: int, port: int, rng: tuple[Any, Any, Any]) -> None:
        import numpy as np
        import torch
        import torch.distributed as dist

        self.rank, self.world, self.port = rank, world, port
        self.rng = rng
        self.cwd = os.getcwd()
        self.path = list(sys.path)
        self.umask = os.umask(0o022)
        os.umask(self.umask)
        self.handlers = _handlers()
        self.blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        self.filters = list(warnings.filters)
        self.loggers = {
            name: (list(lg.handlers), lg.level, lg.propagate, lg.disabled)
            for name, lg in [("", logging.getLogger()), ("ckptools", logging.getLogger("ckptools"))]
        }
        self.disabled = logging.root.manager.disable
        self.torch = (torch.get_default_dtype(), torch.is_grad_enabled(), torch.are_deterministic_algorithms_enabled(),
                      torch.is_anomaly_enabled(), torch.get_num_threads())  # fmt: skip
        self.modules = set(sys.modules)
        self.ckptools = {name for name in sys.modules if name.startswith("ckptools")}
        self.attributes = _Attributes()
        self.threads = {t.ident for t in threading.enumerate()}
        self.maps = _mapped_files()
        self.group = dist.distributed_c10d._get_default_group()
        self.groups = len(dist.distributed_c10d._world.pg_map)
        self.np = np
        self.uses = 0

    def before(self, env: dict[str, str]) -> None:
        import torch

        os.environ.clear()
        os.environ.update(env)
        os.environ.update({"RANK": str(self.rank), "LOCAL_RANK": str(self.rank), "WORLD_SIZE": str(self.world),
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.port)})  # fmt: skip
        os.chdir(self.cwd)
        sys.path[:] = self.path
        os.umask(self.umask)
        for sig, handler in self.handlers.items():
            if handler is not None and signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, self.blocked)
        warnings.filters[:] = self.filters
        warnings._filters_mutated()  # every module's once-registry starts empty again
        for name, (handlers, level, propagate, disabled) in self.loggers.items():
            lg = logging.getLogger(name)
            lg.handlers[:] = handlers
            lg.setLevel(level)
            lg.propagate, lg.disabled = propagate, disabled
        logging.disable(self.disabled)
        dtype, grad, deterministic, anomaly, threads = self.torch
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(grad)
        torch.use_deterministic_algorithms(deterministic)
        torch.autograd.set_detect_anomaly(anomaly)
        torch.set_num_threads(threads)
        torch.set_rng_state(self.rng[0])
        self.np.random.set_state(self.rng[1])
        random.setstate(self.rng[2])
        mp.set_start_method("fork", force=True)
        from ckptools import log as _log

        _log._warned.clear()
        self.uses += 1

    def _new_threads(self) -> list[threading.Thread]:
        return [
            t for t in threading.enumerate() if t.ident not in self.threads and not t.name.startswith(_LASTING_THREADS)
        ]

    def after(self) -> tuple[list[str], int]:
        """Put the process back; what could not be (empty: reusable), and the group's sequence number."""
        import torch
        import torch.distributed as dist

        differences: list[str] = []
        if not dist.is_initialized() or dist.distributed_c10d._get_default_group() is not self.group:
            return ["the test ended or replaced the default process group"], -1
        # Every rank made as many collectives as the others, told through the store (not a collective:
        # one made by a rank alone would pair with it and hang).
        sequence = _sequence(self.group)
        store = dist.distributed_c10d._get_default_store()
        store.set(f"warm/{self.uses}/{self.rank}", str(sequence))
        keys = [f"warm/{self.uses}/{r}" for r in range(self.world)]
        store.wait(keys, datetime.timedelta(seconds=_CLEAN_TIMEOUT))
        counts = [int(store.get(key)) for key in keys]
        if len(set(counts)) > 1:
            return [f"the ranks made different numbers of collectives: {counts}"], sequence
        try:
            from ckptools.lifecycle import end_job

            end_job()  # the save in flight, node memory: what a job's normal end leaves
        except Exception as err:  # noqa: BLE001 - reported: the pool ends
            differences.append(f"ckptools' end of the job failed: {type(err).__name__}: {err}")
        gc.collect()
        self.attributes.put_back()
        for name in set(sys.modules) - self.modules:
            if name.startswith("ckptools"):
                differences.append(f"imported {name}")  # its state was never looked at: a fresh rank next
            elif _dropped(sys.modules[name]):
                del sys.modules[name]
        for sig, handler in self.handlers.items():
            with contextlib.suppress(OSError, ValueError, RuntimeError):
                if signal.getsignal(sig) is None and handler is not None:
                    differences.append(f"signal {sig} has a handler set outside Python")
        deadline = time.monotonic() + 5
        while (extra := self._new_threads()) and time.monotonic() < deadline:
            extra[0].join(0.1)
        if extra:
            differences.append(f"threads left running: {', '.join(t.name for t in extra)}")
        if children := _children():
            differences.append(f"child processes left: {children}")
        if maps := _mapped_files() - self.maps:
            differences.append(f"files left mapped: {sorted(maps)[:3]}")
        if len(dist.distributed_c10d._world.pg_map) != self.groups:
            differences.append("the test made process groups of its own")
        if not differences:
            # The group carries a collective as it should: a rank left inside one, or one that made
            # a collective its peers did not, would pair this one with another.
            probe = torch.tensor([float(self.uses)])
            dist.all_reduce(probe)
            if probe.item() != self.uses * self.world:
                differences.append(
                    f"the group's check-up collective summed {probe.item()}, not {self.uses * self.world}"
                )
        return differences, _sequence(self.group)


def _sequence(group: Any) -> int:
    try:
        return int(group._get_sequence_number_for_group())
    except (AttributeError, RuntimeError):  # not tracked by this torch: the check-up sum stands alone
        return -1


def _serve(rank: int, world: int, port: int, conn: Any, env: dict[str, str]) -> None:
    """A warm rank's life: join the group, warm up, then run what the parent sends until told to go."""
    import numpy as np
    import torch
    import torch.distributed as dist

    # The streams a rank freshly forked from the forkserver starts with (before the warm-up draws).
    rng = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    os.environ.clear()
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})  # fmt: skip
    mp.set_start_method("fork", force=True)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))  # fmt: skip
        _warm_up(rank, world)
        process = _Process(rank, world, port, rng)
        _send(conn, ("ready", None))
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        _send(conn, ("error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
        _leave(conn)
    while True:
        try:
            message = _recv(conn)
        except (EOFError, OSError):  # the test process is gone
            _leave(conn)
        if message is None:
            _leave(conn)
        fn, args, env = message
        process.before(env)
        try:
            outcome: tuple[str, Any] = ("ok", fn(rank, world, *args))
        except BaseException as err:  # noqa: BLE001 - reported to the parent, which fails the test
            outcome = ("error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
        try:
            _send(conn, outcome)
        except Exception as err:  # noqa: BLE001 - a result that does not pickle
            _send(conn, ("error", f"its result could not be sent back: {type(err).__name__}: {err}"))
            outcome = ("error", None)
        if outcome[0] != "ok":
            _leave(conn)
        try:
            differences, sequence = process.after()
        except BaseException as err:  # noqa: BLE001
            differences, sequence = [f"putting the process back failed: {type(err).__name__}: {err}"], -1
        _send(conn, ("clean", (differences, sequence)))
        if differences:
            _leave(conn)


def _send(conn: Any, message: Any) -> None:
    # Plain pickle, not multiprocessing's: that one sends a tensor as shared memory and a descriptor
    # (torch's reductions), which keeps a sharing thread and a mapping alive in the rank after the test.
    conn.send_bytes(pickle.dumps(message))


def _recv(conn: Any) -> Any:
    return pickle.loads(conn.recv_bytes())


def _leave(conn: Any) -> None:
    """Go without destroying the gloo group (see `_dist._exit_now` for why)."""
    with contextlib.suppress(Exception):
        conn.close()
    os._exit(0)


class Pool:
    """``world`` warm ranks in one gloo group, and the pipes to them."""

    def __init__(self, world: int) -> None:
        ctx = _dist._context()
        port = _dist.free_port()
        self.world = world
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        env = dict(os.environ)
        for rank in range(world):
            here, there = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(rank, world, port, there, env), name=f"warm-rank-{rank}")
            proc.start()
            there.close()
            self.conns.append(here)
            self.procs.append(proc)
        STATS["started"] += 1
        errors = self._gather("ready", 120)[1]
        if errors:
            self.close()
            raise RuntimeError("warm ranks failed to start:\n" + "\n".join(errors))

    def _gather(self, expected: str, timeout: float) -> tuple[dict[int, Any], list[str]]:
        """One message from every rank: values by rank, and what went wrong instead."""
        values: dict[int, Any] = {}
        errors: list[str] = []
        pending = dict(enumerate(self.conns))
        deadline = time.monotonic() + timeout
        while pending:
            ready = multiprocessing.connection.wait(
                list(pending.values()), timeout=max(0.0, deadline - time.monotonic())
            )
            if not ready:
                errors += [f"rank {rank}: no report within {timeout:.0f} s" for rank in sorted(pending)]
                break
            for conn in ready:
                rank = next(r for r, c in pending.items() if c is conn)
                del pending[rank]
                try:
                    status, value = _recv(conn)
                except (EOFError, OSError):
                    self.procs[rank].join(1)
                    errors.append(f"rank {rank}: died without reporting (exit code {self.procs[rank].exitcode})")
                    continue
                if status == expected:
                    values[rank] = value
                else:
                    errors.append(f"rank {rank}: {value}")
        return values, errors

    def run(self, fn: Callable[..., Any], args: tuple, timeout: float) -> tuple[list[Any], list[str], list[str]]:
        """Run ``fn`` on every rank: (results by rank, errors, why the pool cannot be reused)."""
        env = dict(os.environ)
        for conn in self.conns:
            _send(conn, (fn, args, env))
        results, errors = self._gather("ok", timeout)
        if errors:
            return [], errors, ["a rank failed"]
        cleaned, trouble = self._gather("clean", _CLEAN_TIMEOUT)
        ended = list(trouble)
        for rank, (differences, _) in sorted(cleaned.items()):
            ended += [f"rank {rank}: {d}" for d in differences]
        if len({sequence for _, sequence in cleaned.values()}) > 1:
            ended.append(f"the ranks made different numbers of collectives: {[s for _, s in cleaned.values()]}")
        return [results[r] for r in range(self.world)], [], ended

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(Exception):
                _send(conn, None)
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self.conns:
            with contextlib.suppress(Exception):
                conn.close()

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(5)
        for conn in self.conns:
            with contextlib.suppress(Exception):
                conn.close()


_POOLS: collections.OrderedDict[int, Pool] = collections.OrderedDict()


def run(fn: Callable[..., Any], world: int, args: tuple, timeout: float) -> list[Any]:
    """``fn(rank, world, *args)`` on this test process's warm ``world``-rank pool (started on first
    use); results by rank. An error on any rank fails the call (and ends the pool)."""
    began = time.monotonic()
    pool = _POOLS.pop(world, None)
    reused = pool is not None
    if pool is None:
        while len(_POOLS) >= _LIMIT:
            _POOLS.popitem(last=False)[1].close()
        pool = Pool(world)
    else:
        STATS["reused"] += 1
    STATS["runs"] += 1
    done = False
    try:
        results, errors, ended = pool.run(fn, args, timeout)
        done = True
    finally:
        if not done:  # interrupted (a pytest-timeout, Ctrl-C): nobody knows where the ranks are
            pool.kill()
            STATS["ended"]["interrupted"] += 1
    if ended:
        pool.kill()
        for reason in ended:
            STATS["ended"][reason.split(": ", 1)[-1][:80]] += 1
    else:
        _POOLS[world] = pool
    if os.environ.get("CKPTOOLS_WARM_LOG"):  # what the pools did, test by test (docs/development.md)
        with open(os.environ["CKPTOOLS_WARM_LOG"], "a") as log:
            test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
            said = f" ended: {'; '.join(ended)}" if ended else ""
            how = "reused" if reused else "started"
            print(f"{os.getpid()} {world} {how} {time.monotonic() - began:.2f}s {test}{said}", file=log)
    if errors:
        raise AssertionError("\n".join(errors))
    return results


@atexit.register
def _close_all() -> None:
    while _POOLS:
        _POOLS.popitem()[1].close()
