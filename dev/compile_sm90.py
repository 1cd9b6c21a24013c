"""Compile every Triton kernel specialisation of the memory op for sm_90 (Hopper) on a machine without a GPU.

Catches compiled-mode errors before any device time is spent, and prints registers, spills and shared memory
per kernel (ptxas -v). Usage: python dev/compile_sm90.py [--dtype bf16] [--warps-key 8]
Environment knobs: CHUNK, PREC, HALVES, STAGES / DSTAGES, STATE_BV, OUT, QG, KD (0: a scalar gate's K e^{g_C - g}
formed in the state and state gradient kernels, as the backward's recompute does for 16-bit inputs at chunks <= 32).
"""

import argparse
import itertools
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from evict.ops.memory.triton import backward as bw
from evict.ops.memory.triton import forward as fw

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def compile_one(fn, sig, consts, warps, stages=1, div16=True):
    """Pointers divisible by 16 (as torch allocations are at launch); `div16`: the integers (T, N) too, as when
    T % 16 == 0 — Triton specialises each launch on this."""
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
             if t.startswith("*") or (div16 and t == "i32")}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    out = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    regs = re.findall(r"Used (\d+) registers", out.stderr)
    spill = re.findall(r"(\d+) bytes spill stores", out.stderr)
    mem = re.findall(r"\b(?:ld|st)\.global(?:\.\w+)*?\.(v[248])?\.?[bfsu]\d+", k.asm["ptx"])
    vec = sum(1 for m in mem if m) / max(1, len(mem))
    return (f"regs {regs[-1] if regs else '?'} spill {spill[-1] if spill else '?'} smem {k.metadata.shared} "
            f"global-ld/st {len(mem)} vectorised {vec:.0%}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--V", type=int, default=0, help="value dim (default: D)")
    ap.add_argument("--only", default="")
    ap.add_argument("--warps", default="", help="name=warps,... overrides, e.g. intra=8,dkey=16")
    ap.add_argument("--gates", default="2,1,0")
    ap.add_argument("--decode", action="store_true", help="the split-K decode attention kernels instead")
    ap.add_argument("--step", action="store_true", help="the memory op's decode step kernel instead (with and without pre)")
    ap.add_argument("--lowp", action="store_true", help="the forward's 16-bit intermediates (forward_triton's lowp)")
    ap.add_argument("--no-div16", action="store_true", help="integer arguments (T, N) not divisible by 16 (odd T)")
    ap.add_argument("--varlen", action="store_true", help="the sequential kernels' packed-sequence form (a chunk table)")
    a = ap.parse_args()
    dt, D, DV = a.dtype, a.D, a.V or a.D
    if a.decode:
        return decode_kernels(a.dtype)
    if a.step:
        return step_kernels(a.dtype, a.D)
    BK, BV = max(16, triton.next_power_of_2(D)), max(16, triton.next_power_of_2(DV))
    p, f = "*" + dt, "*fp32"
    m = p if a.lowp else f  # the forward's stored intermediates
    common = dict(H=16, K=D, V=DV, C=int(os.environ.get("CHUNK", 64)))  # CHUNK: forward_triton's `chunk`
    over = {kv.split('=')[0]: int(kv.split('=')[1]) for kv in a.warps.split(',') if kv}
    for gate in map(int, a.gates.split(',')):
        for delta in (True, False):
            tag = f"gate{gate} delta{int(delta)}"
            jobs = {
                "intra": (fw._intra_kernel, dict(q=p, k=p, v=p, la=p, beta=p, G=f, Ub=m, W=m, Tm=f, Am=f, Pm=m, Kd=m, Dec=f, Qg=f, T="i32", N="i32"),
                          dict(common, SC=16, BK=BK, BV=BV, SPREAD=40.0, GATE=gate, DELTA=delta, HAS_BETA=True, PREC=os.environ.get("PREC", "tf32"),
                               QG=not a.lowp or bool(int(os.environ.get("QG", 0))), KD=gate == 2 or not a.lowp, ABLATE=int(os.environ.get("ABLATE", 0)),
                               REUSE=bool(int(os.environ.get("REUSE", 0)))), int(over.get("intra", 4)), 1),
                "intrakb": (fw._intra_kb_kernel, dict(q=p, k=p, v=p, la=p, beta=p, G=f, Ub=m, W=m, Tm=f, Am=f, Pm=m, Kd=m, Dec=f, Qg=f,
                                                      T="i32", N="i32"),
                            dict(common, SC=16, BK=BK, KB=int(os.environ.get("KB", 64)), BV=BV, SPREAD=40.0, DELTA=delta,
                                 HAS_BETA=True, PREC=os.environ.get("PREC", "tf32"), QG=not a.lowp), int(over.get("intrakb", 4)), 1),
                "state": (fw._state_kernel, dict(k=p, G=f, Kd=m, Dec=f, Ub=m, W=m, U=m, Hs=m, s0=f, sT=f, cu="*i32", T="i32", N="i32",
                                                 q=p, Qg=m, Pm=m, o=p, scale="fp32"),
                          dict(common, BK=BK, BV=int(os.environ.get("STATE_BV", 32)), GATE=gate, DELTA=delta, HAS_S0=True, PREC=os.environ.get("PREC", "tf32"),
                               KD=gate == 2 or bool(int(os.environ.get("KD", int(not a.lowp)))), VARLEN=a.varlen,
                               HALVES=bool(int(os.environ.get("HALVES", 0))),
                               # OUT=1: the output fused into the carry (forward_triton's fuse_out), Hs / U not stored
                               OUT=bool(int(os.environ.get("OUT", 0))), STORE=not int(os.environ.get("OUT", 0)),
                               QG=gate == 2 and bool(int(os.environ.get("QG", 1)))), 4, int(os.environ.get("STAGES", 2))),
                "out": (fw._out_kernel, dict(q=p, G=f, U=m, Pm=m, Hs=m, o=p, scale="fp32", T="i32", N="i32"),
                        dict(common, BK=BK, BV=64, GATE=gate, PREC=os.environ.get("PREC", "tf32"), DOT16=False, KB=64), 4, 2),
                **({"out16": (fw._out_kernel, dict(q=p, G=f, U=m, Pm=m, Hs=m, o=p, scale="fp32", T="i32", N="i32"),
                              dict(common, BK=BK, BV=int(os.environ.get("OUT_BV", 64)), GATE=gate, PREC=os.environ.get("PREC", "tf32"),
                                   DOT16=True, KB=min(64, BK)), int(over.get("out16", 4)), 2)} if a.lowp else {}),
                "dstate": (bw._dstate_kernel, dict(q=p, k=p, do=p, Kd=f, Dec=f, Qg=f, W=f, Pm=f, dU=f, dHs=f, dsT=f, ds0=f, cu="*i32", scale="fp32", T="i32", N="i32", G=f),
                           dict(common, BK=BK, BV=32, GATE=gate, DELTA=delta, HAS_DST=True, PREC=os.environ.get("PREC", "tf32"), VARLEN=a.varlen,
                                HALVES=bool(int(os.environ.get("HALVES", 0))), KD=gate == 2 or bool(int(os.environ.get("KD", 1)))), 4,
                           int(os.environ.get("DSTAGES", 2))),
                "dvalue": (bw._dvalue_kernel, dict(v=p, beta=p, do=p, Ub=f, U=f, dU=f, Tm=f, dPm=f, dAm=f, dB=f, dv=p, scale="fp32", T="i32", N="i32"),
                           dict(H=16, V=DV, C=common["C"], BV=64, DELTA=delta, HAS_BETA=True, PREC=os.environ.get("PREC", "tf32")), 4, 2),
                "dkey": (bw._dkey_kernel, dict(q=p, k=p, beta=p, U=f, dU=f, W=f, Tm=f, Am=f, dPm=f, dAm=f, G=f, Hs=f, dHs=f, dB=f, do=p,
                                                dq=p, dk=p, dg=f, db_out=p, XQ=f, XW=f, XC=f, scale="fp32", T="i32", N="i32"),
                         dict(common, SC=16, BK=BK, BKF=BK, BV=32, SPREAD=40.0, GATE=gate, DELTA=delta, HAS_BETA=True, PREC=os.environ.get("PREC", "tf32"),
                              ABLATE=0, SPLIT=0), int(over.get("dkey", 8)), 1),
                # the key kernel's split form (per-channel gates' default): phases 1-2, then phase 3 per strip
                **{f"dkey{sp}": (bw._dkey_kernel, dict(q=p, k=p, beta=p, U=f, dU=f, W=f, Tm=f, Am=f, dPm=f, dAm=f, G=f, Hs=f, dHs=f,
                                                      dB=f, do=p, dq=p, dk=p, dg=f, db_out=p, XQ=f, XW=f, XC=f, scale="fp32",
                                                      T="i32", N="i32"),
                                 dict(common, SC=16, BK=min(int(os.environ.get("DKB", 64)), BK), BKF=BK, BV=int(os.environ.get("DBV", 32)), SPREAD=40.0, GATE=gate, DELTA=delta,
                                      HAS_BETA=True, PREC=os.environ.get("PREC", "tf32"), ABLATE=0, SPLIT=sp), int(over.get(f"dkey{sp}", 8)), 1)
                   for sp in (1, 2)},
            }
            for name, (fn, sig, consts, warps, stages) in jobs.items():
                if a.only and name not in a.only.split(","):
                    continue
                warps = over.get(name, warps)
                print(f"{tag:16s} {name:7s} w{warps}", compile_one(fn, sig, consts, warps, stages, not a.no_div16), flush=True)


