"""Chunked forward: per-chunk WY factors (parallel), then the state carry (sequential) writing the output too, or
the carry and a separate output kernel (parallel).

Legend: B batch, T time, H heads, K key dim, V value dim; chunks of C = 64 tokens, N of them, Tp = N C;
sub-chunks of SC = 16 rows (I, J index them); BK / BV = K / V padded to powers of two (BV may be a block of V).
Derivation: README.md beside this folder. Per chunk, with g the prefix sums of log alpha inside it:

1. `_intra_kernel`, grid (N, B H): g (stored, float32), then the Gram matrices by strips of SC rows (one
   [SC, K] x [K, C] dot per strip):  A~ = [k_i . k_j e^{g_i - g_j}] (strictly lower),  P = [q_i . k_j e^{g_i - g_j}]
   (lower). Per-channel gates factor through r = the strip's first row, e^{g_i - g_j} = e^{g_i - g_r} e^{g_r - g_j}:
   both <= 1 left of the strip's own columns; on them e^{g_r - g_j} <= e^{spread of the sub-chunk}, used while that
   spread is <= SPREAD, else that diagonal block is redone with exact ratios, one key column at a time.
   T = (I + Diag(beta) A~)^-1: the four diagonal SC x SC inverses at once ([4, SC, SC], forward substitution), then
   T = (I - N (I - N (I - N))) D with D their block diagonal and N = D Diag(beta) A~_below (N^4 = 0).
   W = T Diag(beta) (K * e^g), U_bar = T Diag(beta) V; and for the sequential kernels K * e^{g_C - g}, e^{g_C} and
   (backward only) Q * e^g.
2. `_state_kernel`, grid (V / BV, B H): S [BK, BV] float32 carried across chunks; stores S at each chunk's start (Hs)
   and U = U_bar - W S;  S <- e^{g_C} * S + (K * e^{g_C - g})^T U  (no gate loads or exps in the loop).
   Packed sequences (B = 1, a chunk table): grid (V / BV, N_seq H), each program carrying one sequence's chunks.
3. The output O = scale ((Q * e^g) S + P U): `_out_kernel`, grid (V / BV, N, B H), from Hs and U; or (16-bit inputs
   where the sequence-heads fill the GPU: `fuse_out_default`) in the carry itself, from S in registers (float32) and
   U before its store, so Hs and U need not be stored at all (Q * e^g stored by step 1 for per-channel gates).
Forms by chunk (H200, session 10, BENCHMARKS.md): at C = 64 the carry holds S as two tiles of key rows (HALVES) and
the output kernel takes 16-bit dots on the 16-bit intermediates (DOT16); at C = 32 / 16 both measured slower and stay
off. Opt-in: `_intra_kb_kernel` (step 1 for per-channel gates, KB key columns at a time; slower on the H200).
Every exponent is a difference of prefix sums that is <= 0 (or bounded by SPREAD), so log alpha = -20 stays finite.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

C = 64  # chunk
SC = 16  # sub-chunk: rows per triangular block (also tl.dot's smallest size)
SPREAD = 40.0  # largest in-sub-chunk decay for the factored diagonal block: e^40 leaves e^48 of float32 headroom


@triton.jit
def _rows(ptr, t0, rows, T, stride, cols, ncols):
    """Rows t0 + rows (< T) and columns cols (< ncols) of a row-major [T, stride] slab, as float32 (0 outside)."""
    t = t0 + rows
    m = (t < T)[:, None] & (cols < ncols)[None, :]
    return tl.load(ptr + t[:, None].to(tl.int64) * stride + cols[None, :], mask=m, other=0.0).to(tl.float32)


@triton.jit
def _hrows(ptr, t, cols, ncols):
    """Rows t (all valid) of a head-major float32 [Tp, ncols] buffer, columns cols < ncols (0 past them)."""
    return tl.load(ptr + t[:, None] * ncols + cols[None, :], mask=(cols < ncols)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _hstore(ptr, t, cols, ncols, x):
    tl.store(ptr + t[:, None] * ncols + cols[None, :], x, mask=(cols < ncols)[None, :])


@triton.jit
def _block(ptr, r0, c0, SC: tl.constexpr, C: tl.constexpr):
    """The [SC, SC] block at rows r0.., columns c0.. of a head-major [Tp, C] float32 buffer."""
    rs = tl.arange(0, SC)
    return tl.load(ptr + (r0 + rs)[:, None] * C + c0 + rs[None, :])


@triton.jit
def _store_block(ptr, r0, c0, x, SC: tl.constexpr, C: tl.constexpr):
    rs = tl.arange(0, SC)
    tl.store(ptr + (r0 + rs)[:, None] * C + c0 + rs[None, :], x)


@triton.jit
def _lower(ptr, t0, C: tl.constexpr, STRICT: tl.constexpr):
    """The chunk's [C, C] lower-triangular matrix from a head-major [Tp, C] buffer, as float32. Every such buffer is
    written whole (zeros above the diagonal), so the load is unmasked (vectorised) and the triangle is selected after."""
    rc = tl.arange(0, C)
    if STRICT:
        m = rc[:, None] > rc[None, :]
    else:
        m = rc[:, None] >= rc[None, :]
    return tl.where(m, tl.load(ptr + (t0 + rc)[:, None] * C + rc[None, :]).to(tl.float32), 0.0)


@triton.jit
def _spread(g_r, gI):
    """Largest decay from the sub-chunk's first row r to any of its rows, over channels (>= 0 for log alpha <= 0)."""
    return tl.max(tl.max(g_r[None, :] - gI, axis=1), axis=0)


@triton.jit
def _diag_gram_exact(kI, qI, gI, k_bh, G_bh, r0, T, sk, ck, K: tl.constexpr, SC: tl.constexpr):
    """Diagonal Gram blocks with exact per-channel ratios, one key column j at a time (strong decay only):
    a_ij = sum_c k_ic k_jc e^{g_ic - g_jc}, p_ij = sum_c q_ic k_jc e^{g_ic - g_jc} for j <= i (garbage above)."""
    rs = tl.arange(0, SC)
    a = tl.zeros([SC, SC], tl.float32)
    p = tl.zeros([SC, SC], tl.float32)
    for j in range(SC):
        kj = tl.load(k_bh + (r0 + j).to(tl.int64) * sk + ck, mask=(ck < K) & (r0 + j < T), other=0.0).to(tl.float32)
        gj = tl.load(G_bh + (r0 + j) * K + ck, mask=ck < K, other=0.0)
        e = tl.exp(tl.where(rs[:, None] >= j, gI - gj[None, :], 0.0)) * kj[None, :]
        a = tl.where(rs[None, :] == j, tl.sum(kI * e, axis=1)[:, None], a)
        p = tl.where(rs[None, :] == j, tl.sum(qI * e, axis=1)[:, None], p)
    return a, p


