"""Chunked forward: two kernels, one parallel over chunks, one sequential over them.

Legend: B batch, T time, H heads, K key dim, V value dim, N chunks of C tokens, SC sub-chunk (16 tokens);
BK / BV = K / V padded to powers of two (BV may also be a block of V). Derivation: README.md beside this folder.

1. `_prepare_kernel`, grid (N, B*H). Per chunk: g = prefix sums of log alpha (stored, float32);
   A = Diag(beta) strictly-lower [k_i . k_j e^{g_i - g_j}], P = lower [q_i . k_j e^{g_i - g_j}];
   W = L^-1 Diag(beta) (K * e^g), U_bar = L^-1 Diag(beta) V with L = I + A (delta; else U_bar = Diag(beta) V).
   L^-1 is applied by blocks of SC rows: X_I = (I + A_II)^-1 (R_I - sum_{J<I} A_IJ X_J); the small inverses come
   from forward substitution. Per-channel ratios of block (I, J<I) factor through r = the last token before I:
   e^{g_i - g_j} = e^{g_i - g_r} e^{g_r - g_j}, both <= 1; diagonal blocks use the exact ratios, one key column at a time.
2. `_recur_kernel`, grid (V / BV, B*H). Carries S [BK, BV] in float32 across chunks:
   U = U_bar - W S;  O = scale (Q * e^g) S + scale P U;  S = e^{g_C} * S + (K * e^{g_C - g})^T U.
Every exponent is a difference of prefix sums that is <= 0, so log alpha = -20 per step stays finite.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SC = 16  # sub-chunk: rows per triangular block (also tl.dot's smallest size)


@triton.jit
def _load_rows(ptr, t0, rows, T, stride, cols, ncols):
    """Rows t0 + rows (< T) and columns cols (< ncols) of a row-major [T, stride] slab, as float32 (0 outside)."""
    t = t0 + rows
    m = (t < T)[:, None] & (cols < ncols)[None, :]
    return tl.load(ptr + t[:, None].to(tl.int64) * stride + cols[None, :], mask=m, other=0.0).to(tl.float32)


@triton.jit
def _unit_lower_inverse(A, SC: tl.constexpr):
    """(I + A)^-1 for a strictly lower [SC, SC] A, by forward substitution (row m uses rows < m only)."""
    r = tl.arange(0, SC)
    Tm = (r[:, None] == r[None, :]).to(tl.float32)
    for m in range(1, SC):
        a_m = tl.sum(tl.where(r[:, None] == m, A, 0.0), axis=0)  # [SC] row m of A (zero at and past m)
        row = tl.sum(a_m[:, None] * Tm, axis=0)  # sum_j A[m, j] T[j, :]
        Tm = tl.where(r[:, None] == m, Tm - row[None, :], Tm)
    return Tm


@triton.jit
def _prepare_kernel(
    q, k, v, la, beta, G, W, U, P,
    T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, N,
    C: tl.constexpr, SC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, DELTA: tl.constexpr, HAS_BETA: tl.constexpr, PREC: tl.constexpr,
):
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    t0 = i_n * C
    Tp = N * C
    ck, cv, rs = tl.arange(0, BK), tl.arange(0, BV), tl.arange(0, SC)
    # token-major inputs: (b, t, h) row at ((b T + t) H + h)
    q_bh = q + (i_b.to(tl.int64) * T * H + i_h) * K
    k_bh = k + (i_b.to(tl.int64) * T * H + i_h) * K
    v_bh = v + (i_b.to(tl.int64) * T * H + i_h) * V
    # head-major buffers, padded to Tp rows
    G_bh = G + i_bh.to(tl.int64) * Tp * (K if GATE == 2 else 1)
    W_bh = W + i_bh.to(tl.int64) * Tp * K
    U_bh = U + i_bh.to(tl.int64) * Tp * V
    P_bh = P + i_bh.to(tl.int64) * Tp * C

    rc = tl.arange(0, C)
    if GATE == 2:
        la_c = _load_rows(la + (i_b.to(tl.int64) * T * H + i_h) * K, t0, rc, T, H * K, ck, K)
        tl.store(G_bh + (t0 + rc)[:, None] * K + ck[None, :], tl.cumsum(la_c, axis=0), mask=(ck < K)[None, :])
    if GATE == 1:
        la_c = tl.load(la + (i_b.to(tl.int64) * T + t0 + rc) * H + i_h, mask=t0 + rc < T, other=0.0).to(tl.float32)
        tl.store(G_bh + t0 + rc, tl.cumsum(la_c, axis=0))
    tl.debug_barrier()

    for I in tl.static_range(C // SC):
        r0 = t0 + I * SC  # first token of sub-chunk I
        kI = _load_rows(k_bh, r0, rs, T, H * K, ck, K)
        qI = _load_rows(q_bh, r0, rs, T, H * K, ck, K)
        vI = _load_rows(v_bh, r0, rs, T, H * V, cv, V)
        if HAS_BETA:
            bI = tl.load(beta + (i_b.to(tl.int64) * T + r0 + rs) * H + i_h, mask=r0 + rs < T, other=0.0).to(tl.float32)
        else:
            bI = tl.full([SC], 1.0, tl.float32)
        if GATE == 2:
            gI = tl.load(G_bh + (r0 + rs)[:, None] * K + ck[None, :], mask=(ck < K)[None, :], other=0.0)
        if GATE == 1:
            gI = tl.load(G_bh + r0 + rs)

        # diagonal block: A_II (strictly lower) and P_II (lower) with exact ratios
        if GATE == 2:  # exact ratios, one key column j at a time ([SC, SC, K] at once spilled: 1.9x slower)
            A_II = tl.zeros([SC, SC], tl.float32)
            P_II = tl.zeros([SC, SC], tl.float32)
            for j in range(SC):
                kj = tl.load(k_bh + (r0 + j).to(tl.int64) * H * K + ck, mask=(ck < K) & (r0 + j < T), other=0.0).to(tl.float32)
                gj = tl.load(G_bh + (r0 + j) * K + ck, mask=ck < K, other=0.0)
                e = tl.exp(tl.where(rs[:, None] >= j, gI - gj[None, :], 0.0)) * kj[None, :]  # [SC, BK]
                A_II = tl.where(rs[None, :] == j, tl.sum(kI * e, axis=1)[:, None], A_II)
                P_II = tl.where(rs[None, :] == j, tl.sum(qI * e, axis=1)[:, None], P_II)
        else:
            A_II = tl.dot(kI, tl.trans(kI), input_precision=PREC)
            P_II = tl.dot(qI, tl.trans(kI), input_precision=PREC)
            if GATE == 1:
                ratio = tl.exp(tl.where(rs[:, None] >= rs[None, :], gI[:, None] - gI[None, :], 0.0))
                A_II = A_II * ratio
                P_II = P_II * ratio
        A_II = tl.where(rs[:, None] > rs[None, :], A_II * bI[:, None], 0.0)
        P_II = tl.where(rs[:, None] >= rs[None, :], P_II, 0.0)

        if DELTA:
            if GATE == 2:
                rw = kI * tl.exp(gI) * bI[:, None]
            elif GATE == 1:
                rw = kI * (tl.exp(gI) * bI)[:, None]
            else:
                rw = kI * bI[:, None]
        ru = vI * bI[:, None]

        if GATE == 2 and I > 0:
            g_r = tl.load(G_bh + (r0 - 1) * K + ck, mask=ck < K, other=0.0)
            kdI = kI * tl.exp(gI - g_r[None, :])
            qdI = qI * tl.exp(gI - g_r[None, :])
        for J in tl.static_range(I):
            kJ = _load_rows(k_bh, t0 + J * SC, rs, T, H * K, ck, K)
            if GATE == 2:
                gJ = tl.load(G_bh + (t0 + J * SC + rs)[:, None] * K + ck[None, :], mask=(ck < K)[None, :], other=0.0)
                krJ = kJ * tl.exp(g_r[None, :] - gJ)
                A_IJ = tl.dot(kdI, tl.trans(krJ), input_precision=PREC)
                P_IJ = tl.dot(qdI, tl.trans(krJ), input_precision=PREC)
            else:
                A_IJ = tl.dot(kI, tl.trans(kJ), input_precision=PREC)
                P_IJ = tl.dot(qI, tl.trans(kJ), input_precision=PREC)
                if GATE == 1:
                    gJ = tl.load(G_bh + t0 + J * SC + rs)
                    ratio = tl.exp(gI[:, None] - gJ[None, :])
                    A_IJ = A_IJ * ratio
                    P_IJ = P_IJ * ratio
            tl.store(P_bh + (r0 + rs)[:, None] * C + (J * SC + rs)[None, :], P_IJ)
            if DELTA:
                A_IJ = A_IJ * bI[:, None]
                wJ = tl.load(W_bh + (t0 + J * SC + rs)[:, None] * K + ck[None, :], mask=(ck < K)[None, :], other=0.0)
                uJ = tl.load(U_bh + (t0 + J * SC + rs)[:, None] * V + cv[None, :], mask=(cv < V)[None, :], other=0.0)
                rw -= tl.dot(A_IJ, wJ, input_precision=PREC)
                ru -= tl.dot(A_IJ, uJ, input_precision=PREC)
        tl.store(P_bh + (r0 + rs)[:, None] * C + (I * SC + rs)[None, :], P_II)
        for J in tl.static_range(I + 1, C // SC):
            tl.store(P_bh + (r0 + rs)[:, None] * C + (J * SC + rs)[None, :], tl.zeros([SC, SC], tl.float32))
        if DELTA:
            Tinv = _unit_lower_inverse(A_II, SC)
            tl.store(W_bh + (r0 + rs)[:, None] * K + ck[None, :], tl.dot(Tinv, rw, input_precision=PREC), mask=(ck < K)[None, :])
            ru = tl.dot(Tinv, ru, input_precision=PREC)
        tl.store(U_bh + (r0 + rs)[:, None] * V + cv[None, :], ru, mask=(cv < V)[None, :])
        tl.debug_barrier()


@triton.jit
def _recur_kernel(
    q, k, G, W, U, P, s0, sT, o,
    scale, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, N,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, DELTA: tl.constexpr, HAS_S0: tl.constexpr, PREC: tl.constexpr,
):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    Tp = N * C
    ck, rc = tl.arange(0, BK), tl.arange(0, C)
    cv = i_v * BV + tl.arange(0, BV)
    mk, mv = ck < K, cv < V
    q_bh = q + (i_b.to(tl.int64) * T * H + i_h) * K
    k_bh = k + (i_b.to(tl.int64) * T * H + i_h) * K
    o_bh = o + (i_b.to(tl.int64) * T * H + i_h) * V
    G_bh = G + i_bh.to(tl.int64) * Tp * (K if GATE == 2 else 1)
    W_bh = W + i_bh.to(tl.int64) * Tp * K
    U_bh = U + i_bh.to(tl.int64) * Tp * V
    P_bh = P + i_bh.to(tl.int64) * Tp * C
    s_off = i_bh.to(tl.int64) * K * V + ck[:, None] * V + cv[None, :]
    m_s = mk[:, None] & mv[None, :]
    if HAS_S0:
        S = tl.load(s0 + s_off, mask=m_s, other=0.0)
    else:
        S = tl.zeros([BK, BV], tl.float32)
    for n in range(N):
        t0 = n * C
        qn = _load_rows(q_bh, t0, rc, T, H * K, ck, K)
        kn = _load_rows(k_bh, t0, rc, T, H * K, ck, K)
        Pn = tl.load(P_bh + (t0 + rc)[:, None] * C + rc[None, :])
        u = tl.load(U_bh + (t0 + rc)[:, None] * V + cv[None, :], mask=mv[None, :], other=0.0)
        if DELTA:
            wn = tl.load(W_bh + (t0 + rc)[:, None] * K + ck[None, :], mask=mk[None, :], other=0.0)
            u -= tl.dot(wn, S, input_precision=PREC)
        if GATE == 2:
            gn = tl.load(G_bh + (t0 + rc)[:, None] * K + ck[None, :], mask=mk[None, :], other=0.0)
            g_end = tl.load(G_bh + (t0 + C - 1) * K + ck, mask=mk, other=0.0)
            qn = qn * tl.exp(gn)
            kn = kn * tl.exp(g_end[None, :] - gn)
            decay = tl.exp(g_end)[:, None]
        if GATE == 1:
            gn = tl.load(G_bh + t0 + rc)
            g_end = tl.load(G_bh + t0 + C - 1)
            qn = qn * tl.exp(gn)[:, None]
            kn = kn * tl.exp(g_end - gn)[:, None]
            decay = tl.exp(g_end)
        on = scale * (tl.dot(qn, S, input_precision=PREC) + tl.dot(Pn, u, input_precision=PREC))
        tl.store(o_bh + (t0 + rc)[:, None].to(tl.int64) * H * V + cv[None, :], on.to(o.dtype.element_ty),
                 mask=(t0 + rc < T)[:, None] & mv[None, :])
        if GATE == 0:
            S = S + tl.dot(tl.trans(kn), u, input_precision=PREC)
        else:
            S = S * decay + tl.dot(tl.trans(kn), u, input_precision=PREC)
    tl.store(sT + s_off, S, mask=m_s)


def forward_triton(q, k, v, *, log_alpha=None, beta=None, delta=False, scale, initial_state=None, chunk_size=64,
                   precision=None, block_v=None, warps=(4, 4), stages=None):
    """Chunked forward on [B, T, H, D] tensors. Returns (o [B, T, H, V] in q's dtype, final state [B, H, K, V] float32).

    `precision` is tl.dot's input_precision; default "tf32x3" for float32 inputs (float32-grade), "tf32" otherwise.
    `block_v` (V columns per program of the carry kernel) and `warps` (per kernel) and `stages` (software pipelining of the carry loop) are tuning knobs.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = min(max(chunk_size, SC), 64)  # P [C, C] lives in registers: 64 at most
    N = max(1, triton.cdiv(T, C))
    Tp = N * C
    dev = q.device
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    gate = 0 if log_alpha is None else (1 if log_alpha.dim() == 3 else 2)
    la = log_alpha.contiguous() if log_alpha is not None else q
    bt = beta.contiguous() if beta is not None else q
    prec = precision or ("tf32x3" if q.dtype == torch.float32 else "tf32")
    f32 = torch.float32
    G = torch.empty(B * H * Tp * (K if gate == 2 else 1) if gate else 1, dtype=f32, device=dev)
    W = torch.empty(B * H * Tp * K if delta else 1, dtype=f32, device=dev)
    U = torch.empty(B * H * Tp * V, dtype=f32, device=dev)
    P = torch.empty(B * H * Tp * C, dtype=f32, device=dev)
    BK, BVf = max(16, triton.next_power_of_2(K)), max(16, triton.next_power_of_2(V))
    _prepare_kernel[(N, B * H)](
        q, k, v, la, bt, G, W, U, P, T, H=H, K=K, V=V, N=N, C=C, SC=SC, BK=BK, BV=BVf,
        GATE=gate, DELTA=bool(delta), HAS_BETA=beta is not None, PREC=prec, num_warps=warps[0], num_stages=1,
    )
    o = torch.empty(B, T, H, V, dtype=q.dtype, device=dev)
    sT = torch.empty(B, H, K, V, dtype=f32, device=dev)
    s0 = initial_state.contiguous().to(f32) if initial_state is not None else sT
    if block_v is None:  # narrow V blocks (and a pipelined loop) when B H alone cannot fill the GPU
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if q.is_cuda else 1
        block_v = 16 if B * H * triton.cdiv(V, 32) < sms else 32
    if stages is None:
        stages = 2 if block_v <= 16 and q.dtype != torch.float32 else 1  # shared memory: 2 stages fit for 16-bit inputs
    BV = min(BVf, max(16, block_v))
    _recur_kernel[(triton.cdiv(V, BV), B * H)](
        q, k, G, W, U, P, s0, sT, o, float(scale), T, H=H, K=K, V=V, N=N, C=C, BK=BK, BV=BV,
        GATE=gate, DELTA=bool(delta), HAS_S0=initial_state is not None, PREC=prec, num_warps=warps[1], num_stages=stages,
    )
    return o, sT
