"""Capturing and restoring random-number-generator states (python, numpy, torch, CUDA).

States are stored only as types ``torch.load(weights_only=True)`` accepts: numpy's key array
and python's state tuple become int64 tensors, never pickled ndarrays. Capturing reads the
generators' states and never draws from them, so saving a checkpoint changes no random stream.
`capture_cpu_streams` / `seed_cpu_streams` / `restore_cpu_streams` are the in-process form for
`SeededDataset`'s hot path: native state objects, nothing converted, no CUDA.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import torch

try:  # numpy is optional: a training script without it has no numpy stream to restore.
    import numpy as _np
except ImportError:  # pragma: no cover - numpy is installed in every supported set-up
    _np = None  # type: ignore[assignment]


def get_rng_state() -> dict[str, Any]:
    """Return this process's RNG states as a dict of weights_only-safe values.

    CUDA states are captured only when CUDA has already been initialised: querying them would
    otherwise create a CUDA context on every visible GPU.
    """
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "torch": torch.get_rng_state(),
    }
    if _np is not None:
        kind, keys, pos, has_gauss, cached = _np.random.get_state()
        state["numpy"] = {
            "kind": str(kind),
            "keys": torch.from_numpy(keys.astype("int64")),  # type: ignore[attr-defined]  # an ndarray
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    if _cuda_in_use():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return state


def _cuda_in_use() -> bool:
    """Whether this process initialised CUDA: asking for its streams otherwise would create a
    CUDA context on every visible GPU."""
    return torch.cuda.is_available() and bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]


def python_state(entry: dict[str, Any]) -> tuple[Any, ...]:
    """``random.getstate()``'s tuple from `get_rng_state`'s ``"python"`` entry.

    Examples:
        >>> python_state(get_rng_state()["python"]) == random.getstate()
        True
    """
    return (int(entry["version"]), tuple(int(x) for x in entry["state"].tolist()), entry["gauss"])


def numpy_state(entry: dict[str, Any]) -> tuple[Any, ...]:
    """``numpy.random.get_state()``'s tuple from `get_rng_state`'s ``"numpy"`` entry (the keys as uint32).

    Examples:
        >>> numpy_state(get_rng_state()["numpy"])[0]
        'MT19937'
    """
    import numpy as np

    keys = np.asarray(entry["keys"].cpu().numpy(), dtype=np.uint32)
    return (entry["kind"], keys, int(entry["pos"]), int(entry["has_gauss"]), float(entry["cached_gaussian"]))


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore RNG states captured by `get_rng_state` (missing parts are left alone).

    CUDA states are restored for as many devices as both the checkpoint and this machine have.
    """
    if "python" in state:
        random.setstate(python_state(state["python"]))
    if "torch" in state:
        torch.set_rng_state(state["torch"].cpu().to(torch.uint8))
    if "numpy" in state and _np is not None:
        _np.random.set_state(numpy_state(state["numpy"]))
    if "cuda" in state and torch.cuda.is_available():
        for index, cuda_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state.cpu().to(torch.uint8), index)


def capture_cpu_streams() -> tuple[Any, ...]:
    """This process's python, numpy and torch CPU streams, to put back with `restore_cpu_streams`.

    Native state objects, for use in this process only (see `get_rng_state` for a checkpoint).
    """
    numpy_state = None if _np is None else _np.random.get_state(legacy=False)
    return torch.default_generator.get_state(), random.getstate(), numpy_state


def seed_cpu_streams(torch_seed: int, python_seed: int, numpy_seed: int) -> None:
    """Seed torch's default CPU generator (not CUDA's: ``torch.manual_seed`` costs ~0.2 ms for
    that), python's ``random`` and numpy's global RNG (a 32-bit seed)."""
    torch.default_generator.manual_seed(torch_seed)
    random.seed(python_seed)
    if _np is not None:
        _np.random.seed(numpy_seed)


def restore_cpu_streams(saved: tuple[Any, ...]) -> None:
    """Put back the streams `capture_cpu_streams` returned."""
    torch_state, python_state, numpy_state = saved
    torch.default_generator.set_state(torch_state)
    random.setstate(python_state)
    if _np is not None:
        _np.random.set_state(numpy_state)


def capture_streams() -> tuple[Any, Any]:
    """`capture_cpu_streams` and this device's CUDA stream where CUDA is in use (None otherwise),
    to put back with `restore_streams`, in this process.

    Examples:
        >>> import torch
        >>> saved = capture_streams(); first = torch.rand(1)
        >>> restore_streams(saved); torch.equal(torch.rand(1), first)
        True
    """
    return capture_cpu_streams(), torch.cuda.get_rng_state() if _cuda_in_use() else None


def restore_streams(saved: tuple[Any, Any]) -> None:
    """Put back the streams `capture_streams` returned."""
    cpu, cuda = saved
    restore_cpu_streams(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


class SampleIndex(int):
    """A dataset index that carries its sampler's seed and epoch to whatever process fetches it.

    An ``int`` in every other respect (equal, hashed and printed as the index), so a dataset, a
    batch sampler or a collate function that never asks sees the plain index.
    """

    seed: int
    epoch: int

    def __new__(cls, index: int, seed: int, epoch: int) -> SampleIndex:
        self = super().__new__(cls, index)
        self.seed, self.epoch = seed, epoch
        return self

    def __reduce__(self) -> tuple[Any, tuple[int, int, int]]:
        # Compact through the DataLoader's index queues (and importable in spawned workers).
        return (SampleIndex, (int(self), self.seed, self.epoch))


def item_seeds(seed: int, epoch: int, index: int) -> tuple[int, int, int]:
    """The seeds of item ``index`` of ``epoch``: torch's (64 bits), python's (64), numpy's (32).

    One BLAKE2b digest of the triple: distinct triples give unrelated seeds (no ``seed + i``
    collisions between neighbouring items or epochs), the same on every machine and process.
    """
    digest = hashlib.blake2b(f"{seed}/{epoch}/{index}".encode(), digest_size=20, person=b"ckptools.item").digest()
    return (
        int.from_bytes(digest[:8], "little"),
        int.from_bytes(digest[8:16], "little"),
        int.from_bytes(digest[16:20], "little"),  # numpy's legacy seeding takes 32 bits
    )
