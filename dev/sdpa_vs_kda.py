"""Issue 74's question: KDA's forward against SDPA's causal forward at B4 T8192 H16 D128 bf16, one run, each SDPA
backend named (the README's 'faster than flash attention at 8K' came from `evict bench ops`, which forces
SDPBackend.FLASH_ATTENTION). Prints one line per form, ms = triton.testing.do_bench median."""

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from evict.ops import memory

argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
B, T, H, D = 4, 8192, 16, 128
dev, bf = "cuda", torch.bfloat16
torch.manual_seed(0)
q, k, v = (torch.randn(B, T, H, D, device=dev, dtype=bf) for _ in range(3))
q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
la = F.logsigmoid(torch.randn(B, T, H, D, device=dev) + 4)
beta = torch.rand(B, T, H, device=dev)
with torch.no_grad():
    kda = do_bench(lambda: memory(q, k, v, log_alpha=la, beta=beta, delta=True, check=False), return_mode="median")
    print(f"KDA forward (evict, triton, no grad): {kda:.3f} ms")
    qs, ks, vs = (torch.randn(B, H, T, D, device=dev, dtype=bf) for _ in range(3))
    for name, backends in (("default dispatch", None), ("FLASH_ATTENTION", [SDPBackend.FLASH_ATTENTION]),
                           ("CUDNN_ATTENTION", [SDPBackend.CUDNN_ATTENTION]),
                           ("EFFICIENT_ATTENTION", [SDPBackend.EFFICIENT_ATTENTION])):
        fn = lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)  # noqa: E731
        try:
            if backends is None:
                ms = do_bench(fn, return_mode="median")
            else:
                with sdpa_kernel(backends):
                    ms = do_bench(fn, return_mode="median")
            print(f"SDPA causal forward, {name}: {ms:.3f} ms (KDA / it = {kda / ms:.2f})")
        except RuntimeError as e:
            print(f"SDPA causal forward, {name}: unavailable ({str(e).splitlines()[0][:80]})")
