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
def _softplus(x):
    """F.softplus (threshold 20) in a form that does not overflow: max(x, 0) + log(1 + e^-|x|)."""
    return tl.where(x > 20.0, x, tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x))))


@triton.jit
def _decay(g, A, BOUNDED: tl.constexpr):
    """log alpha from the biased gate g: -A softplus(g), or -5 sigmoid(A g) (BOUNDED): evict.ops.memory.preact."""
    if BOUNDED:
        return -5.0 / (1.0 + tl.exp(-A * g))
    return -A * _softplus(g)


@triton.jit
def _step_kernel(
    q, k, v, la, beta, s_in, s_out, o, rows, a_log, dt_bias,
    scale, beta_scale, sq, sv,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, DELTA: tl.constexpr, HAS_BETA: tl.constexpr, HAS_ROWS: tl.constexpr,
    PRE: tl.constexpr, SILU: tl.constexpr, L2: tl.constexpr, BOUNDED: tl.constexpr,
):
    # sq, sv: batch strides of q / k and of v (their heads and dims contiguous). PRE: the inputs are raw (Preact):
    # q, k, v SiLU'd (SILU) and q, k L2-normalised (L2) here; la the gate projection, decayed by A = exp(a_log[h]) and
    # dt_bias; beta the projection, beta_scale sigmoid(beta)
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    mk, mv = rk < K, rv < V
    if HAS_ROWS:  # the state row of batch row b is rows[b] of a slot pool
        i_sh = tl.load(rows + i_b).to(tl.int64) * H + i_h
    else:
        i_sh = i_bh.to(tl.int64)
    s_off = i_sh * K * V + rk[:, None] * V + rv[None, :]
    m_s = mk[:, None] & mv[None, :]
    S = tl.load(s_in + s_off, mask=m_s, other=0.0)  # [BK, BV] float32
    qt = tl.load(q + i_b * sq + i_h * K + rk, mask=mk, other=0.0).to(tl.float32)
    kt = tl.load(k + i_b * sq + i_h * K + rk, mask=mk, other=0.0).to(tl.float32)
    vt = tl.load(v + i_b * sv + i_h * V + rv, mask=mv, other=0.0).to(tl.float32)
    if SILU:
        qt, kt, vt = qt / (1.0 + tl.exp(-qt)), kt / (1.0 + tl.exp(-kt)), vt / (1.0 + tl.exp(-vt))
    if L2:  # F.normalize: x / max(|x|, 1e-12)
        qt = qt / tl.maximum(tl.sqrt(tl.sum(qt * qt, axis=0)), 1e-12)
        kt = kt / tl.maximum(tl.sqrt(tl.sum(kt * kt, axis=0)), 1e-12)
    if GATE == 1:
        g = tl.load(la + i_bh).to(tl.float32)
        if PRE:
            g = _decay(g + tl.load(dt_bias + i_h).to(tl.float32), tl.exp(tl.load(a_log + i_h).to(tl.float32)), BOUNDED)
        S = S * tl.exp(g)
    if GATE == 2:
        g = tl.load(la + i_bh * K + rk, mask=mk, other=0.0).to(tl.float32)
        if PRE:
            g = g + tl.load(dt_bias + i_h * K + rk, mask=mk, other=0.0).to(tl.float32)
            g = tl.where(mk, _decay(g, tl.exp(tl.load(a_log + i_h).to(tl.float32)), BOUNDED), 0.0)
        S = S * tl.exp(g)[:, None]
    if DELTA:
        u = vt - tl.sum(kt[:, None] * S, axis=0)
    else:
        u = vt
    if HAS_BETA:
        b = tl.load(beta + i_bh).to(tl.float32)
        if PRE:
            b = beta_scale / (1.0 + tl.exp(-b))
        u = u * b
    S = S + kt[:, None] * u[None, :]
    ot = (scale * tl.sum(qt[:, None] * S, axis=0)).to(tl.float32)
    tl.store(s_out + s_off, S, mask=m_s)
    tl.store(o + i_bh * V + rv, ot.to(o.dtype.element_ty), mask=mv)


def _heads(t):
    """t [B, H, D] with its heads and dims contiguous (any batch stride), as the kernel reads it."""
    return t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous()


def step_triton(q, k, v, state, *, log_alpha=None, beta=None, delta=False, scale, out=None, rows=None, pre=None):
    """One token: q, k [B, H, K]; v [B, H, V]; state [B, H, K, V] float32. Returns (o [B, H, V], new state).

    `out` ([B, H, K, V] float32, may be `state` itself) receives the new state; otherwise a new tensor is made.
    `rows` [B]: state and out are [N, H, K, V] and row b lives at rows[b] (out not `state`: a copy of state first).
    `pre` (evict.ops.memory.preact.Preact): q, k, v, log_alpha and beta are raw and mapped in the kernel.
    q, k and v may be views with any batch stride (of one projection's output: no copies).
    """
    B, H, K = q.shape
    V = v.shape[-1]
    q, k, v = _heads(q), _heads(k), _heads(v)
    if k.stride(0) != q.stride(0):
        q, k = q.contiguous(), k.contiguous()
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
    gated = pre is not None and pre.A_log is not None and log_alpha is not None
    _step_kernel[grid](
        q, k, v, la, bt, state, s_out, o, q if rows is None else rows,
        pre.A_log.contiguous() if gated else q, pre.dt_bias.contiguous() if gated else q,
        float(scale), 1.0 if pre is None else float(pre.beta_scale), q.stride(0), v.stride(0),
        H=H, K=K, V=V, BK=BK, BV=BV, GATE=GATES[gate], DELTA=bool(delta), HAS_BETA=beta is not None,
        HAS_ROWS=rows is not None, PRE=pre is not None, SILU=pre is not None and pre.silu,
        L2=pre is not None and pre.l2, BOUNDED=pre is not None and pre.form == "bounded",
        num_warps=4 if BK * BV <= 4096 else 8,
    )
    return o, s_out
