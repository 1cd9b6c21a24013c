"""Normalization: RMSNorm (computed in float32, cast back) and the residual-stream norm chosen by the config.

    build_norm(kind, dim, eps) -> RMSNorm ("rmsnorm": no bias; Llama, Kimi) or nn.LayerNorm ("layernorm": mean removed,
                                  weight and bias; GPT-2, eps 1e-5)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

NORMS = ("rmsnorm", "layernorm")


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dim; weight initialised to ones."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        # F.rms_norm: the same math (x · rsqrt(mean(x²) + eps) · weight, in xf's dtype); on CUDA one fused kernel each
        # way (torch's _fused_rms_norm and its backward) where the written-out form took ~7 forward and ~10 backward
        return F.rms_norm(xf, (xf.shape[-1],), self.weight.to(xf.dtype), self.eps).to(x.dtype)


def build_norm(kind: str, dim: int, eps: float) -> nn.LayerNorm | RMSNorm:
    """The norm of the residual stream: RMSNorm(dim) or LayerNorm(dim) with bias (weight 1, bias 0 at init)."""
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps)
    if kind == "rmsnorm":
        return RMSNorm(dim, eps)
    raise ValueError(f"norm: expected one of {NORMS}, got {kind!r}")
