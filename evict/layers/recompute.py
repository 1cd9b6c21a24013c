"""Activation memory: pieces of a block that keep only their inputs for the backward and recompute the rest there.

    y = recompute(fn, *args)   # fn(*args); under autograd only args are kept, fn's own saved tensors are recomputed
    y = linear_of(lin, fn, *args)  # lin(fn(*args)) for a bias-free nn.Linear: fn's output is not kept either
    xs = compute_inputs(x, n)  # n handles on one autocast-dtype copy of x, for n Linears that would each cast it

`recompute` is `torch.utils.checkpoint` (non-reentrant, no RNG stash: the pieces draw no random numbers) on a short,
cheap, elementwise stretch (a gate, a norm, an activation), in eager mode. Under torch.compile fn runs as it is:
Dynamo's checkpoint region broke the block's graph ("HOP: Non-nullified side effect", session 60), and Inductor's
partitioner already chooses what to recompute across the whole block. The gradients are autograd's own of fn,
recomputed: the same arithmetic, not a hand-written backward.
`linear_of` is a Linear whose input is recomputed: its weight gradient needs that input (the largest thing a SwiGLU
keeps), so the backward recomputes fn(*args) (elementwise) and forms both of the Linear's products itself, in the
dtype the forward's product ran in (autocast's), as nn.Linear's backward does.
Without a gradient (inference, no_grad) fn runs as it is. Measured per token and layer: dev/train_memory.py.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def recompute(fn: Callable, *args):
    """fn(*args), keeping only `args` for the backward (see the module doc)."""
    if _plain(args):
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)


def _plain(args) -> bool:
    """Run as it is: no gradient wanted, or under torch.compile (see the module doc)."""
    return (not torch.is_grad_enabled() or torch.compiler.is_compiling()
            or not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args))


class _LinearOf(torch.autograd.Function):
    """y = fn(*args) Wᵀ keeping args and W only; the backward recomputes h = fn(*args) under the forward's autocast.
    `params`: parameters fn reads itself (a norm's weight), given as inputs so their gradients reach them."""

    @staticmethod
    def forward(ctx, fn, n_args, weight, *rest):
        args = rest[:n_args]
        dev = weight.device.type
        ctx.fn, ctx.dev, ctx.params = fn, dev, rest[n_args:]
        ctx.amp = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        ctx.save_for_backward(weight, *args)
        return F.linear(fn(*args), weight)  # under the ambient autocast, as nn.Linear runs

    @staticmethod
    def backward(ctx, dy):
        weight, *args = ctx.saved_tensors
        with torch.enable_grad(), torch.autocast(ctx.dev, dtype=ctx.amp or torch.bfloat16, enabled=ctx.amp is not None):
            xs = [a.detach().requires_grad_(a.requires_grad) for a in args]
            h = ctx.fn(*xs)
        ct = dy.dtype  # the product's dtype: autocast's, or the operands' own
        hc = h.detach().to(ct)
        dh = dy @ weight.to(ct)  # [..., in]
        dw = (dy.reshape(-1, dy.shape[-1]).t() @ hc.reshape(-1, hc.shape[-1])).to(weight.dtype)  # [out, in]
        want = [x for x in xs if x.requires_grad] + [p for p in ctx.params if p.requires_grad]
        got = iter(torch.autograd.grad(h, want, dh.to(h.dtype), allow_unused=True) if want else ())
        return (None, None, dw if ctx.needs_input_grad[2] else None,
                *(next(got) if x.requires_grad else None for x in [*xs, *ctx.params]))


def linear_of(lin: nn.Linear, fn: Callable, *args, params: tuple = ()) -> torch.Tensor:
    """lin(fn(*args)) for a Linear without bias, keeping only args and the weight for the backward (module doc);
    `params`: the parameters fn reads itself, whose gradients the backward then gives too."""
    if lin.bias is not None or _plain(args):
        return lin(fn(*args))
    return _LinearOf.apply(fn, len(args), lin.weight, *args, *params)


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
