"""Rotary position embedding on [B, T, H, D] tensors, positions given explicitly (the cache owns them)."""

from __future__ import annotations

import torch


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotate channel pairs (i, i + D/2) of x [B, T, H, D] by angle pos * theta^(-2i/D); positions [T] or [B, T] int64
    (per-row positions: sequences at different lengths in one batch)."""
    D = x.shape[-1]
    if D % 2:
        raise ValueError(f"x: expected an even head dim for RoPE, got {D}")
    sd = torch.float64 if x.dtype == torch.float64 else torch.float32
    inv = theta ** (-torch.arange(0, D // 2, device=x.device, dtype=sd) * 2 / D)  # [D/2]
    ang = positions.to(sd)[..., None] * inv  # [T, D/2] or [B, T, D/2]
    if ang.dim() == 2:
        ang = ang[None]
    cos, sin = ang.cos()[:, :, None, :], ang.sin()[:, :, None, :]  # [1 or B, T, 1, D/2]
    x1, x2 = x.to(sd).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)
