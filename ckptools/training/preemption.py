"""``Preemption``: catch SIGTERM/SIGUSR1, agree across ranks at a step boundary, save, leave together."""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

from .. import log
from ..collective.arrival import arrive, checked_in
from ..collective.group import get_rank, launcher_gone, max_over_ranks
from ..collective.launch import libc_prctl, spawn_parent
from ..lifecycle import end_job
from .process import leave

__all__ = ["Preemption"]

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def _die_with_parent() -> None:
    """Have the kernel kill this DataLoader worker the moment its rank process dies (Linux).

    A worker forked after ``init_process_group`` holds copies of the rank's sockets: when the rank
    dies (a crash, ``kill -9``, ``os._exit``), its gloo connections stay open until its orphaned
    workers notice (torch's watchdog polls every 5 s), so the other ranks find out seconds late.
    Ignoring SIGTERM (below) must not make workers outlive their rank either. Runs in the worker:
    it imports nothing and opens no library (see `libc_prctl`; a spawned worker looks it up afresh).
    """
    prctl = libc_prctl()
    if prctl is None:
        return
    prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    parent = multiprocessing.parent_process()  # the rank
    if parent is None or parent.pid is None or os.getppid() == parent.pid:
        return
    # Not the rank's child: an orphan whose rank died before the line above took effect, or a
    # forkserver's child. The forkserver shares the rank's process group and does not ignore
    # SIGTERM, so a worker tied to it would die with it at the first signal to the group: such a
    # worker is left to torch's watchdog (which ends it within 5 s of its rank).
    try:
        os.kill(parent.pid, 0)
    except ProcessLookupError:
        os._exit(0)
    prctl(1, 0, 0, 0, 0)


class _IgnoreSignals:
    """A DataLoader ``worker_init_fn`` that makes the worker ignore the given signals, then runs
    the loader's own ``worker_init_fn``. A class rather than a closure so that it pickles for
    the ``spawn`` and ``forkserver`` start methods."""

    def __init__(self, signals: tuple[int, ...], inner: Callable[[int], Any] | None) -> None:
        self.signals = signals
        self.inner = inner

    def __call__(self, worker_id: int) -> None:
        _die_with_parent()
        for signum in self.signals:
            signal.signal(signum, signal.SIG_IGN)
        # A forked worker inherits the parent's wakeup fd; its signals must not wake the
        # parent's watchdog.
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(-1)
        if self.inner is not None:
            self.inner(worker_id)


