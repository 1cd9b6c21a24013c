"""The memory op's forward stage by stage beside fla's, its two output forms side by side, in one run (issue 74, GPU).

For each shape and rule (KDA, Gated DeltaNet; bf16, H16 D128): the forward through `memory(impl="triton")` with the
output fused into the carry (`forward_triton(fuse_out=True)`) and without it (the output kernel), the row of the one
the default picks by shape (`fuse_out_default`) marked, fla's chunked forward when installed, and the same as CUDA
time per kernel (the stage table); forward + backward through autograd for evict's two forms, and its kernels for the
default form; for Gated DeltaNet also the backward with a scalar gate's K e^{g_C - g} formed in the kernels
(`backward.FORM_KD`, opt-in; stored by default); the first stage's parts by ablation at chunks 32 and 64 at every
shape (timing only); SDPA's causal forward at the first shape (default dispatch and FlashAttention-2 forced); with `--fla-bwd`, last,
fla's forward + backward (its first call autotunes). Each section stops when `--budget` seconds have passed since
the start, so one device call ends on time.
Usage: python dev/fwd_stages.py [--shapes 4x8192,1x32768] [--budget 150] [--no-bwd] [--fla-bwd]
"""

import argparse
import functools
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from evict.bench.ops import _fla, kernel_profile, rel_err, rule_inputs
from evict.ops import memory
from evict.ops.memory.triton import autograd as ag
from evict.ops.memory.triton import backward as bw
from evict.ops.memory.triton.autograd import auto_chunk
from evict.ops.memory.triton.forward import _sms, forward_triton, fuse_out_default, intra
from evict.report import markdown_table

FORMS = {"fused": dict(fuse_out=True), "output kernel": dict(fuse_out=False)}


