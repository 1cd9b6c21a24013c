"""Issue 73: which kernel runs the prompt chunks of a packed step. One step's chunks (P chunks of T query tokens, chunk
i reading its h_i past keys + its own, causally; 8 heads of 128, bf16) through (a) SDPA once per chunk (evict.ops.
attention: flash / memory-efficient kernels) and (b) PyTorch's flex_attention once over all chunks packed (keys of all
chunks concatenated, a document + causal block mask built per step, the kernel compiled once with dynamic=False per
shape). Prints one JSON line: median ms per step of each, and the max |difference| of their outputs.
Run on CUDA: python dev/packed_attention_gpu.py"""

import argparse
import json
import statistics
import time

import torch

from evict.ops import attention


def timed(fn, n=10):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    dev, H, D = "cuda", 8, 128
    out = []
    for P, T, hist in ((2, 4096, 0), (8, 1024, 3072), (4, 1024, 0)):
        g = torch.Generator(device=dev).manual_seed(0)
        hs = [hist * (i % 2) for i in range(P)]
        qs = [torch.randn(1, T, H, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(P)]
        ks = [torch.randn(1, h + T, H, D, device=dev, dtype=torch.bfloat16, generator=g) for h in hs]
        vs = [torch.randn_like(k) for k in ks]

        def sdpa():
            return torch.cat([attention(q, k, v, causal=True, check=False) for q, k, v in zip(qs, ks, vs)], dim=1)

        qdoc = torch.cat([torch.full((T,), i, device=dev) for i in range(P)])
        qpos = torch.cat([torch.arange(h, h + T, device=dev) for h in hs])
        kdoc = torch.cat([torch.full((h + T,), i, device=dev) for i, h in enumerate(hs)])
        kpos = torch.cat([torch.arange(h + T, device=dev) for h in hs])
        qp = torch.cat(qs, 1).transpose(1, 2)  # [1, H, PT, D]
        kp, vp = torch.cat(ks, 1).transpose(1, 2), torch.cat(vs, 1).transpose(1, 2)

        def mask_mod(b, h, qi, ki):
            return (qdoc[qi] == kdoc[ki]) & (kpos[ki] <= qpos[qi])

        def flexed():
            bm = create_block_mask(mask_mod, 1, 1, qp.shape[2], kp.shape[2], device=dev)  # per step: the layout changes
            return flex(qp, kp, vp, block_mask=bm).transpose(1, 2)

        a = sdpa()
        try:
            t0 = time.perf_counter()
            b = flexed()
            compile_s = time.perf_counter() - t0
            diff, t_flex = (a - b).abs().max().item(), timed(flexed)
        except Exception as e:  # report, do not hide
            diff, t_flex, compile_s = str(e).splitlines()[0][:120], None, None
        out.append({"chunks": P, "T": T, "history": hs, "sdpa_ms": timed(sdpa), "flex_ms": t_flex,
                    "flex_first_call_s": compile_s, "max_abs_diff": diff})
    print("PACKED_ATTENTION", json.dumps(out))


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
