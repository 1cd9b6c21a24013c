"""The memory op in chunks: the WY/UT form (derivation in README.md beside this file).

Legend: N chunks, B batch, H heads, C chunk length, c sub-chunk length, K key dim, V value dim.
Per chunk (state S at its start), with g = prefix sums of log alpha inside the chunk, [.., C] or [.., C, K]:
    A  = strictly lower   sum_k k_ik k_jk exp(g_ik - g_jk)         [N, B, H, C, C]
    U  = (I + diag(beta) A)^-1 diag(beta) (V - (K * e^g) S)         (delta; otherwise U = diag(beta) V)
    O  = scale ((Q * e^g) S + P U),   P = lower  sum_k q_ik k_jk exp(g_ik - g_jk)
    S <- e^{g_C} * S + (K * e^{g_C - g})^T U
Every exponent is <= 0: decay ratios are differences of prefix sums, never exp(G_i) * exp(-G_j).
"""

from __future__ import annotations

import torch

from ._check import LOG_ALPHA_FLOOR

DEFAULT_CHUNK = 64  # chunk_size=None
SUB = 8  # sub-chunk length for per-channel decay ratios
# Largest in-chunk decay (-g at the chunk's end) for which the two-factor form e^{g_i} * e^{-g_j} is used for per-channel
# gates: e^{-g_j} <= e^{SAFE_SPREAD} leaves a factor >= e^28 (float32 max ~ e^88.7; float64 ~ e^709.8) of headroom
# for |x_ik| |y_jk|, and each product keeps its relative precision. Beyond it (strong decay) the exact sub-chunked
# ratios are used.
SAFE_SPREAD = {torch.float32: 60.0, torch.float64: 600.0}