@triton.jit
def _store_strip(A_bh, P_bh, r0, rs, ri, rc, a, p, C: tl.constexpr, DELTA: tl.constexpr):
    """A Gram strip's rows r0 + rs (chunk rows ri): A~ strictly lower (delta rule only), P lower."""
    if DELTA:
        _hstore(A_bh, r0 + rs, rc, C, tl.where(ri[:, None] > rc[None, :], a, 0.0))
    _hstore(P_bh, r0 + rs, rc, C, tl.where(ri[:, None] >= rc[None, :], p, 0.0))


@triton.jit
def _store_diag(A_bh, P_bh, r0, I, a_d, p_d, SC: tl.constexpr, C: tl.constexpr, DELTA: tl.constexpr):
    """Overwrite sub-chunk I's diagonal blocks with `_diag_gram_exact`'s (after the strip's stores)."""
    rs = tl.arange(0, SC)
    tl.debug_barrier()
    if DELTA:
        _store_block(A_bh, r0, I * SC, tl.where(rs[:, None] > rs[None, :], a_d, 0.0), SC, C)
    _store_block(P_bh, r0, I * SC, tl.where(rs[:, None] >= rs[None, :], p_d, 0.0), SC, C)


@triton.jit
def _strip_decay(g, g_ref, rows, hi, spread, SPREAD: tl.constexpr, SC: tl.constexpr):
    """e^{g_ref - g_j} for rows j < hi, except the reference's own sub-chunk (the SC rows below hi) when its spread is
    above SPREAD, else 0: the key-side factor of a Gram strip. [C, BK]."""
    end = tl.where(spread <= SPREAD, hi, hi - SC)
    return tl.exp(tl.where((rows < end)[:, None], g_ref[None, :] - g, float("-inf")))


@triton.jit
def _chunk_gates(q_bh, kc, la, tok, t0, rc, ck, G_bh, Kd, Dec, Qg, hm, i_bh, i_n,
                 T, H: tl.constexpr, K: tl.constexpr, N, C: tl.constexpr,
                 GATE: tl.constexpr, QG: tl.constexpr, KD: tl.constexpr):
    """A chunk's gates: the prefix sums g (stored in G, returned), the chunk's decay e^{g_C} (Dec), the decayed keys
    K e^{g_C - g} (Kd, when KD) and the decayed queries Q e^g (Qg, when QG). kc: the chunk's keys [C, BK]."""
    gc = tl.zeros([C], tl.float32)
    if GATE == 2:
        gc = tl.cumsum(_rows(la + tok * K, t0, rc, T, H * K, ck, K), axis=0)
        _hstore(G_bh, t0 + rc, ck, K, gc)
        g_end = tl.sum(tl.where(rc[:, None] == C - 1, gc, 0.0), axis=0)
        _hstore(Kd + hm * K, t0 + rc, ck, K, kc * tl.exp(g_end[None, :] - gc))
        tl.store(Dec + (i_bh.to(tl.int64) * N + i_n) * K + ck, tl.exp(g_end), mask=ck < K)
        if QG:
            _hstore(Qg + hm * K, t0 + rc, ck, K, _rows(q_bh, t0, rc, T, H * K, ck, K) * tl.exp(gc))
    if GATE == 1:
        gc = tl.cumsum(tl.load(la + tok + (t0 + rc).to(tl.int64) * H, mask=t0 + rc < T, other=0.0).to(tl.float32), axis=0)
        tl.store(G_bh + t0 + rc, gc)
        g_end = tl.sum(tl.where(rc == C - 1, gc, 0.0), axis=0)
        if KD:  # else the state kernel forms K e^{g_C - g} itself: one exp per row costs less than the stores
            _hstore(Kd + hm * K, t0 + rc, ck, K, kc * tl.exp(g_end - gc)[:, None])
        tl.store(Dec + i_bh.to(tl.int64) * N + i_n, tl.exp(g_end))
        if QG:
            _hstore(Qg + hm * K, t0 + rc, ck, K, _rows(q_bh, t0, rc, T, H * K, ck, K) * tl.exp(gc)[:, None])
    return gc


