"""Split-K decode attention in Triton (see evict/ops/decode.py for the math and the argument contract).

Launch 1, grid (B G, S): program (b, g, s) owns keys [s n, min((s + 1) n, lengths[b])) of sequence b, group g. It
loads the M queries of the group once ([BM, Dk], BM >= 16 for tl.dot), streams its keys in blocks of BN with an
online softmax (running max m, running sum l, float32 accumulator [BM, Dv]), and writes its partial (acc, m, l).
A split past the sequence's length writes (0, -inf, 0) and reads nothing. When the values are the keys (MLA's latent)
each key block is loaded once and used for both products.
Launch 2, grid (B H, Dv / 64): o = sum_s e^(m_s - m) acc_s / sum_s e^(m_s - m) l_s, m = max_s m_s.
The number of splits S depends only on host-known sizes (B, G, L and the card), so a captured graph stays valid
while `lengths` changes on the device.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _split_kernel(
    q, k, v, q2, k2, lengths, tab, po, pm, pl,
    s_qb, s_qh, s_kb, s_kl, s_kg, s_vb, s_vl, s_vg, s_q2b, s_q2h, s_k2b, s_k2l, s_k2g, s_tb,
    scale, split_len, n_splits, page,
    G: tl.constexpr, M: tl.constexpr, BM: tl.constexpr, DK: tl.constexpr, BDK: tl.constexpr,
    DV: tl.constexpr, BDV: tl.constexpr, D2: tl.constexpr, BD2: tl.constexpr,
    HAS2: tl.constexpr, V_IS_K: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr, PAGED: tl.constexpr,
):
    i_bg, i_s = tl.program_id(0), tl.program_id(1)
    b, g = i_bg // G, i_bg % G
    b64 = b.to(tl.int64)
    length = tl.load(lengths + b).to(tl.int32)
    start = i_s * split_len
    end = tl.minimum(start + split_len, length)
    rm = tl.arange(0, BM)
    mm = rm < M
    h = g * M + rm  # [BM] heads of this group
    rd = tl.arange(0, BDK)
    md = rd < DK
    qt = tl.load(q + b64 * s_qb + h[:, None] * s_qh + rd[None, :], mask=mm[:, None] & md[None, :], other=0.0)
    if HAS2:
        r2 = tl.arange(0, BD2)
        m2 = r2 < D2
        q2t = tl.load(q2 + b64 * s_q2b + h[:, None] * s_q2h + r2[None, :], mask=mm[:, None] & m2[None, :], other=0.0)
    rv = tl.arange(0, BDV)
    mv = rv < DV
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BDV], tl.float32)
    for n0 in range(start, end, BN):
        rn = n0 + tl.arange(0, BN)
        mn = rn < end
        if PAGED:  # position n of sequence b is row n % page of block tab[b, n // page]
            blk = tl.load(tab + b64 * s_tb + rn // page, mask=mn, other=0).to(tl.int64)
            pin = (rn % page).to(tl.int64)
        else:
            blk = b64 + tl.zeros([BN], tl.int64)
            pin = rn.to(tl.int64)
        kt = tl.load(k + (blk * s_kb + pin * s_kl + g * s_kg)[:, None] + rd[None, :], mask=mn[:, None] & md[None, :],
                     other=0.0)  # [BN, BDK]
        s = tl.dot(qt, tl.trans(kt), input_precision=PREC)  # [BM, BN] float32
        if HAS2:
            k2t = tl.load(k2 + (blk * s_k2b + pin * s_k2l + g * s_k2g)[:, None] + r2[None, :], mask=mn[:, None] & m2[None, :],
                          other=0.0)
            s += tl.dot(q2t, tl.trans(k2t), input_precision=PREC)
        s = tl.where(mn[None, :], s * scale, float("-inf")).to(tl.float32)  # float32 even if scale arrives as fp64 (compile)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_IS_K:
            vt = kt
        else:
            vt = tl.load(v + (blk * s_vb + pin * s_vl + g * s_vg)[:, None] + rv[None, :], mask=mn[:, None] & mv[None, :],
                         other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PREC)
        m_i = m_new
    off = ((b64 * (G * M) + h) * n_splits + i_s)  # [BM] into [B, H, S]
    tl.store(po + off[:, None] * DV + rv[None, :], acc, mask=mm[:, None] & mv[None, :])
    tl.store(pm + off, m_i, mask=mm)
    tl.store(pl + off, l_i, mask=mm)


@triton.jit
def _merge_kernel(po, pm, pl, o, n_splits, DV: tl.constexpr, BS: tl.constexpr, BDV: tl.constexpr):
    i_bh, i_v = tl.program_id(0).to(tl.int64), tl.program_id(1)
    rs = tl.arange(0, BS)
    ms = rs < n_splits
    rv = i_v * BDV + tl.arange(0, BDV)
    mv = rv < DV
    m_s = tl.load(pm + i_bh * n_splits + rs, mask=ms, other=float("-inf"))
    l_s = tl.load(pl + i_bh * n_splits + rs, mask=ms, other=0.0)
    m = tl.max(m_s, 0)
    w = tl.where(ms & (m_s > float("-inf")), tl.exp(m_s - m), 0.0)  # [BS]; empty splits weigh 0
    acc = tl.load(po + (i_bh * n_splits + rs[:, None]) * DV + rv[None, :], mask=ms[:, None] & mv[None, :], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l_s * w, 0)
    tl.store(o + i_bh * DV + rv, out.to(o.dtype.element_ty), mask=mv)


@functools.cache
def _sms(device_index: int) -> int:
    """The card's SM count (16 for the interpreter)."""
    if not torch.cuda.is_available():
        return 16
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# Launch settings by key width, from dev/tune_decode.py on an H200 (dev/LOG.md 2026-11-30): MLA's 512-wide latent wants
# small key blocks and many programs (8 per SM) to keep loads in flight; heads of <= 128 want long blocks, 8 warps,
# 3 stages. (BN, warps, stages, programs per SM)
WIDE, NARROW = (32, 4, 2, 8), (128, 8, 3, 2)


