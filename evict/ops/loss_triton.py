"""One row chunk of the linear cross-entropy in Triton: log-sum-exp, loss, argmax and the logits' gradient in one kernel.

    row_loss, row_correct = ce_rows_triton(logits, targets, inv, ignore_index=-100, grad=True)

logits [c, V] (the chunk's h Wᵀ in the compute dtype: bf16 under autocast), targets [c] int64, inv [] the mean's
1 / labelled (a device tensor: no host sync). One program per row, two passes over it: the first keeps a running max
and sum of exponentials (float32, rescaled when the max grows) and the first index of the row's maximum; the second —
when `grad` — writes the gradient softmax - one-hot, scaled by `inv` (0 on ignored rows), over the logits in place,
rounded to their dtype. Returns each row's loss (lse - logit[target], 0 on ignored rows; float32) and whether its
argmax is its target (int32). The PyTorch form (evict/ops/loss.py) makes the same numbers from a float32 copy of the
chunk in about ten passes over it; this reads the 16-bit logits twice and writes them once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BV = 4096  # logits per block of a row's loop


@triton.jit
def _ce_rows_kernel(logits, targets, inv, row_loss, row_ok, stride, ignore_index, V: tl.constexpr,
                    GRAD: tl.constexpr, BV: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    base = logits + r * stride
    t = tl.load(targets + r)
    valid = t != ignore_index
    t = tl.where(valid, t, 0)
    cols = tl.arange(0, BV)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    best = tl.full([], float("-inf"), tl.float32)
    arg = tl.zeros([], tl.int64)
    for a in range(0, V, BV):
        c = a + cols
        x = tl.load(base + c, mask=c < V, other=float("-inf")).to(tl.float32)
        bm = tl.max(x, 0)
        bi = tl.min(tl.where(x == bm, c, V), 0)  # the block's first maximum
        take = bm > best  # strictly: an earlier block's equal maximum stays first
        arg = tl.where(take, bi.to(tl.int64), arg)
        best = tl.where(take, bm, best)
        m_new = tl.maximum(m, bm)
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    lse = m + tl.log(s)
    xt = tl.load(base + t).to(tl.float32)
    tl.store(row_loss + r, tl.where(valid, lse - xt, 0.0))
    tl.store(row_ok + r, (valid & (arg == t)).to(tl.int32))
    if GRAD:
        scale = tl.where(valid, tl.load(inv).to(tl.float32), 0.0)
        for a in range(0, V, BV):
            c = a + cols
            x = tl.load(base + c, mask=c < V, other=0.0).to(tl.float32)
            g = (tl.exp(x - lse) - tl.where(c == t, 1.0, 0.0)) * scale
            tl.store(base + c, g.to(logits.dtype.element_ty), mask=c < V)


def ce_rows_triton(logits: torch.Tensor, targets: torch.Tensor, inv: torch.Tensor, *, ignore_index: int = -100,
                   grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [c, V] (rows contiguous; overwritten by their gradient when `grad`), targets [c] int64, inv [] ->
    (row losses [c] float32, row argmax == target [c] int32)."""
    c, V = logits.shape
    if logits.stride(1) != 1:
        raise ValueError(f"logits: expected contiguous rows, got strides {logits.stride()}")
    row_loss = torch.empty(c, dtype=torch.float32, device=logits.device)
    row_ok = torch.empty(c, dtype=torch.int32, device=logits.device)
    if c:
        _ce_rows_kernel[(c,)](logits, targets.contiguous(), inv, row_loss, row_ok, logits.stride(0), ignore_index, V=V,
                              GRAD=grad, BV=min(BV, triton.next_power_of_2(V)), num_warps=8)
    return row_loss, row_ok
