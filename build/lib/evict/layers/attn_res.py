"""Attention Residuals (Kimi): one read point per sublayer input, and the block bookkeeping of its sources.

A read point h = sum_i softmax_i(q . RMSNorm(v_i)) v_i has its own query q [D] (zero at init: the uniform
mean of the sources) and its own key RMSNorm. In the block form the sources are the embedding, one sum per
completed block of sublayer outputs, and the running sum of the current block (once it has an output).
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.attn_res import attn_res
from .norms import RMSNorm


class AttnResRead(nn.Module):
    """One read point: forward(sources: list of S [B, T, D]) -> [B, T, D]."""

    def __init__(self, d_model: int, eps: float = 1e-6):
        super().__init__()
        if not isinstance(d_model, int) or isinstance(d_model, bool) or d_model < 1:
            raise ValueError(f"d_model: expected a positive int, got {d_model!r}")
        self.query = nn.Parameter(torch.zeros(d_model))
        self.norm = RMSNorm(d_model, eps=eps)

    def reset_parameters(self) -> None:
        """query = 0 (uniform mix over sources); key norm weight = 1."""
        nn.init.zeros_(self.query)
        nn.init.ones_(self.norm.weight)

    def forward(self, sources) -> torch.Tensor:
        return attn_res(sources, self.query, norm_weight=self.norm.weight, eps=self.norm.eps)


class AttnResBlocks:
    """Source bookkeeping for one forward pass (plain object, no parameters).

    completed: [embedding, block_1 sum, ...]; partial: running sum of the current block's sublayer outputs,
    or None right after a block closes. The caller decides when blocks close (every S layers).
    """

    def __init__(self, embedding: torch.Tensor):
        self.completed: list[torch.Tensor] = [embedding]
        self.partial: torch.Tensor | None = None

    def sources(self) -> list[torch.Tensor]:
        return self.completed + ([] if self.partial is None else [self.partial])

    def read(self, read_point: AttnResRead) -> torch.Tensor:
        """The input of the next sublayer (or the final norm): read_point's mix of the current sources."""
        return read_point(self.sources())

    def add(self, sublayer_output: torch.Tensor) -> None:
        self.partial = sublayer_output if self.partial is None else self.partial + sublayer_output

    def close_block(self) -> None:
        """Freeze the current block's sum as a source (no-op when the block has no output yet)."""
        if self.partial is not None:
            self.completed.append(self.partial)
            self.partial = None
