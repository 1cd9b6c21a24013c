"""Chunked linear cross-entropy: the LM head and its loss in row chunks, never B·T × vocab float32 logits at once.

    out = linear_cross_entropy(h, weight, targets)      # h [N, D], weight [V, D], targets [N] int64
    out.loss      mean over labelled rows (targets != ignore_index) of logsumexp(h Wᵀ) - (h Wᵀ)[target]
    out.correct   labelled rows whose argmax is the target (int64, no gradient)
    out.labelled  how many rows are labelled (int64, no gradient)

The forward walks `rows` rows at a time: logits of one chunk [rows, V] in the compute dtype, their float32 copy for the
log-sum-exp, and — when a gradient is wanted — the gradient of that chunk right away (softmax - one-hot, scaled by
1 / labelled): dh for those rows and its share of dW, summed in float32. The backward then only scales the two saved
gradients by the incoming scalar. So the head's matmuls run once forward and twice for the gradients, as with an
nn.Linear, and the largest temporary is one chunk's logits instead of the whole batch's.

Autocast aware: under autocast the products run in its dtype (bf16 on CUDA), as nn.Linear's would, and everything
after them (log-sum-exp, softmax, the dW sum) in float32; dh comes back in h's dtype, dW in the weight's.
With no labelled row the loss is 0 (its gradient 0), where F.cross_entropy gives NaN.

impl: "torch" is the form above; "triton" (CUDA, or the CPU interpreter; 16/32-bit compute dtypes) does each chunk's
log-sum-exp, loss, argmax and gradient in one kernel over the chunk's logits, in place (loss_triton.py: the same
float32 arithmetic, no float32 copy of the chunk); "auto" (default) takes it where it runs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .memory import triton as _tri

IMPLS = ("auto", "torch", "triton")
# The Triton form pads the vocabulary to a multiple of this with zero weight rows, so the head's bf16 products have an
# aligned leading dimension: at GPT-2's V 50257 the whole chunked loss ran at about a quarter of the aligned KDA head's
# FLOP rate (dev/train_ops_bench.py, H100, 2026-12-06); with it (and the row kernel's
# 16-byte loads over the padded row) GPT-2 B48 compiled reached 40.3 % MFU (BENCHMARKS.md, session 72).
ALIGN = 64
_ADDMM_DTYPE = hasattr(torch.ops.aten.addmm, "dtype_out")  # addmm(..., out_dtype=) exists (torch >= 2.8)
# Logits per chunk by default (rows = this // V; 1 GiB of float32 at most). GPT-2 124M compiled, B48 x T1024, H100,
# 2026-12-07 (session 72): 2^26 -> 38.9 % MFU at 11.69 GiB, 2^27 -> 39.8 % at 11.92, 2^28 -> 40.3-40.4 % at 12.42,
# 2^29 -> 40.7 % at 13.43: fewer, longer products and row launches, for 0.7 GiB more at the peak.
CHUNK_ELEMENTS = 1 << 28


class LossOut(NamedTuple):
    loss: torch.Tensor  # [] float32 (float64 for float64 inputs), differentiable
    correct: torch.Tensor  # [] int64
    labelled: torch.Tensor  # [] int64


def _compute_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    dev = h.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return torch.promote_types(h.dtype, weight.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, ignore_index: int, rows: int, dtype: torch.dtype, grad_h: bool, grad_w: bool,
                fused: bool):
        N, D = h.shape
        w = weight.to(dtype)  # [V, D]
        valid = targets != ignore_index  # [N]
        labelled = valid.sum()
        acc = torch.float64 if dtype == torch.float64 else torch.float32  # what the softmax and the sums run in
        inv = 1.0 / labelled.clamp_min(1).to(acc)
        loss = torch.zeros((), dtype=acc, device=h.device)
        correct = torch.zeros((), dtype=torch.int64, device=h.device)
        dh = torch.empty_like(h) if grad_h else None  # [N, D]
        dw = torch.zeros(weight.shape, dtype=acc, device=h.device) if grad_w else None  # [V, D]
        V = weight.shape[0]
        if fused and V % ALIGN:  # zero rows up to a multiple of ALIGN: their logits are 0 and never read, their
            w = torch.cat([w, w.new_zeros(-V % ALIGN, D)])  # gradient columns stay 0; the products' rows align
        for a in range(0, N, rows):
            hc = h[a:a + rows].to(dtype)  # [c, D]
            tc, vc = targets[a:a + rows], valid[a:a + rows]
            want = dh is not None or dw is not None
            if fused:  # one kernel: the chunk's losses, argmax hits and (in place) its gradient in the compute dtype
                from .loss_triton import ce_rows_triton

                g16 = hc @ w.t()  # [c, V (padded)]
                row_loss, row_ok = ce_rows_triton(g16, tc, inv, vocab=V, ignore_index=ignore_index, grad=want)
                loss += row_loss.sum()
                correct += row_ok.sum()
            else:
                chunk_loss, chunk_correct, g16 = _chunk_torch(hc, w, tc, vc, inv, acc, dtype, want)
                loss += chunk_loss
                correct += chunk_correct
            if dh is not None:
                dh[a:a + rows] = g16 @ w
            if dw is not None:
                _add_product(dw, g16[:, :V].t(), hc)
        ctx.save_for_backward(dh, dw)
        ctx.h_dtype, ctx.w_dtype = h.dtype, weight.dtype
        ctx.mark_non_differentiable(correct, labelled)
        return loss * inv, correct, labelled

    @staticmethod
    def backward(ctx, dloss, _dcorrect, _dlabelled):
        dh, dw = ctx.saved_tensors
        gh = None if dh is None else (dh * dloss).to(ctx.h_dtype)
        gw = None if dw is None else (dw * dloss).to(ctx.w_dtype)
        return gh, gw, None, None, None, None, None, None, None


def _add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, in place. With 16-bit a, b and a float32 acc on CUDA, one product that sums into acc in float32
    (`addmm`'s out_dtype, torch >= 2.8; session 70's GPT-2 B48 profile spent 5.8 ms of a 115 ms step adding each
    chunk's bf16 dW into the float32 sum); elsewhere the product in a, b's dtype, then the sum."""
    if a.is_cuda and a.dtype != acc.dtype and _ADDMM_DTYPE:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.add_(a @ b)


