"""Multi-head Latent Attention (DeepSeek-V2/V3; Kimi Linear / K3 use it with NoPE).

Legend: B batch, T new tokens, L cached tokens (incl. new), H heads, r kv_lora_rank, n nope dim, p rope dim, e v dim.
Cache per token: c (r) + k_rope (p) numbers. Two equal forms:
    naive     k = [W_uk c ; k_rope], v = W_uv c, softmax attention per head (training, prefill)
    absorbed  q~ = q_nope W_uk^T (into latent space); scores = q~ c^T + q_rope k_rope^T; o = (softmax c) W_uv (decode)
"""

from __future__ import annotations

import torch
from torch import nn

from evict.cache import LatentState, PackedBatch, PaddedBatch, SlotBatch
from evict.ops import attention
from evict.ops.decode import decode_attention, kernel_runs_on
from evict.ops.rope import rope

from .conv import ShortConv
from .init import reset_children
from .norms import RMSNorm


class MLA(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        H, r, n, p, e = cfg.n_heads, cfg.kv_lora_rank, cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.v_head_dim
        self.H, self.r, self.n, self.p, self.e = H, r, n, p, e
        self.use_rope, self.theta = cfg.mla_rope, cfg.rope_theta
        self.scale = (n + p) ** -0.5
        d = cfg.d_model
        if cfg.q_lora_rank:
            self.wq: nn.Module = nn.Sequential(nn.Linear(d, cfg.q_lora_rank, bias=False), RMSNorm(cfg.q_lora_rank, cfg.norm_eps),
                                    nn.Linear(cfg.q_lora_rank, H * (n + p), bias=False))
        else:
            self.wq = nn.Linear(d, H * (n + p), bias=False)
        self.wdkv = nn.Linear(d, r + p, bias=False)
        # optional short causal conv over [q ; c ; k_rope] before normalization / RoPE (cfg.short_conv)
        self.conv = ShortConv(H * (n + p) + r + p, cfg.conv_size) if cfg.short_conv else None
        self.kv_norm = RMSNorm(r, cfg.norm_eps)
        self.wuk = nn.Parameter(torch.empty(H, n, r))  # k_nope = W_uk c per head
        self.wuv = nn.Parameter(torch.empty(H, e, r))  # v = W_uv c per head
        self.init_std = cfg.init_std
        nn.init.normal_(self.wuk, std=cfg.init_std)
        nn.init.normal_(self.wuv, std=cfg.init_std)
        self.wgate = nn.Linear(d, H * e, bias=False) if cfg.mla_gate else None
        self.wo = nn.Linear(H * e, d, bias=False)
        self.decode_kernel = True  # absorbed one-token steps use the split-K decode kernel where it runs (CUDA)

    def reset_parameters(self) -> None:
        """W_uk, W_uv ~ N(0, init_std); norms 1; the conv its own; Linears PyTorch's defaults (the LM overrides them)."""
        nn.init.normal_(self.wuk, std=self.init_std)
        nn.init.normal_(self.wuv, std=self.init_std)
        reset_children(self)

    def forward(self, x: torch.Tensor, state: LatentState | None = None,
                pos: int | SlotBatch | PackedBatch | PaddedBatch = 0, absorb: bool | None = None) -> torch.Tensor:
        """x [B, T, d]; pos: the batch's first position, or a SlotBatch (rows of a slot pool at their own positions),
        or a PackedBatch (sequences packed along T, B = 1: each part attends over its own latents), or a PaddedBatch
        (left-padded rows: pad latents masked, positions counted from each row's first token)."""
        B, T, _ = x.shape
        H, n, p = self.H, self.n, self.p
        q, ckv = self.wq(x), self.wdkv(x)  # [B, T, H (n + p)], [B, T, r + p]
        if self.conv is not None:
            qc, tail = self.conv.run(torch.cat([q, ckv], dim=-1), None if state is None else state.conv, pos)
            q, ckv = qc.split([H * (n + p), self.r + p], dim=-1)
            if state is not None:
                state.conv = tail
        q_nope, q_rope = q.view(B, T, H, n + p).split([n, p], dim=-1)  # [B, T, H, n], [B, T, H, p]
        c, k_rope = ckv.split([self.r, p], dim=-1)
        c = self.kv_norm(c)  # [B, T, r]
        if self.use_rope:
            positions = pos.positions if not isinstance(pos, int) else torch.arange(pos, pos + T, device=x.device)
            q_rope = rope(q_rope, positions, self.theta)
            k_rope = rope(k_rope[:, :, None], positions, self.theta)[:, :, 0]
        if isinstance(pos, (SlotBatch, PackedBatch)):
            if state is None:
                raise ValueError("state: a slot pool's rows need this layer's LatentState, got None")
            pos.write(state.c, c)
            pos.write(state.k_rope, k_rope)
            if isinstance(pos, SlotBatch):
                o = self._attend_slots(q_nope, q_rope, state, pos, absorb)
            else:
                o = pos.join([self._attend_slots(qn, qr, state, part, absorb)
                              for qn, qr, (part, _) in zip(pos.split(q_nope), pos.split(q_rope), pos.parts())])
        else:
            start, mask = (pos.start, pos.mask) if isinstance(pos, PaddedBatch) else (pos, None)
            if state is not None:
                state.c[:, start : start + T] = c
                state.k_rope[:, start : start + T] = k_rope
                c, k_rope = state.c[:, : start + T], state.k_rope[:, : start + T]  # [B, L, r], [B, L, p]
            if absorb is None:
                absorb = state is not None and T == 1
            o = (self._absorbed if absorb else self._naive)(q_nope, q_rope, c, k_rope, mask)  # [B, T, H, e]
        if self.wgate is not None:
            o = o * torch.sigmoid(self.wgate(x)).view(B, T, H, self.e)
        return self.wo(o.reshape(B, T, H * self.e))

    def _attend_slots(self, q_nope, q_rope, state: LatentState, pos: SlotBatch, absorb: bool | None):
        """[B, T, H, e] for slot-pool rows whose new latents are already in the arenas (absorbed for one-token rows)."""
        T = q_nope.shape[1]
        absorb = T == 1 if absorb is None else absorb
        if absorb and T == 1 and self.decode_kernel and kernel_runs_on(state.c):  # the paged decode op, in place
            return self._absorbed(q_nope, q_rope, state.c, state.k_rope, None, pos)
        # [B, L, r], [B, L, p]: each row's latents: exactly its past (one prompt chunk), or those past its position masked
        c, k_rope, mask = pos.read(state.c), pos.read(state.k_rope), None if pos.exact else pos.mask
        return (self._absorbed if absorb else self._naive)(q_nope, q_rope, c, k_rope, mask)

    def _naive(self, q_nope, q_rope, c, k_rope, mask=None):
        B, L, _ = c.shape
        k_nope = torch.einsum("blr,hnr->blhn", c, self.wuk.to(c.dtype))  # [B, L, H, n]
        v = torch.einsum("blr,her->blhe", c, self.wuv.to(c.dtype))  # [B, L, H, e]
        k = torch.cat([k_nope, k_rope[:, :, None].expand(B, L, self.H, self.p)], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k, v = k.to(q.dtype), v.to(q.dtype)  # one compute dtype at the op's boundary (cache vs autocast dtypes)
        # v head dim e may differ from n + p; without a mask the queries are the last T of the L keys
        return attention(q, k, v, causal=mask is None, mask=mask, scale=self.scale, check=False)

    def _absorbed(self, q_nope, q_rope, c, k_rope, mask=None, paged=None):
        """`paged` (a SlotBatch): c and k_rope are a slot pool's block arenas, read in place by the decode op."""
        T, L = q_nope.shape[1], c.shape[1]
        q_lat = torch.einsum("bthn,hnr->bthr", q_nope, self.wuk.to(c.dtype))  # [B, T, H, r]
        if paged is not None or (T == 1 and mask is None and self.decode_kernel and kernel_runs_on(c)):
            two = {} if self.p == 0 else {"q2": q_rope[:, 0].to(c.dtype), "k2": k_rope[:, :, None]}
            rows = {} if paged is None else {"lengths": paged.lengths, "block_table": paged.table}
            o_lat = decode_attention(q_lat[:, 0].to(c.dtype), c[:, :, None], None, scale=self.scale, **two, **rows)  # [B, H, r]
            return torch.einsum("bhr,her->bhe", o_lat, self.wuv.to(c.dtype))[:, None]
        scores = torch.einsum("bthr,blr->bhtl", q_lat, c) + torch.einsum("bthp,blp->bhtl", q_rope, k_rope)
        scores = scores.float() if scores.dtype != torch.float64 else scores
        if mask is None:
            mask = torch.ones(T, L, dtype=torch.bool, device=c.device).tril(L - T)  # queries are the last T of L
        else:
            mask = mask[:, None]  # [B, 1, T, L]
        w = (scores * self.scale).masked_fill(~mask, float("-inf")).softmax(-1).to(c.dtype)  # [B, H, T, L]
        o_lat = torch.einsum("bhtl,blr->bthr", w, c)  # [B, T, H, r]
        return torch.einsum("bthr,her->bthe", o_lat, self.wuv.to(c.dtype))

    def new_state(self, batch_size: int, max_len: int, device=None, dtype=torch.float32, *, blocks: int | None = None) -> LatentState:
        """Latents [blocks or batch_size, max_len, r] and rope keys [.., p] (a pool's block arena when `blocks` is
        given), the conv tail [batch_size, k-1, C]."""
        n = batch_size if blocks is None else blocks
        return LatentState(c=torch.zeros(n, max_len, self.r, device=device, dtype=dtype),
                           k_rope=torch.zeros(n, max_len, self.p, device=device, dtype=dtype),
                           conv=None if self.conv is None else self.conv.new_tail(batch_size, device, dtype))

    def state_size(self, context_len: int) -> int:
        """Numbers held per sequence: the latent and the shared rope key of every token (+ the conv tail, if any)."""
        tail = 0 if self.conv is None else self.conv.weight.shape[0] * (self.conv.kernel - 1)
        return (self.r + self.p) * context_len + tail
