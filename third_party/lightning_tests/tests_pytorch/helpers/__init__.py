from pytorch_lightning.demos.boring_classes import (  # noqa: F401
    BoringDataModule,
    BoringModel,
    ManualOptimBoringModel,
    RandomDataset,
)
from tests_pytorch.helpers.datasets import TrialMNIST  # noqa: F401
