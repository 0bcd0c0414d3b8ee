"""A model class that golden files pickle whole (``torch.save(model)``), as many published files do.

Importable by module name (``golden_models``) only where ``tests/interop`` is on ``sys.path``:
elsewhere the pickled class is a module that is not installed, as on a user's machine.
"""

from __future__ import annotations

import torch


class TinyNet(torch.nn.Module):
    """A few layers with parameters and buffers (BatchNorm's running statistics)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU())
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))
