"""Attention Residuals (Kimi): a learned softmax mix over depth sources replaces the residual sum.

    h = sum_i w_i v_i,   w = softmax_i( q . RMSNorm(v_i) )     (no 1/sqrt(d); per token, over sources only)

Legend: S sources, B batch, T time, D model width. The query q [D] belongs to one read point; the keys are the
sources themselves after an RMSNorm (weight norm_weight [D]), the values are the raw sources. Positions never mix.
"""

from __future__ import annotations

import torch


def _stack(sources) -> torch.Tensor:
    if isinstance(sources, torch.Tensor):
        if sources.dim() != 4:
            raise ValueError(f"sources: expected a stacked [S, B, T, D] or a list of [B, T, D], got {list(sources.shape)}")
        return sources
    if not isinstance(sources, (list, tuple)) or len(sources) == 0:
        raise ValueError(f"sources: expected a non-empty list of [B, T, D] tensors, got {sources!r:.60}")
    first = sources[0]
    want = list(first.shape) if isinstance(first, torch.Tensor) and first.dim() == 3 else None
    for i, v in enumerate(sources):
        if not isinstance(v, torch.Tensor) or list(v.shape) != want:
            got = list(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise ValueError(f"sources: expected every source of shape {want or '[B, T, D]'} (as source 0), source {i} is {got}")
    return torch.stack(list(sources))  # [S, B, T, D]


def _check(v: torch.Tensor, query, norm_weight) -> None:
    D = v.shape[-1]
    if not isinstance(query, torch.Tensor) or list(query.shape) != [D]:
        got = list(query.shape) if isinstance(query, torch.Tensor) else type(query).__name__
        raise ValueError(f"query: expected shape [{D}] (D), got {got}")
    if norm_weight is not None and (not isinstance(norm_weight, torch.Tensor) or list(norm_weight.shape) != [D]):
        got = list(norm_weight.shape) if isinstance(norm_weight, torch.Tensor) else type(norm_weight).__name__
        raise ValueError(f"norm_weight: expected shape [{D}] (D) or None, got {got}")


def attn_res(sources, query: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """Mix S sources per token. sources: list of S [B, T, D] or stacked [S, B, T, D]; query, norm_weight [D].

    Keys, logits and softmax in float32 (float64 stays float64); returns [B, T, D] in the sources' dtype.
    """
    v = _stack(sources)  # [S, B, T, D]
    w = attn_res_weights(v, query, norm_weight, eps)  # [S, B, T]
    return torch.einsum("sbt,sbtd->btd", w, v.to(w.dtype)).to(v.dtype)  # [B, T, D]


def attn_res_weights(sources, query: torch.Tensor, norm_weight: torch.Tensor | None = None,
                     eps: float = 1e-6) -> torch.Tensor:
    """The mix's weights over the sources, [S, B, T] (float32, or float64 for float64 sources); sum 1 over S."""
    v = _stack(sources)  # [S, B, T, D]
    _check(v, query, norm_weight)
    cd = torch.float64 if v.dtype == torch.float64 else torch.float32
    vf = v.to(cd)
    key = vf * torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + eps)  # [S, B, T, D]
    if norm_weight is not None:
        key = key * norm_weight.to(cd)
    logits = torch.einsum("sbtd,d->sbt", key, query.to(cd))  # [S, B, T]
    return torch.softmax(logits, dim=0)  # [S, B, T] over sources


def attn_res_reference(sources, query: torch.Tensor, norm_weight: torch.Tensor | None = None,
                       eps: float = 1e-6) -> torch.Tensor:
    """The same mix token by token, source by source, with an explicit max-shifted softmax (float64)."""
    v0 = _stack(sources)
    _check(v0, query, norm_weight)
    v = v0.double()  # [S, B, T, D]
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
    return out.to(v0.dtype)
