"""GPT-2's feed-forward block: Linear -> GELU -> Linear (with biases)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn


class GeluMLP(nn.Module):
    def __init__(self, d_model: int, d_hidden: int, bias: bool = True):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_hidden, bias=bias)
        self.w2 = nn.Linear(d_hidden, d_model, bias=bias)

    def reset_parameters(self) -> None:
        """PyTorch's Linear defaults (the LM overrides them: see LM.init_weights)."""
        self.w1.reset_parameters()
        self.w2.reset_parameters()

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))
