"""Attention Residuals (Kimi): one read point per sublayer input (the block bookkeeping of its sources is in
evict.models.lm: LM.forward closes blocks, Block.forward reads and adds).

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
