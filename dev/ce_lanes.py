"""A candidate for the loss's row kernel (evict/ops/loss_triton.py), checked and timed beside it (issue 74, session 70).

GPT-2 B48's profile (H100, session 70) spent 11.6 ms of a 115 ms step in `_ce_rows_kernel`: 312 µs a chunk of
1,335 × 50,304 bf16 logits, ~2.3× its bytes at the card's copy bandwidth. Its first pass does four block-wide
reductions per 4,096 logits (the block's max, the first index of it, the sum of exponentials, the running max's
rescale reads the reduced max), each a cross-warp exchange. The candidate keeps a running state per lane instead
— max m_j, sum s_j (rescaled when m_j grows), the first index of its own largest logit — and reduces across lanes
once per row at the end:

    m = max_j m_j,   s = sum_j s_j e^{m_j - m},   argmax = min{ i_j : best_j = max best }   (first maximum overall)

The second pass (the gradient, in place) is unchanged. Same arithmetic in float32, so the same numbers up to the
order of the sum.

    python3 dev/ce_lanes.py                 # CUDA: check both kernels against a float64 reference, then time them
    TRITON_INTERPRET=1 python3 dev/ce_lanes.py --check-only --tokens 37 --vocab 5001    # the check on a CPU
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from evict.ops.loss import ALIGN
from evict.ops.loss_triton import ce_rows_triton


@triton.jit
def _ce_lanes_kernel(logits, targets, inv, row_loss, row_ok, stride, ignore_index, V: tl.constexpr,
                     GRAD: tl.constexpr, BV: tl.constexpr, VP: tl.constexpr):
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
        x = tl.where(c < V, x, float("-inf"))  # padded columns (VP > V): read whole 16-byte vectors, count none
        grow = x > m  # strictly: a lane keeps its first maximum
        arg = tl.where(grow, c, arg)
        m_new = tl.maximum(m, x)
        s = s * tl.exp(tl.where(m_new == float("-inf"), 0.0, m - m_new)) + tl.where(x == float("-inf"), 0.0, tl.exp(x - m_new))
        m = m_new
    mx = tl.max(m, 0)
    total = tl.sum(s * tl.exp(tl.where(m == float("-inf"), float("-inf"), m - mx)), 0)
    first = tl.min(tl.where(m == mx, arg, V), 0)
    lse = mx + tl.log(total)
    xt = tl.load(base + t).to(tl.float32)
    tl.store(row_loss + r, tl.where(valid, lse - xt, 0.0))
    tl.store(row_ok + r, (valid & (first == t)).to(tl.int32))
    if GRAD:
        scale = tl.where(valid, tl.load(inv).to(tl.float32), 0.0)
        for a in range(0, VP, BV):
            c = a + cols
            x = tl.load(base + c, mask=c < VP, other=0.0).to(tl.float32)
            g = tl.where(c < V, (tl.exp(x - lse) - tl.where(c == t, 1.0, 0.0)) * scale, 0.0)  # padded columns: 0
            tl.store(base + c, g.to(logits.dtype.element_ty), mask=c < VP)


def ce_lanes(logits, targets, inv, *, ignore_index=-100, grad=True, bv=2048, warps=8, vocab=None):
    """`logits` [c, VP]: the first `vocab` columns (default all) are the row's logits, the rest padding (the head's
    zero rows, evict/ops/loss.py's ALIGN), read in whole vectors, counted in no sum, their gradient written 0."""
    c, VP = logits.shape
    V = vocab or VP
    row_loss = torch.empty(c, dtype=torch.float32, device=logits.device)
    row_ok = torch.empty(c, dtype=torch.int32, device=logits.device)
    if c:
        _ce_lanes_kernel[(c,)](logits, targets.contiguous(), inv, row_loss, row_ok, logits.stride(0), ignore_index, V=V,
                               GRAD=grad, BV=min(bv, triton.next_power_of_2(VP)), VP=VP, num_warps=warps)
    return row_loss, row_ok


def reference(logits, targets, inv, ignore_index=-100):
    """float64: each row's loss, argmax hit and gradient (softmax - one-hot) * inv, 0 on ignored rows."""
    x = logits.double()
    valid = targets != ignore_index
    safe = torch.where(valid, targets, torch.zeros_like(targets))
    lse = torch.logsumexp(x, -1)
    loss = torch.where(valid, lse - x.gather(1, safe[:, None])[:, 0], torch.zeros_like(lse))
    ok = valid & (x.argmax(-1) == targets)
    g = torch.softmax(x, -1)
    g[torch.arange(len(g)), safe] -= 1
    g *= (valid.double() * float(inv))[:, None]
    return loss, ok, g