def _form(kw):
    """memory()'s Triton forward with forward_triton's knobs `kw` (through the autograd op, as a model calls it)."""
    ag.forward_triton = functools.partial(forward_triton, **kw)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4x8192,1x32768")
    ap.add_argument("--budget", type=float, default=150.0, help="seconds; later sections are skipped past it")
    ap.add_argument("--no-bwd", action="store_true")
    ap.add_argument("--fla-bwd", action="store_true", help="fla's forward + backward too, after everything else")
    a = ap.parse_args()
    t_start = time.time()
    late = lambda: time.time() - t_start > a.budget  # noqa: E731
    bench = lambda fn, rep=100: do_bench(fn, warmup=10, rep=rep, return_mode="median")  # noqa: E731
    fla, _ = _fla()
    H, D = 16, 128
    rows, stages = [], {}
    shapes = [tuple(map(int, sh.split("x"))) for sh in a.shapes.split(",")]
    for rule in ("kda", "gated_deltanet"):  # KDA first at every shape: the sections past the budget are skipped
        for B, T in shapes:
            if late():
                print(f"skipped {rule} B{B} T{T}: past the budget", flush=True)
                continue
            x = rule_inputs(rule, B, T, H, D, dtype=torch.bfloat16, device="cuda")
            args = (x["q"], x["k"], x["v"], x["log_alpha"], x["beta"])
            leaves = [t.clone().requires_grad_(True) for t in args]
            do = torch.randn_like(x["v"])
            tag = f"{rule} B{B} T{T} (chunk {auto_chunk(B, H, D)})"
            fwd = lambda: memory(*args[:3], log_alpha=args[3], beta=args[4], delta=True, check=False, impl="triton")[0]  # noqa: E731

            def fb():
                o, _ = memory(*leaves[:3], log_alpha=leaves[3], beta=leaves[4], delta=True, check=False, impl="triton")
                return torch.autograd.grad(o, leaves, do)
            outs, mine = {}, []
            default = "fused" if fuse_out_default(B, H, D, D, auto_chunk(B, H, D), True, _sms(x["q"].device)) else "output kernel"
            for name, kw in FORMS.items():
                _form(kw)
                outs[name] = fwd()
                row = {"op": f"evict {name}" + (" (default)" if name == default else ""), "shape": tag,
                       "fwd ms": round(bench(fwd), 4)}
                stages[f"{tag}: evict {name}"] = kernel_profile(fwd)
                if not a.no_bwd:
                    row["fwd+bwd ms"] = round(bench(fb, rep=200), 4)
                    if name == default:
                        stages[f"{tag}: evict {name} fwd+bwd"] = kernel_profile(fb)
                rows.append(row)
                mine.append(row)
                print(row, flush=True)
            _form({})
            mine[0]["note"] = f"fused vs output kernel {rel_err(outs['fused'], outs['output kernel']):.1e}"
            if rule == "gated_deltanet" and not a.no_bwd and not late():  # session 60's opt-in backward form
                bw.FORM_KD = True
                rows.append({"op": "evict default, bwd K e^(g_C-g) formed (FORM_KD, opt-in)", "shape": tag,
                             "fwd+bwd ms": round(bench(fb, rep=200), 4)})
                bw.FORM_KD = False
                print(rows[-1], flush=True)
            if rule in fla and not late():
                f = fla[rule]
                with torch.no_grad():
                    agree = f"out vs evict fused {rel_err(f(*args)[0], outs['fused']):.1e}"
                rows.append({"op": "fla", "shape": tag, "fwd ms": round(bench(lambda: f(*args)), 4), "note": agree})
                stages[f"{tag}: fla"] = kernel_profile(lambda: f(*args))
                print(rows[-1], flush=True)
                for r in mine:
                    r["vs fla"] = f"{r['fwd ms'] / rows[-1]['fwd ms']:.2f}x"
            # the first stage's parts at every shape, at chunks 32 and 64 (the same tokens: where a chunk of 64 costs
            # twice a chunk of 32's per token, which part grows); timing only: ablations skip work, wrong results
            for C in (32, 64):
                if late():
                    break
                q, k, v, la, beta = args
                ab = {}
                for bits, what in ((0, "whole"), (1, "no Gram strips"), (2, "no diagonal inverses"),
                                   (4, "no Neumann / W / U dots")):
                    ab[what] = round(bench(lambda: intra(q, k, v, la, beta, True, store=q.dtype, kd=False, ablate=bits,
                                                         chunk=C, qg=rule == "kda")), 4)
                rows.append({"op": f"evict first stage alone, chunk {C}", "shape": tag, "note": str(ab)})
                print(rows[-1], flush=True)
            if rule == "kda" and (B, T) == shapes[0] and not late():
                qs, ks, vs = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                sdpa = lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)  # noqa: E731
                rows.append({"op": "sdpa causal fwd (default dispatch)", "shape": f"B{B} T{T}", "fwd ms": round(bench(sdpa), 4)})
                with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                    rows.append({"op": "sdpa causal fwd (FLASH_ATTENTION forced)", "shape": f"B{B} T{T}",
                                 "fwd ms": round(bench(sdpa), 4)})
                print(rows[-2:], flush=True)
    print(markdown_table(rows, ["op", "shape", "fwd ms", "vs fla", "fwd+bwd ms", "note"]))
    for key, per in stages.items():
        print(f"\n{key} (CUDA ms per call, per kernel)")
        print(markdown_table([{"kernel": n[:60], "ms": round(ms, 4)} for n, ms in per]
                             + [{"kernel": "TOTAL", "ms": round(sum(ms for _, ms in per), 4)}], ["kernel", "ms"]))
    import triton
    print(f"\n{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} "
          f"fla {getattr(__import__('fla'), '__version__', '?') if fla else 'absent'}; {time.time() - t_start:.0f} s")
    if a.fla_bwd:  # last, after the tables above are out: fla's backward autotunes on its first call at each shape
        rows = []
        for rule in ("kda", "gated_deltanet"):
            for B, T in shapes:
                if rule not in fla or late():
                    continue
                x = rule_inputs(rule, B, T, H, D, dtype=torch.bfloat16, device="cuda")
                leaves = [x[n].clone().requires_grad_(True) for n in ("q", "k", "v", "log_alpha", "beta")]
                do = torch.randn_like(x["v"])
                fb_fla = lambda: torch.autograd.grad(fla[rule](*leaves)[0], leaves, do)  # noqa: E731
                try:
                    fb_fla()
                    rows.append({"op": "fla", "shape": f"{rule} B{B} T{T}", "fwd+bwd ms": round(bench(fb_fla, rep=200), 4)})
                except Exception as e:  # fla's own guard may refuse a gated backward on some Triton / card pairs
                    rows.append({"op": "fla", "shape": f"{rule} B{B} T{T}", "note": f"fwd+bwd refused: {str(e)[:60]}"})
                print(rows[-1], flush=True)
        print(markdown_table(rows, ["op", "shape", "fwd+bwd ms", "note"]), f"\n{time.time() - t_start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
