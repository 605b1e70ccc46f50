"""PyTorch twins of ``jddp bench``'s models, loaded with the same NumPy parameters.

``jddp.benchmark.models.init_params`` holds dense weights as ``(in, out)`` and
convolution weights as ``(out, in, kernel)``; ``torch.nn.Linear`` wants
``(out, in)``, ``Conv1d`` the same ``(out, in, kernel)``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from jddp.benchmark import models


class MLP(nn.Module):
    def __init__(self, features: int = models.FEATURES, hidden: int = models.HIDDEN) -> None:
        super().__init__()
        self.l0 = nn.Linear(features, hidden)
        self.l1 = nn.Linear(hidden, hidden)
        self.l2 = nn.Linear(hidden, models.CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(torch.relu(self.l0(x)))))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        c, k = models.CHANNELS, models.KERNEL
        self.c0 = nn.Conv1d(1, c, k, padding=k // 2)
        self.c1 = nn.Conv1d(c, c, k, padding=k // 2)
        self.c2 = nn.Conv1d(c, c, k, padding=k // 2)
        self.out = nn.Linear(c * models.FEATURES, models.CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x[:, None, :]
        for conv in (self.c0, self.c1, self.c2):
            h = torch.relu(conv(h))
        return self.out(h.flatten(1))


def build(model: str, params: dict) -> nn.Module:
    """The PyTorch module of ``model`` holding ``params`` (from ``models.init_params``)."""
    if model == models.WIDE:
        module = MLP(models.WIDE_FEATURES, models.WIDE_HIDDEN)
    else:
        module = MLP() if model == "mlp" else CNN()
    with torch.no_grad():
        for name, leaf in params.items():
            layer = getattr(module, name)
            w = leaf["w"].T if isinstance(layer, nn.Linear) else leaf["w"]
            layer.weight.copy_(torch.from_numpy(np.ascontiguousarray(w)))
            layer.bias.copy_(torch.from_numpy(leaf["b"]))
    return module
