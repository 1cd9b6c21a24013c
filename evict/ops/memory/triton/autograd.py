"""The Triton forward behind torch.autograd: `memory_triton(...)` is what `memory(impl="triton")` calls.

Backward: recompute through the PyTorch chunked form (float32, autograd) and differentiate that. Exact gradients
for q, k, v, log_alpha, beta and initial_state, but at eager-PyTorch speed; Triton backward kernels are open work
(dev/LOG.md, 2026-11-30, issue 5).
"""

from __future__ import annotations

import torch

from ..chunked import memory_chunked
from .forward import forward_triton


class _MemoryTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, log_alpha, beta, initial_state, delta, scale, chunk_size):
        o, S = forward_triton(q, k, v, log_alpha=log_alpha, beta=beta, delta=delta, scale=scale,
                              initial_state=initial_state, chunk_size=chunk_size)
        ctx.save_for_backward(q, k, v, log_alpha, beta, initial_state)
        ctx.delta, ctx.scale, ctx.chunk_size = delta, scale, chunk_size
        return o, S

    @staticmethod
    def backward(ctx, do, dS):
        saved = ctx.saved_tensors
        leaves = [None if t is None else t.detach().float().requires_grad_(ctx.needs_input_grad[i])
                  for i, t in enumerate(saved)]
        q, k, v, la, beta, s0 = leaves
        with torch.enable_grad():
            o, S = memory_chunked(q, k, v, log_alpha=la, beta=beta, delta=ctx.delta, scale=ctx.scale,
                                  initial_state=s0, chunk_size=ctx.chunk_size)
            outs, grads = [], []
            if do is not None:
                outs.append(o)
                grads.append(do.float())
            if dS is not None:
                outs.append(S)
                grads.append(dS.float())
            want = [t for t in leaves if t is not None and t.requires_grad]
            got = iter(torch.autograd.grad(outs, want, grads, allow_unused=True)) if want else iter(())
        result = []
        for t, orig in zip(leaves, saved):
            g = next(got) if t is not None and t.requires_grad else None
            result.append(None if g is None else g.to(orig.dtype))
        return (*result, None, None, None)


def memory_triton(q, k, v, *, log_alpha=None, beta=None, delta=False, scale, initial_state=None, chunk_size=64):
    """o [B, T, H, V] in q's dtype and the final state [B, H, K, V] float32, differentiable."""
    return _MemoryTriton.apply(q, k, v, log_alpha, beta, initial_state, bool(delta), float(scale), int(chunk_size))
