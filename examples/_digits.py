"""A small 10-class image set for the examples, built here (no download, no extra package).

Each class is a fixed random 8x8 pattern; a sample is its class's pattern
plus Gaussian noise, so a small model learns it in an epoch or two, like
sklearn's 8x8 digits.  ``digits()`` returns ``(images [N, 1, 8, 8], labels
[N])`` in float32 / int64, the same on every call and every rank;
``flat_digits()`` the same as flattened train and validation sets.
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

__all__ = ["digits", "flat_digits"]


def digits(n: int = 1800, noise: float = 0.6, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    patterns = torch.rand(10, 1, 8, 8, generator=g)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = patterns[labels] + noise * torch.randn(n, 1, 8, 8, generator=g)
    return images, labels


def flat_digits(num_train: int = 1500) -> tuple[TensorDataset, TensorDataset]:
    """``digits()`` with each image flattened to 64 features, split into the first ``num_train`` and the rest."""
    images, labels = digits()
    x = images.flatten(1)
    return TensorDataset(x[:num_train], labels[:num_train]), TensorDataset(x[num_train:], labels[num_train:])
