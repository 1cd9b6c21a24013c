"""Softmax attention mixer (GPT-2 / Llama style): MHA or GQA, RoPE or external positions, KV cache."""

from __future__ import annotations

import torch
from torch import nn

from evict.cache import KVState, PackedBatch, PaddedBatch, SlotBatch
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

    def forward(self, x: torch.Tensor, state: KVState | None = None,
                pos: int | SlotBatch | PackedBatch | PaddedBatch = 0) -> torch.Tensor:
        """x [B, T, d]; pos: the batch's first position, or a SlotBatch (rows of a slot pool at their own positions),
        or a PackedBatch (sequences of a slot pool packed along T, B = 1: each part attends over its own keys), or a
        PaddedBatch (left-padded rows: pad keys masked, positions counted from each row's first token)."""
        B, T, _ = x.shape
        qkv = self.wqkv(x)
        if self.conv is not None:
            qkv, tail = self.conv.run(qkv, None if state is None else state.conv, pos)
            if state is not None:
                state.conv = tail
        q, k, v = qkv.split([self.n_heads * self.hd, self.n_kv * self.hd, self.n_kv * self.hd], dim=-1)
        q = q.view(B, T, self.n_heads, self.hd)  # [B, T, H, D]
        k, v = k.view(B, T, self.n_kv, self.hd), v.view(B, T, self.n_kv, self.hd)  # [B, T, Hkv, D]
        if self.rope:
            positions = pos.positions if not isinstance(pos, int) else torch.arange(pos, pos + T, device=x.device)
            q, k = rope(q, positions, self.theta), rope(k, positions, self.theta)
        if isinstance(pos, (SlotBatch, PackedBatch)):
            if state is None:
                raise ValueError("state: a slot pool's rows need this layer's KVState, got None")
            pos.write(state.k, k)
            pos.write(state.v, v)
            if isinstance(pos, SlotBatch):
                o = self._attend_slots(q, state, pos)
            else:
                o = pos.join([self._attend_slots(qp, state, part) for qp, (part, _) in zip(pos.split(q), pos.parts())])
        else:
            start, mask = (pos.start, pos.mask) if isinstance(pos, PaddedBatch) else (pos, None)
            if state is not None:
                state.k[:, start : start + T] = k
                state.v[:, start : start + T] = v
                k, v = state.k[:, : start + T], state.v[:, : start + T]
            o = self._attend(q, k, v, mask=mask,
                             kernel=T == 1 and state is not None and self.decode_kernel and kernel_runs_on(q))
        return self.wo(o.reshape(B, T, self.n_heads * self.hd))

    def _attend_slots(self, q: torch.Tensor, state: KVState, pos: SlotBatch) -> torch.Tensor:
        """q [B, T, H, D] of slot-pool rows whose new keys and values are already in the arenas."""
        if q.shape[1] == 1 and self.decode_kernel and kernel_runs_on(q) and state.k.dtype == q.dtype:
            # the paged decode op reads each row's blocks in place
            return decode_attention(q[:, 0], state.k, state.v, pos.lengths, block_table=pos.table)[:, None]
        # [B, L, Hkv, D] each row's keys: exactly its past (one prompt chunk: causal), or the keys past its position masked
        return self._attend(q, pos.read(state.k), pos.read(state.v), mask=None if pos.exact else pos.mask)

    def _attend(self, q, k, v, mask=None, kernel=False) -> torch.Tensor:
        # one compute dtype at the op's boundary: the cache may hold another (float32 cache, bf16 autocast)
        k, v = k.to(q.dtype), v.to(q.dtype)
        if kernel and mask is None:
            return decode_attention(q[:, 0], k, v)[:, None]  # reads each cached key and value once for its query heads
        # without a mask the queries are the last T of the L keys
        return attention(q, k, v, causal=mask is None, mask=mask, check=False)

    def new_state(self, batch_size: int, max_len: int, device=None, dtype=torch.float32, *, blocks: int | None = None) -> KVState:
        """Keys and values [blocks or batch_size, max_len, Hkv, D] (a pool's block arena when `blocks` is given),
        the conv tail [batch_size, k-1, C]."""
        shape = (batch_size if blocks is None else blocks, max_len, self.n_kv, self.hd)
        return KVState(k=torch.zeros(shape, device=device, dtype=dtype), v=torch.zeros(shape, device=device, dtype=dtype),
                       conv=None if self.conv is None else self.conv.new_tail(batch_size, device, dtype))

    def state_size(self, context_len: int) -> int:
        """Numbers held per sequence: keys and values of every token (+ the conv tail, if any)."""
        tail = 0 if self.conv is None else self.conv.weight.shape[0] * (self.conv.kernel - 1)
        return 2 * self.n_kv * self.hd * context_len + tail
