"""The hybrid cache: one container of typed per-layer states that owns the position.

Three kinds of memory, one per mixer family:
    KVState         attention: keys and values of every past token     [B, L_max, H_kv, D]   grows O(N)
    LatentState     MLA: the compressed latent c and the shared rope key [B, L_max, r + d_rope]  grows O(N), smaller
    RecurrentState  linear / delta family: the fixed-size memory S [B, H, K, V] (float32) + conv tail [B, k-1, C]
Layers read and write their own state at `cache.pos` and never advance it; the model advances once per call.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class KVState:
    k: torch.Tensor  # [B, L_max, H_kv, D]
    v: torch.Tensor  # [B, L_max, H_kv, D]
    conv: torch.Tensor | None = None  # [B, k-1, C] short-conv tail, when the layer has one


@dataclass
class LatentState:
    c: torch.Tensor  # [B, L_max, r]  normalized latent
    k_rope: torch.Tensor  # [B, L_max, d_rope]  rotated (or NoPE) shared key slice
    conv: torch.Tensor | None = None  # [B, k-1, C] short-conv tail, when the layer has one


@dataclass
class RecurrentState:
    S: torch.Tensor | None = None  # [B, H, K, V] float32, None until the first write
    conv: torch.Tensor | None = None  # [B, k-1, C] last inputs of the short conv


class HybridCache:
    """Per-layer states for a batch of sequences, all at the same position."""

    def __init__(self, states: list, batch_size: int, max_len: int):
        for name, value in (("batch_size", batch_size), ("max_len", max_len)):
            if type(value) is not int or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        self.states = states
        self.batch_size = batch_size
        self.max_len = max_len
        self.pos = 0

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, i: int):
        return self.states[i]

    def reserve(self, n: int) -> None:
        """Check that n more tokens fit (call before a forward; layers then write at [pos, pos + n))."""
        if self.pos + n > self.max_len:
            raise ValueError(f"tokens: cache holds {self.max_len} positions, {self.pos} used, cannot add {n}")

    def advance(self, n: int) -> None:
        self.pos += n

    def reset(self) -> None:
        """Forget every sequence: zero all states and conv tails in place (their buffers keep their addresses, so a
        captured decode graph stays valid) and return to position 0. Reuse then equals a fresh cache exactly."""
        for st in self.states:
            for f in fields(st):
                t = getattr(st, f.name)
                if isinstance(t, torch.Tensor):
                    t.zero_()
        self.pos = 0

    def bytes_per_sequence(self) -> int:
        """Bytes this cache holds per sequence, as allocated (KV and latent at full max_len)."""
        total = 0
        for st in self.states:
            for f in fields(st):
                t = getattr(st, f.name)
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
        return total // max(self.batch_size, 1)