def plan(B: int, G: int, L: int, Dk: int, programs: int, BN: int | None = None, max_splits: int = 512) -> tuple[int, int, int]:
    """(BN, n_splits, split_len) for B G sequence-groups over a cache of L positions."""
    BN = BN or (WIDE if Dk > 128 else NARROW)[0]
    blocks = triton.cdiv(L, BN)
    splits = max(1, min(triton.cdiv(blocks, 4), triton.cdiv(programs, B * G), max_splits))  # >= 4 key blocks a split
    split_len = triton.cdiv(blocks, splits) * BN
    return BN, triton.cdiv(L, split_len), split_len


def decode_triton(q, k, v, lengths, *, scale, q2=None, k2=None, block_table=None, tune: dict | None = None):
    """`block_table` [B, max_blocks]: k, v, k2 are block arenas [n_blocks, page, G, D] (paged cache).
    `tune` (benchmarks only): BN, programs, max_splits, warps, stages overrides."""
    tune = tune or {}
    B, H, Dk = q.shape
    G = k.shape[2]
    paged = block_table is not None
    L = block_table.shape[1] * k.shape[1] if paged else k.shape[1]  # positions a sequence can hold
    M = H // G
    v_is_k = v is None
    Dv = Dk if v_is_k else v.shape[-1]
    for name, t in (("q", q), ("k", k), ("v", v), ("q2", q2), ("k2", k2)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name}: expected a unit stride in the last dim, got strides {list(t.stride())}")
    dev_index = q.device.index if q.is_cuda and q.device.index is not None else (torch.cuda.current_device() if q.is_cuda else 0)
    BNd, warps, stages, per_sm = WIDE if Dk > 128 else NARROW
    if q.element_size() > 2:  # float32 tiles are twice as wide: NARROW's 3 stages of 128 keys overflow shared memory
        BNd, stages = min(BNd, 64), 2
    BN, S, split_len = plan(B, G, L, Dk, tune.get("programs", per_sm * _sms(dev_index)), tune.get("BN", BNd),
                            tune.get("max_splits", 512))
    po = torch.empty(B, H, S, Dv, device=q.device, dtype=torch.float32)
    pm = torch.empty(B, H, S, device=q.device, dtype=torch.float32)
    pl = torch.empty(B, H, S, device=q.device, dtype=torch.float32)
    vv = k if v_is_k else v
    has2 = q2 is not None
    q2_, k2_ = (q2, k2) if has2 else (q, k)
    D2 = q2.shape[-1] if has2 else 16
    BM = max(16, triton.next_power_of_2(M))
    BDK = max(16, triton.next_power_of_2(Dk))
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    tab = block_table if paged else lengths
    _split_kernel[(B * G, S)](
        q, k, vv, q2_, k2_, lengths, tab, po, pm, pl,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), vv.stride(0), vv.stride(1), vv.stride(2),
        q2_.stride(0), q2_.stride(1), k2_.stride(0), k2_.stride(1), k2_.stride(2), tab.stride(0),
        float(scale), split_len, S, k.shape[1] if paged else 1,
        G=G, M=M, BM=BM, DK=Dk, BDK=BDK, DV=Dv, BDV=BDK if v_is_k else max(16, triton.next_power_of_2(Dv)),
        D2=D2, BD2=max(16, triton.next_power_of_2(D2)), HAS2=has2, V_IS_K=v_is_k, BN=BN, PREC=prec, PAGED=paged,
        num_warps=tune.get("warps", warps), num_stages=tune.get("stages", stages),
    )
    o = torch.empty(B, H, Dv, device=q.device, dtype=q.dtype)
    BDV = min(64, max(16, triton.next_power_of_2(Dv)))
    BS = max(2, triton.next_power_of_2(S))
    BDV = min(BDV, max(16, 4096 // BS))  # the [BS, BDV] partial tile stays within registers
    _merge_kernel[(B * H, triton.cdiv(Dv, BDV))](po, pm, pl, o, S, DV=Dv, BS=BS, BDV=BDV, num_warps=4)
    return o
