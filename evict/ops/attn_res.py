"""Attention Residuals (Kimi): a learned softmax mix over depth sources replaces the residual sum.

    h = sum_i w_i v_i,   w = softmax_i( q . RMSNorm(v_i) )     (no 1/sqrt(d); per token, over sources only)

Legend: S sources, B batch, T time, D model width. The query q [D] belongs to one read point; the keys are the
sources themselves after an RMSNorm (weight g = norm_weight [D]), the values are the raw sources. Positions never mix.

The fast form uses q . (g * v / rms(v)) = (v . u) * rstd(v) with u = q * g [D] and rstd = 1 / sqrt(mean(v^2) + eps):
a logit is one dot product and one norm per token and source, never a normalized [B, T, D] key. It is an
autograd.Function over the list of sources (never stacked): it saves the sources themselves (the residual stream's
own tensors, no copy) and [S, B, T] weights and statistics, and its backward is written from the math:

    gw_i = go . v_i                          gl_i = w_i (gw_i - sum_j w_j gw_j)         (softmax over S)
    gdot_i = gl_i rstd_i                     grstd_i = gl_i dot_i,  gms_i = -rstd_i^3 grstd_i / 2
    dv_i = w_i go + gdot_i u + (2 / D) gms_i v_i          du = sum_i sum_bt gdot_i v_i,  dq = du g,  dg = du q

Under torch.compile the same forward is traced as plain ops (`_mix`) and Inductor derives the backward. The
token-by-token float64 loop `attn_res_reference` is the check of all forms (tests/ops/test_attn_res.py).
"""

from __future__ import annotations

import functools

import torch


