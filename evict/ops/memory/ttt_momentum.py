"""The TTT frame's momentum in chunks (derivation in README.md, "Where a chunked form exists"): the update is linear in
the pair (S, M), so a chunk's tokens couple through one unit lower-triangular system, as the op's WY form, with every
Gram matrix weighted by token-pair coefficients built from the products of the gates a and momenta μ.

Legend: B batch, H heads, C chunk length (the last chunk may be shorter: no padding, since a padded token would add
M to S), K key dim, V value dim. Per chunk from (S₀, M₀), with P^x[t, j] = Π_{j<s≤t} x_s and P^x₀[t] = Π_{s≤t} x_s:

    c = P^a P^μ (lower),  D = P^a P^μ₀,  E = D − P^μ₀,  Cₑ = strictly lower (c − P^μ)
    U  = (I + diag(β) (Cₑ ⊙ K Kᵀ))^{-1} diag(β) (V − P^a₀ ⊙ K S₀ − E ⊙ K M₀)
    O  = scale (P^a₀ ⊙ Q S₀ + D ⊙ Q M₀ + (c ⊙ Q Kᵀ) U)
    S ← P^a₀[C] S₀ + D[C] M₀ + (c[C] ⊙ K)ᵀ U,    M ← P^μ₀[C] M₀ + (P^μ[C] ⊙ K)ᵀ U

The products are cumulative products, not exponentials of sums: μ = 0 (and a hard reset, a = 0) stay exact zeros.
Scalar gates only (a per-channel gate makes c a C × C × K tensor; not implemented).
"""

from __future__ import annotations

import torch


def _products(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., C] -> (P [..., C, C] with P[t, j] = Π_{j<s≤t} x_s for j ≤ t and 0 above, P₀ [..., C] = Π_{s≤t} x_s)."""
    C = x.shape[-1]
    tri = torch.ones(C, C, dtype=torch.bool, device=x.device).tril()  # [t, s]: s <= t
    Y = torch.where(tri, x[..., None, :], torch.ones_like(x[..., None, :]))  # [..., C, C]
    Z = Y.flip(-1).cumprod(-1).flip(-1)  # Z[t, s] = Π_{s ≤ s' ≤ t} x_s'
    P = torch.cat([Z[..., 1:], torch.ones_like(Z[..., :1])], dim=-1)  # P[t, j] = Z[t, j + 1]
    return P.masked_fill(~tri, 0.0), Z[..., 0]


def momentum_chunked(q, k, v, *, log_alpha, beta, momentum, scale: float, S, M, chunk_size: int):
    """q, k [B, T, H, K]; v [B, T, H, V]; log_alpha None or [B, T, H]; beta (the step, β or β_m), momentum
    [B, T, H]; S, M [B, H, K, V]; all in the state dtype. Returns o [B, T, H, V] and the final (S, M)."""
    T = q.shape[1]
    heads = lambda x: x.transpose(1, 2)  # noqa: E731  [B, C, H, ...] -> [B, H, C, ...]
    outs = []
    for start in range(0, T, chunk_size):
        cut = slice(start, min(T, start + chunk_size))
        qc, kc, vc = heads(q[:, cut]), heads(k[:, cut]), heads(v[:, cut])  # [B, H, C, K|V]
        mu = heads(momentum[:, cut])  # [B, H, C]
        b = torch.ones_like(mu) if beta is None else heads(beta[:, cut])
        a = torch.ones_like(mu) if log_alpha is None else heads(log_alpha[:, cut]).exp()
        Pa, a0 = _products(a)
        Pm, m0 = _products(mu)
        c = Pa @ Pm  # [B, H, C, C] lower, 1 on the diagonal
        D = (Pa @ m0[..., None])[..., 0]  # [B, H, C]
        A = b[..., None] * ((c - Pm).tril(-1) * (kc @ kc.transpose(-1, -2)))  # strictly lower
        rhs = b[..., None] * (vc - a0[..., None] * (kc @ S) - (D - m0)[..., None] * (kc @ M))
        U = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)  # [B, H, C, V]
        outs.append(scale * (a0[..., None] * (qc @ S) + D[..., None] * (qc @ M)
                             + ((qc @ kc.transpose(-1, -2)) * c) @ U))
        S, M = (a0[..., -1, None, None] * S + D[..., -1, None, None] * M
                + (kc * c[..., -1, :, None]).transpose(-1, -2) @ U,
                m0[..., -1, None, None] * M + (kc * Pm[..., -1, :, None]).transpose(-1, -2) @ U)
    o = torch.cat(outs, dim=2).transpose(1, 2) if outs else q.new_zeros(*q.shape[:-1], v.shape[-1])
    return o, S, M
