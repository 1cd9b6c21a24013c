"""Short causal depthwise convolution over time, with a decode tail (the last k-1 inputs)."""

from __future__ import annotations

import torch
from torch import nn


class ShortConv(nn.Module):
    """y_t = sum_{s<k} w_s x_{t-s} per channel; x [B, T, C]. The tail [B, k-1, C] carries context across calls."""

    def __init__(self, channels: int, kernel: int = 4):
        super().__init__()
        self.kernel = kernel
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))
        nn.init.uniform_(self.weight, -kernel**-0.5, kernel**-0.5)

    def forward(self, x: torch.Tensor, tail: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, C = x.shape
        if tail is None:
            tail = x.new_zeros(B, self.kernel - 1, C)
        xt = torch.cat([tail.to(x.dtype), x], dim=1)  # [B, k-1+T, C]
        windows = xt.unfold(1, self.kernel, 1)  # [B, T, C, k]: the k inputs ending at each t, oldest first
        y = torch.einsum("btck,ck->btc", windows, self.weight[:, 0].to(x.dtype))  # [B, T, C]
        return y, xt[:, -(self.kernel - 1):]
