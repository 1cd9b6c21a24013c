"""Chunked backward: the forward's first two kernels recomputed, then three backward kernels.

Legend as in forward.py. Per chunk, with S its start state, S' its end state and dS' = dL/dS' (dH, stored):

1. `_dstate_kernel`, grid (V / BV, B H), chunks in reverse (sequential), carrying dS [BK, BV]:
       dU = scale P^T dO + (K * e^{g_C - g}) dS'            (stored)
       dS = e^{g_C} * dS' + scale (Q * e^g)^T dO - W^T dU     (the last one is dL/d initial_state)
2. `_dvalue_kernel`, grid (N, B H), loops over V blocks:
       dP = scale dO U^T (lower);  dR_u = T^T dU;  dv = beta * dR_u;  dbeta += rowsum(dR_u * v);  dA = -dR_u U_bar^T
3. `_dkey_kernel`, grid (N, B H): the V contractions dO S^T, -dU S^T (= dW), U dS'^T; then dR_w = T^T dW,
   dA -= dR_w W^T (strictly lower), dbeta += rowsum(dR_w * K e^g) + rowsum(dA * A~), dA~ = Diag(beta) dA, and by
   sub-chunk blocks (the same factoring through r = the first row of I as the forward's Gram blocks):
       dq_i     = scale (dO S^T)_i e^{g_i} + sum_j dP_ij k_j e^{g_i - g_j}
       dk_row_i = beta_i (dR_w)_i e^{g_i}  + sum_j dA~_ij k_j e^{g_i - g_j}            (k_i as a reader: its erase)
       dk_col_j = (U dS'^T)_j e^{g_C - g_j} + sum_i (dA~_ij k_i + dP_ij q_i) e^{g_i - g_j}   (k_j as a writer)
   dk = dk_row + dk_col, and the gate: every use of token t's decay is a factor e^{G_t} on q_t or on k_t as a reader,
   or e^{-G_t} on k_t as a writer (G the prefix sum of log alpha over the whole sequence; the final state also carries
   e^{G_T}), so dL/dG_t = q_t dq_t + k_t (dk_row_t - dk_col_t) and dlog alpha_t = sum_{s >= t} dL/dG_s
   + rowsum(S_T dS_T): a reverse cumulative sum (`_revcumsum_kernel`).
Packed sequences (a chunk table, see autograd.py): the dstate carry and the reverse sum run per sequence.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .forward import (SC, SPREAD, _block, chunk_length, _chunk_decay, _chunk_keys, _chunk_queries, _hrows, _hstore,
                      _lower, _rows, _segment, _spread,
                      _state_tile, _strip_decay, carry, intra, precision_for, state_block_v)


@triton.jit
def _dstate_back(dS, qn, don, du, W, Dec, hm, i_bh, N, n, t0, rc, ck, scale, K: tl.constexpr, GATE: tl.constexpr,
                 DELTA: tl.constexpr, PREC: tl.constexpr):
    """Rows ck of the state gradient one chunk back: dS e^{g_C} + scale (Q e^g)^T dO - W^T dU (qn: rows ck of Q e^g)."""
    dS = _chunk_decay(dS, Dec, i_bh, N, n, ck, K, GATE)
    # products with `scale` cast to float32: under torch.compile (Inductor) a Python float argument arrives as fp64
    dS += (scale * tl.dot(tl.trans(qn), don, input_precision=PREC)).to(tl.float32)
    if DELTA:
        dS -= tl.dot(tl.trans(_hrows(W + hm * K, t0 + rc, ck, K)), du, input_precision=PREC)
    return dS


@triton.jit
def _dstate_kernel(
    q, k, do, Kd, Dec, Qg, W, Pm, dU, dHs, dsT, ds0, cu, scale,
    T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, N,
    G,  # without KD only (after the others: with KD the kernel compiles as it did before it came)
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, DELTA: tl.constexpr, HAS_DST: tl.constexpr, PREC: tl.constexpr, VARLEN: tl.constexpr = False,
    HALVES: tl.constexpr = False, KD: tl.constexpr = True,
):
    """HALVES: the state gradient as two [BK / 2, BV] tiles of key rows, as `_state_kernel`'s. KD: K e^{g_C - g} as
    the first stage stored it (Kd), else (a scalar gate) formed here from K and the prefix sums G, as `_state_kernel`
    does."""
    i_v, i_sh = tl.program_id(0), tl.program_id(1)  # as in _state_kernel: (sequence, head)
    i_s, i_h = i_sh // H, i_sh % H
    n0, n1, i_b = _segment(cu, i_s, N, VARLEN)
    i_bh = i_b * H + i_h
    ck, rc = tl.arange(0, BK // 2 if HALVES else BK), tl.arange(0, C)
    cv = i_v * BV + tl.arange(0, BV)
    mv = cv < V
    tok = i_b.to(tl.int64) * T * H + i_h
    q_bh, k_bh, do_bh = q + tok * K, k + tok * K, do + tok * V
    hm = i_bh.to(tl.int64) * N * C
    s_off, m_s, dS = _state_tile(dsT, i_sh, ck, cv, K, V, HAS_DST)
    if HALVES:
        ck2 = BK // 2 + ck
        s_off2, m_s2, dS2 = _state_tile(dsT, i_sh, ck2, cv, K, V, HAS_DST)
    for i in range(n1 - n0):
        n = n1 - 1 - i
        t0 = n * C
        tl.store(dHs + (i_bh.to(tl.int64) * N + n) * K * V + s_off, dS, mask=m_s)
        if HALVES:
            tl.store(dHs + (i_bh.to(tl.int64) * N + n) * K * V + s_off2, dS2, mask=m_s2)
        don = _rows(do_bh, t0, rc, T, H * V, cv, V)
        du = (scale * tl.dot(tl.trans(_lower(Pm + hm * C, t0, C, False)), don, input_precision=PREC)).to(tl.float32)
        kn = _chunk_keys(k_bh, Kd, G, hm, t0, rc, ck, T, H, K, C, GATE, KD)  # K, or K e^{g_C - g} (stored or formed)
        qn = _chunk_queries(q_bh, Qg, Qg, hm, t0, rc, ck, T, H, K, GATE, True)
        du += tl.dot(kn, dS, input_precision=PREC)
        if HALVES:
            du += tl.dot(_chunk_keys(k_bh, Kd, G, hm, t0, rc, ck2, T, H, K, C, GATE, KD), dS2, input_precision=PREC)
        tl.store(dU + (hm + t0 + rc)[:, None] * V + cv[None, :], du, mask=mv[None, :])
        dS = _dstate_back(dS, qn, don, du, W, Dec, hm, i_bh, N, n, t0, rc, ck, scale, K, GATE, DELTA, PREC)
        if HALVES:
            dS2 = _dstate_back(dS2, _chunk_queries(q_bh, Qg, Qg, hm, t0, rc, ck2, T, H, K, GATE, True), don, du, W, Dec, hm,
                               i_bh, N, n, t0, rc, ck2, scale, K, GATE, DELTA, PREC)
    tl.store(ds0 + i_sh.to(tl.int64) * K * V + s_off, dS, mask=m_s)
    if HALVES:
        tl.store(ds0 + i_sh.to(tl.int64) * K * V + s_off2, dS2, mask=m_s2)


@triton.jit
def _dvalue_kernel(
    v, beta, do, Ub, U, dU, Tm, dPm, dAm, dB, dv, scale,
    T, H: tl.constexpr, V: tl.constexpr, N,
    C: tl.constexpr, BV: tl.constexpr, DELTA: tl.constexpr, HAS_BETA: tl.constexpr, PREC: tl.constexpr,
):
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    t0 = i_n * C
    rc = tl.arange(0, C)
    tok = i_b.to(tl.int64) * T * H + i_h
    hm = i_bh.to(tl.int64) * N * C
    if HAS_BETA:
        bc = tl.load(beta + tok + (t0 + rc).to(tl.int64) * H, mask=t0 + rc < T, other=0.0).to(tl.float32)
    if DELTA:
        Tc = _lower(Tm + hm * C, t0, C, False)
        dA = tl.zeros([C, C], tl.float32)
    dP = tl.zeros([C, C], tl.float32)
    db = tl.zeros([C], tl.float32)
    for v0 in range(0, V, BV):
        cv = v0 + tl.arange(0, BV)
        h_off = (hm + t0 + rc)[:, None] * V + cv[None, :]
        m_h = (cv < V)[None, :]
        don = _rows(do + tok * V, t0, rc, T, H * V, cv, V)
        dun = tl.load(dU + h_off, mask=m_h, other=0.0)
        dP += tl.dot(don, tl.trans(tl.load(U + h_off, mask=m_h, other=0.0).to(tl.float32)), input_precision=PREC)
        if DELTA:
            dR = tl.dot(tl.trans(Tc), dun, input_precision=PREC)
            dA -= tl.dot(dR, tl.trans(tl.load(Ub + h_off, mask=m_h, other=0.0).to(tl.float32)), input_precision=PREC)
        else:
            dR = dun
        if HAS_BETA:
            db += tl.sum(dR * _rows(v + tok * V, t0, rc, T, H * V, cv, V), axis=1)
            dR = dR * bc[:, None]
        tl.store(dv + (tok + (t0 + rc).to(tl.int64) * H)[:, None] * V + cv[None, :], dR.to(dv.dtype.element_ty),
                 mask=(t0 + rc < T)[:, None] & (cv < V)[None, :])
    _hstore(dPm + hm * C, t0 + rc, rc, C, tl.where(rc[:, None] >= rc[None, :], (scale * dP).to(tl.float32), 0.0))
    if DELTA:
        _hstore(dAm + hm * C, t0 + rc, rc, C, dA)
    if HAS_BETA:
        tl.store(dB + hm + t0 + rc, db)


@triton.jit
def _diag_rows_exact(M1, M2, y_bh, G_bh, r0, gI, T, sy, ck, K: tl.constexpr, SC: tl.constexpr, BK: tl.constexpr):
    """sum_j M_ij y_j e^{g_i - g_j} over the sub-chunk (M lower), for M1 and M2, exact ratios: [SC, BK] each."""
    rs = tl.arange(0, SC)
    out1 = tl.zeros([SC, BK], tl.float32)
    out2 = tl.zeros([SC, BK], tl.float32)
    for j in range(SC):
        yj = tl.load(y_bh + (r0 + j).to(tl.int64) * sy + ck, mask=(ck < K) & (r0 + j < T), other=0.0).to(tl.float32)
        gj = tl.load(G_bh + (r0 + j) * K + ck, mask=ck < K, other=0.0)
        e = tl.exp(tl.where(rs[:, None] >= j, gI - gj[None, :], 0.0)) * yj[None, :]
        out1 += tl.sum(tl.where(rs[None, :] == j, M1, 0.0), axis=1)[:, None] * e
        out2 += tl.sum(tl.where(rs[None, :] == j, M2, 0.0), axis=1)[:, None] * e
    return out1, out2


@triton.jit
def _diag_cols_exact(M1, x1, M2, x2, G_bh, r0, gI, ck, K: tl.constexpr, SC: tl.constexpr, BK: tl.constexpr):
    """sum_i (M1_ij x1_i + M2_ij x2_i) e^{g_i - g_j} over the sub-chunk (M lower), exact ratios: [SC, BK]."""
    rs = tl.arange(0, SC)
    out = tl.zeros([SC, BK], tl.float32)
    for j in range(SC):
        gj = tl.load(G_bh + (r0 + j) * K + ck, mask=ck < K, other=0.0)
        e = tl.exp(tl.where(rs[:, None] >= j, gI - gj[None, :], 0.0))
        m1 = tl.sum(tl.where(rs[None, :] == j, M1, 0.0), axis=1)
        m2 = tl.sum(tl.where(rs[None, :] == j, M2, 0.0), axis=1)
        col = tl.sum((m1[:, None] * x1 + m2[:, None] * x2) * e, axis=0)
        out = tl.where(rs[:, None] == j, col[None, :], out)
    return out


@triton.jit
def _v_contractions(Hs, dHs, do, U, dU, tok, hm, h_off, t0, ck, nv, T, H: tl.constexpr, K: tl.constexpr,
                    V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DELTA: tl.constexpr,
                    PREC: tl.constexpr):
    """Phase 1 of the key gradients for key columns ck, over the first nv value columns: dO S^T, -dU S^T (with the
    delta rule) and U dS'^T, each [C, BK] float32."""
    rc = tl.arange(0, C)
    mk = ck < K
    xq = tl.zeros([C, BK], tl.float32)
    xw = tl.zeros([C, BK], tl.float32)
    xc = tl.zeros([C, BK], tl.float32)
    for v0 in range(0, nv, BV):
        cv = v0 + tl.arange(0, BV)
        mv = cv < V
        s_off = h_off + ck[None, :] * V + cv[:, None]  # [BV, BK]: S^T
        St = tl.load(Hs + s_off, mask=mv[:, None] & mk[None, :], other=0.0).to(tl.float32)
        dSt = tl.load(dHs + s_off, mask=mv[:, None] & mk[None, :], other=0.0)
        don = _rows(do + tok * V, t0, rc, T, H * V, cv, V)
        un = tl.load(U + (hm + t0 + rc)[:, None] * V + cv[None, :], mask=mv[None, :], other=0.0).to(tl.float32)
        xq += tl.dot(don, St, input_precision=PREC)
        xc += tl.dot(un, dSt, input_precision=PREC)
        if DELTA:
            dun = tl.load(dU + (hm + t0 + rc)[:, None] * V + cv[None, :], mask=mv[None, :], other=0.0)
            xw -= tl.dot(dun, St, input_precision=PREC)
    return xq, xw, xc


