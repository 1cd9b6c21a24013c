"""Softmax attention mixer (GPT-2 / Llama style): MHA or GQA, RoPE or external positions, KV cache."""

from __future__ import annotations

import torch
from torch import nn

from evict.cache import KVState
from evict.ops import attention
from evict.ops.decode import decode_attention, kernel_runs_on
from evict.ops.rope import rope

from .conv import ShortConv
from .init import reset_children


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.kv_heads, cfg.head_size
        self.rope = cfg.pos == "rope"
        self.theta = cfg.rope_theta
        self.wqkv = nn.Linear(cfg.d_model, (self.n_heads + 2 * self.n_kv) * self.hd, bias=cfg.bias)
        self.conv = ShortConv((self.n_heads + 2 * self.n_kv) * self.hd, cfg.conv_size) if cfg.short_conv else None
        self.wo = nn.Linear(self.n_heads * self.hd, cfg.d_model, bias=cfg.bias)
        self.decode_kernel = True  # one-token steps over a cache use the split-K decode kernel where it runs (CUDA)

    def reset_parameters(self) -> None:
        """PyTorch's Linear defaults and the conv's own init (the LM overrides the Linears: see LM.init_weights)."""
        reset_children(self)

    def forward(self, x: torch.Tensor, state: KVState | None = None, pos: int = 0) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.wqkv(x)
        if self.conv is not None:
            qkv, tail = self.conv(qkv, None if state is None else state.conv)
            if state is not None:
                state.conv = tail
        q, k, v = qkv.split([self.n_heads * self.hd, self.n_kv * self.hd, self.n_kv * self.hd], dim=-1)
        q = q.view(B, T, self.n_heads, self.hd)  # [B, T, H, D]
        k, v = k.view(B, T, self.n_kv, self.hd), v.view(B, T, self.n_kv, self.hd)  # [B, T, Hkv, D]
        if self.rope:
            positions = torch.arange(pos, pos + T, device=x.device)
            q, k = rope(q, positions, self.theta), rope(k, positions, self.theta)
        if state is not None:
            state.k[:, pos : pos + T] = k
            state.v[:, pos : pos + T] = v
            k, v = state.k[:, : pos + T], state.v[:, : pos + T]
        # one compute dtype at the op's boundary: the cache may hold another (float32 cache, bf16 autocast)
        k, v = k.to(q.dtype), v.to(q.dtype)
        if T == 1 and state is not None and self.decode_kernel and kernel_runs_on(q):
            o = decode_attention(q[:, 0], k, v)[:, None]  # reads each cached key and value once for its query heads
        else:
            o = attention(q, k, v, causal=True, check=False)  # queries are the last T of pos + T keys
        return self.wo(o.reshape(B, T, self.n_heads * self.hd))

    def new_state(self, batch_size: int, max_len: int, device=None, dtype=torch.float32) -> KVState:
        shape = (batch_size, max_len, self.n_kv, self.hd)
        return KVState(k=torch.zeros(shape, device=device, dtype=dtype), v=torch.zeros(shape, device=device, dtype=dtype))

    def state_size(self, context_len: int) -> int:
        """Numbers held per sequence: keys and values of every token (+ the conv tail, if any)."""
        tail = 0 if self.conv is None else self.conv.weight.shape[0] * (self.conv.kernel - 1)
        return 2 * self.n_kv * self.hd * context_len + tail
