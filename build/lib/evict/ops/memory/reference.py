"""The memory op, token by token: the obviously-correct form every faster one is tested against.

Legend: B batch, T time, H heads, K key dim (Dk), V value dim (Dv). State S is [B, H, K, V]; a read is o = q S.
"""

from __future__ import annotations

import torch


def rule(q, k, v, S, log_alpha, beta, delta: bool, scale: float):
    """One step of the update rule on [B, H, D] tensors and a state S [B, H, K, V] (all in the state dtype).

    1. decay  S' = Diag(alpha) S           2. erase  u = beta (v - k S')  (or beta v without delta)
    3. write  S  = S' + k^T u              4. read   o = scale q S
    """
    if log_alpha is not None:
        alpha = log_alpha.exp()  # [B, H] scalar gate or [B, H, K] per channel
        S = S * (alpha[..., None, None] if alpha.dim() == 2 else alpha[..., :, None])
    u = v - torch.einsum("bhk,bhkv->bhv", k, S) if delta else v
    if beta is not None:
        u = beta[..., None] * u
    S = S + k[..., :, None] * u[..., None, :]
    o = scale * torch.einsum("bhk,bhkv->bhv", q, S)
    return o, S


def memory_reference(q, k, v, *, log_alpha=None, beta=None, delta=False, scale, initial_state=None):
    """Loop `rule` over time. q, k [B, T, H, K]; v [B, T, H, V]; returns o [B, T, H, V] (state dtype) and S."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    sd = torch.float64 if q.dtype == torch.float64 else torch.float32
    S = q.new_zeros(B, H, K, V, dtype=sd) if initial_state is None else initial_state.to(sd)
    outs = []
    for t in range(T):
        la = None if log_alpha is None else log_alpha[:, t].to(sd)
        b = None if beta is None else beta[:, t].to(sd)
        o, S = rule(q[:, t].to(sd), k[:, t].to(sd), v[:, t].to(sd), S, la, b, delta, scale)
        outs.append(o)
    o = torch.stack(outs, dim=1) if outs else q.new_zeros(B, 0, H, V, dtype=sd)
    return o, S