@triton.jit
def _state_side(xq, xc, G_bh, t0, ck, K: tl.constexpr, C: tl.constexpr, GATE: tl.constexpr):
    """Phase 2's decays for key columns ck: Q reads S through e^g, K writes dS' through e^{g_C - g}. Returns the decayed
    xq, xc and e^g ([C, BK] per channel, [C, 1] for a scalar gate, ones without a gate)."""
    rc = tl.arange(0, C)
    eg = tl.full([C, 1], 1.0, tl.float32)
    if GATE == 2:
        gc = _hrows(G_bh, t0 + rc, ck, K)
        g_end = tl.load(G_bh + (t0 + C - 1) * K + ck, mask=ck < K, other=0.0)
        eg = tl.exp(gc)
        xq = xq * eg
        xc = xc * tl.exp(g_end[None, :] - gc)
    if GATE == 1:
        gc = tl.load(G_bh + t0 + rc)
        eg = tl.exp(gc)[:, None]
        xq = xq * eg
        xc = xc * tl.exp(tl.load(G_bh + t0 + C - 1) - gc)[:, None]
    return xq, xc, eg


@triton.jit
def _chunk_terms(xw, eg, dA, dbk, k_bh, W_bh, Tt, bc, t0, ck, T, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr,
                 GATE: tl.constexpr, HAS_BETA: tl.constexpr, PREC: tl.constexpr):
    """Phase 2's WY terms for key columns ck: dR_w = T^T xw, dA -= dR_w W^T and dbeta's rowsum(dR_w K e^g) share;
    returns (dk_row from W for these columns, dA, dbk)."""
    rc = tl.arange(0, C)
    dR = tl.dot(Tt, xw, input_precision=PREC)
    dA -= tl.dot(dR, tl.trans(_hrows(W_bh, t0 + rc, ck, K)), input_precision=PREC)
    if GATE != 0:
        dR = dR * eg
    if HAS_BETA:
        dbk += tl.sum(dR * _rows(k_bh, t0, rc, T, H * K, ck, K), axis=1)
        dR = dR * bc[:, None]
    return dR, dA, dbk


