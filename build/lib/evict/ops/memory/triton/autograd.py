"""The Triton forward and backward behind torch.autograd: `memory_triton(...)` is what `memory(impl="triton")` calls.

The forward keeps only its inputs; the backward recomputes the per-chunk factors and chunk start states (two of the
forward's three kernels) and runs the three backward kernels (backward.py). Chunks are 64 tokens on this path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .backward import backward_triton
from .forward import forward_triton


class _MemoryTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, log_alpha, beta, initial_state, delta, scale):
        o, S = forward_triton(q, k, v, log_alpha=log_alpha, beta=beta, delta=delta, scale=scale,
                              initial_state=initial_state)
        ctx.save_for_backward(q, k, v, log_alpha, beta, initial_state)
        ctx.delta, ctx.scale = delta, scale
        return o, S

    @staticmethod
    def backward(ctx, do, dS):
        q, k, v, la, beta, s0 = ctx.saved_tensors
        dq, dk, dv, dla, dbeta, ds0 = backward_triton(q, k, v, la, beta, s0, do, dS, delta=ctx.delta, scale=ctx.scale)
        need = ctx.needs_input_grad
        grads = (dq, dk, dv, dla, dbeta, ds0)
        return (*(g if need[i] else None for i, g in enumerate(grads)), None, None)


MIN_K = 32  # key dims below this are zero-padded: the delta backward faults at K = 16 on an H200 (dev/LOG.md)


def memory_triton(q, k, v, *, log_alpha=None, beta=None, delta=False, scale, initial_state=None, chunk_size=64):
    """o [B, T, H, V] in q's dtype and the final state [B, H, K, V] float32, differentiable.

    Key dims below MIN_K run zero-padded, which is exact: a zero key channel writes nothing into its row of S, a zero
    query channel reads nothing from it, and a zero log-decay there touches only that (zero) row; the padded rows of
    the final state are dropped and the gradients of the padding never reach the inputs.
    `chunk_size` is accepted for the common signature; the kernels always use chunks of 64 tokens."""
    K = q.shape[-1]
    pad = MIN_K - K if K < MIN_K else 0
    if pad:
        q, k = F.pad(q, (0, pad)), F.pad(k, (0, pad))
        if log_alpha is not None and log_alpha.dim() == 4:
            log_alpha = F.pad(log_alpha, (0, pad))
        if initial_state is not None:
            initial_state = F.pad(initial_state, (0, 0, 0, pad))
    o, S = _MemoryTriton.apply(q, k, v, log_alpha, beta, initial_state, bool(delta), float(scale))
    return o, (S[:, :, :K] if pad else S)