@triton.jit
def _inverse(A_bh, T_bh, beta, tok, t0, bc, T, H: tl.constexpr, C: tl.constexpr, SC: tl.constexpr,
             HAS_BETA: tl.constexpr, PREC: tl.constexpr, ABLATE: tl.constexpr):
    """T = (I + Diag(beta) A~)^-1 of the chunk (A~ strictly lower, in A_bh), stored whole in T_bh and returned [C, C].

    Diagonal blocks first, all four at once ([4, SC, SC]), by forward substitution: row m of (I + A_II)^-1 is
    e_m - sum_{j<m} A_II[m, j] T_II[j, :]. Then the rest by a block Neumann series: with D = blockdiag(T_II) and
    N = D Diag(beta) A~_below (strictly block-lower, N^4 = 0), T = (I + N)^-1 D = (I - N (I - N (I - N))) D."""
    rc, rs = tl.arange(0, C), tl.arange(0, SC)
    nb = tl.arange(0, C // SC)
    r3 = nb[:, None, None] * SC + rs[None, :, None]
    c3 = nb[:, None, None] * SC + rs[None, None, :]
    A3 = tl.load(A_bh + (t0 + r3) * C + c3)
    if HAS_BETA:
        A3 = A3 * tl.load(beta + tok + (t0 + r3).to(tl.int64) * H, mask=t0 + r3 < T, other=0.0).to(tl.float32)
    T3 = (r3 == c3).to(tl.float32)
    for m in range(1, 1 if ABLATE & 2 else SC):
        a_m = tl.sum(tl.where(rs[None, :, None] == m, A3, 0.0), axis=1)  # [4, SC]: row m of each block
        T3 = tl.where(rs[None, :, None] == m, T3 - tl.sum(a_m[:, :, None] * T3, axis=1)[:, None, :], T3)
    tl.store(T_bh + (t0 + r3) * C + c3, T3)
    tl.debug_barrier()
    same = (rc[:, None] // SC) == (rc[None, :] // SC)
    D = tl.load(T_bh + (t0 + rc)[:, None] * C + rc[None, :], mask=same & (rc[:, None] >= rc[None, :]), other=0.0)
    Ab = tl.load(A_bh + (t0 + rc)[:, None] * C + rc[None, :], mask=(rc[:, None] // SC) > (rc[None, :] // SC), other=0.0)
    if ABLATE & 4:
        Tc = D + Ab
    else:
        Nm = tl.dot(D, Ab * bc[:, None], input_precision=PREC)
        eye = (rc[:, None] == rc[None, :]).to(tl.float32)
        Z = eye - Nm
        Z = eye - tl.dot(Nm, Z, input_precision=PREC)
        Z = eye - tl.dot(Nm, Z, input_precision=PREC)
        Tc = tl.dot(Z, D, input_precision=PREC)
    Tc = tl.where(rc[:, None] >= rc[None, :], Tc, 0.0)
    _hstore(T_bh, t0 + rc, rc, C, Tc)
    return Tc


@triton.jit
def _chunk_beta(beta, tok, t0, rc, T, H: tl.constexpr, HAS_BETA: tl.constexpr):
    """beta of the chunk's rows as float32 [C] (1 without beta), 0 past the end of the sequence."""
    if HAS_BETA:
        bc = tl.load(beta + tok + (t0 + rc).to(tl.int64) * H, mask=t0 + rc < T, other=0.0).to(tl.float32)
    else:
        bc = tl.where(t0 + rc < T, 1.0, 0.0)
    return bc


@triton.jit
def _intra_kernel(
    q, k, v, la, beta, G, Ub, W, Tm, Am, Pm, Kd, Dec, Qg,
    T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, N,
    C: tl.constexpr, SC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SPREAD: tl.constexpr,
    GATE: tl.constexpr, DELTA: tl.constexpr, HAS_BETA: tl.constexpr, PREC: tl.constexpr, QG: tl.constexpr = False,
    KD: tl.constexpr = True, ABLATE: tl.constexpr = 0, REUSE: tl.constexpr = False,
):
    # ABLATE (timing only, wrong results): bit 1 skips the Gram strips, 2 the diagonal inverses, 4 the Neumann / W / U dots
    # REUSE: A~, P and T are the forward's (kept by it): only the gates, W and U_bar are formed, from the stored T
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    t0 = i_n * C
    rc, rs, ck, cv = tl.arange(0, C), tl.arange(0, SC), tl.arange(0, BK), tl.arange(0, BV)
    tok = i_b.to(tl.int64) * T * H + i_h  # token-major row of (b, t = 0, h); token t is row tok + t H
    q_bh, k_bh, v_bh = q + tok * K, k + tok * K, v + tok * V
    hm = i_bh.to(tl.int64) * N * C  # head-major first row
    G_bh = G + hm * (K if GATE == 2 else 1)
    W_bh, U_bh = W + hm * K, Ub + hm * V
    T_bh, A_bh, P_bh = Tm + hm * C, Am + hm * C, Pm + hm * C

    kc = _rows(k_bh, t0, rc, T, H * K, ck, K)
    gc = _chunk_gates(q_bh, kc, la, tok, t0, rc, ck, G_bh, Kd, Dec, Qg, hm, i_bh, i_n, T, H, K, N, C, GATE, QG, KD)
    tl.debug_barrier()

    # Gram strips, one sub-chunk of rows I at a time: A~ (k.k, strictly lower; delta rule only), P (q.k, lower)
    for I in range(0 if (ABLATE & 1) or REUSE else C // SC):
        r0 = t0 + I * SC
        ri = I * SC + rs  # rows in the chunk
        kI = _rows(k_bh, r0, rs, T, H * K, ck, K)
        qI = _rows(q_bh, r0, rs, T, H * K, ck, K)
        if GATE == 2:
            gI = _hrows(G_bh, r0 + rs, ck, K)
            g_r = tl.load(G_bh + r0 * K + ck, mask=ck < K, other=0.0)
            spread = _spread(g_r, gI)
            xf = tl.exp(gI - g_r[None, :])
            ky = kc * _strip_decay(gc, g_r, rc, (I + 1) * SC, spread, SPREAD, SC)
            a = tl.dot(kI * xf, tl.trans(ky), input_precision=PREC)
            p = tl.dot(qI * xf, tl.trans(ky), input_precision=PREC)
        else:
            a = tl.dot(kI, tl.trans(kc), input_precision=PREC)
            p = tl.dot(qI, tl.trans(kc), input_precision=PREC)
            if GATE == 1:
                gI = tl.load(G_bh + r0 + rs)
                ratio = tl.exp(tl.where(ri[:, None] >= rc[None, :], gI[:, None] - gc[None, :], float("-inf")))
                a, p = a * ratio, p * ratio
        _store_strip(A_bh, P_bh, r0, rs, ri, rc, a, p, C, DELTA)
        if GATE == 2:
            if spread > SPREAD:  # strong decay inside the sub-chunk: its diagonal block with exact ratios
                a_d, p_d = _diag_gram_exact(kI, qI, gI, k_bh, G_bh, r0, T, H * K, ck, K, SC)
                _store_diag(A_bh, P_bh, r0, I, a_d, p_d, SC, C, DELTA)

    bc = _chunk_beta(beta, tok, t0, rc, T, H, HAS_BETA)
    if DELTA:
        tl.debug_barrier()
        if REUSE:
            Tc = _lower(T_bh, t0, C, False)
        else:
            Tc = _inverse(A_bh, T_bh, beta, tok, t0, bc, T, H, C, SC, HAS_BETA, PREC, ABLATE)
        kw = kc * bc[:, None]
        if GATE == 2:
            kw = kw * tl.exp(gc)
        if GATE == 1:
            kw = kw * tl.exp(gc)[:, None]
        _hstore(W_bh, t0 + rc, ck, K, tl.dot(Tc, kw, input_precision=PREC))
        vc = tl.dot(Tc, _rows(v_bh, t0, rc, T, H * V, cv, V) * bc[:, None], input_precision=PREC)
    else:
        vc = _rows(v_bh, t0, rc, T, H * V, cv, V) * bc[:, None]
    _hstore(U_bh, t0 + rc, cv, V, vc)


@triton.jit
def _intra_kb_kernel(
    q, k, v, la, beta, G, Ub, W, Tm, Am, Pm, Kd, Dec, Qg,
    T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, N,
    C: tl.constexpr, SC: tl.constexpr, BK: tl.constexpr, KB: tl.constexpr, BV: tl.constexpr, SPREAD: tl.constexpr,
    DELTA: tl.constexpr, HAS_BETA: tl.constexpr, PREC: tl.constexpr, QG: tl.constexpr,
):
    """`_intra_kernel` for per-channel gates, KB key columns at a time: the same buffers, but no [C, K] tile of keys or
    gates lives through the chunk (the one-tile form spills at K = 128 on sm_90: 440 B per thread at tf32, 1,868 at
    tf32x3). Each pass re-reads its [C, KB] keys and stored gates (L1 / L2 hits); the Gram strips sum over blocks."""
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    t0 = i_n * C
    rc, rs, cv = tl.arange(0, C), tl.arange(0, SC), tl.arange(0, BV)
    tok = i_b.to(tl.int64) * T * H + i_h
    q_bh, k_bh, v_bh = q + tok * K, k + tok * K, v + tok * V
    hm = i_bh.to(tl.int64) * N * C
    G_bh = G + hm * K
    W_bh, U_bh = W + hm * K, Ub + hm * V
    T_bh, A_bh, P_bh = Tm + hm * C, Am + hm * C, Pm + hm * C

    for kb in tl.static_range(0, BK, KB):  # gates: prefix sums (stored in G), decayed keys / queries, chunk decay
        cb = kb + tl.arange(0, KB)
        _chunk_gates(q_bh, _rows(k_bh, t0, rc, T, H * K, cb, K), la, tok, t0, rc, cb, G_bh, Kd, Dec, Qg, hm, i_bh, i_n,
                     T, H, K, N, C, 2, QG, True)
    tl.debug_barrier()

    for I in range(C // SC):  # Gram strips: A~ (strictly lower; delta rule only) and P (lower), summed over key blocks
        r0 = t0 + I * SC
        ri = I * SC + rs
        spread = 0.0
        for kb in tl.static_range(0, BK, KB):
            cb = kb + tl.arange(0, KB)
            spread = tl.maximum(spread, _spread(tl.load(G_bh + r0 * K + cb, mask=cb < K, other=0.0),
                                                _hrows(G_bh, r0 + rs, cb, K)))
        a = tl.zeros([SC, C], tl.float32)
        p = tl.zeros([SC, C], tl.float32)
        for kb in tl.static_range(0, BK, KB):
            cb = kb + tl.arange(0, KB)
            g_r = tl.load(G_bh + r0 * K + cb, mask=cb < K, other=0.0)
            xf = tl.exp(_hrows(G_bh, r0 + rs, cb, K) - g_r[None, :])
            ky = _rows(k_bh, t0, rc, T, H * K, cb, K) * _strip_decay(_hrows(G_bh, t0 + rc, cb, K), g_r, rc,
                                                                      (I + 1) * SC, spread, SPREAD, SC)
            a += tl.dot(_rows(k_bh, r0, rs, T, H * K, cb, K) * xf, tl.trans(ky), input_precision=PREC)
            p += tl.dot(_rows(q_bh, r0, rs, T, H * K, cb, K) * xf, tl.trans(ky), input_precision=PREC)
        _store_strip(A_bh, P_bh, r0, rs, ri, rc, a, p, C, DELTA)
        if spread > SPREAD:  # strong decay inside the sub-chunk: its diagonal block with exact ratios (full width)
            ck = tl.arange(0, BK)
            a_d, p_d = _diag_gram_exact(_rows(k_bh, r0, rs, T, H * K, ck, K), _rows(q_bh, r0, rs, T, H * K, ck, K),
                                        _hrows(G_bh, r0 + rs, ck, K), k_bh, G_bh, r0, T, H * K, ck, K, SC)
            _store_diag(A_bh, P_bh, r0, I, a_d, p_d, SC, C, DELTA)

    bc = _chunk_beta(beta, tok, t0, rc, T, H, HAS_BETA)
    if DELTA:
        tl.debug_barrier()
        Tc = _inverse(A_bh, T_bh, beta, tok, t0, bc, T, H, C, SC, HAS_BETA, PREC, 0)
        for kb in tl.static_range(0, BK, KB):
            cb = kb + tl.arange(0, KB)
            kw = _rows(k_bh, t0, rc, T, H * K, cb, K) * bc[:, None] * tl.exp(_hrows(G_bh, t0 + rc, cb, K))
            _hstore(W_bh, t0 + rc, cb, K, tl.dot(Tc, kw, input_precision=PREC))
        vc = tl.dot(Tc, _rows(v_bh, t0, rc, T, H * V, cv, V) * bc[:, None], input_precision=PREC)
    else:
        vc = _rows(v_bh, t0, rc, T, H * V, cv, V) * bc[:, None]
    _hstore(U_bh, t0 + rc, cv, V, vc)


@triton.jit
def _state_tile(ptr, i_bh, ck, cv, K: tl.constexpr, V: tl.constexpr, LOAD: tl.constexpr):
    """Offsets and mask of a program's [BK, BV] block of a [B H, K, V] state, and that block (zeros unless LOAD)."""
    s_off = ck[:, None] * V + cv[None, :]
    m_s = (ck < K)[:, None] & (cv < V)[None, :]
    if LOAD:
        S = tl.load(ptr + i_bh.to(tl.int64) * K * V + s_off, mask=m_s, other=0.0)
    else:
        S = tl.zeros([ck.shape[0], cv.shape[0]], tl.float32)
    return s_off, m_s, S


@triton.jit
def _segment(cu, i_s, N, VARLEN: tl.constexpr):
    """Sequence i_s of a sequential kernel: its chunks [n0, n1) and batch row b. Packed sequences (VARLEN): chunks
    cu[i_s] .. cu[i_s + 1] of the one row b = 0; otherwise all N chunks of row b = i_s."""
    if VARLEN:
        n0, n1, i_b = tl.load(cu + i_s), tl.load(cu + i_s + 1), i_s * 0
    else:
        n0, n1, i_b = i_s * 0, i_s * 0 + N, i_s
    return n0, n1, i_b


@triton.jit
def _chunk_keys(k_bh, Kd, G, hm, t0, rc, ck, T, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, GATE: tl.constexpr,
                KD: tl.constexpr):
    """Columns ck of the chunk's keys as the carry uses them: K (no gate), K e^{g_C - g} (stored, or for a scalar gate
    without KD formed here from the chunk's prefix sums, which end at g_C)."""
    if GATE == 0:
        kn = _rows(k_bh, t0, rc, T, H * K, ck, K)
    elif KD:
        kn = _hrows(Kd + hm * K, t0 + rc, ck, K)
    else:
        gn = tl.load(G + hm + t0 + rc)
        kn = _rows(k_bh, t0, rc, T, H * K, ck, K) * tl.exp(tl.sum(tl.where(rc == C - 1, gn, 0.0), axis=0) - gn)[:, None]
    return kn


@triton.jit
def _chunk_queries(q_bh, Qg, G, hm, t0, rc, ck, T, H: tl.constexpr, K: tl.constexpr, GATE: tl.constexpr,
                   QG: tl.constexpr):
    """Columns ck of the chunk's queries as the state (gradient) kernels read them: Q, or Q e^g — stored by the first
    stage (QG), else formed here from the chunk's prefix sums G."""
    if GATE == 0:
        qn = _rows(q_bh, t0, rc, T, H * K, ck, K)
    elif QG:
        qn = _hrows(Qg + hm * K, t0 + rc, ck, K)
    elif GATE == 1:
        qn = _rows(q_bh, t0, rc, T, H * K, ck, K) * tl.exp(tl.load(G + hm + t0 + rc))[:, None]
    else:
        qn = _rows(q_bh, t0, rc, T, H * K, ck, K) * tl.exp(_hrows(G + hm * K, t0 + rc, ck, K))
    return qn


@triton.jit
def _chunk_decay(S, Dec, i_bh, N, n, ck, K: tl.constexpr, GATE: tl.constexpr):
    """Rows ck of a state (or state gradient) times the chunk's decay e^{g_C}."""
    if GATE == 2:
        S = S * tl.load(Dec + (i_bh.to(tl.int64) * N + n) * K + ck, mask=ck < K, other=0.0)[:, None]
    if GATE == 1:
        S = S * tl.load(Dec + i_bh.to(tl.int64) * N + n)
    return S


@triton.jit
def _state_kernel(
    k, G, Kd, Dec, Ub, W, U, Hs, s0, sT, cu,
    T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, N,
    q, Qg, Pm, o, scale,  # OUT only (after the others: without OUT the kernel compiles as it did before they came)
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, DELTA: tl.constexpr, HAS_S0: tl.constexpr, PREC: tl.constexpr, KD: tl.constexpr = True,
    VARLEN: tl.constexpr = False, HALVES: tl.constexpr = False, OUT: tl.constexpr = False, STORE: tl.constexpr = True,
    QG: tl.constexpr = True,
):
    """HALVES: the state as two [BK / 2, BV] tiles of key rows, each with its own [C, BK / 2] columns of keys and W
    (fewer live registers; the one-tile form spills at K = 128 under tf32x3, as the backward's recompute runs it).
    OUT: the output too, O = scale ((Q e^g) S + P U), from the state while it is in registers (float32) and U before
    it is stored — no chunk start states or U go through memory for an output kernel (STORE off: neither is stored).
    QG: Q e^g as the first stage stored it (else formed here: Q, or Q e^g of a scalar gate)."""
    i_v, i_sh = tl.program_id(0), tl.program_id(1)  # i_sh: (sequence, head); states are [sequences H, K, V]
    i_s, i_h = i_sh // H, i_sh % H
    n0, n1, i_b = _segment(cu, i_s, N, VARLEN)
    i_bh = i_b * H + i_h
    ck, rc = tl.arange(0, BK // 2 if HALVES else BK), tl.arange(0, C)
    cv = i_v * BV + tl.arange(0, BV)
    mv = cv < V
    tok = i_b.to(tl.int64) * T * H + i_h  # token-major row of (b, t = 0, h)
    k_bh = k + tok * K
    hm = i_bh.to(tl.int64) * N * C
    W_bh, Ub_bh, U_bh = W + hm * K, Ub + hm * V, U + hm * V
    s_off, m_s, S = _state_tile(s0, i_sh, ck, cv, K, V, HAS_S0)
    if HALVES:
        ck2 = BK // 2 + ck
        s_off2, m_s2, S2 = _state_tile(s0, i_sh, ck2, cv, K, V, HAS_S0)
    for n in range(n0, n1):
        t0 = n * C
        if STORE:
            tl.store(Hs + (i_bh.to(tl.int64) * N + n) * K * V + s_off, S, mask=m_s)
            if HALVES:
                tl.store(Hs + (i_bh.to(tl.int64) * N + n) * K * V + s_off2, S2, mask=m_s2)
        if OUT:  # the inter-chunk read (Q e^g) S, off the carry's critical path
            on = tl.dot(_chunk_queries(q + tok * K, Qg, G, hm, t0, rc, ck, T, H, K, GATE, QG), S, input_precision=PREC)
            if HALVES:
                on += tl.dot(_chunk_queries(q + tok * K, Qg, G, hm, t0, rc, ck2, T, H, K, GATE, QG), S2,
                             input_precision=PREC)
        u = tl.load(Ub_bh + (t0 + rc)[:, None] * V + cv[None, :], mask=mv[None, :], other=0.0).to(tl.float32)
        if DELTA:
            u -= tl.dot(_hrows(W_bh, t0 + rc, ck, K), S, input_precision=PREC)
            if HALVES:
                u -= tl.dot(_hrows(W_bh, t0 + rc, ck2, K), S2, input_precision=PREC)
        if STORE:
            tl.store(U_bh + (t0 + rc)[:, None] * V + cv[None, :], u, mask=mv[None, :])
        if OUT:  # the intra-chunk read P U; products with `scale` cast to float32 (Inductor passes it as fp64)
            on += tl.dot(_lower(Pm + hm * C, t0, C, False), u, input_precision=PREC)
            tl.store(o + (tok + (t0 + rc).to(tl.int64) * H)[:, None] * V + cv[None, :],
                     (scale * on).to(tl.float32).to(o.dtype.element_ty), mask=(t0 + rc < T)[:, None] & mv[None, :])
        kn = _chunk_keys(k_bh, Kd, G, hm, t0, rc, ck, T, H, K, C, GATE, KD)
        S = _chunk_decay(S, Dec, i_bh, N, n, ck, K, GATE)
        S += tl.dot(tl.trans(kn), u, input_precision=PREC)
        if HALVES:
            kn2 = _chunk_keys(k_bh, Kd, G, hm, t0, rc, ck2, T, H, K, C, GATE, KD)
            S2 = _chunk_decay(S2, Dec, i_bh, N, n, ck2, K, GATE)
            S2 += tl.dot(tl.trans(kn2), u, input_precision=PREC)
    tl.store(sT + i_sh.to(tl.int64) * K * V + s_off, S, mask=m_s)
    if HALVES:
        tl.store(sT + i_sh.to(tl.int64) * K * V + s_off2, S2, mask=m_s2)


@triton.jit
def _out_kernel(
    q, G, U, Pm, Hs, o, scale,
    T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, N,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr, PREC: tl.constexpr, DOT16: tl.constexpr,
    KB: tl.constexpr,
):
    """DOT16 (16-bit intermediates only): both products as 16-bit tl.dot (exact products, float32 sums) on the stored
    S, U, P as they are, Q e^g rounded to the store dtype, KB key columns at a time; otherwise float32 operands at
    PREC."""
    i_v, i_n, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    t0 = i_n * C
    ck, rc = tl.arange(0, BK), tl.arange(0, C)
    cv = i_v * BV + tl.arange(0, BV)
    mk, mv = ck < K, cv < V
    tok = i_b.to(tl.int64) * T * H + i_h
    hm = i_bh.to(tl.int64) * N * C
    if DOT16:  # key columns KB at a time: fewer live registers, Q e^g rounded to the store dtype per block
        u = tl.load(U + (hm + t0 + rc)[:, None] * V + cv[None, :], mask=mv[None, :], other=0.0)
        P = tl.load(Pm + (hm + t0 + rc)[:, None] * C + rc[None, :])
        on = tl.dot(tl.where(rc[:, None] >= rc[None, :], P, tl.zeros_like(P)), u)
        for kb in tl.static_range(0, BK, KB):
            cb = kb + tl.arange(0, KB)
            qb = _rows(q + tok * K, t0, rc, T, H * K, cb, K)
            if GATE == 2:
                qb = qb * tl.exp(_hrows(G + hm * K, t0 + rc, cb, K))
            if GATE == 1:
                qb = qb * tl.exp(tl.load(G + hm + t0 + rc))[:, None]
            S = tl.load(Hs + (i_bh.to(tl.int64) * N + i_n) * K * V + cb[:, None] * V + cv[None, :],
                        mask=(cb < K)[:, None] & mv[None, :], other=0.0)
            on += tl.dot(qb.to(S.dtype), S)
    else:
        qn = _rows(q + tok * K, t0, rc, T, H * K, ck, K)
        if GATE == 2:
            qn = qn * tl.exp(_hrows(G + hm * K, t0 + rc, ck, K))
        if GATE == 1:
            qn = qn * tl.exp(tl.load(G + hm + t0 + rc))[:, None]
        S = tl.load(Hs + (i_bh.to(tl.int64) * N + i_n) * K * V + ck[:, None] * V + cv[None, :],
                    mask=mk[:, None] & mv[None, :], other=0.0).to(tl.float32)
        u = tl.load(U + (hm + t0 + rc)[:, None] * V + cv[None, :], mask=mv[None, :], other=0.0).to(tl.float32)
        on = tl.dot(qn, S, input_precision=PREC) + tl.dot(_lower(Pm + hm * C, t0, C, False), u, input_precision=PREC)
    tl.store(o + (tok + (t0 + rc).to(tl.int64) * H)[:, None] * V + cv[None, :], (scale * on).to(tl.float32).to(o.dtype.element_ty),
             mask=(t0 + rc < T)[:, None] & mv[None, :])


def _gate(log_alpha):
    return 0 if log_alpha is None else (1 if log_alpha.dim() == 3 else 2)


def precision_for(dtype) -> str:
    """tl.dot's input precision: float32-grade "tf32x3" for float32 inputs, "tf32" for 16-bit ones."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


def _sms(dev) -> int:
    return torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1


def fills_gpu(B, H, V, sms: int) -> bool:
    """Whether B H sequence-heads, in blocks of 32 value columns, give every SM a program of the sequential kernels."""
    return B * H * triton.cdiv(V, 32) >= sms


def state_block_v(B, H, V, dev) -> int:
    """V columns per program of the sequential kernels: narrower when B H alone cannot fill the GPU."""
    return 32 if fills_gpu(B, H, V, _sms(dev)) else 16


def fuse_out_default(B, H, K, V, C, low: bool, sms: int) -> bool:
    """`forward_triton(fuse_out=None)`: the output in the carry kernel where that is faster (H100, bf16, H16 D128,
    dev/fwd_stages.py, session 60). The fused carry does the output kernel's products inside its sequential loop. With
    enough programs to fill the GPU (B4: 64 sequence-heads x 4 blocks of 32 values = 256 programs on 132 SMs) each
    program's chunk step waits on its dot chain, and the extra, independent products hide in that wait while the
    chunk start states and U (at chunks of 32, 4x the bytes of q, k, v) no longer go through memory: KDA 3.06 -> 2.72
    ms, Gated DeltaNet 1.75 -> 1.66 (B4 T8192, chunks of 32). Without (B1: 16 sequence-heads, blocks of 16 values,
    128 programs), the SMs' issue slots are not the wait's, the serial steps grow by the output's work, and the
    separate output kernel (parallel over chunks too) is cheaper: KDA 3.99 -> 4.82, GDN 2.75 -> 3.09 (B1 T32768,
    chunks of 64; forward + backward likewise: B4 14.54 -> 14.23 and 12.40 -> 12.33, B1 19.70 -> 20.53 and 17.05 ->
    17.40; dev/LOG.md, session 60 lead, 13:28). So: fused exactly where `state_block_v` takes full 32-column blocks, for 16-bit inputs with `lowp`
    at padded key dims <= 128 (the forms whose sm_90 compile neither spills nor outgrows shared memory: float32
    operands at tf32x3 spill 232 B at chunks of 64, K 256 808 B; float32 at tf32 needs 240 KB) and chunks C of 32 or
    64 (chunks of 16, the lab's key dims <= 32, were never timed fused: the output kernel stays there)."""
    return low and K <= 128 and C >= 32 and fills_gpu(B, H, V, sms)


CHUNKS = (16, 32, 64)  # chunk lengths the kernels take (multiples of SC, powers of two); C = 64 is the default


def chunk_length(chunk) -> int:
    """`chunk` (None = C) checked against CHUNKS."""
    if chunk is None:
        return C
    if chunk not in CHUNKS:
        raise ValueError(f"chunk: expected one of {CHUNKS}, got {chunk!r}")
    return int(chunk)


def intra(q, k, v, log_alpha, beta, delta: bool, *, warps=4, precision=None, qg=False, ablate=0, store=None, kd=True,
          key_block=None, chunk=None, factors=None):
    """Kernel 1: G, U_bar, W, T, A~, P, K e^{g_C - g} (Kd), e^{g_C} (Dec) and, with `qg`, Q e^g (Qg) on head-major
    buffers (W / T / A~ empty without the delta rule; Kd / Dec / Qg without a gate; Kd also empty for a scalar gate
    unless `kd`). `store`: the dtype of U_bar, W, P and Kd (default float32; the forward alone stores them in its
    16-bit input dtype, halving the bytes the memory-bound kernels move; the backward's recompute keeps float32).
    `key_block` (per-channel gates; opt-in: slower in the forward, H200 session 10): `_intra_kb_kernel`, that many key
    columns at a time, when fewer than the padded key dim. `chunk`: tokens per chunk (CHUNKS; default C = 64), kept in
    the result as "C" for the kernels after this one (shorter chunks halve the per-token work of this kernel's [C, C]
    products and tiles, which do not shrink with the head dim; `auto_chunk` picks them by shape).
    `factors` (the memory op's default when a gradient is needed): the [C, C] matrices T, A~ and P that a forward kept
    (`forward_triton(keep_factors=...)`); the kernel then skips the Gram strips and the inverse and forms only the
    gates, W and U_bar (T from the stored one) — the backward's recompute without its costliest part."""
    C = chunk_length(chunk)
    if factors is not None and factors["C"] != C:
        raise ValueError(f"factors: kept at chunks of {factors['C']}, used at {C}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = max(1, triton.cdiv(T, C))
    dev, f32 = q.device, torch.float32
    st = store or f32
    gate = _gate(log_alpha)
    kd = bool(kd) or gate == 2
    G = torch.empty(B * H * N * C * (K if gate == 2 else 1) if gate else 1, dtype=f32, device=dev)
    Ub = torch.empty(B * H * N * C * V, dtype=st, device=dev)
    W = torch.empty(B * H * N * C * K if delta else 1, dtype=st, device=dev)
    if factors is not None:
        Tm, Am, Pm = factors["Tm"], factors["Am"], factors["Pm"]
    else:
        Tm, Am = (torch.empty(B * H * N * C * C if delta else 1, dtype=f32, device=dev) for _ in range(2))
        Pm = torch.empty(B * H * N * C * C, dtype=st, device=dev)
    Kd = torch.empty(B * H * N * C * K if gate and kd else 1, dtype=st, device=dev)
    Dec = torch.empty(B * H * N * (K if gate == 2 else 1) if gate else 1, dtype=f32, device=dev)
    Qg = torch.empty(B * H * N * C * K if gate and qg else 1, dtype=st, device=dev)
    BK, BV = max(16, triton.next_power_of_2(K)), max(16, triton.next_power_of_2(V))
    prec = precision or precision_for(q.dtype)
    out = dict(G=G, Ub=Ub, W=W, Tm=Tm, Am=Am, Pm=Pm, Kd=Kd, Dec=Dec, Qg=Qg, N=N, C=C, gate=gate, kd=kd, store=st)
    if gate == 2 and key_block and key_block < BK and not ablate and factors is None:
        _intra_kb_kernel[(N, B * H)](
            q, k, v, log_alpha, beta if beta is not None else q, G, Ub, W, Tm, Am, Pm, Kd, Dec, Qg,
            T, H=H, K=K, V=V, N=N, C=C, SC=SC, BK=BK, KB=max(16, triton.next_power_of_2(key_block)), BV=BV,
            SPREAD=SPREAD, DELTA=delta, HAS_BETA=beta is not None, PREC=prec, QG=bool(qg), num_warps=warps, num_stages=1,
        )
        return out
    _intra_kernel[(N, B * H)](
        q, k, v, log_alpha if gate else q, beta if beta is not None else q, G, Ub, W, Tm, Am, Pm, Kd, Dec, Qg,
        T, H=H, K=K, V=V, N=N, C=C, SC=SC, BK=BK, BV=BV, SPREAD=SPREAD,
        GATE=gate, DELTA=delta, HAS_BETA=beta is not None, PREC=prec, QG=bool(qg and gate),
        KD=kd, ABLATE=ablate, REUSE=factors is not None,
        num_warps=warps, num_stages=1,
    )
    return out


def carry(k, x, initial_state, delta: bool, *, V: int, chunks=None, block_v=None, warps=4, stages=2, precision=None,
          halves=False, out=None):
    """Kernel 2: per-chunk start states Hs [B H N K V], U (head-major), both in intra's store dtype, and the final
    state [B, H, K, V] float32 (carried in float32 whatever is stored; with `chunks`, the int32 chunk table
    [N_seq + 1] of packed sequences in a batch of one: [N_seq, H, K, V]). `halves` (padded K >= 64; opt-in, not yet
    measured on a GPU): the state as two tiles of key rows. `out` = (q, o, scale, store): the kernel also writes the
    output o (the output kernel's work, from the state in registers); Hs and U are then stored only with `store`
    (else returned empty)."""
    B, T, H, K = k.shape
    N, C, gate, dev = x["N"], x["C"], x["gate"], k.device
    seqs = B if chunks is None else chunks.numel() - 1
    f32 = torch.float32
    q, o, scale, store = out if out is not None else (k, k, 1.0, True)
    U = torch.empty(B * H * N * C * V if store else 1, dtype=x["store"], device=dev)
    Hs = torch.empty(B * H * N * K * V if store else 1, dtype=x["store"], device=dev)
    sT = torch.empty(seqs, H, K, V, dtype=f32, device=dev)
    BK = max(16, triton.next_power_of_2(K))
    BV = min(max(16, triton.next_power_of_2(V)), block_v or state_block_v(seqs, H, V, dev))
    if BK > 128:  # two stages of [C, 256] key tiles exceed an sm_90 SM's 227 KB of shared memory (312 KB at C 64); one: 64-96 KB
        stages = 1
    s0 = initial_state.contiguous().to(f32) if initial_state is not None else sT
    _state_kernel[(triton.cdiv(V, BV), seqs * H)](
        k, x["G"], x["Kd"], x["Dec"], x["Ub"], x["W"], U, Hs, s0, sT, chunks if chunks is not None else sT,
        T, H=H, K=K, V=V, N=N, q=q, Qg=x["Qg"], Pm=x["Pm"], o=o, scale=float(scale), C=C, BK=BK, BV=BV,
        GATE=gate, DELTA=delta, HAS_S0=initial_state is not None, PREC=precision or precision_for(k.dtype), KD=x["kd"],
        VARLEN=chunks is not None, HALVES=bool(halves and BK >= 64), OUT=out is not None, STORE=bool(store),
        QG=x["Qg"].numel() > 1, num_warps=warps, num_stages=stages,
    )
    return U, Hs, sT


def forward_triton(q, k, v, *, log_alpha=None, beta=None, delta=False, scale, initial_state=None, chunks=None,
                   block_v=None, warps=(4, 4, 4), stages=2, out_block_v=64, precision=None, lowp=True,
                   out_dot16=None, intra_kb=None, carry_halves=None, chunk=None, keep_factors=None, keep_states=None,
                   fuse_out=None, out_qg=True):
    """Chunked forward on [B, T, H, D] tensors. Returns (o [B, T, H, V] in q's dtype, final state [B, H, K, V] float32),
    plus what the backward may take from it (`keep_factors` / `keep_states`, below). `chunks`: packed sequences laid out chunk-aligned in a batch of one (see
    autograd.py), the int32 table of each sequence's chunks [N_seq + 1]; states are then [N_seq, H, K, V]. Tuning
    knobs: `warps` per kernel (intra, carry, out), `block_v` / `stages` of the carry kernel (V columns per program,
    software pipelining), `out_block_v` of the output kernel. `lowp` (16-bit inputs only): intermediates stored in the
    input dtype, states carried and every product summed in float32; scalar gates form K e^{g_C - g} in the carry
    kernel instead of storing it. `out_dot16` (with `lowp`): the output kernel's products as 16-bit dots;
    `carry_halves`: carry's `halves`; both default (None) to on at chunks of 64 and off at 32 / 16 (H200, bf16, B4
    T8192 H16 D128: output kernel 0.545 -> 0.306 ms and carry 0.540 -> 0.454 ms for KDA at 64; at 32 the output kernel
    0.647 -> 0.832 and the carry 0.716 -> 0.849). `intra_kb`: intra's `key_block` (opt-in; slower: 2.26 -> 3.16 ms at
    32 columns). `chunk`: intra's (tokens per chunk; not with `chunks`, whose layout is aligned to C = 64).
    `keep_factors`: a tl.dot precision for the first stage ("tf32" as the forward, "tf32x3" as the backward's
    recompute); the forward then also returns the [C, C] matrices T, A~, P (float32, P in the store dtype) for
    `backward_triton(factors=...)`, which skips the recompute's Gram strips and inverse (autograd.py keeps them by
    default, at the forward's precision). `keep_states` (opt-in, not yet measured on a GPU; with `keep_factors`): a
    tl.dot precision for the carry ("tf32x3" as the backward's recompute); the forward then stores every intermediate
    in float32 (its first stage also forms Q e^g) and returns them with U, the chunk start states Hs and the final
    state, for `backward_triton(states=...)`, which then skips its recompute altogether (memory: at D 128 and chunks
    of 32 about 5 KB per token and head, against 768 B of bf16 q, k, v — a trade for small models).
    `fuse_out`: True, the carry kernel also writes the output, from each chunk's start state while it is in registers
    (float32) and U before it leaves them, so neither the start states Hs (K V per chunk: at chunks of 32 and D 128,
    4x the bytes of q, k, v) nor U go through memory and the output kernel does not run; False: the output kernel
    (`out_dot16` / `out_block_v` / warps[2] apply to it); None (the default): `fuse_out_default`, fused for 16-bit
    inputs at padded key dims <= 128 and chunks of 32 or 64 where the sequence-heads fill the GPU (B4 H16 on an H100:
    yes; B1 H16: no; its reasoning and timings there). `out_qg` (per-channel gates, with `fuse_out`): the first stage
    stores Q e^g (in the store dtype) for the carry to read, else the carry forms it from Q and the stored prefix sums."""
    if chunks is not None and chunk_length(chunk) != C:
        raise ValueError(f"chunk: packed sequences (chunks) are laid out in chunks of {C}; got chunk={chunk}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    log_alpha = log_alpha.contiguous() if log_alpha is not None else None
    beta = beta.contiguous() if beta is not None else None
    prec = precision or precision_for(q.dtype)
    if keep_states and not keep_factors:
        raise ValueError("keep_states: needs keep_factors (the backward then takes every intermediate from the forward)")
    low = lowp and q.dtype in (torch.bfloat16, torch.float16) and not keep_states
    if fuse_out is None:
        fuse_out = fuse_out_default(B if chunks is None else chunks.numel() - 1, H, K, V, chunk_length(chunk), low,
                                    _sms(q.device))
    qg = bool(keep_states) or bool(fuse_out and out_qg and log_alpha is not None and log_alpha.dim() == 4)
    x = intra(q, k, v, log_alpha, beta, bool(delta), warps=warps[0], precision=keep_factors or prec,
              store=q.dtype if low else None, kd=not low, key_block=None if keep_factors else intra_kb, chunk=chunk,
              qg=qg)
    long_chunks = x["C"] == C
    carry_halves = long_chunks if carry_halves is None else carry_halves
    out_dot16 = long_chunks if out_dot16 is None else out_dot16
    o = torch.empty(B, T, H, V, dtype=q.dtype, device=q.device)
    U, Hs, sT = carry(k, x, initial_state, bool(delta), V=V, chunks=chunks, block_v=block_v, warps=warps[1], stages=stages,
                      precision=keep_states or prec, halves=carry_halves,
                      out=(q, o, scale, bool(keep_states)) if fuse_out else None)
    if not fuse_out:
        BK = max(16, triton.next_power_of_2(K))
        BV = min(max(16, triton.next_power_of_2(V)), out_block_v)
        _out_kernel[(triton.cdiv(V, BV), x["N"], B * H)](
            q, x["G"], U, x["Pm"], Hs, o, float(scale), T, H=H, K=K, V=V, N=x["N"], C=x["C"], BK=BK, BV=BV,
            GATE=x["gate"], PREC=prec, DOT16=bool(out_dot16 and low), KB=min(64, BK), num_warps=warps[2], num_stages=2,
        )
    if keep_states:
        return o, sT, {**x, "U": U, "Hs": Hs, "sT": sT}
    if keep_factors:
        return o, sT, dict(Tm=x["Tm"], Am=x["Am"], Pm=x["Pm"], C=x["C"])
    return o, sT