@triton.jit
def _strip_mats(dP_bh, dA_bh, G_bh, t0, I, C: tl.constexpr, SC: tl.constexpr, GATE: tl.constexpr, DELTA: tl.constexpr):
    """Phase 3's rows (I, all columns) and columns (all rows, I) of dP and dA~ for sub-chunk I, a scalar gate's decay
    ratios applied (they do not depend on the key column)."""
    rc, rs = tl.arange(0, C), tl.arange(0, SC)
    r0, ri = t0 + I * SC, I * SC + rs
    dPr = tl.load(dP_bh + (r0 + rs)[:, None] * C + rc[None, :])  # [SC, C]
    dPc = tl.load(dP_bh + (t0 + rc)[:, None] * C + ri[None, :])  # [C, SC]
    dAr = tl.zeros([SC, C], tl.float32)
    dAc = tl.zeros([C, SC], tl.float32)
    if DELTA:
        dAr = tl.load(dA_bh + (r0 + rs)[:, None] * C + rc[None, :])
        dAc = tl.load(dA_bh + (t0 + rc)[:, None] * C + ri[None, :])
    if GATE == 1:
        gc = tl.load(G_bh + t0 + rc)
        gI = tl.load(G_bh + r0 + rs)
        rr = tl.exp(tl.where(ri[:, None] >= rc[None, :], gI[:, None] - gc[None, :], float("-inf")))  # [SC, C]
        rcl = tl.exp(tl.where(rc[:, None] >= ri[None, :], gc[:, None] - gI[None, :], float("-inf")))  # [C, SC]
        dPr, dPc, dAr, dAc = dPr * rr, dPc * rcl, dAr * rr, dAc * rcl
    return dPr, dPc, dAr, dAc


