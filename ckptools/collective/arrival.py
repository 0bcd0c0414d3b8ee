"""Every rank comes to a collective call of ckptools, or every rank that came raises: no silent hang.

Each public collective call (`checked_in`, `arrive`) first checks in through the process group's
key-value store, never a collective: one call everywhere is a go; different calls are refused on
every rank at once; a rank missing ``CKPTOOLS_ARRIVAL_TIMEOUT`` seconds (default 60) after the first
arrival makes every rank that came raise, naming the ranks that did not come and the fix; a rank that
died before it came is noticed at once on its host. Why, and what it costs: docs/guides/resuming.md
("Every rank makes every ckptools call").
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from .. import log
from ..errors import CheckpointError
from ..storage import pid_alive
from . import group
from .group import collective_timeout, default_store, found_node, get_rank, get_world_size

__all__ = ["ENV", "arrival_timeout", "arrive", "barrier", "checked_in", "entered"]

ENV = "CKPTOOLS_ARRIVAL_TIMEOUT"
F = TypeVar("F", bound=Callable[..., Any])

_count = 0  # this process's check-ins so far: every rank counts the same calls in the same order
_depth = 0  # >0 inside a call that checked in (the calls it makes do not check in again)
_known: str | None = None  # the torchrun attempt this process recorded its host and pid for


def arrival_timeout() -> float:
    """Seconds a rank waits at a collective call for the others (``CKPTOOLS_ARRIVAL_TIMEOUT``, default
    60; 0 or less: the process group's timeout).

    Examples:
        >>> arrival_timeout()
        60.0
    """
    text = os.environ.get(ENV, "").strip()
    group = collective_timeout().total_seconds()
    if not text:
        return min(60.0, group)
    try:
        seconds = float(text)
    except ValueError as err:
        raise ValueError(f"{ENV}={text!r} is not a number of seconds; unset it (60 s) or set e.g. {ENV}=600") from err
    return min(seconds, group) if seconds > 0 else group


def arrive(name: str) -> None:
    """Check in at the collective call ``name``; return once every rank came to it.

    A no-op without a process group or with one rank.

    Raises:
        CheckpointError: on every rank that came, when some rank did not come within
            `arrival_timeout` seconds, or came to another collective call of ckptools.
    """
    store = default_store()
    world = get_world_size()
    if store is None or world == 1:
        return
    try:
        _check_in(store, name, world)
    except CheckpointError:
        raise
    except (RuntimeError, OSError) as err:  # the store is gone (torchrun's agent held it): no check, no hang
        log.warn(
            f"{name}: the process group's store cannot be reached ({type(err).__name__}: "
            f"{(str(err).strip().splitlines() or [''])[0][:200]}); "
            "collective calls go on without checking that every rank came",
            once="arrival_store",
            all_ranks=True,
        )


def _check_in(store: Any, name: str, world: int) -> None:
    global _count, _known
    _count += 1
    rank = get_rank()
    # Keys of their own per torchrun attempt: the agent's store outlives a failed attempt's keys.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    base = f"ckptools/arrival/{attempt}"
    if _known != attempt:  # once: where this rank runs, so that a rank waiting beside it can tell it died
        store.set(f"{base}/who/{rank}", json.dumps([*_whereabouts(), os.getpid()]))
        _known = attempt
    key = f"{base}/{_count}"
    verdict = f"{key}/verdict"
    store.set(f"{key}/{rank}", name)
    if store.add(key, 1) == world:  # the last to come: every rank is here, at which calls?
        names = [store.get(f"{key}/{r}").decode() for r in range(world)]
        store.compare_set(verdict, "", "ok" if len(set(names)) == 1 else "calls:" + json.dumps(names))
    timeout = arrival_timeout()
    _await(store, key, world, base, timeout)
    said = store.get(verdict).decode()
    if said == "ok":
        _forget(store, f"{base}/{_count - 1}", rank)
        if "LOCAL_RANK" not in os.environ and _count == 1:  # every rank wrote where it runs, before it came
            found_node([json.loads(store.get(f"{base}/who/{r}"))[0] for r in range(world)])
        return
    kind, _, detail = said.partition(":")
    if kind == "dead":
        raise CheckpointError(
            f"{name} is collective, and rank(s) {_ranks(json.loads(detail))} died before every rank had come to it: "
            "the job has to restart (it resumes from the last complete checkpoint)"
        )
    if kind == "calls":
        calls = json.loads(detail)
        listed = ", ".join(f"rank {r} {call}" for r, call in enumerate(calls))
        raise CheckpointError(
            f"the ranks came to different collective calls of ckptools at the same point ({listed}): every rank "
            "must make the same ckptools calls in the same order. A call under `if rank == 0:` does this: make it "
            "on every rank (ckptools decides who writes)"
        )
    came = json.loads(detail)
    missing = [r for r in range(world) if r not in came]
    if not missing:  # every rank wrote its name, and the count or the verdict never followed
        raise CheckpointError(
            f"{name} is collective: every rank came to it, but the check-in did not complete within {timeout:g} s "
            "(a rank stopped or died in the middle of it, or the store lost a write): the job has to restart"
        )
    raise CheckpointError(
        f"{name} is collective: every rank calls it. Rank(s) {_ranks(came)} came to it, rank(s) {_ranks(missing)} "
        f"(of {world}) did not within {timeout:g} s. Call it on every rank, not under `if rank == 0:` (ckptools "
        "decides who writes: global rank 0, or every rank its share). If a rank is only slower to get here "
        f"(an evaluation on one rank first), raise the bound: {ENV}=600 (seconds)"
    )


def _await(store: Any, key: str, world: int, base: str, timeout: float) -> None:
    """Wait for ``key``'s verdict; past ``timeout`` (or once a missing rank on this host died), give
    one for everyone (the first rank to give one decides: ``compare_set``)."""
    verdict = f"{key}/verdict"
    started = time.monotonic()
    pause, looked = 0.0005, started
    while not store.check([verdict]):
        now = time.monotonic()
        if now - started >= timeout:
            came = [r for r in range(world) if store.check([f"{key}/{r}"])]
            store.compare_set(verdict, "", "came:" + json.dumps(came))
            return
        if now - looked >= 1.0:
            looked = now
            dead = _dead(store, key, world, base)
            if dead:
                store.compare_set(verdict, "", "dead:" + json.dumps(dead))
                return
        time.sleep(min(pause, max(timeout - (now - started), 0.0)))
        pause = min(pause * 2, 0.1)


def _whereabouts() -> list[Any]:
    """This process's host and PID namespace: where its process id means this process."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # not Linux: the pid alone would say nothing reliable across containers
        namespace = None
    return [socket.gethostname(), namespace]


def _dead(store: Any, key: str, world: int, base: str) -> list[int]:
    """The ranks known dead while ``key`` has no verdict: same host and PID namespace as this rank
    (recorded at their first check-in), and their process is gone. Whether or not a rank wrote its
    name first: one that died after writing it, before the count or the verdict, leaves the
    others waiting just as one that never came."""
    here = _whereabouts()
    if here[1] is None:
        return []
    dead = []
    for r in range(world):
        if not store.check([f"{base}/who/{r}"]):
            continue
        host, namespace, pid = json.loads(store.get(f"{base}/who/{r}"))
        if [host, namespace] == here and not pid_alive(pid):
            dead.append(r)
    return dead


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def _forget(store: Any, key: str, rank: int) -> None:
    """Remove the previous check-in's keys: every rank has passed it (they all came to this one)."""
    if key.endswith("/0"):
        return
    with contextlib.suppress(Exception):  # a store without delete_key keeps them: a few bytes each
        store.delete_key(f"{key}/{rank}")
        if rank == 0:
            store.delete_key(key)
            store.delete_key(f"{key}/verdict")


@contextlib.contextmanager
def entered(name: str) -> Iterator[None]:
    """Check in as ``name`` on entering the block, unless inside a call that checked in already (the
    form of `checked_in` for a call whose own clean-up must also run when the check-in fails)."""
    global _depth
    if _depth == 0:
        arrive(name)
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1


def checked_in(name: str) -> Callable[[F], F]:
    """Decorate a public collective call: it checks in as ``name`` first (see the module), unless
    another call that checked in is running it.

    Examples:
        >>> @checked_in("ck.example")
        ... def example() -> int:
        ...     return 1
        >>> example()  # no process group: nothing to check
        1
    """

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            with entered(name):
                return fn(*args, **kwargs)

        return call  # type: ignore[return-value]

    return decorate


@checked_in("ck.barrier")
def barrier() -> None:
    """Wait for every rank of the default group; a no-op without a process group.

    On NCCL the barrier runs on this rank's GPU (``device_ids``), which avoids NCCL guessing a
    device and hanging when ranks guessed differently. A rank that does not come within
    `arrival_timeout` seconds makes every rank that came raise (see this module).

    Examples:
        >>> import ckptools as ck
        >>> ck.barrier()  # no process group: returns at once
    """
    group.barrier()
