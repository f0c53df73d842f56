"""A small model for the compression tests: large 2-D layers (compressed) beside small and 1-D ones (never)."""

import torch


class MixedNet(torch.nn.Module):
    """Two large 2-D layers (eligible), a small one and 1-D parameters (never compressed)."""

    def __init__(self, width: int = 96) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(32, width)
        self.fc2 = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.relu(self.fc2(torch.relu(self.fc1(x))))))