@triton.jit
def _strip_grads(q_bh, k_bh, G_bh, dP_bh, dA_bh, XQ_bh, XW_bh, XC_bh, dq, dk, dg, tok, t0, I, ck, spread,
                 dPr, dPc, dAr, dAc, T, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, SC: tl.constexpr,
                 BK: tl.constexpr, SPREAD: tl.constexpr, GATE: tl.constexpr, DELTA: tl.constexpr, PREC: tl.constexpr):
    """Phase 3 for sub-chunk I and key columns ck: the Gram matrices' transposed products plus phases 1-2's terms (XQ,
    XW, XC), stored as dq, dk and (per channel) the gate's dG; returns this block's share of a scalar gate's dG [SC].
    Row side (rows I): reference r = I's first row; column side (columns I): reference s = its last row; `spread` is
    I's decay spread over every key column (per-channel gates)."""
    rc, rs = tl.arange(0, C), tl.arange(0, SC)
    r0 = t0 + I * SC
    mk = ck < K
    qI = _rows(q_bh, r0, rs, T, H * K, ck, K)
    kI = _rows(k_bh, r0, rs, T, H * K, ck, K)
    kc = _rows(k_bh, t0, rc, T, H * K, ck, K)
    qc = _rows(q_bh, t0, rc, T, H * K, ck, K)
    if GATE == 2:
        gc = _hrows(G_bh, t0 + rc, ck, K)
        gI = _hrows(G_bh, r0 + rs, ck, K)
        g_r = tl.load(G_bh + r0 * K + ck, mask=mk, other=0.0)
        g_s = tl.load(G_bh + (r0 + SC - 1) * K + ck, mask=mk, other=0.0)
        ky = kc * _strip_decay(gc, g_r, rc, (I + 1) * SC, spread, SPREAD, SC)
        xf = tl.exp(gI - g_r[None, :])
        dqI = tl.dot(dPr, ky, input_precision=PREC) * xf
        start = tl.where(spread <= SPREAD, I * SC, (I + 1) * SC)
        xs = tl.exp(tl.where((rc >= start)[:, None], gc - g_s[None, :], float("-inf")))
        col = tl.dot(tl.trans(dPc), qc * xs, input_precision=PREC)
        if DELTA:
            dkr = tl.dot(dAr, ky, input_precision=PREC) * xf
            col += tl.dot(tl.trans(dAc), kc * xs, input_precision=PREC)
        else:
            dkr = tl.zeros([SC, BK], tl.float32)
        dkc = col * tl.exp(g_s[None, :] - gI)
        if spread > SPREAD:  # strong decay inside the sub-chunk: its diagonal block with exact ratios
            dPb = _block(dP_bh, r0, I * SC, SC, C)
            if DELTA:
                dAb = _block(dA_bh, r0, I * SC, SC, C)
            else:
                dAb = tl.zeros([SC, SC], tl.float32)
            dqd, dkrd = _diag_rows_exact(dPb, dAb, k_bh, G_bh, r0, gI, T, H * K, ck, K, SC, BK)
            dqI += dqd
            dkr += dkrd
            dkc += _diag_cols_exact(dPb, qI, dAb, kI, G_bh, r0, gI, ck, K, SC, BK)
    else:
        dqI = tl.dot(dPr, kc, input_precision=PREC)
        dkc = tl.dot(tl.trans(dPc), qc, input_precision=PREC)
        if DELTA:
            dkr = tl.dot(dAr, kc, input_precision=PREC)
            dkc += tl.dot(tl.trans(dAc), kc, input_precision=PREC)
        else:
            dkr = tl.zeros([SC, BK], tl.float32)
    dqI += _hrows(XQ_bh, r0 + rs, ck, K)
    dkc += _hrows(XC_bh, r0 + rs, ck, K)
    if DELTA:
        dkr += _hrows(XW_bh, r0 + rs, ck, K)
    m_out = (r0 + rs < T)[:, None] & mk[None, :]
    o_off = (tok + (r0 + rs).to(tl.int64) * H)[:, None] * K + ck[None, :]
    tl.store(dq + o_off, dqI.to(dq.dtype.element_ty), mask=m_out)
    tl.store(dk + o_off, (dkr + dkc).to(dk.dtype.element_ty), mask=m_out)
    if GATE == 2:
        tl.store(dg + o_off, qI * dqI + kI * (dkr - dkc), mask=m_out)
    return tl.sum(qI * dqI + kI * (dkr - dkc), axis=1)


