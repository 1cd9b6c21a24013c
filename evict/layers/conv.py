"""Short causal depthwise convolution over time, with a decode tail (the last k-1 inputs)."""

from __future__ import annotations

import torch
from torch import nn

from evict.cache import PackedBatch, PaddedBatch
from evict.ops.conv import conv_step, short_conv


class ShortConv(nn.Module):
    """y_t = sum_{s<k} w[k-1-s] x_{t-s} per channel (w[k-1] weighs the current token); x [B, T, C].

    The tail [B, k-1, C] (the last k-1 inputs, zeros before the first call) carries context across calls.
    """

    def __init__(self, channels: int, kernel: int = 4):
        super().__init__()
        self.kernel = kernel
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """weight ~ U(±k^-1/2) (PyTorch's conv default for a depthwise kernel of size k)."""
        nn.init.uniform_(self.weight, -self.kernel**-0.5, self.kernel**-0.5)

    def new_tail(self, batch_size: int, device=None, dtype=torch.float32) -> torch.Tensor:
        """The tail before the first token: zeros [batch_size, k-1, C]."""
        return torch.zeros(batch_size, self.kernel - 1, self.weight.shape[0], device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, tail: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """y [B, T, C] and the new tail (evict.ops.conv.short_conv: Triton on CUDA without a tail, else a conv2d)."""
        return short_conv(x, self.weight[:, 0], tail)

    def step(self, x: torch.Tensor, tails: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token x [B, 1, C] of a slot pool's rows: y [B, 1, C] and the pool's tails [N, k-1, C], whose rows `rows`
        are shifted by x in place (evict.ops.conv.conv_step)."""
        return conv_step(x, self.weight[:, 0], tails, rows), tails

    def run(self, x: torch.Tensor, tail: torch.Tensor | None, pos=None) -> tuple[torch.Tensor, torch.Tensor]:
        """forward(x, tail); for sequences packed along T (`pos` a PackedBatch, x [1, T, C], tail [N, k-1, C] one
        per sequence), each part convolved with its own tails: y [1, T, C] and the new tails [N, k-1, C]. A left-padded
        batch (`pos` a PaddedBatch) is convolved with zeros at its pads, as a row alone sees before its first token."""
        if isinstance(pos, PaddedBatch):
            return self(pos.zero_pads(x), tail)
        if not isinstance(pos, PackedBatch):
            return self(x, tail)
        if tail is None:
            raise ValueError("tail: packed sequences need their conv tails [N, k-1, C], got None")
        ys, tails = [], []
        for part, (_, rows) in zip(pos.split(x), pos.parts()):
            y, t = self(part, tail[rows])
            ys.append(y)
            tails.append(t)
        return pos.join(ys), torch.cat(tails)