def _chunk_torch(hc, w, tc, vc, inv, acc, dtype, grad: bool):
    """The PyTorch form of one chunk: (the sum of its rows' losses, its argmax hits, its gradient softmax - one-hot
    scaled by inv, 0 on ignored rows, in the compute dtype — or the logits when not `grad`: unused then)."""
    safe = torch.where(vc, tc, torch.zeros_like(tc))[:, None]  # [c, 1]: ignored rows point at class 0
    logits = (hc @ w.t()).to(acc)  # [c, V] float32 (float64 for float64)
    lse = torch.logsumexp(logits, dim=-1)  # [c]
    loss = ((lse - logits.gather(1, safe)[:, 0]) * vc).sum()
    correct = ((logits.argmax(-1) == tc) & vc).sum()
    if not grad:
        return loss, correct, logits
    g = logits.sub_(lse[:, None]).exp_()  # softmax, in place
    g.scatter_add_(1, safe, -vc[:, None].to(g.dtype))  # - one-hot on labelled rows
    g.mul_((vc.to(g.dtype) * inv)[:, None])  # ignored rows 0; the mean's 1 / labelled
    return loss, correct, g.to(dtype)


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100,
                         rows: int | None = None, impl: str = "auto") -> LossOut:
    """Mean cross-entropy of the logits h Wᵀ against `targets`, computed `rows` rows at a time (see the module doc).

    h [N, D] float; weight [V, D] (an nn.Linear's, no bias); targets [N] int64, each in [0, V) or ignore_index;
    rows: a positive int, default CHUNK_ELEMENTS // V (at least 1); impl: one of IMPLS.
    Returns LossOut(loss, correct, labelled)."""
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")
    if not (isinstance(h, torch.Tensor) and h.dim() == 2 and h.is_floating_point()):
        got = f"{tuple(h.shape)} {h.dtype}" if isinstance(h, torch.Tensor) else type(h).__name__
        raise ValueError(f"h: expected a floating tensor [N, D], got {got}")
    if not (isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[1] == h.shape[1]
            and weight.is_floating_point() and weight.device == h.device):
        got = f"{tuple(weight.shape)} {weight.dtype} on {weight.device}" if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight: expected a floating tensor [V, D={h.shape[1]}] on {h.device}, got {got}")
    if not (isinstance(targets, torch.Tensor) and targets.shape == h.shape[:1] and targets.dtype == torch.int64
            and targets.device == h.device):
        got = f"{tuple(targets.shape)} {targets.dtype} on {targets.device}" if isinstance(targets, torch.Tensor) else type(targets).__name__
        raise ValueError(f"targets: expected an int64 tensor [N={h.shape[0]}] on {h.device}, got {got}")
    if rows is None:
        rows = max(1, CHUNK_ELEMENTS // weight.shape[0])
    elif type(rows) is not int or rows < 1:
        raise ValueError(f"rows: expected a positive integer or None, got {rows!r}")
    dtype = _compute_dtype(h, weight)
    runs = dtype in (torch.float16, torch.bfloat16, torch.float32) and _tri.runs_on(h)
    if impl == "triton" and not runs:
        raise ValueError(f"impl='triton': needs CUDA (or interpreter) tensors and a 16/32-bit compute dtype, got "
                         f"{h.device.type} {dtype}")
    grad = torch.is_grad_enabled()
    out = _LinearCrossEntropy.apply(h, weight, targets, int(ignore_index), rows, dtype,
                                    grad and h.requires_grad, grad and weight.requires_grad, impl != "torch" and runs)
    return LossOut(*out)