def _to_chunks(x: torch.Tensor, n: int, c: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, T, H, *rest] -> [N, B, H, C, *rest] contiguous, zero-padding T to N * C (padding writes and decays nothing)."""
    B, T = x.shape[:2]
    x = x.to(dtype)
    if n * c != T:
        x = torch.cat([x, x.new_zeros(B, n * c - T, *x.shape[2:])], dim=1)
    x = x.reshape(B, n, c, *x.shape[2:])  # [B, N, C, H, *rest]
    return x.permute(1, 0, 3, 2, *range(4, x.dim())).contiguous()


def _tril(C: int, device) -> torch.Tensor:
    return torch.ones(C, C, dtype=torch.bool, device=device).tril()


def _channel_decayed_dots(xs, y, g, seg=None):
    """For each x in xs: sum_k x_ik y_jk exp(g_ik - g_jk), j <= i, per-channel g [..., C, K], by sub-chunks of SUB.

    Diagonal blocks: the exact [c, c, K] ratios. Block (I, J < I): with r the last token before sub-chunk I,
    exp(g_i - g_j) = exp(g_i - g_r) * exp(g_r - g_j), both factors <= 1, so one matmul per sub-chunk row.
    The y-side factors are computed once and shared by every x.
    `seg` [..., C, K] (hard resets so far, per channel): a ratio is 0 across a reset (seg_i != seg_j), and `g` is then
    the prefix sum since the last reset; the factoring through r holds because seg is non-decreasing (j <= r < i).
    """
    C, K = y.shape[-2:]
    c = min(SUB, C)
    n = C // c
    ys, gs = y.unflatten(-2, (n, c)), g.unflatten(-2, (n, c))  # [..., n, c, K]
    keep = _tril(c, y.device)[:, :, None]
    if seg is not None:
        ss = seg.unflatten(-2, (n, c))
        keep = keep & (ss[..., :, None, :] == ss[..., None, :, :])  # [..., n, c, c, K]
    ratio = (gs[..., :, None, :] - gs[..., None, :, :]).masked_fill(~keep, float("-inf")).exp()  # [..., n, c, c, K]
    ratio_y = ratio * ys[..., None, :, :]
    eye = torch.eye(n, dtype=y.dtype, device=y.device)
    if n > 1:
        g_r = gs[..., :-1, -1, :]  # [..., n-1, K] reference: last token of the previous sub-chunk
        to_r = (gs[..., 1:, :, :] - g_r[..., None, :]).exp()  # [..., n-1, c, K]
        before = torch.arange(C, device=y.device)[None, :] < (torch.arange(1, n, device=y.device) * c)[:, None]
        before = before[:, :, None]  # [n-1, C, 1]
        if seg is not None:  # masked before the exponential: across a reset the rebased exponent may be > 0
            s_r = ss[..., :-1, -1, :]  # [..., n-1, K]
            to_r = (gs[..., 1:, :, :] - g_r[..., None, :]).masked_fill(ss[..., 1:, :, :] != s_r[..., None, :],
                                                                      float("-inf")).exp()
            before = before & (seg[..., None, :, :] == s_r[..., :, None, :])  # [..., n-1, C, K]
        expo = (g_r[..., :, None, :] - g[..., None, :, :]).masked_fill(~before, float("-inf"))
        y_t = y[..., None, :, :] * expo.exp()  # [..., n-1, C, K], zero at and after sub-chunk I
    outs = []
    for x in xs:
        xs_ = x.unflatten(-2, (n, c))
        diag = (xs_[..., :, None, :] * ratio_y).sum(-1)  # [..., n, c, c]
        out = (diag[..., :, :, None, :] * eye[:, None, :, None]).flatten(-2)  # [..., n, c, C] block diagonal
        if n > 1:
            off = (xs_[..., 1:, :, :] * to_r) @ y_t.transpose(-1, -2)  # [..., n-1, c, C]
            out = out + torch.cat([torch.zeros_like(off[..., :1, :, :]), off], dim=-3)
        outs.append(out.flatten(-3, -2))  # [..., C, C]
    return outs


def _decayed_dots(xs, y, g, *, factor: bool | None = None):
    """For each x in xs: sum_k x_ik y_jk exp(g_ik - g_jk) for j <= i, zero above. x, y [..., C, K] -> [..., C, C].

    g is None (no decay) or per channel [..., C, K] without hard resets. Per-channel g: `factor=None` picks the two-factor matmul form when the chunk's decay spread is below
    SAFE_SPREAD (one host sync), else the exact sub-chunked ratios; True / False force one form (tests).
    """
    keep = _tril(y.shape[-2], y.device)
    if g is not None and g.dim() == y.dim():
        if factor is None:
            factor = float((-g[..., -1, :]).detach().max()) <= SAFE_SPREAD[g.dtype]
        if not factor:
            return _channel_decayed_dots(xs, y, g)
        y_in = y * (-g).exp()  # e^{-g_j} <= e^{SAFE_SPREAD}
        eg = g.exp()
        return [((x * eg) @ y_in.transpose(-1, -2)).masked_fill(~keep, 0.0) for x in xs]
    return [(x @ y.transpose(-1, -2)).masked_fill(~keep, 0.0) for x in xs]  # no decay (scalar gates: below)


def _exp_where(x, keep):
    """exp(x) where keep, exactly 0 elsewhere (masked first: x may overflow where it is not kept)."""
    return x.masked_fill(~keep, float("-inf")).exp()


def _scalar_decayed_dots(xs, y, g, seg):
    """For each x in xs: sum_k x_ik y_jk exp(g_i - g_j) for j <= i in the same reset segment (seg_i == seg_j), else 0.
    Scalar g, seg [..., C]; x, y [..., C, K] -> [..., C, C]."""
    keep = _tril(y.shape[-2], y.device) & (seg[..., :, None] == seg[..., None, :])
    ratio = (g[..., :, None] - g[..., None, :]).masked_fill(~keep, float("-inf")).exp()  # [..., C, C]
    return [(x @ y.transpose(-1, -2)) * ratio for x in xs]


def _rebased_prefix_sums(la, dim):
    """Prefix sums g of log alpha inside each chunk, restarted at every hard reset, and seg, the resets so far.

    A hard reset is log alpha at its floor (LOG_ALPHA_FLOOR, where alpha = 0 exactly): nothing crosses it, so g need
    only be exact between resets; restarting there keeps g small (a floor of -110 summed over a chunk would cost
    float32 digits of every later small decay). With no reset, g is the plain prefix sum and seg is 0.
    """
    reset = la <= LOG_ALPHA_FLOOR[la.dtype]
    c = la.masked_fill(reset, 0.0).cumsum(dim)  # non-increasing along dim
    at_reset = c.masked_fill(~reset, float("inf")).cummin(dim).values  # c at the last reset (c is non-increasing)
    return c - at_reset.masked_fill(at_reset == float("inf"), 0.0), reset.cumsum(dim)


def memory_chunked(q, k, v, *, log_alpha=None, beta=None, delta=False, scale, initial_state=None, chunk_size=None):
    """Chunked form of `rule`; same arguments as the reference, plus `chunk_size` (None: 64). Returns o [B, T, H, V]
    and S (state dtype)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    sd = torch.float64 if q.dtype == torch.float64 else torch.float32
    C = chunk_size or DEFAULT_CHUNK
    N = max(1, -(-T // C))
    q, k, v = (_to_chunks(x, N, C, sd) for x in (q, k, v))  # [N, B, H, C, K|V]
    b = None if beta is None else _to_chunks(beta, N, C, sd)[..., None]  # [N, B, H, C, 1]
    g = seg = None
    qg, kg, kl, decay_end = q, k, k, None
    if log_alpha is not None:
        la = _to_chunks(log_alpha, N, C, sd)
        g, seg = _rebased_prefix_sums(la, -1 if la.dim() == 4 else -2)
        if la.dim() == 4:  # scalar gate [N, B, H, C]
            g_end, s_end = g[..., -1:], seg[..., -1:]
            eg = _exp_where(g, seg == 0)[..., None]
            kl = k * _exp_where(g_end - g, seg == s_end)[..., None]
            decay_end = _exp_where(g_end, s_end == 0)[..., None]  # [N, B, H, 1, 1]
        else:  # per channel [N, B, H, C, K]
            g_end, s_end = g[..., -1:, :], seg[..., -1:, :]
            eg, kl = _exp_where(g, seg == 0), k * _exp_where(g_end - g, seg == s_end)
            decay_end = _exp_where(g_end, s_end == 0).transpose(-1, -2)  # [N, B, H, K, 1]
        qg, kg = q * eg, k * eg
    bv = v if b is None else b * v
    xs = (q, k) if delta else (q,)
    if g is not None and g.dim() < k.dim():
        P, *A = _scalar_decayed_dots(xs, k, g, seg)
    elif g is not None and seg is not None and (q.device.type != "cpu" or torch.compiler.is_compiling()
                                                or bool((seg[..., -1, :] > 0).any())):
        # per channel: off the CPU (no host sync: a CUDA graph can capture it) and under torch.compile (a sync is a
        # graph break) always the exact sub-chunked form; on the CPU in eager that form only where a chunk holds a
        # hard reset, else _decayed_dots picks (one cheap sync)
        P, *A = _channel_decayed_dots(xs, k, g, seg)
    else:
        P, *A = _decayed_dots(xs, k, g)
    if delta:
        A = A[0].tril(-1)  # strictly lower: a key's own write is not in its erase
        if b is not None:
            A = b * A
        rhs = torch.cat([bv, kg if b is None else b * kg], dim=-1)  # solve once for [u_bar | w]
        sol = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
        u_bar, w = sol[..., :V], sol[..., V:]
    else:
        u_bar, w = bv, None

    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(sd)
    outs = []
    for n in range(N):
        u = u_bar[n] if w is None else u_bar[n] - w[n] @ S
        outs.append(qg[n] @ S + P[n] @ u)
        S = kl[n].transpose(-1, -2) @ u + (S if decay_end is None else decay_end[n] * S)
    o = scale * torch.stack(outs, dim=0)  # [N, B, H, C, V]
    o = o.permute(1, 0, 3, 2, 4).reshape(B, N * C, H, V)[:, :T]
    return o, S