def check(kernel, logits, vocab, targets, inv, name) -> dict:
    """`logits` [c, VP] padded past `vocab` as the loss pads them; the kernel's loss, hits and gradient against the
    float64 reference on the first `vocab` columns (and the padding's gradient 0 when the kernel writes it)."""
    want_loss, want_ok, want_g = reference(logits[:, :vocab], targets, inv)
    work = logits.clone()
    loss, ok = kernel(work, targets, inv)
    # |gradient| <= inv: float32 arithmetic, or one rounding to bf16 (2^-8 relative) on top
    tol = float(inv) * (1e-5 if logits.dtype == torch.float32 else 2 ** -7)
    row = {"kernel": name, "dtype": str(logits.dtype)[6:], "vocab": vocab, "padded": logits.shape[1],
           "loss max abs err": float((loss.double() - want_loss).abs().max()),
           "argmax hits equal": bool(torch.equal(ok.bool(), want_ok)),
           "grad max abs err": float((work[:, :vocab].double() - want_g).abs().max()), "grad tol": tol}
    row["padding 0"] = bool((work[:, vocab:] == 0).all())  # the head's zero rows: no gradient
    row["ok"] = (row["argmax hits equal"] and row["loss max abs err"] < 1e-4 and row["grad max abs err"] < tol
                 and row["padding 0"])
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1335, help="rows of one chunk (GPT-2 B48's default chunk: 2^26 // 50,257 = 1,335)")
    p.add_argument("--vocab", type=int, default=50257, help="logits per row (GPT-2's: 50,257; padded to 64s: 50,304)")
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    V, VP = a.vocab, -(-a.vocab // ALIGN) * ALIGN
    g = torch.Generator().manual_seed(0)
    rows = []
    kernels = [("library", lambda w, t, i: ce_rows_triton(w[:, :V], t, i)),  # as evict/ops/loss.py calls it
               ("lanes, padded", lambda w, t, i: ce_lanes(w, t, i, vocab=V)),
               ("lanes, unpadded", lambda w, t, i: ce_lanes(w[:, :V], t, i))]
    for dtype in (torch.float32, torch.bfloat16) if dev == "cuda" else (torch.float32,):
        logits = torch.zeros(a.tokens, VP, dtype=dtype)
        logits[:, :V] = (torch.randn(a.tokens, V, generator=g) * 4).to(dtype)
        ties = [i for i in (7, 9, 7 + 1024, 7 + 2048, 7 + 4096) if i < V]  # the first maximum counts: ties in
        logits[0, ties] = logits[0, :V].max() + 1  # other lanes of a block and in the same lane of later blocks
        logits = logits.to(dev)
        targets = torch.randint(0, V, (a.tokens,), generator=g).to(dev)
        targets[0], targets[1], targets[2] = 7, 9, -100
        inv = torch.tensor(1.0 / a.tokens, device=dev)
        for name, fn in kernels:
            rows.append(check(fn, logits, V, targets, inv, name))
            print(rows[-1], flush=True)
    if not a.check_only and dev == "cuda":
        from triton.testing import do_bench

        logits = torch.zeros(a.tokens, VP, device=dev, dtype=torch.bfloat16)
        logits[:, :V] = torch.randn(a.tokens, V, device=dev)
        targets = torch.randint(0, V, (a.tokens,), device=dev)
        inv = torch.tensor(1.0 / a.tokens, device=dev)
        nbytes = 3 * a.tokens * V * logits.element_size()  # two reads, one write of the row's logits
        variants = [("library", lambda w: ce_rows_triton(w[:, :V], targets, inv))]
        variants += [(f"lanes {how} BV {bv} warps {nw}", lambda w, bv=bv, nw=nw, pad=pad:
                      ce_lanes(w if pad else w[:, :V], targets, inv, bv=bv, warps=nw, vocab=V))
                     for how, pad in (("padded", True), ("unpadded", False)) for bv in (1024, 2048, 4096) for nw in (4, 8)]
        for name, fn in variants:
            work = logits.clone()
            ms = do_bench(lambda: fn(work), return_mode="median")  # in place: the logits become gradients, same bytes
            rows.append({"kernel": name, "ms": round(ms, 4), "GB/s": round(nbytes / ms / 1e6, 1)})
            print(rows[-1], flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
                       "triton": triton.__version__, "rows": rows}, f, indent=1)
    if not all(r.get("ok", True) for r in rows):
        raise SystemExit("ce_lanes: a kernel disagrees with the float64 reference (rows above)")


if __name__ == "__main__":
    main()
