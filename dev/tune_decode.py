"""Time the split-K decode kernel alone over launch settings (issue 13), against bytes / copy bandwidth.

    python dev/tune_decode.py      # MLA latent (H 8, r 512, rope 64) and MHA (8 heads of 128), batch 1, 128K and 1M
"""
import itertools
import statistics
import time

import sys

if {"-h", "--help"} & set(sys.argv[1:]):  # the docstring is the help; nothing below runs
    print(__doc__.strip())
    sys.exit(0)

import torch

from evict.bench.decode import copy_bandwidth
from evict.cli_args import first_line
from evict.ops.decode_triton import decode_triton


def timeit(f, n=20):
    f()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        f()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


bw = copy_bandwidth(torch.device("cuda"))
print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
dt = torch.bfloat16
for L in (131072, 1048576):
    for kind in ("mla", "mha"):
        if kind == "mla":
            q, k, q2, k2, v = (torch.randn(1, 8, 512, device="cuda", dtype=dt), torch.randn(1, L, 1, 512, device="cuda", dtype=dt),
                               torch.randn(1, 8, 64, device="cuda", dtype=dt), torch.randn(1, L, 1, 64, device="cuda", dtype=dt), None)
            nbytes = L * 576 * 2
            grid = itertools.product((16, 32, 64), (4, 8), (2, 3, 4), (128, 512), (264, 1056))
        else:
            q, k, v = torch.randn(1, 8, 128, device="cuda", dtype=dt), torch.randn(1, L, 8, 128, device="cuda", dtype=dt), torch.randn(1, L, 8, 128, device="cuda", dtype=dt)
            q2 = k2 = None
            nbytes = L * 8 * 128 * 2 * 2
            grid = itertools.product((32, 64, 128), (4, 8), (2, 3, 4), (128, 512), (264, 1056))
        floor = nbytes / bw
        res = []
        for BN, warps, stages, ms, progs in grid:
            tune = dict(BN=BN, warps=warps, stages=stages, max_splits=ms, programs=progs)
            try:
                lengths = torch.full((1,), L, device="cuda", dtype=torch.int32)
                t = timeit(lambda: decode_triton(q, k, v, lengths, scale=0.1, q2=q2, k2=k2, tune=tune))
            except Exception as e:
                print(kind, L, tune, "failed", first_line(e, 80))
                continue
            res.append((t, tune))
        res.sort(key=lambda r: r[0])
        default = timeit(lambda: decode_triton(q, k, v, torch.full((1,), L, device="cuda", dtype=torch.int32), scale=0.1, q2=q2, k2=k2))
        print(f"{kind} L={L}: floor {floor * 1e3:.3f} ms; default {default * 1e3:.3f} ms ({default / floor:.2f}x floor)")
        for t, tune in res[:5]:
            print(f"   {t * 1e3:.3f} ms ({t / floor:.2f}x floor) {tune}")
        del q, k, v, q2, k2
        torch.cuda.empty_cache()
