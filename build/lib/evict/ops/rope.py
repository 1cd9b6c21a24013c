"""Rotary position embedding on [B, T, H, D] tensors, positions given explicitly (the cache owns them)."""

from __future__ import annotations

import torch


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotate channel pairs (i, i + D/2) of x [B, T, H, D] by angle pos * theta^(-2i/D); positions [T] int64."""
    D = x.shape[-1]
    if D % 2:
        raise ValueError(f"x: expected an even head dim for RoPE, got {D}")
    sd = torch.float64 if x.dtype == torch.float64 else torch.float32
    inv = theta ** (-torch.arange(0, D // 2, device=x.device, dtype=sd) * 2 / D)  # [D/2]
    ang = positions.to(sd)[:, None] * inv[None, :]  # [T, D/2]
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]  # [1, T, 1, D/2]
    x1, x2 = x.to(sd).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)
