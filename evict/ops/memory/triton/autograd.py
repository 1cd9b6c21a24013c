"""The Triton forward and backward behind torch.autograd: `memory_triton(...)` is what `memory(impl="triton")` calls.

The forward keeps only its inputs; the backward recomputes the per-chunk factors and chunk start states (two of the
forward's three kernels) and runs the three backward kernels (backward.py). Chunks are 64 tokens on this path.
"""

from __future__ import annotations

import torch

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


def memory_triton(q, k, v, *, log_alpha=None, beta=None, delta=False, scale, initial_state=None, chunk_size=64):
    """o [B, T, H, V] in q's dtype and the final state [B, H, K, V] float32, differentiable.

    `chunk_size` is accepted for the common signature; the kernels always use chunks of 64 tokens."""
    return _MemoryTriton.apply(q, k, v, log_alpha, beta, initial_state, bool(delta), float(scale))
