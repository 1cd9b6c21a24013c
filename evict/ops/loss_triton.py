"""One row chunk of the linear cross-entropy in Triton: log-sum-exp, loss, argmax and the logits' gradient in one kernel.

    row_loss, row_correct = ce_rows_triton(logits, targets, inv, vocab=None, ignore_index=-100, grad=True)

logits [c, VP] (the chunk's h Wᵀ in the compute dtype: bf16 under autocast): each row's first `vocab` columns (default
all VP) are its logits, the rest padding (evict/ops/loss.py pads the head to a multiple of 64 rows, so the row's loads
are whole 16-byte vectors: with an unaligned V the compiler issues none); targets [c] int64, inv [] the mean's
1 / labelled (a device tensor: no host sync). One program per row, two passes over it. The first keeps, per lane of
the block, a running max m_j, a sum s_j of e^(x - m_j) (rescaled when m_j grows) and the first index of its own
maximum, in float32, and reduces across lanes once at the row's end:

    m = max_j m_j,   lse = m + log sum_j s_j e^(m_j - m),   argmax = min{ i_j : m_j = m }   (the row's first maximum)

The second — when `grad` — writes the gradient softmax - one-hot, scaled by `inv` (0 on ignored rows, 0 on padding),
over the logits in place, rounded to their dtype. Returns each row's loss (lse - logit[target], 0 on ignored rows;
float32) and whether its argmax is its target (int32). The PyTorch form (evict/ops/loss.py) makes the same numbers
from a float32 copy of the chunk in about ten passes over it; this reads the 16-bit logits twice and writes them once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BV = 2048  # logits per block of a row's loop: one per lane


@triton.jit
def _ce_rows_kernel(logits, targets, inv, row_loss, row_ok, stride, ignore_index, V: tl.constexpr, VP: tl.constexpr,
                    GRAD: tl.constexpr, BV: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    base = logits + r * stride
    t = tl.load(targets + r)
    valid = t != ignore_index
    t = tl.where(valid, t, 0)
    cols = tl.arange(0, BV)
    m = tl.full([BV], float("-inf"), tl.float32)  # per lane: running max, sum of e^(x - m), first index of its max
    s = tl.zeros([BV], tl.float32)
    arg = tl.zeros([BV], tl.int32)
    for a in range(0, VP, BV):
        c = a + cols
        x = tl.load(base + c, mask=c < VP, other=float("-inf")).to(tl.float32)
        x = tl.where(c < V, x, float("-inf"))  # padding: read in whole vectors, counted in nothing
        arg = tl.where(x > m, c, arg)  # strictly: a lane keeps its first maximum
        m_new = tl.maximum(m, x)
        s = s * tl.exp(tl.where(m_new == float("-inf"), 0.0, m - m_new)) + tl.where(x == float("-inf"), 0.0, tl.exp(x - m_new))
        m = m_new
    mx = tl.max(m, 0)
    lse = mx + tl.log(tl.sum(s * tl.exp(tl.where(m == float("-inf"), float("-inf"), m - mx)), 0))
    first = tl.min(tl.where(m == mx, arg, V), 0)
    xt = tl.load(base + t).to(tl.float32)
    tl.store(row_loss + r, tl.where(valid, lse - xt, 0.0))
    tl.store(row_ok + r, (valid & (first == t)).to(tl.int32))
    if GRAD:
        scale = tl.where(valid, tl.load(inv).to(tl.float32), 0.0)
        for a in range(0, VP, BV):
            c = a + cols
            x = tl.load(base + c, mask=c < VP, other=0.0).to(tl.float32)
            g = tl.where(c < V, (tl.exp(x - lse) - tl.where(c == t, 1.0, 0.0)) * scale, 0.0)
            tl.store(base + c, g.to(logits.dtype.element_ty), mask=c < VP)


def ce_rows_triton(logits: torch.Tensor, targets: torch.Tensor, inv: torch.Tensor, *, vocab: int | None = None,
                   ignore_index: int = -100, grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [c, VP] (rows contiguous; overwritten by their gradient when `grad`, padding by 0), the first `vocab`
    (default VP) columns the logits, targets [c] int64, inv [] -> (row losses [c] float32, row argmax == target [c]
    int32)."""
    c, VP = logits.shape
    V = VP if vocab is None else vocab
    if logits.stride(1) != 1:
        raise ValueError(f"logits: expected contiguous rows, got strides {logits.stride()}")
    if not 0 < V <= VP:
        raise ValueError(f"vocab: expected 1..{VP} (the logits' columns), got {V}")
    row_loss = torch.empty(c, dtype=torch.float32, device=logits.device)
    row_ok = torch.empty(c, dtype=torch.int32, device=logits.device)
    if c:
        _ce_rows_kernel[(c,)](logits, targets.contiguous(), inv, row_loss, row_ok, logits.stride(0), ignore_index, V=V,
                              VP=VP, GRAD=grad, BV=min(BV, triton.next_power_of_2(VP)), num_warps=8)
    return row_loss, row_ok
