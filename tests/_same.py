"""Equal bit for bit: the one comparison the tests make of tensors and trees (and a tiny model)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch


def bits(tensor: torch.Tensor) -> bytes:
    """The tensor's bytes in order (any dtype numpy lacks too: bfloat16, float8)."""
    flat = tensor.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def same_tensor(a: Any, b: Any, *, same_type: bool = False, strides: bool = False) -> bool:
    """Both tensors of one dtype and shape, with the same bytes (NaN payloads and -0.0 included);
    ``same_type``: also the same class (a ``Parameter`` is not a plain tensor); ``strides``: also
    the same strides and device (laid out as torch.save would)."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if same_type and type(a) is not type(b):
        return False
    if strides and (a.stride(), a.device) != (b.stride(), b.device):
        return False
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and bits(a) == bits(b)


def assert_same_tree(a: Any, b: Any, where: str = "tree", *, ignore: Collection[str] = (), key_order: bool = True,
                     **tensors: bool) -> None:  # fmt: skip
    """Assert two trees equal: dicts (their keys in the same order unless not ``key_order``; keys in
    ``ignore`` skipped), lists and tuples (same type, length), tensors bit for bit (`same_tensor`, given
    ``tensors``' options), other values by ==."""
    if isinstance(a, torch.Tensor):
        assert same_tensor(a, b, **tensors), f"{where}: {_describe(a)} != {_describe(b)}"
    elif isinstance(a, dict):
        assert isinstance(b, dict), f"{where}: a dict against {type(b).__name__}"
        keys_a, keys_b = [k for k in a if k not in ignore], [k for k in b if k not in ignore]
        if key_order:
            assert keys_a == keys_b, f"{where}: keys {keys_a[:5]} != {keys_b[:5]}"
        else:
            assert set(keys_a) == set(keys_b), f"{where}: keys differ: {sorted(set(keys_a) ^ set(keys_b), key=str)[:5]}"
        for k in keys_a:
            assert_same_tree(a[k], b[k], f"{where}[{k!r}]", ignore=ignore, key_order=key_order, **tensors)
    elif type(a).__module__ == "numpy" and hasattr(a, "tobytes"):  # an array (NumPy's RNG state)
        same = type(b) is type(a) and (a.dtype, a.shape) == (b.dtype, b.shape) and a.tobytes() == b.tobytes()
        assert same, f"{where}: the arrays differ"
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: {type(a).__name__} of {len(a)} != {b!r:.80}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{where}[{i}]", ignore=ignore, key_order=key_order, **tensors)
    else:
        assert a == b, f"{where}: {a!r:.80} != {b!r:.80}"


def same_tree(a: Any, b: Any, **options: Any) -> bool:
    """`assert_same_tree` as a bool."""
    try:
        assert_same_tree(a, b, **options)
    except AssertionError:
        return False
    return True


def tiny_net(seed: int = 0) -> torch.nn.Module:
    """A small MLP (8 -> 16 -> 4), its weights drawn from ``seed``."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


class TinyClassifier(torch.nn.Module):
    """A 4 -> 2 linear classifier called as the HF Trainer calls a model: ``forward(x, labels)`` returns
    ``{"loss", "logits"}``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.lin(x)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def filled_linear(size: int, value: float) -> torch.nn.Linear:
    """A ``size`` x ``size`` Linear whose weight is ``value`` everywhere (which checkpoint loaded shows)."""
    linear = torch.nn.Linear(size, size)
    with torch.no_grad():
        linear.weight.fill_(value)
    return linear


def _describe(t: Any) -> str:
    return f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
