"""What a checkpoint tree torch loaded holds: ckptools' metadata key, Lightning's, the weights, the
placeholders of refused classes. Tree-level, no file: what restoring and inspection ask of a tree.

Examples:
    >>> import torch
    >>> from ckptools.read import loaded_weights
    >>> sorted(loaded_weights({"model": {"w": torch.ones(1)}, "step": 3}, None, "x.pt"))
    ['w']
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..codecs.parsed import Opaque
from ..codecs.record import META_KEY, record_of
from ..codecs.trees import LIGHTNING_VERSION_KEY, locate_weights

__all__ = ["LIGHTNING_VERSION_KEY", "META_KEY", "loaded_weights", "placeholder_name", "record_of"]


def loaded_weights(tree: Any, key: str | None, path: str) -> Mapping[str, Any]:
    """The model weights inside a tree torch loaded (see `ckptools.codecs.trees.locate_weights`)."""
    import torch

    return locate_weights(tree, key=key, path=path, is_leaf=lambda v: isinstance(v, torch.Tensor))[2]


def placeholder_name(node: Any) -> str | None:
    """The refused class an inert placeholder stands in for (``node`` is one), else None."""
    return node.name if isinstance(node, Opaque) else None
