"""Activation memory: pieces of a block that keep only their inputs for the backward and recompute the rest there.

    y = recompute(fn, *args, params=())      # fn(*args); under autograd only args are kept, fn is rerun in the backward
    y = linear_of(lin, fn, *args, params=())  # lin(fn(*args)), a bias-free nn.Linear: fn's output is not kept either
    xs = compute_inputs(x, n)                 # n handles on one autocast-dtype copy of x, for n Linears

`recompute` and `linear_of` run a short, cheap, elementwise stretch (a gate, the conv + feature maps, a norm, an
activation) without a graph in the forward, keep its arguments, and in the backward run it again under the forward's
autocast with a graph and take autograd's own gradients of it: the same arithmetic as the plain form, not a
hand-written derivative. `params`: the parameters fn reads itself (a norm's weight, the decay's A and bias), given so
their gradients reach them (a parameter left out would get none: tests/layers/test_recompute.py compares every
gradient with the plain form's). `linear_of` also forms the Linear's two products in the backward (its weight gradient
needs fn's output, the largest thing a SwiGLU keeps), in the dtype the forward's product ran in, as nn.Linear does.

In eager mode only. Under torch.compile, and without a gradient, fn runs as it is: Inductor's partitioner chooses
what to recompute across the whole block (a torch.utils.checkpoint region broke the block's graph, "HOP: Non-nullified
side effect", session 60). Measured per token and layer: dev/train_memory.py.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn


def _plain(args) -> bool:
    """Run as it is: no gradient wanted, or under torch.compile (see the module doc)."""
    return (not torch.is_grad_enabled() or torch.compiler.is_compiling()
            or not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args))


def _keep(ctx, fn, args, params, dev: str) -> None:
    ctx.fn, ctx.dev, ctx.params = fn, dev, params
    ctx.amp = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
    ctx.n_args = len(args)


def _rerun(ctx, args) -> tuple[list, Any]:
    """fn again on detached copies of its arguments, with a graph, under the forward's autocast: (the copies, out)."""
    with torch.enable_grad(), torch.autocast(ctx.dev, dtype=ctx.amp or torch.bfloat16, enabled=ctx.amp is not None):
        xs = [a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args]
        return xs, ctx.fn(*xs)


def _grads(ctx, xs, outs, douts) -> list:
    """Gradients of outs (given douts, None = unused) for every argument and param (None where none is wanted)."""
    pairs = [(o, g) for o, g in zip(outs, douts) if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
    inputs = [*xs, *ctx.params]
    want = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    got = iter(torch.autograd.grad([o for o, _ in pairs], want, [g for _, g in pairs], allow_unused=True)
               if want and pairs else [None] * len(want))
    return [next(got) if isinstance(t, torch.Tensor) and t.requires_grad else None for t in inputs]


_KEPT = object()  # marks a tensor argument's place among the non-tensor ones


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, n_args, dev, *rest):
        args = rest[:n_args]
        _keep(ctx, fn, args, rest[n_args:], dev)
        ctx.save_for_backward(*(a for a in args if isinstance(a, torch.Tensor)))
        ctx.others = [_KEPT if isinstance(a, torch.Tensor) else a for a in args]  # non-tensor arguments (None, ints)
        return fn(*args)

    @staticmethod
    def backward(ctx, *douts):
        kept = iter(ctx.saved_tensors)
        xs, out = _rerun(ctx, [next(kept) if a is _KEPT else a for a in ctx.others])
        outs = out if isinstance(out, tuple) else (out,)
        return (None, None, None, *_grads(ctx, xs, outs, douts))


class _LinearOf(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, n_args, weight, *rest):
        args = rest[:n_args]
        _keep(ctx, fn, args, rest[n_args:], weight.device.type)
        ctx.save_for_backward(weight, *args)
        return F.linear(fn(*args), weight)  # under the ambient autocast, as nn.Linear runs

    @staticmethod
    def backward(ctx, dy):
        weight, *args = ctx.saved_tensors
        xs, h = _rerun(ctx, args)
        ct = dy.dtype  # the product's dtype: autocast's, or the operands' own
        hc = h.detach().to(ct)
        dh = dy @ weight.to(ct)  # [..., in]
        dw = (dy.reshape(-1, dy.shape[-1]).t() @ hc.reshape(-1, hc.shape[-1])).to(weight.dtype)  # [out, in]
        return (None, None, dw if ctx.needs_input_grad[2] else None, *_grads(ctx, xs, (h,), (dh.to(h.dtype),)))


def recompute(fn: Callable, *args, params: tuple = ()):
    """fn(*args) (a tensor or a tuple of tensors and Nones), keeping only `args` for the backward (module doc)."""
    if _plain(args) and not any(p.requires_grad for p in params) or torch.compiler.is_compiling():
        return fn(*args)
    dev = next(a for a in args if isinstance(a, torch.Tensor)).device.type
    return _Recompute.apply(fn, len(args), dev, *args, *params)


def linear_of(lin: nn.Linear, fn: Callable, *args, params: tuple = ()) -> torch.Tensor:
    """lin(fn(*args)) for a Linear without bias, keeping only args and the weight for the backward (module doc)."""
    if lin.bias is not None or _plain([*args, lin.weight, *params]):
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
    if not torch.is_autocast_enabled(dev) or x.dtype != torch.float32 or torch.compiler.is_compiling():
        return (x,) * n  # compiled: the graph's casts of one x are one (common subexpressions)
    dt = torch.get_autocast_dtype(dev)
    if not torch.is_grad_enabled() or not x.requires_grad:
        return (x.to(dt),) * n
    return _CastShared.apply(x, dt, n)
