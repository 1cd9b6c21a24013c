"""Issue 74, the training step's pieces changed in session 58, each beside the form it replaced, one run (CUDA):

- the chunked linear cross-entropy, impl="torch" (float32 copy of each chunk, ~10 passes) vs impl="triton" (one kernel
  per chunk, evict/ops/loss_triton.py), forward + backward under bf16 autocast at GPT-2 124M's head (B16 T1024,
  d 768, V 50257) and the KDA LM 226M's (B4 T4096, d 1024, V 32768): ms (do_bench median) and peak memory;
- RMSNorm written out in float32 (the old RMSNorm.forward) vs F.rms_norm (torch's fused kernel), forward + backward,
  on the residual stream [16384, 1024] float32 and the memory mixers' output [16384 · 8, 128] bf16.

    python3 dev/train_ops_bench.py [--out FILE.json]
    python3 dev/train_ops_bench.py --chunk-rows 1 2 4 8 [--tokens 49152]   # session 70's question, below

--chunk-rows M …: only the Triton loss at GPT-2's head (d 768, V 50257, --tokens rows), forward + backward under bf16
autocast, at M × the default row chunk (CHUNK_ELEMENTS // V = 1,335 rows) each: ms, peak memory and the loss and
gradients' difference from M = 1. The GPT-2 B48 profile (session 70) spent 5.8 ms of a 115 ms step in the 37 float32
dW sums one per chunk; fewer, larger chunks sum fewer times, each chunk's logits cost M × 134 MB.
"""

import argparse
import json

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from evict.ops.loss import linear_cross_entropy

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--out", default=None)
p.add_argument("--chunk-rows", type=int, nargs="+", default=None, metavar="M")
p.add_argument("--tokens", type=int, default=49152)
a = p.parse_args()
dev = "cuda"
rows = []


def timed(fn) -> tuple[float, float]:
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ms = do_bench(fn, return_mode="median")
    return ms, (torch.cuda.max_memory_allocated() - base) / 2**30


def head(N: int, D: int, V: int):
    """A head's inputs, seed 0: h [N, D] and weight [V, D] (both wanting gradients), targets [N]."""
    g = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(N, D, device=dev, generator=g).requires_grad_()
    w = (torch.randn(V, D, device=dev, generator=g) / D ** 0.5).requires_grad_()
    return h, w, torch.randint(0, V, (N,), device=dev, generator=g)


def loss_run(h, w, t, **kw) -> tuple:
    """linear_cross_entropy(**kw) forward + backward under bf16 autocast: (ms, peak GiB, loss, dh, dW)."""
    def step():
        h.grad = w.grad = None
        with torch.autocast(dev, dtype=torch.bfloat16):
            out = linear_cross_entropy(h, w, t, **kw)
        out.loss.backward()
        return out
    ms, gib = timed(step)
    out = step()
    return ms, gib, float(out.loss), h.grad.clone(), w.grad.clone()


def chunk_rows(mults: list[int], N: int, D: int = 768, V: int = 50257) -> None:
    """The Triton loss at `mults` × the default row chunk, each beside the default (M = 1)."""
    from evict.ops.loss import CHUNK_ELEMENTS

    h, w, t = head(N, D, V)
    base = max(1, CHUNK_ELEMENTS // V)
    ref = None
    for m in [1] + [m for m in mults if m != 1]:
        ms, gib, loss, dh, dw = loss_run(h, w, t, impl="triton", rows=base * m)
        ms1, _, l1, h1, w1 = ref = ref or (ms, gib, loss, dh, dw)
        rows.append({"piece": f"linear cross-entropy fwd+bwd, GPT-2 head N {N}, rows {base * m} ({-(-N // (base * m))} chunks)",
                     "ms": round(ms, 3), "vs rows x1": round(ms / ms1, 3), "peak GiB": round(gib, 2),
                     "loss diff": abs(loss - l1), "dh rel diff": float((dh - h1).norm() / h1.norm()),
                     "dW rel diff": float((dw - w1).norm() / w1.norm())})
        print(rows[-1], flush=True)


if a.chunk_rows:
    chunk_rows(a.chunk_rows, a.tokens)
for name, N, D, V in () if a.chunk_rows else (("GPT-2 124M head", 16384, 768, 50257), ("KDA LM 226M head", 16384, 1024, 32768)):
    h, w, t = head(N, D, V)
    (mt, gt, lt, ht, wt), (mk, gk, lk, hk, wk) = (loss_run(h, w, t, impl=impl) for impl in ("torch", "triton"))
    rows.append({"piece": f"linear cross-entropy fwd+bwd, {name} (N {N}, d {D}, V {V}), bf16 autocast",
                 "old ms": round(mt, 3), "new ms": round(mk, 3), "new / old": round(mk / mt, 3),
                 "old peak GiB": round(gt, 2), "new peak GiB": round(gk, 2), "loss diff": abs(lt - lk),
                 "dh rel diff": float((hk - ht).norm() / ht.norm()), "dW rel diff": float((wk - wt).norm() / wt.norm())})
    print(rows[-1], flush=True)
    del h, w, ht, wt, hk, wk


def written_out(x, w, eps=1e-6):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * w).to(x.dtype)


def fused(x, w, eps=1e-6):
    xf = x.float()
    return F.rms_norm(xf, (xf.shape[-1],), w, eps).to(x.dtype)


for name, shape, dtype in () if a.chunk_rows else (("residual stream", (16384, 1024), torch.float32),
                                                    ("mixer output", (131072, 128), torch.bfloat16)):
    x = torch.randn(*shape, device=dev, dtype=dtype).requires_grad_()
    w = torch.ones(shape[-1], device=dev).requires_grad_()
    dy = torch.randn(*shape, device=dev, dtype=dtype)
    ms = {}
    for label, fn in (("old", written_out), ("new", fused)):
        def step(fn=fn):
            x.grad = w.grad = None
            fn(x, w).backward(dy)
        ms[label] = timed(step)[0]
    rows.append({"piece": f"RMSNorm fwd+bwd, {name} {list(shape)} {str(dtype)[6:]}", "old ms": round(ms["old"], 3),
                 "new ms": round(ms["new"], 3), "new / old": round(ms["new"] / ms["old"], 3)})
    print(rows[-1], flush=True)
if a.out:
    with open(a.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