class Preemption:
    """Stop a DDP job cleanly when the scheduler says so: every rank saves at the same step, then leaves.

    Creating it installs handlers for ``signals`` (SIGTERM and SIGUSR1 by default: what
    ``scancel``, Kubernetes, spot reclaim and torchrun send, and what SLURM's
    ``--signal=USR1@90`` sends) that only record the signal. At each step boundary the loop
    asks `should_stop`, a collective that returns the same answer on every rank at the
    same step: True if *any* rank got a signal. Signals land on ranks at different moments
    (or on one rank only); a rank that left on its own would hang the others in their next
    collective, so nobody leaves before they agree. Then the loop saves and calls
    `exit`, which finishes any async save in flight and makes every rank exit together
    with `exit_code` (128 + the signal number: 143 for SIGTERM, 138 for SIGUSR1, what a
    shell reports for a process ended by that signal; pass ``exit_code=`` to choose).

    SIGTERM sent to a whole process group also reaches DataLoader workers, which die of it,
    and the loop then dies fetching its next batch before any save. `protect` makes a
    loader's workers ignore the signals (they stop when the main process stops them, or when
    it is gone).

    If no step boundary comes within ``grace_seconds`` of the first signal (a rank stuck in a
    collective, or steps longer than that), a watchdog thread says so in the log on that rank,
    with every thread's stack, because the launcher's SIGKILL is coming (torchrun waits 30 s
    after forwarding SIGTERM, as do Kubernetes' and SLURM's defaults). The last committed
    checkpoint survives that: saves are atomic. The watchdog works even while the main thread
    is blocked in C++ (it wakes through ``signal.set_wakeup_fd``, unless something else such
    as a running asyncio loop holds that slot; then the grace warning is not given).

    Args:
        signals: signals to catch (handlers can only be installed from the main thread).
        check_every: communicate on every k-th call of `should_stop` only (the others
            return False at once); a stop then comes at most k - 1 steps later.
        exit_code: the exit status of `exit`; None for 128 + the signal number.
        grace_seconds: when to say in the log that no step boundary came after a signal.

    Examples:
        >>> import ckptools as ck
        >>> preemption = ck.Preemption()  # doctest: +SKIP
        >>> loader = preemption.protect(loader)  # doctest: +SKIP
        >>> for x, y in sampler.track(loader):  # doctest: +SKIP
        ...     train_step(x, y)
        ...     step += 1
        ...     if preemption.should_stop():  # collective: same answer on every rank
        ...         manager.save(state, step)  # finishes an async save in flight first
        ...         preemption.exit()  # every rank leaves with exit code 143 (SIGTERM)
    """

    def __init__(
        self,
        signals: Iterable[int] = DEFAULT_SIGNALS,
        *,
        check_every: int = 1,
        exit_code: int | None = None,
        grace_seconds: float = 20.0,
    ) -> None:
        if not isinstance(check_every, int) or isinstance(check_every, bool) or check_every < 1:
            raise ValueError(f"check_every must be an integer >= 1, got {check_every!r}")
        if threading.current_thread() is not threading.main_thread():
            raise ValueError("Preemption() installs signal handlers, which Python allows from the main thread only")
        self.signals = tuple(signal.Signals(s) for s in signals)
        # Under mp.spawn the parent's death reaches each worker as SIGINT (torch's PR_SET_PDEATHSIG): the
        # scheduler's SIGTERM to the job's first process, or its kill, is then this job's preemption.
        self._spawned_by = spawn_parent() if signal.SIGTERM in self.signals else None
        if self._spawned_by is not None and signal.SIGINT not in self.signals:
            self.signals = (*self.signals, signal.SIGINT)
        self.check_every = check_every
        self.grace_seconds = float(grace_seconds)
        self._exit_code = exit_code
        self.received: int | None = None  # the first signal this rank got (local)
        self.received_at: float | None = None
        self.stop_signal: int | None = None  # the agreed signal, the same on every rank
        self._calls = 0
        self._orphaned = False  # SIGHUP stands for this rank's torchrun agent gone, not a signal
        self._left = threading.Event()
        self._previous = {s: signal.signal(s, self._handle) for s in self.signals}
        self._wakeup: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None
        self._start_watchdog()

    def __repr__(self) -> str:
        names = ", ".join(s.name for s in self.signals)
        return f"Preemption([{names}], check_every={self.check_every}, received={self._name(self.received)})"

    def __enter__(self) -> Preemption:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _name(signum: int | None) -> str | None:
        return None if signum is None else signal.Signals(signum).name

    def _handle(self, signum: int, frame: Any) -> None:
        # Runs on the main thread between two bytecodes: record, nothing else (no I/O, no locks).
        if self.received is None:
            # mp.spawn's parent died (its SIGTERM, mostly) or Ctrl-C: the stop the launcher was told of
            self.received = signal.SIGTERM if signum == signal.SIGINT and self._spawned_by else signum
            self.received_at = time.monotonic()

    def _start_watchdog(self) -> None:
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # the C-level handler must never block on it
        try:
            previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except ValueError:
            previous = -2
        if previous != -1:  # someone else's (asyncio's): give it back, go without the watchdog
            if previous >= 0:
                signal.set_wakeup_fd(previous)
            os.close(read_fd)
            os.close(write_fd)
            return
        self._wakeup = (read_fd, write_fd)
        _LIVE.add(self)
        self._thread = threading.Thread(target=self._watch, args=(read_fd,), name="ckptools-preemption", daemon=True)
        self._thread.start()

    def _watch(self, read_fd: int) -> None:
        # Woken by the C-level signal handler itself, so this runs even while the main thread
        # is blocked in a collective and the Python-level handler cannot run.
        # The thread owns read_fd and closes it on its way out: were close() to close it, the
        # number could be reused (by a subprocess's stdout pipe, say) before this thread's next
        # os.read, which would then swallow someone else's data.
        try:
            self._watch_fd(read_fd)
        finally:
            with contextlib.suppress(OSError):
                os.close(read_fd)

    def _watch_fd(self, read_fd: int) -> None:
        ours = {int(s) for s in self.signals}
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data or self._left.is_set():
                return  # close(): the write end is closed
            hits = [b for b in data if b in ours]
            if not hits:
                continue
            name = signal.Signals(hits[0]).name
            log.logger.info("rank %d received %s: stopping at the next step boundary", get_rank(), name)
            if self._left.wait(self.grace_seconds):
                return
            log.logger.error(
                "rank %d: %.0f s after %s no step boundary was reached (a rank stuck in a collective, or a step "
                "longer than that); the launcher will kill the job, which resumes from its last complete "
                "checkpoint. Stacks of this process follow.",
                get_rank(),
                self.grace_seconds,
                name,
            )
            with contextlib.suppress(Exception):
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            return

    @property
    def exit_code(self) -> int:
        """What `exit` leaves with: ``exit_code=`` if given, else 128 + the agreed signal."""
        if self._exit_code is not None:
            return self._exit_code
        return 128 + int(self.stop_signal or self.received or signal.SIGTERM)

    def requested(self) -> bool:
        """Whether *this* rank got a signal (local; use `should_stop` to decide anything)."""
        return self.received is not None

    def should_stop(self) -> bool:
        """Collective, at a step boundary: whether any rank got a signal. Same answer everywhere.

        A rank whose torchrun agent is gone (killed: nobody would restart or stop the ranks) counts
        as having received SIGHUP: every rank saves and leaves with exit code 129.

        Every rank must call it at the same points (once per step). With ``check_every=k``
        only every k-th call communicates (one 1-byte all-reduce on the CPU, over a gloo group
        when training uses nccl, so it never waits for the GPU); the others return False at
        once. Once True, it stays True.

        Examples:
            >>> if preemption.should_stop():  # doctest: +SKIP
            ...     manager.save(state, step)
            ...     preemption.exit()
        """
        if self.stop_signal is not None:
            return True
        self._calls += 1
        if self._calls == 1:  # every step costs a check-in's store round trips; the first call tells
            arrive("Preemption.should_stop")
        if self._calls % self.check_every:
            return False
        if self.received is None and launcher_gone():
            self.received = signal.SIGHUP  # the launcher hung up: as good as a signal to stop
            self._orphaned = True
        elif self.received is None and self._spawned_by is not None and os.getppid() != self._spawned_by:
            self.received = signal.SIGTERM  # mp.spawn's parent is gone (its SIGINT to us may come late)
        agreed = max_over_ranks(int(self.received or 0))
        if agreed:
            self.stop_signal = agreed
            if get_rank() == 0:
                got = "torchrun's agent is gone" if self._orphaned else self._name(self.received) or "no signal itself"
                log.logger.info(
                    "%s received: every rank stops at this step (rank 0: %s)", signal.Signals(agreed).name, got
                )
        return bool(agreed)

    def protect(self, loader: Any) -> Any:
        """Make ``loader``'s workers ignore the signals; return the same loader.

        A signal sent to the whole process group (torchrun's ``killpg`` on shutdown, ``kill
        -TERM -PGID``, SLURM signalling every process of a step) would otherwise kill the
        DataLoader workers, and the main process would die fetching the next batch before it
        could save. The loader's own ``worker_init_fn`` still runs, after this one. A worker
        started with ``fork`` is covered from its first instruction (it inherits the handlers);
        with ``spawn`` from the moment ``worker_init_fn`` runs. Call it before the loader's first
        iteration: ``persistent_workers`` already started keep the init function they had.
        On Linux the workers also die the moment their rank dies (``PR_SET_PDEATHSIG``): a
        crashed rank leaves no orphaned workers behind, holding what they inherited from it, for
        torch's watchdog to find up to 5 s later. Create the loader's iterator in the thread
        that keeps running (the main thread, as usual): the kernel ties the signal to it.

        Raises:
            ValueError: the loader starts its workers with ``forkserver``: the forkserver is a
                process of the rank's group that does not ignore the signal, and when it dies
                torch ends its workers; use ``fork`` (the default) or ``spawn``.

        Examples:
            >>> loader = preemption.protect(DataLoader(dataset, num_workers=4))  # doctest: +SKIP
        """
        context = getattr(loader, "multiprocessing_context", None)
        method = context if isinstance(context, str) else getattr(context, "_name", None)
        if context is None and getattr(loader, "num_workers", 0) > 0:
            method = multiprocessing.get_start_method(allow_none=True)  # the loader starts workers as set
        if method == "forkserver":
            raise ValueError(
                "Preemption.protect cannot keep forkserver-started DataLoader workers alive through a signal to "
                "the process group (the forkserver dies of it, and torch then ends its workers); start them "
                "with multiprocessing_context='spawn' or 'fork'"
            )
        inner = loader.worker_init_fn
        if not isinstance(inner, _IgnoreSignals):
            libc_prctl()  # here, in the rank, not in a forked worker (see there)
            loader.worker_init_fn = _IgnoreSignals(tuple(int(s) for s in self.signals), inner)
        return loader

    @checked_in("Preemption.exit")
    def exit(self, code: int | None = None) -> NoReturn:
        """Leave the job together: finish an async save in flight, barrier, flush, ``os._exit``.

        Collective. ``os._exit`` skips interpreter teardown, where freeing a DDP model can hang
        in the process group's destructor; everything ckptools wrote is complete and fsynced
        by then. Exit status: ``code``, else `exit_code`.

        Examples:
            >>> preemption.exit()  # doctest: +SKIP
        """
        end_job()  # its state is in the folder now: the node-memory snapshots go
        status = self.exit_code if code is None else code
        since = "" if self.received_at is None else f", {time.monotonic() - self.received_at:.2f} s after the signal"
        if get_rank() == 0:
            log.logger.info("preempted: every rank leaves with exit code %d%s", status, since)
        self._left.set()
        leave(status)

    def close(self) -> None:
        """Put back the previous signal handlers (and wakeup fd); stops catching signals."""
        self._left.set()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}
        _LIVE.discard(self)
        if self._wakeup is not None:
            signal.set_wakeup_fd(-1)
            # The write end only: the watchdog's read sees EOF and the thread closes the read end.
            with contextlib.suppress(OSError):
                os.close(self._wakeup[1])
            self._wakeup = None


# Open Preemptions, for the fork hook below.
_LIVE: weakref.WeakSet[Preemption] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # A forked child (a DataLoader worker) inherits the wakeup fd and both ends of the pipe but
    # not the watchdog thread. Holding the write end would keep the parent's watchdog from ever
    # seeing EOF after close(), and a signal to the child would wake the parent's watchdog as if
    # the parent had got it. Drop the wakeup fd, then the copies (the write end only once it is no
    # longer the wakeup fd: a signal must never write into a reused descriptor).
    for preemption in list(_LIVE):
        if preemption._wakeup is None:
            continue
        read_fd, write_fd = preemption._wakeup
        with contextlib.suppress(OSError):
            os.close(read_fd)
        try:
            previous = signal.set_wakeup_fd(-1)
            if previous not in (write_fd, -1):  # someone else's: put it back, keep ours open
                signal.set_wakeup_fd(previous)
                continue
        except ValueError:  # forked from a thread other than the main one: keep the write end
            continue
        with contextlib.suppress(OSError):
            os.close(write_fd)
        preemption._wakeup = None
    _LIVE.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
