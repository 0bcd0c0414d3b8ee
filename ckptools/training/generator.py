"""A DataLoader's workers' base seed, lent per epoch so that a resumed run draws nothing from the
global RNG there; and which DataLoader iterator is driving a sampler (for its warnings).

Examples:
    >>> import torch
    >>> loader = torch.utils.data.DataLoader(range(4))
    >>> _ = lend_generator(loader, iter, key=(0, 0, 0)); loader.generator is None  # lent, then given back
    True
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch.utils.data

__all__ = ["lend_generator", "lent_generator", "loader_iterator"]

T = TypeVar("T")


def loader_iterator() -> Any:
    """The torch DataLoader iterator whose request for indices is running this call, or None.

    The sampler is iterated from ``_BaseDataLoaderIter._next_index`` through the BatchSampler,
    a few frames up. Only used to warn; any other driver (a custom loop) is simply not found.
    """
    base = getattr(torch.utils.data.dataloader, "_BaseDataLoaderIter", None)
    if base is None:
        return None
    frame: Any = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, base):
            return candidate
        frame = frame.f_back
    return None


def lend_generator(
    loader: torch.utils.data.DataLoader[Any],
    make: Callable[[torch.utils.data.DataLoader[Any]], Iterator[T]],
    *,
    key: tuple[int, int, int],
) -> Iterator[T]:
    """``make(loader)`` (the loader's iterator) with ``loader`` lent, for that moment, a generator
    seeded from ``key`` (the sampler's seed, the epoch, the rank), unless it has one of its own.

    Making a DataLoader iterator draws its workers' base seed from ``loader.generator``, or from the
    global torch RNG when it has none: a run resumed mid-epoch would draw it at another point of
    the restored stream than the uninterrupted run, and every random number after it would differ.
    """
    with lent_generator(loader, key=key):
        return make(loader)


@contextlib.contextmanager
def lent_generator(loader: Any, *, key: tuple[int, int, int]) -> Iterator[None]:
    """`lend_generator`'s loan for a block: whatever makes ``loader``'s iterator inside it draws the
    workers' base seed from the generator of ``key`` (a loader with a generator of its own keeps it).

    Examples:
        >>> import torch
        >>> loader = torch.utils.data.DataLoader(range(4))
        >>> with lent_generator(loader, key=(0, 0, 0)):
        ...     loader.generator is not None
        True
    """
    if loader.generator is not None:
        yield
        return
    # The base seed is drawn when the iterator is made, and only then: the generator is lent for
    # that moment, so the user's DataLoader is left as it was. One seed per (seed, epoch, rank),
    # from a string seed: CPython hashes it with SHA-512, the same on every machine and Python
    # version; distinct triples give unrelated seeds.
    seed = random.Random("ckptools/{}/{}/{}".format(*key)).getrandbits(63)
    loader.generator = torch.Generator().manual_seed(seed)
    try:
        yield
    finally:
        loader.generator = None
