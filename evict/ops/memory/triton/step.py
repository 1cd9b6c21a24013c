"""Fused decode step: decay, erase, write and read of one token in one launch per step.

Legend: B batch, H heads, K key dim, V value dim; BK = K padded to a power of two, BV a block of V.
One program owns the state tile S[b, h, :, v-block] (float32, [BK, BV]): it reads the tile once, applies
    S' = Diag(alpha) S;  u = beta (v - k S') (delta) or beta v;  S = S' + k^T u;  o = scale q S
and writes the tile once. No host syncs and no step-dependent allocations, so the launch can be graph-captured;
the new state may be written over the old one (each program reads its whole tile before writing it). With `rows`
the states are a slot pool's and batch row b reads and writes pool row rows[b] (no gather or scatter copy).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GATES = {None: 0, "scalar": 1, "channel": 2}


@triton.jit
def _step_kernel(
    q, k, v, la, beta, s_in, s_out, o, rows,
    scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, DELTA: tl.constexpr, HAS_BETA: tl.constexpr, HAS_ROWS: tl.constexpr,
):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    mk, mv = rk < K, rv < V
    if HAS_ROWS:  # the state row of batch row b is rows[b] of a slot pool
        i_sh = tl.load(rows + i_bh // H).to(tl.int64) * H + i_bh % H
    else:
        i_sh = i_bh.to(tl.int64)
    s_off = i_sh * K * V + rk[:, None] * V + rv[None, :]
    m_s = mk[:, None] & mv[None, :]
    S = tl.load(s_in + s_off, mask=m_s, other=0.0)  # [BK, BV] float32
    qt = tl.load(q + i_bh * K + rk, mask=mk, other=0.0).to(tl.float32)
    kt = tl.load(k + i_bh * K + rk, mask=mk, other=0.0).to(tl.float32)
    vt = tl.load(v + i_bh * V + rv, mask=mv, other=0.0).to(tl.float32)
    if GATE == 1:
        S = S * tl.exp(tl.load(la + i_bh).to(tl.float32))
    if GATE == 2:
        S = S * tl.exp(tl.load(la + i_bh * K + rk, mask=mk, other=0.0).to(tl.float32))[:, None]
    if DELTA:
        u = vt - tl.sum(kt[:, None] * S, axis=0)
    else:
        u = vt
    if HAS_BETA:
        u = u * tl.load(beta + i_bh).to(tl.float32)
    S = S + kt[:, None] * u[None, :]
    ot = (scale * tl.sum(qt[:, None] * S, axis=0)).to(tl.float32)
    tl.store(s_out + s_off, S, mask=m_s)
    tl.store(o + i_bh * V + rv, ot.to(o.dtype.element_ty), mask=mv)


def step_triton(q, k, v, state, *, log_alpha=None, beta=None, delta=False, scale, out=None, rows=None):
    """One token: q, k [B, H, K]; v [B, H, V]; state [B, H, K, V] float32. Returns (o [B, H, V], new state).

    `out` ([B, H, K, V] float32, may be `state` itself) receives the new state; otherwise a new tensor is made.
    `rows` [B]: state and out are [N, H, K, V] and row b lives at rows[b] (out not `state`: a copy of state first).
    """
    B, H, K = q.shape
    V = v.shape[-1]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    state = state.contiguous()
    gate = None if log_alpha is None else ("scalar" if log_alpha.dim() == 2 else "channel")
    la = log_alpha.contiguous() if log_alpha is not None else q
    bt = beta.contiguous() if beta is not None else q
    if rows is None:
        s_out = torch.empty_like(state) if out is None else out
    else:
        s_out = state.clone() if out is None else out if out is state else out.copy_(state)
        rows = rows.contiguous()
    o = torch.empty(B, H, V, dtype=q.dtype, device=q.device)
    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), max(16, 4096 // BK))
    grid = (triton.cdiv(V, BV), B * H)
    _step_kernel[grid](
        q, k, v, la, bt, state, s_out, o, q if rows is None else rows, float(scale),
        H=H, K=K, V=V, BK=BK, BV=BV, GATE=GATES[gate], DELTA=bool(delta), HAS_BETA=beta is not None,
        HAS_ROWS=rows is not None,
        num_warps=4 if BK * BV <= 4096 else 8,
    )
    return o, s_out
