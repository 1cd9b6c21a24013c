"""The short causal depthwise conv in Triton, forward and backward (see evict/ops/conv.py for the math and contract).

Training's form: no tail (zeros before the first token). Forward, grid (T / BT, C / BC, B): a program loads the k
shifted [BT, BC] tiles of x it needs (rows before 0 read as zeros) and sums them weighted in float32. Backward, the
same grid: dx from the k shifted tiles of dy (rows past T read as zeros), and each program's [BC, k] share of dw
(x's shifted tiles times dy, summed over its rows) written to a float32 buffer [B · T / BT, C, k] that one torch sum
reduces (deterministic: no atomics). Both are one pass over their inputs; cuDNN's grouped weight-gradient kernel took
2.25 ms per call at the lab's largest cell (dev/LOG.md), this form reads the same bytes in a few dozen µs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BT, BC = 64, 128  # rows and channels per program


@triton.jit
def _conv_fwd_kernel(x, w, y, T, C, s_xb, s_xt, s_yb, s_yt, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    i_t, i_c, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    rt = i_t * BT + tl.arange(0, BT)
    rc = i_c * BC + tl.arange(0, BC)
    mc = rc < C
    acc = tl.zeros([BT, BC], tl.float32)
    for j in tl.static_range(K):  # y_t = sum_j w[j] x_{t + j - (K - 1)}
        r = rt + j - (K - 1)
        m = (r >= 0) & (r < T)
        xj = tl.load(x + b * s_xb + r[:, None].to(tl.int64) * s_xt + rc[None, :], mask=m[:, None] & mc[None, :], other=0.0)
        wj = tl.load(w + rc * K + j, mask=mc, other=0.0)
        acc += xj.to(tl.float32) * wj[None, :]
    mt = rt < T
    tl.store(y + b * s_yb + rt[:, None].to(tl.int64) * s_yt + rc[None, :], acc.to(y.dtype.element_ty),
             mask=mt[:, None] & mc[None, :])


@triton.jit
def _conv_bwd_kernel(x, w, dy, dx, dw, T, C, n_t, s_xb, s_xt, s_db, s_dt, s_gb, s_gt,
                     K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    i_t, i_c, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    rt = i_t * BT + tl.arange(0, BT)
    rc = i_c * BC + tl.arange(0, BC)
    mc = rc < C
    mt = rt < T
    g = tl.load(dy + b * s_db + rt[:, None].to(tl.int64) * s_dt + rc[None, :], mask=mt[:, None] & mc[None, :],
                other=0.0).to(tl.float32)
    acc = tl.zeros([BT, BC], tl.float32)
    part = dw + ((b * n_t + i_t) * C + rc) * K  # this program's [BC, K] share of dw
    for j in tl.static_range(K):
        # dx_t = sum_j w[j] dy_{t + (K - 1) - j}
        r = rt + (K - 1) - j
        m = r < T
        gj = tl.load(dy + b * s_db + r[:, None].to(tl.int64) * s_dt + rc[None, :], mask=m[:, None] & mc[None, :],
                     other=0.0)
        wj = tl.load(w + rc * K + j, mask=mc, other=0.0)
        acc += gj.to(tl.float32) * wj[None, :]
        # dw[j] = sum_t x_{t + j - (K - 1)} dy_t over this program's rows t
        s = rt + j - (K - 1)
        ms = (s >= 0) & mt
        xj = tl.load(x + b * s_xb + s[:, None].to(tl.int64) * s_xt + rc[None, :], mask=ms[:, None] & mc[None, :],
                     other=0.0)
        tl.store(part + j, tl.sum(xj.to(tl.float32) * g, axis=0), mask=mc)
    tl.store(dx + b * s_gb + rt[:, None].to(tl.int64) * s_gt + rc[None, :], acc.to(dx.dtype.element_ty),
             mask=mt[:, None] & mc[None, :])


def _grid(B: int, T: int, C: int) -> tuple[int, int, int]:
    return triton.cdiv(T, BT), triton.cdiv(C, BC), B


def conv_forward_triton(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [B, T, C] (channel stride 1), w [C, k] float32 -> y [B, T, C] in x's dtype (float32 sums)."""
    B, T, C = x.shape
    y = torch.empty(B, T, C, device=x.device, dtype=x.dtype)
    bt = min(BT, triton.next_power_of_2(T))  # a decode step's few rows (tail + 1): no 64-row tiles of masked loads
    _conv_fwd_kernel[(triton.cdiv(T, bt), triton.cdiv(C, BC), B)](x, w, y, T, C, x.stride(0), x.stride(1), y.stride(0),
                                                                y.stride(1), K=w.shape[1], BT=bt, BC=BC, num_warps=4)
    return y


def conv_backward_triton(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [B, T, C] in x's dtype, dw [C, k] float32) of y = conv(x, w) for the upstream gradient dy."""
    B, T, C = x.shape
    n_t = triton.cdiv(T, BT)
    dx = torch.empty(B, T, C, device=x.device, dtype=x.dtype)
    parts = torch.empty(B * n_t, C, w.shape[1], device=x.device, dtype=torch.float32)
    _conv_bwd_kernel[_grid(B, T, C)](x, w, dy, dx, parts, T, C, n_t, x.stride(0), x.stride(1), dy.stride(0),
                                     dy.stride(1), dx.stride(0), dx.stride(1), K=w.shape[1], BT=BT, BC=BC, num_warps=4)
    return dx, parts.sum(0)


@triton.jit
def _conv_step_kernel(x, w, tails, y, rows, C, s_xb, K: tl.constexpr, BC: tl.constexpr, HAS_ROWS: tl.constexpr):
    """One token of B rows, grid (C / BC, B): y = sum_j w[j] [tail; x]_j in float32 (the forward kernel's sum, in its
    order), and the tail [k-1, C] of pool row rows[b] (or b) shifted by x, in place (a program reads its tile first)."""
    i_c, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    rc = i_c * BC + tl.arange(0, BC)
    mc = rc < C
    if HAS_ROWS:
        t = tails + tl.load(rows + b).to(tl.int64) * (K - 1) * C + rc
    else:
        t = tails + b * (K - 1) * C + rc
    xt = tl.load(x + b * s_xb + rc, mask=mc, other=0.0)
    acc = tl.zeros([BC], tl.float32)
    for j in tl.static_range(K):
        if j < K - 1:
            xj = tl.load(t + j * C, mask=mc, other=0.0)
        else:
            xj = xt
        wj = tl.load(w + rc * K + j, mask=mc, other=0.0).to(tl.float32)
        acc += xj.to(tl.float32) * wj
    for j in tl.static_range(K - 2):
        tl.store(t + j * C, tl.load(t + (j + 1) * C, mask=mc, other=0.0), mask=mc)
    if K > 1:
        tl.store(t + (K - 2) * C, xt.to(tails.dtype.element_ty), mask=mc)
    tl.store(y + b * C + rc, acc.to(y.dtype.element_ty), mask=mc)


def conv_step_triton(x: torch.Tensor, w: torch.Tensor, tails: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """x [B, 1, C] (channel stride 1), w [C, k] (any float dtype), tails [N, k-1, C] contiguous, rows [B] or None
    (then N = B) -> y [B, 1, C] in x's dtype; tails[rows] shifted by x in place."""
    B, _, C = x.shape
    y = torch.empty(B, 1, C, device=x.device, dtype=x.dtype)
    _conv_step_kernel[(triton.cdiv(C, BC), B)](x, w, tails, y, tails if rows is None else rows, C, x.stride(0),
                                               K=w.shape[1], BC=BC, HAS_ROWS=rows is not None, num_warps=4)
    return y
