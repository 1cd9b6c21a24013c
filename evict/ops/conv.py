"""The short causal depthwise convolution over time: y_t = sum_{s<k} w[k-1-s] x_{t-s} per channel.

    short_conv(x, w, tail=None, impl="auto") -> (y, new_tail)
    conv_step(x, w, tails, rows=None) -> y           one token [B, 1, C]; tails[rows] (a slot pool's) shifted in place

x [B, T, C]; w [C, k] (w[:, k-1] weighs the current token); tail [B, k-1, C], the k-1 inputs before x (zeros when
None); y [B, T, C] in x's dtype; new_tail = the last k-1 inputs seen (reaching into the old tail when T < k-1), what
the next call's tail is during decoding.

Forms: "torch" is a grouped conv2d over [B, C, 1, k-1+T] whose strides are channels-last (oneDNN's depthwise kernel on a
CPU, ~4x faster forward + backward than unfold + einsum and ~2x faster than conv1d: dev/LOG.md); "triton" (CUDA, or the
CPU interpreter; no tail: training's case) sums the k shifted tiles in float32, forward and backward each one pass
(conv_triton.py), where cuDNN's grouped weight gradient cost 2.25 ms per call at the lab's largest cell; with a tail
(prefill chunks and decode steps) it runs over [tail; x] and drops the first k-1 rows. "auto" takes triton where it
runs, torch otherwise (serving's packed steps give cuDNN a new shape nearly every step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .memory import triton as _tri

IMPLS = ("auto", "torch", "triton")


def kernel_runs_on(x: torch.Tensor) -> bool:
    """The Triton form takes CUDA tensors of 16- or 32-bit floats (CPU float32 under the interpreter)."""
    return x.dtype in (torch.float16, torch.bfloat16, torch.float32) and _tri.runs_on(x)


# The Triton form as two torch.library custom ops tied by register_autograd (opaque to torch.compile: no graph break),
# each with a fake form for shapes. The weight is taken as float32 [C, k]; the caller casts it (differentiably).
@torch.library.custom_op("evict::short_conv_forward", mutates_args=())
def _conv_forward_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    from .conv_triton import conv_forward_triton

    return conv_forward_triton(x, w.contiguous())


@_conv_forward_op.register_fake
def _(x, w):
    return x.new_empty(x.shape)  # contiguous, as the kernel writes it


@torch.library.custom_op("evict::short_conv_backward", mutates_args=())
def _conv_backward_op(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from .conv_triton import conv_backward_triton

    return conv_backward_triton(x, w.contiguous(), dy.contiguous())


@_conv_backward_op.register_fake
def _(x, w, dy):
    return x.new_empty(x.shape), w.new_empty(w.shape, dtype=torch.float32)


def _conv_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _conv_backward(ctx, dy):
    x, w = ctx.saved_tensors
    return _conv_backward_op(x, w, dy)


_conv_forward_op.register_autograd(_conv_backward, setup_context=_conv_setup)


def _last_inputs(x: torch.Tensor, tail: torch.Tensor | None, k: int) -> torch.Tensor:
    B, T, C = x.shape
    if T >= k - 1:
        return x[:, T - (k - 1):]
    before = x.new_zeros(B, k - 1, C) if tail is None else tail.to(x.dtype)
    return torch.cat([before, x], 1)[:, T:]


def short_conv(x: torch.Tensor, w: torch.Tensor, tail: torch.Tensor | None = None, *,
               impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """y [B, T, C] and the new tail [B, k-1, C]; see the module docstring."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if x.dim() != 3 or w.dim() != 2 or w.shape[0] != x.shape[2]:
        raise ValueError(f"x: expected [B, T, C] with w [C, k], got x {tuple(x.shape)} and w {tuple(w.shape)}")
    B, T, C = x.shape
    k = w.shape[1]
    if tail is not None and tuple(tail.shape) != (B, k - 1, C):
        raise ValueError(f"tail: expected shape {(B, k - 1, C)}, got {tuple(tail.shape)}")
    if impl == "triton" and not kernel_runs_on(x):
        raise ValueError("impl='triton': needs a CUDA (or interpreter) tensor of 16/32-bit floats")
    if impl == "triton" or (impl == "auto" and kernel_runs_on(x) and T > 0):
        if tail is not None:  # the tail prepended: outputs from row k-1 on are exactly the conv continued from it
            xt = torch.cat([tail.to(x.dtype), x], dim=1)  # [B, k-1+T, C]
            return _conv_forward_op(xt, w.float())[:, k - 1 :].contiguous(), xt[:, T:]
        xc = x if x.stride(2) == 1 else x.contiguous()
        return _conv_forward_op(xc, w.float()), _last_inputs(x, tail, k)
    if tail is None:
        tail = x.new_zeros(B, k - 1, C)
    xt = torch.cat([tail.to(x.dtype), x], dim=1)  # [B, k-1+T, C]
    wc = w.to(x.dtype)[:, None, None, :]  # [C, 1, 1, k]
    y = F.conv2d(xt.transpose(1, 2)[:, :, None, :], wc, groups=C)  # [B, C, 1, T], cross-correlation
    return y[:, :, 0].transpose(1, 2).contiguous(), xt[:, T:]


# The decode step's one Triton launch (conv_step_triton) on CUDA; False: the gather / short_conv / scatter form. On by
# default since its GPU tests passed on an H100 (session 61: equal to the forward kernel, eager and graphed).
FUSED_STEP = True


def conv_step(x: torch.Tensor, w: torch.Tensor, tails: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """One decode token: y [B, 1, C] = short_conv(x, w, tails[rows])'s output, and tails[rows] (tails [N, k-1, C], a
    slot pool's; rows [B], or None: N = B) become the new tails in place. On CUDA one Triton launch (no gather, cast
    or scatter; the same float32 sum as the forward kernel's; with FUSED_STEP); elsewhere short_conv on the gathered
    rows, copied back."""
    B, T, C = x.shape
    k = w.shape[1]
    if T != 1 or tuple(tails.shape[1:]) != (k - 1, C) or (rows is None and tails.shape[0] != B):
        raise ValueError(f"conv_step: expected x [B, 1, C] and tails [N, {k - 1}, {C}], got x {tuple(x.shape)} and "
                         f"tails {tuple(tails.shape)}")
    if FUSED_STEP and kernel_runs_on(x) and x.is_cuda and tails.is_contiguous() and k > 1:
        from .conv_triton import conv_step_triton

        return conv_step_triton(x if x.stride(2) == 1 else x.contiguous(), w.contiguous(), tails, rows)
    y, new = short_conv(x, w, tails if rows is None else tails[rows])
    if rows is None:
        tails.copy_(new)
    else:
        tails.index_copy_(0, rows, new.to(tails.dtype))
    return y