def _sources(sources) -> list[torch.Tensor]:
    """The S sources as a list of [B, T, D] (a stacked [S, B, T, D] is unbound into views, no copy)."""
    if isinstance(sources, torch.Tensor):
        if sources.dim() != 4:
            raise ValueError(f"sources: expected a stacked [S, B, T, D] or a list of [B, T, D], got {list(sources.shape)}")
        return list(sources.unbind(0))
    if not isinstance(sources, (list, tuple)) or len(sources) == 0:
        raise ValueError(f"sources: expected a non-empty list of [B, T, D] tensors, got {sources!r:.60}")
    first = sources[0]
    want = list(first.shape) if isinstance(first, torch.Tensor) and first.dim() == 3 else None
    for i, v in enumerate(sources):
        if not isinstance(v, torch.Tensor) or list(v.shape) != want:
            got = list(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise ValueError(f"sources: expected every source of shape {want or '[B, T, D]'} (as source 0), source {i} is {got}")
    return list(sources)


def _check(D: int, query, norm_weight) -> None:
    if not isinstance(query, torch.Tensor) or list(query.shape) != [D]:
        got = list(query.shape) if isinstance(query, torch.Tensor) else type(query).__name__
        raise ValueError(f"query: expected shape [{D}] (D), got {got}")
    if norm_weight is not None and (not isinstance(norm_weight, torch.Tensor) or list(norm_weight.shape) != [D]):
        got = list(norm_weight.shape) if isinstance(norm_weight, torch.Tensor) else type(norm_weight).__name__
        raise ValueError(f"norm_weight: expected shape [{D}] (D) or None, got {got}")


def _dtypes(vs: list[torch.Tensor]) -> tuple[torch.dtype, torch.dtype]:
    """(compute dtype, output dtype): float64 if any source is float64, else float32; the sources' promoted dtype."""
    out = functools.reduce(torch.promote_types, [v.dtype for v in vs])
    return (torch.float64 if out == torch.float64 else torch.float32), out


def _stats(vs: list[torch.Tensor], u: torch.Tensor, eps: float, cd: torch.dtype):
    """Per token and source: dot = v . u and rstd = 1 / sqrt(mean(v^2) + eps), each [S, B, T] in `cd`. Eager: a
    matrix-vector product and a norm, each reads a source once and writes no [B, T, D] temporary (for sources already
    in `cd`); under torch.compile the pointwise-and-sum form, which Inductor fuses into one read of each source."""
    D = u.shape[0]
    fused = torch.compiler.is_compiling()
    dots, rstds = [], []
    with torch.autocast(u.device.type, enabled=False):  # float32 dot products under a bf16 autocast too
        for v in vs:
            vf = v.to(cd)
            dots.append((vf * u).sum(-1) if fused else vf @ u)  # [B, T]
            ms = vf.square().mean(-1) if fused else torch.linalg.vector_norm(vf, dim=-1).square() / D
            rstds.append(torch.rsqrt(ms + eps))  # [B, T]
    return torch.stack(dots), torch.stack(rstds)  # [S, B, T] each


def _u(query: torch.Tensor, norm_weight: torch.Tensor | None, cd: torch.dtype) -> torch.Tensor:
    return query.to(cd) if norm_weight is None else query.to(cd) * norm_weight.to(cd)  # [D]


class _AttnRes(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, norm_weight, eps, *vs):
        out, u, w, dot, rstd = _mix(query, norm_weight, eps, list(vs))
        ctx.save_for_backward(query, norm_weight, u, w, dot, rstd, *vs)
        ctx.has_norm = norm_weight is not None
        return out

    @staticmethod
    def backward(ctx, go):
        with torch.autocast(go.device.type, enabled=False):  # float32 products under a bf16 autocast too
            return _AttnRes._backward(ctx, go)

    @staticmethod
    def _backward(ctx, go):
        query, norm_weight, u, w, dot, rstd, *vs = ctx.saved_tensors
        cd = u.dtype
        D = u.shape[0]
        gof = go.to(cd)  # [B, T, D]
        gw = torch.stack([(gof * v.to(cd)).sum(-1) for v in vs])  # [S, B, T]
        gl = w * (gw - (w * gw).sum(0))  # [S, B, T]: through the softmax
        gdot = gl * rstd
        c = gl * dot * rstd.pow(3) * (-1.0 / D)  # (2 / D) gms: the coefficient of v_i in dv_i
        du = torch.zeros_like(u)
        grads = []
        for i, v in enumerate(vs):  # three passes for dv, a matrix-vector product for du
            vf = v.to(cd)
            dv = torch.addcmul(gof * w[i, ..., None], vf, c[i, ..., None])  # [B, T, D]
            dv = torch.addr(dv.reshape(-1, D), gdot[i].flatten(), u).view(dv.shape)  # + gdot_i (outer) u
            du += torch.tensordot(gdot[i], vf, dims=([0, 1], [0, 1]))  # [D]
            grads.append(dv.to(v.dtype))
        gq = (du if norm_weight is None else du * norm_weight.to(cd)).to(query.dtype)
        gg = (du * query.to(cd)).to(norm_weight.dtype) if ctx.has_norm else None
        return (gq, gg, None, *grads)


def attn_res(sources, query: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """Mix S sources per token. sources: list of S [B, T, D] or stacked [S, B, T, D]; query, norm_weight [D].

    Logits, softmax and the weighted sum in float32 (float64 when a source is float64); returns [B, T, D] in the
    sources' promoted dtype. Never stacks the sources; its autograd saves them by reference (no copy)."""
    vs = _sources(sources)
    _check(vs[0].shape[-1], query, norm_weight)
    if torch.compiler.is_compiling():  # Inductor derives and fuses the backward of the plain ops itself
        return _mix(query, norm_weight, eps, vs)[0]
    return _AttnRes.apply(query, norm_weight, eps, *vs)


def _mix(query, norm_weight, eps: float, vs: list[torch.Tensor]):
    """The forward, differentiable torch ops: out [B, T, D] and u [D], w, dot, rstd [S, B, T]. The Function runs it
    without autograd and saves what its backward needs; torch.compile traces it instead of the Function, whose
    written-out backward under Inductor on CUDA (torch 2.11) returned a zero gradient for a source (the GPU test in
    tests/ops/test_attn_res.py, session 61) where the CPU's Inductor (torch 2.13) agreed with the loop."""
    cd, od = _dtypes(vs)
    u = _u(query, norm_weight, cd)  # [D]
    dot, rstd = _stats(vs, u, eps, cd)  # [S, B, T]
    w = torch.softmax(dot * rstd, dim=0)  # [S, B, T] over sources
    acc = vs[0].to(cd) * w[0, ..., None]  # [B, T, D]
    for i in range(1, len(vs)):
        acc.addcmul_(vs[i], w[i, ..., None])  # acc is this function's own tensor
    return acc.to(od), u, w, dot, rstd


def attn_res_weights(sources, query: torch.Tensor, norm_weight: torch.Tensor | None = None,
                     eps: float = 1e-6) -> torch.Tensor:
    """The mix's weights over the sources, [S, B, T] (float32, or float64 for float64 sources); sum 1 over S."""
    vs = _sources(sources)
    _check(vs[0].shape[-1], query, norm_weight)
    cd = _dtypes(vs)[0]
    dot, rstd = _stats(vs, _u(query, norm_weight, cd), eps, cd)
    return torch.softmax(dot * rstd, dim=0)  # [S, B, T] over sources


def attn_res_reference(sources, query: torch.Tensor, norm_weight: torch.Tensor | None = None,
                       eps: float = 1e-6) -> torch.Tensor:
    """The same mix token by token, source by source, with an explicit max-shifted softmax (float64)."""
    vs = _sources(sources)
    _check(vs[0].shape[-1], query, norm_weight)
    v = torch.stack(vs).double()  # [S, B, T, D]
    S, B, T, D = v.shape
    q = query.double()
    g = v.new_ones(D) if norm_weight is None else norm_weight.double()
    out = v.new_empty(B, T, D)
    for b in range(B):
        for t in range(T):
            logits = []
            for i in range(S):
                vi = v[i, b, t]  # [D]
                key = vi / torch.sqrt((vi * vi).sum() / D + eps) * g
                logits.append((q * key).sum())
            m = max(logits)
            e = [torch.exp(l - m) for l in logits]
            z = sum(e)
            out[b, t] = sum(e[i] / z * v[i, b, t] for i in range(S))
    return out.to(_dtypes(vs)[1])