@triton.jit
def _dkey_kernel(
    q, k, beta, U, dU, W, Tm, Am, dPm, dAm, G, Hs, dHs, dB, do,
    dq, dk, dg, db_out, XQ, XW, XC, scale,
    T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, N,
    C: tl.constexpr, SC: tl.constexpr, BK: tl.constexpr, BKF: tl.constexpr, BV: tl.constexpr, SPREAD: tl.constexpr,
    GATE: tl.constexpr, DELTA: tl.constexpr, HAS_BETA: tl.constexpr, PREC: tl.constexpr, ABLATE: tl.constexpr = 0,
    SPLIT: tl.constexpr = 0,
):
    """The key side of the backward (dq, dk, the gate's dG, dbeta), BK key columns at a time (BKF: all of them,
    padded). SPLIT = 0: grid (N, B H), every phase in one program per chunk. SPLIT = 1: phases 1-2 only, grid (N, B H);
    SPLIT = 2: phase 3 only, one program per sub-chunk strip, grid (N C / SC, B H) — smaller tiles, more programs."""
    # ABLATE (timing only, wrong results): bit 1 skips the V contractions
    NB: tl.constexpr = C // SC
    i_p, i_bh = tl.program_id(0), tl.program_id(1)
    if SPLIT == 2:
        i_n, I0, I1 = i_p // NB, i_p % NB, i_p % NB + 1
    else:
        i_n, I0, I1 = i_p, 0, NB
    i_b, i_h = i_bh // H, i_bh % H
    t0 = i_n * C
    rc = tl.arange(0, C)
    tok = i_b.to(tl.int64) * T * H + i_h
    q_bh, k_bh = q + tok * K, k + tok * K
    hm = i_bh.to(tl.int64) * N * C
    G_bh = G + hm * (K if GATE == 2 else 1)
    XQ_bh, XW_bh, XC_bh = XQ + hm * K, XW + hm * K, XC + hm * K
    dP_bh, dA_bh = dPm + hm * C, dAm + hm * C
    if SPLIT != 2:
        # phases 1-2: contractions over V with the chunk's start state S and end-state gradient dS', then the whole-chunk
        # terms (state reads / writes, the WY factors)
        h_off = (i_bh.to(tl.int64) * N + i_n) * K * V
        bc = tl.zeros([C], tl.float32)
        if HAS_BETA:
            bc = tl.load(beta + tok + (t0 + rc).to(tl.int64) * H, mask=t0 + rc < T, other=0.0).to(tl.float32)
        Tt = tl.zeros([C, C], tl.float32)
        dA = tl.zeros([C, C], tl.float32)
        if DELTA:
            Tt = tl.trans(_lower(Tm + hm * C, t0, C, False))
            dA = tl.load(dA_bh + (t0 + rc)[:, None] * C + rc[None, :], mask=rc[:, None] > rc[None, :], other=0.0)
        dbk = tl.zeros([C], tl.float32)
        for k0 in range(0, K, BK):
            ck = k0 + tl.arange(0, BK)
            xq, xw, xc = _v_contractions(Hs, dHs, do, U, dU, tok, hm, h_off, t0, ck, 0 if ABLATE & 1 else V,
                                         T, H, K, V, C, BK, BV, DELTA, PREC)
            xq, xc, eg = _state_side(xq, xc, G_bh, t0, ck, K, C, GATE)
            _hstore(XQ_bh, t0 + rc, ck, K, (scale * xq).to(tl.float32))
            _hstore(XC_bh, t0 + rc, ck, K, xc)
            if DELTA:
                dR, dA, dbk = _chunk_terms(xw, eg, dA, dbk, k_bh, W + hm * K, Tt, bc, t0, ck, T, H, K, C, GATE, HAS_BETA,
                                           PREC)
                _hstore(XW_bh, t0 + rc, ck, K, dR)  # dk_row from W
        if DELTA:  # dbeta += rowsum(dR_w K e^g) + rowsum(dA A~); dA~ = Diag(beta) dA, stored over dA
            dA = tl.where(rc[:, None] > rc[None, :], dA, 0.0)
            if HAS_BETA:
                tl.store(dB + hm + t0 + rc, tl.load(dB + hm + t0 + rc) + dbk
                         + tl.sum(dA * _lower(Am + hm * C, t0, C, True), axis=1))
                dA = dA * bc[:, None]
            _hstore(dA_bh, t0 + rc, rc, C, dA)
    if SPLIT == 0:
        tl.debug_barrier()
    if SPLIT != 1:
        # phase 3: sub-chunk strips, the Gram matrices' transposed products
        rs = tl.arange(0, SC)
        cf = tl.arange(0, BKF)
        for I in range(I0, I1):
            r0 = t0 + I * SC
            dPr, dPc, dAr, dAc = _strip_mats(dP_bh, dA_bh, G_bh, t0, I, C, SC, GATE, DELTA)
            spread = tl.zeros([], tl.float32)
            if GATE == 2:
                spread = _spread(tl.load(G_bh + r0 * K + cf, mask=cf < K, other=0.0), _hrows(G_bh, r0 + rs, cf, K))
            dgs = tl.zeros([SC], tl.float32)
            for k0 in range(0, K, BK):
                dgs += _strip_grads(q_bh, k_bh, G_bh, dP_bh, dA_bh, XQ_bh, XW_bh, XC_bh, dq, dk, dg, tok, t0, I,
                                    k0 + tl.arange(0, BK), spread, dPr, dPc, dAr, dAc,
                                    T, H, K, C, SC, BK, SPREAD, GATE, DELTA, PREC)
            if GATE == 1:
                tl.store(dg + tok + (r0 + rs).to(tl.int64) * H, dgs, mask=r0 + rs < T)
            if HAS_BETA:
                tl.store(db_out + tok + (r0 + rs).to(tl.int64) * H,
                         tl.load(dB + hm + r0 + rs).to(db_out.dtype.element_ty), mask=r0 + rs < T)