def step_kernels(dt, D):
    """evict/ops/memory/triton/step.py at K = V = D (BV as step_triton picks it): every gate x delta, plain (inputs
    mapped before) and PRE (memory_step(pre=...): SiLU, L2, the decay gate and beta's sigmoid in the kernel), rows;
    and the short conv's decode step (evict/ops/conv_triton.py, k 4)."""
    from evict.ops.memory.triton import step as st

    p, f, i = "*" + dt, "*fp32", "i32"
    sig = dict(q=p, k=p, v=p, la=p, beta=p, s_in=f, s_out=f, o=p, rows="*i64", a_log=f, dt_bias=f, scale="fp32",
               beta_scale="fp32", sq=i, sv=i)
    BK = triton.next_power_of_2(D)
    BV = min(BK, max(16, 4096 // BK))
    for gate, delta, pre, bounded in itertools.product((0, 1, 2), (True, False), (False, True), (False, True)):
        if bounded and not (pre and gate):
            continue
        consts = dict(H=8, K=D, V=D, BK=BK, BV=BV, GATE=gate, DELTA=delta, HAS_BETA=delta, HAS_ROWS=True, PRE=pre,
                      SILU=pre, L2=pre, BOUNDED=bounded)
        tag = f"gate{gate} delta{int(delta)} pre{int(pre)}{' bounded' if bounded else ''}"
        print(f"step {tag:26s} w4", compile_one(st._step_kernel, sig, consts, 4 if BK * BV <= 4096 else 8, 1, False), flush=True)
    from evict.ops import conv_triton as ct

    csig = dict(x=p, w=p, tails=p, y=p, rows="*i64", C=i, s_xb=i)
    for rows in (True, False):
        print(f"conv step rows{int(rows)}", compile_one(ct._conv_step_kernel, csig, dict(K=4, BC=ct.BC, HAS_ROWS=rows), 4, 1,
                                                      False), flush=True)


def decode_kernels(dt):
    """evict/ops/decode_triton.py: the split kernel for attention heads of 128 (M = 1, 2, 4 per group) and MLA's
    latent (Dk = Dv = 512 read once, rope key 64, M = 8), and the merge kernel."""
    from evict.ops import decode_triton as dk

    p, f, i = "*" + dt, "*fp32", "i32"
    names = ["s_qb", "s_qh", "s_kb", "s_kl", "s_kg", "s_vb", "s_vl", "s_vg", "s_q2b", "s_q2h", "s_k2b", "s_k2l", "s_k2g", "s_tb"]
    sig = dict(q=p, k=p, v=p, q2=p, k2=p, lengths="*i32", tab="*i64", po=f, pm=f, pl=f, **{n: i for n in names}, scale="fp32",
               split_len=i, n_splits=i, page=i)
    for tag, consts, warps in (
        ("mha pag", dict(G=8, M=1, BM=16, DK=128, BDK=128, DV=128, BDV=128, D2=16, BD2=16, HAS2=False, V_IS_K=False, BN=128, PAGED=True), 8),
        ("mha M1", dict(G=8, M=1, BM=16, DK=128, BDK=128, DV=128, BDV=128, D2=16, BD2=16, HAS2=False, V_IS_K=False, BN=128, PAGED=False), 8),
        ("gqa M4", dict(G=4, M=4, BM=16, DK=128, BDK=128, DV=128, BDV=128, D2=16, BD2=16, HAS2=False, V_IS_K=False, BN=128, PAGED=False), 8),
        ("mla M8", dict(G=1, M=8, BM=16, DK=512, BDK=512, DV=512, BDV=512, D2=64, BD2=64, HAS2=True, V_IS_K=True, BN=32, PAGED=False), 4),
    ):
        print(f"split {tag:8s} w{warps}", compile_one(dk._split_kernel, sig, dict(consts, PREC=os.environ.get("PREC", "tf32")), warps, 3 if consts["BN"] == 128 else 2, True), flush=True)
    msig = dict(po=f, pm=f, pl=f, o=p, n_splits=i)
    print("merge    DV128 w4", compile_one(dk._merge_kernel, msig, dict(DV=128, BS=64, BDV=128), 4, 1, False))
    print("merge    DV512 w4", compile_one(dk._merge_kernel, msig, dict(DV=512, BS=64, BDV=512), 4, 1, False))


if __name__ == "__main__":
    main()
