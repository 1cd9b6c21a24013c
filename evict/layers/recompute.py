"""Activation memory: pieces of a block that keep only their inputs for the backward and recompute the rest there.

    y = recompute(fn, *args)   # fn(*args); under autograd only args are kept, fn's own saved tensors are recomputed
    xs = compute_inputs(x, n)  # n handles on one autocast-dtype copy of x, for n Linears that would each cast it

`recompute` is `torch.utils.checkpoint` (non-reentrant, no RNG stash: the pieces draw no random numbers) on a short,
cheap, elementwise stretch (a gate, a norm, an activation), in eager mode. Under torch.compile fn runs as it is:
Dynamo's checkpoint region broke the block's graph ("HOP: Non-nullified side effect", session 60), and Inductor's
partitioner already chooses what to recompute across the whole block. The gradients are autograd's own of fn,
recomputed: the same arithmetic, not a hand-written backward.
Without a gradient (inference, no_grad) fn runs as it is. Measured per token and layer: dev/train_memory.py.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint


def recompute(fn: Callable, *args):
    """fn(*args), keeping only `args` for the backward (see the module doc)."""
    if (not torch.is_grad_enabled() or torch.compiler.is_compiling()
            or not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)):
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)


class _CastShared(torch.autograd.Function):
    """x cast to `dtype` once, handed out as n views of the one copy; the backward sums the n gradients in x's dtype
    (as n separate autocast casts would), not in the 16-bit dtype."""

    @staticmethod
    def forward(ctx, x, dtype, n):
        ctx.dtype = x.dtype
        y = x.to(dtype)
        return tuple(y.view_as(y) for _ in range(n))

    @staticmethod
    def backward(ctx, *grads):
        total = None
        for g in grads:
            if g is not None:
                total = g.to(ctx.dtype) if total is None else total + g.to(ctx.dtype)
        return total, None, None


def compute_inputs(x: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """n handles on x cast once to autocast's dtype when autocast is on for its device and x is float32 (else x, n
    times), for n Linears that read x.

    Each autocast Linear casts its input and keeps that cast for its weight gradient: four Linears reading one float32
    x keep four bf16 copies of it; here they keep one (the same values: autocast casts the same way). Their input
    gradients are summed in x's dtype, as the n casts' would be."""
    dev = x.device.type
    if not torch.is_autocast_enabled(dev) or x.dtype != torch.float32:
        return (x,) * n
    dt = torch.get_autocast_dtype(dev)
    if not torch.is_grad_enabled() or not x.requires_grad:
        return (x.to(dt),) * n
    return _CastShared.apply(x, dt, n)