@triton.jit
def _revcumsum_kernel(x, last, out, cu, T, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                      HAS_LAST: tl.constexpr, VARLEN: tl.constexpr = False):
    """out[b, t, h, :] = sum_{s >= t} x[b, s, h, :] (+ last[b, h, :]) on token-major [B, T, H, K] float32 x;
    packed sequences (VARLEN): the sum runs over each sequence's chunks only, with last[sequence, h, :]."""
    i_k, i_sh = tl.program_id(0), tl.program_id(1)
    i_s, i_h = i_sh // H, i_sh % H
    n0, n1, i_b = _segment(cu, i_s, tl.cdiv(T, C), VARLEN)
    ck = i_k * BK + tl.arange(0, BK)
    rc = tl.arange(0, C)
    tok = i_b.to(tl.int64) * T * H + i_h
    if HAS_LAST:
        carry = tl.load(last + i_sh.to(tl.int64) * K + ck, mask=ck < K, other=0.0)
    else:
        carry = tl.zeros([BK], tl.float32)
    for i in range(n1 - n0):
        t0 = (n1 - 1 - i) * C
        xn = _rows(x + tok * K, t0, rc, T, H * K, ck, K)
        tot = tl.sum(xn, axis=0)
        sfx = tot[None, :] - tl.cumsum(xn, axis=0) + xn + carry[None, :]
        tl.store(out + (tok + (t0 + rc).to(tl.int64) * H)[:, None] * K + ck[None, :], sfx.to(out.dtype.element_ty),
                 mask=(t0 + rc < T)[:, None] & (ck < K)[None, :])
        carry += tot


def backward_triton(q, k, v, log_alpha, beta, initial_state, do, dsT, *, delta, scale, chunks=None, block_v=None,
                    warps=None, value_block=64, key_block=32, stages=2, fwd_warps=(4, 4), precision=None, ablate=(0, 0),
                    split=None, intra_kb=None, halves=True, dkey_block=64, chunk=None, factors=None,
                    dstate_stages=None, states=None):
    """Gradients (dq, dk, dv, dlog_alpha, dbeta, dinitial_state) of the chunked forward, given dO (or None) and the
    final state's gradient (or None). Recomputes the forward's per-chunk factors and start states. `chunks`: packed
    sequences' chunk table, as forward_triton's. `precision`: tl.dot's input precision, one for every kernel or a tuple
    (recompute, dstate, dvalue, dkey) or (recompute's first stage, recompute's carry, dstate, dvalue, dkey); default:
    16-bit inputs ("tf32x3", "tf32", "tf32", "tf32x3"), float32 inputs "tf32x3" everywhere. `split`: the key kernel
    in two (phases 1-2 per chunk, then phase 3 per sub-chunk strip) with [C, dkey_block]-column tiles; default (None):
    per-channel gates with K > 64, where
    the one kernel spills on sm_90 and the split measured 8.9 ms against its 12.7 (H200, B4 T8192 H16 D128 bf16;
    scalar gates: 7.2 against 5.7). At K <= 64 neither form spills; one kernel, as before (not compared there).
    `intra_kb`: the recompute's `key_block` (forward.intra; opt-in, slower on the H200). `halves` (default on; padded
    K >= 64): the recompute's carry and the state gradient as two tiles of key rows — at tf32x3 the one-tile forms
    spill (carry 528 B, dstate 1,024 B per thread), and halves cut KDA's backward at B4 T8192 H16 D128 bf16 by 2.3 ms
    at chunks of 64 and 0.9 ms at 32 (H200, session 10). `dkey_block`: the split key kernel's key columns per tile (64;
    32 spills less at tf32x3 but measured slower: 8.9 -> 13.0 ms). `warps` (dstate, dvalue, dkey): (4, 4, 4) for key
    dims <= 32, which cut KDA's backward at the lab's largest cell (B256 T512 H4 D32 bf16) from 5.92 to 4.80 ms per
    layer (H200, session 7); above, the key kernel at 4 warps except in one launch at chunks of 64, and the value
    kernel at 4 at chunks <= 32, else 8 (H200, bf16, B4 T8192 H16 D128, session 11: KDA's split key kernel 8.93 ->
    5.73 ms at chunks of 64 and 8.74 -> 5.44 at 32; Gated DeltaNet's one launch 5.77 -> 7.51 at 64 but 6.17 -> 5.00 at
    32; the value kernel 1.11 -> 0.65 at 32; 4 warps at 64 not measured). `chunk`: the forward's tokens per chunk
    (opt-in, not with `chunks`; forward.intra). `factors`: the [C, C] matrices the forward kept
    (`forward_triton(keep_factors=...)`, autograd.py's default): the recompute then forms only the gates, W and U_bar.
    `dstate_stages`: the state gradient kernel's software pipelining; default 2 at chunks of 16 (the lab's B256 T512
    H4 D32: 0.32 -> 0.22 ms for KDA, 0.32 -> 0.20 for Gated DeltaNet), else 1 (2 was slower at 32, D 128: 2.12 ->
    2.26 ms; at 64 its two stages of [C, K] float32 tiles exceed shared memory, 258 KB). `states` (opt-in, not yet
    measured on a GPU): every intermediate the forward kept (`forward_triton(keep_states=...)`): no recompute at all.
    The recompute stores its intermediates and states in float32 even for 16-bit inputs (fla stores 16-bit ones):
    with float32 products, 16-bit storage multiplies log alpha's gradient error under strong decay by 1.0-11x (all of
    it) and 3-69x (the chunk start states alone), and q's and k's by ~1.8x (dev/store16_precision.py, interpreter,
    3 draws, session 11). Every load of them is widened to float32 all the same."""
    if chunks is not None and chunk_length(chunk) != chunk_length(None):
        raise ValueError(f"chunk: packed sequences (chunks) are laid out in chunks of {chunk_length(None)}; got chunk={chunk}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    dev, f32 = q.device, torch.float32
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    log_alpha = log_alpha.contiguous() if log_alpha is not None else None
    beta = beta.contiguous() if beta is not None else None
    delta = bool(delta)
    carry_prec, precs = _precisions(precision, q.dtype)
    if states is not None:  # the forward's own intermediates, states and final state: nothing to recompute
        if states["C"] != chunk_length(chunk):
            raise ValueError(f"states: kept at chunks of {states['C']}, used at {chunk_length(chunk)}")
        x, U, Hs, sT = states, states["U"], states["Hs"], states["sT"]
    else:
        x = intra(q, k, v, log_alpha, beta, delta, warps=fwd_warps[0], precision=precs[0], qg=True, ablate=ablate[0],
                  key_block=intra_kb, chunk=chunk, factors=factors, kd=_store_kd(q.dtype, chunk_length(chunk)))
        U, Hs, sT = carry(k, x, initial_state, delta, V=V, chunks=chunks, block_v=block_v, warps=fwd_warps[1],
                          stages=stages, precision=carry_prec, halves=halves)
    N, C, gate = x["N"], x["C"], x["gate"]
    split = (gate == 2 and K > 64) if split is None else bool(split)
    seqs, varlen = sT.shape[0], chunks is not None
    BK, BVf = max(16, triton.next_power_of_2(K)), max(16, triton.next_power_of_2(V))
    warps = warps or ((4, 4, 4) if BK <= 32 else (4, 4 if C <= 32 else 8, 8 if C == 64 and not split else 4))
    dstate_stages = dstate_stages or (2 if C <= 16 else 1)
    do = torch.zeros(B, T, H, V, dtype=q.dtype, device=dev) if do is None else do.contiguous()
    dU = torch.empty(B * H * N * C * V, dtype=f32, device=dev)
    dHs = torch.empty(Hs.shape, dtype=f32, device=dev)  # float32 whatever Hs is stored in
    ds0 = torch.empty(seqs, H, K, V, dtype=f32, device=dev)
    BVs = min(BVf, block_v or state_block_v(seqs, H, V, dev))
    _dstate_kernel[(triton.cdiv(V, BVs), seqs * H)](
        q, k, do, x["Kd"], x["Dec"], x["Qg"], x["W"], x["Pm"], dU, dHs, dsT.contiguous() if dsT is not None else ds0, ds0,
        chunks if varlen else ds0, float(scale),
        T, H=H, K=K, V=V, N=N, G=x["G"], C=C, BK=BK, BV=BVs, GATE=gate, DELTA=delta, HAS_DST=dsT is not None, PREC=precs[1], VARLEN=varlen,
        HALVES=bool(halves and BK >= 64), KD=x["kd"],
        num_warps=warps[0], num_stages=dstate_stages,  # at C 64, 2 stages of its [C, K] float32 tiles exceed shared memory
    )
    dPm = torch.empty(B * H * N * C * C, dtype=f32, device=dev)
    dAm = torch.empty(B * H * N * C * C if delta else 1, dtype=f32, device=dev)
    dB = torch.empty(B * H * N * C if beta is not None else 1, dtype=f32, device=dev)
    dv = torch.empty_like(v)
    BV2 = min(BVf, value_block)
    _dvalue_kernel[(N, B * H)](
        v, beta if beta is not None else v, do, x["Ub"], U, dU, x["Tm"], dPm, dAm, dB, dv, float(scale),
        T, H=H, V=V, N=N, C=C, BV=BV2, DELTA=delta, HAS_BETA=beta is not None, PREC=precs[2], num_warps=warps[1], num_stages=1,
    )
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    dg = torch.empty(B, T, H, *((K,) if gate == 2 else ()), dtype=f32, device=dev) if gate else dB
    dbeta = torch.empty_like(beta) if beta is not None else dB
    XQ, XW, XC = (torch.empty(B * H * N * C * K, dtype=f32, device=dev) for _ in range(3))
    BV3 = min(BVf, key_block)
    common = (q, k, beta if beta is not None else q, U, dU, x["W"], x["Tm"], x["Am"], dPm, dAm, x["G"], Hs, dHs, dB, do,
              dq, dk, dg, dbeta, XQ, XW, XC, float(scale))
    meta = dict(T=T, H=H, K=K, V=V, N=N, C=C, SC=SC, BKF=BK, BV=BV3, SPREAD=SPREAD, GATE=gate, DELTA=delta,
                HAS_BETA=beta is not None, PREC=precs[3], ABLATE=ablate[1], num_warps=warps[2], num_stages=1)
    if split:  # phases 1-2 per chunk, then phase 3 per strip, dkey_block key columns at a time
        tile = min(max(16, triton.next_power_of_2(dkey_block)), BK)
        _dkey_kernel[(N, B * H)](*common, BK=tile, SPLIT=1, **meta)
        _dkey_kernel[(N * (C // SC), B * H)](*common, BK=tile, SPLIT=2, **meta)
    else:
        _dkey_kernel[(N, B * H)](*common, BK=BK, SPLIT=0, **meta)
    dla = _dlog_alpha(dg, log_alpha, sT, dsT, chunks, gate=gate, C=C) if gate else None
    return dq, dk, dv, dla, dbeta if beta is not None else None, ds0


def _store_kd(dtype: torch.dtype, C: int) -> bool:
    """Whether the backward's recompute stores a scalar gate's K e^{g_C - g} (float32, [C, K] per chunk) for the carry
    and the state gradient kernel to read, or they form it from K and the prefix sums (one exp per row). Formed for
    16-bit inputs at chunks <= 32: no buffer written and read back, K read at half the bytes, and on sm_90 (bf16, K V
    128, dstate at tf32) the state gradient kernel compiles to fewer registers (224 -> 202 at chunks of 32, no spills
    either way). Stored otherwise: at chunks of 64 forming it spills more (196 -> 228 B a thread), and at float32's
    tf32x3 too (chunks of 32: 4 -> 108 B) — dev/compile_sm90.py, session 60; not yet timed. Opt-in (`FORM_KD`) until
    its GPU tests have run on a card (session 60's device calls failed to start): by default it is stored, as before."""
    return dtype == torch.float32 or C > 32 or not FORM_KD


FORM_KD = False  # True: 16-bit inputs at chunks <= 32 form K e^{g_C - g} in the kernels (`_store_kd`); interpreter-tested


def _precisions(precision, dtype: torch.dtype) -> tuple[str, tuple[str, ...]]:
    """backward_triton's `precision` -> (the recompute's carry, (recompute, dstate, dvalue, dkey))."""
    # the gate's gradient is a long sum of cancelling terms: tf32 rounding in the recompute or the key kernel shows in it
    # (log alpha's gradient 1.2e-1 vs 2.8e-3 under strong decay, scalar gate, bf16 inputs; per-channel 1.0e-2 vs
    # 2.1e-3). tf32 in dstate and dvalue alone keeps it (scalar 2.8e-3, per-channel 2.1e-3: dev/check_precision.py,
    # H200) and cuts 1.3 ms of KDA's backward at B4 T8192: the default for 16-bit inputs. float32 inputs keep tf32x3
    # everywhere (their gradient tests' 1e-3 failed under tf32 in dstate / dvalue, session 5)
    if precision is None and dtype in (torch.bfloat16, torch.float16):
        precision = ("tf32x3", "tf32", "tf32", "tf32x3")
    precs = tuple(precision) if isinstance(precision, (tuple, list)) else (precision or "tf32x3",) * 4
    if len(precs) not in (4, 5):
        raise ValueError(f"precision: expected one value or a tuple of 4 or 5, got {precision!r}")
    # 5 values: the recompute split into its first stage and its carry (intra, carry, dstate, dvalue, dkey)
    return (precs[1], (precs[0], *precs[2:])) if len(precs) == 5 else (precs[0], precs)


def _dlog_alpha(dg, log_alpha, sT, dsT, chunks, *, gate: int, C: int) -> torch.Tensor:
    """dlog alpha_t = sum_{s >= t} dG_s (per sequence), plus the final state's own factor e^{G_T}: rowsum(S_T dS_T)."""
    T, H = dg.shape[1], dg.shape[2]
    GK = dg.shape[3] if gate == 2 else 1
    seqs, varlen = sT.shape[0], chunks is not None
    last = None
    if dsT is not None:
        last = (sT * dsT.float()).sum(-1)
        last = (last if gate == 2 else last.sum(-1)).contiguous()
    dla = torch.empty_like(log_alpha)
    BKr = min(32, max(16, triton.next_power_of_2(GK)))
    _revcumsum_kernel[(triton.cdiv(GK, BKr), seqs * H)](
        dg, last if last is not None else dg, dla, chunks if varlen else dg, T, H=H, K=GK, C=C, BK=BKr,
        HAS_LAST=last is not None, VARLEN=varlen, num_stages=3)
    return dla
