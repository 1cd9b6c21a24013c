"""Is the sm_90 code of the memory op's default kernels unchanged since git revision REV? (No GPU needed.)

Compiles every Triton kernel the default forward and backward launch — `_intra_kernel`, `_state_kernel`,
`_out_kernel`, `_dstate_kernel`, `_dvalue_kernel`, `_dkey_kernel` (one launch and both split launches) — for sm_90
from REV's tree and from the working tree, over gates x delta x {bf16 forward at tf32, float32 backward recompute at
tf32x3} (and packed sequences for the sequential kernels; at chunks of 64 with the state kernels' two tiles of key
rows and the bf16 output kernel's 16-bit dots, as launched since session 10; and the bf16 carry with the output fused
at chunks of 32, the default at B4 H16 since session 60), and compares the PTX with line info and labels removed.
Identical PTX means a refactor or an added opt-in branch left the GPU-tested code as it was.

    python dev/ptx_same.py REV          (e.g. HEAD, or the last commit whose kernels ran on the GPU)
"""

import argparse
import importlib
import inspect
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def _load(root):
    for name in [m for m in sys.modules if m == "evict" or m.startswith("evict.")]:
        del sys.modules[name]
    sys.path.insert(0, root)
    try:
        return (importlib.import_module("evict.ops.memory.triton.forward"),
                importlib.import_module("evict.ops.memory.triton.backward"))
    finally:
        sys.path.pop(0)


def _ptx(fn, sig, consts, warps, stages):
    try:
        return _compile(fn, sig, consts, warps, stages)
    except Exception as e:  # another signature (arguments renamed, added): different code by definition
        return f"cannot compile here: {type(e).__name__}: {e}"


def _compile(fn, sig, consts, warps, stages):
    sig = {n: t for n, t in sig.items() if n in fn.arg_names}  # an argument the old kernel lacks: not passed
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items() if t.startswith("*") or t == "i32"}
    consts = {n: v for n, v in consts.items() if n in fn.arg_names}  # a constexpr the old kernel lacks: its default
    # a constexpr not named here takes its default, as at a launch (else the compiler keeps it as a runtime value)
    consts.update({a.name: a.default for a in fn.params if a.is_constexpr and a.name not in consts
                   and a.default is not inspect.Parameter.empty})
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages})
    code = k.asm["ptx"].split(".section\t.debug")[0]  # the DWARF sections name inlined helpers: not code
    # parameter declarations dropped: arguments added after the old ones (unused without their branch) declare more
    keep = [ln for ln in code.splitlines() if not re.match(r"\s*(\.loc|\.file|//|\$L__|\.param)", ln)]
    return re.sub(r"\$L__\w+", "L", "\n".join(keep))


def kernels(fw, bw) -> dict:
    p, f = "*bf16", "*fp32"
    out = {}
    for prec, m, rec in (("tf32", p, False), ("tf32x3", f, True)):  # the bf16 forward; the backward's recompute
        for gate in (0, 1, 2):
            for delta in (True, False):
                out["intra", prec, gate, delta] = _ptx(
                    fw._intra_kernel, dict(q=p, k=p, v=p, la=p, beta=p, G=f, Ub=m, W=m, Tm=f, Am=f, Pm=m, Kd=m, Dec=f, Qg=f,
                                           T="i32", N="i32"),
                    dict(H=16, K=128, V=128, C=64, SC=16, BK=128, BV=128, SPREAD=40.0, GATE=gate, DELTA=delta,
                         HAS_BETA=True, PREC=prec, QG=rec and gate > 0, KD=gate == 2 or rec, ABLATE=0), 4, 1)
                for varlen in (False, True):
                    out["state", prec, gate, delta, varlen] = _ptx(
                        fw._state_kernel, dict(k=p, G=f, Kd=m, Dec=f, Ub=m, W=m, U=m, Hs=m, s0=f, sT=f, cu="*i32",
                                               T="i32", N="i32", q=p, Qg=f, Pm=m, o=p, scale="fp32"),
                        dict(H=16, K=128, V=128, C=64, BK=128, BV=32, GATE=gate, DELTA=delta, HAS_S0=True, PREC=prec,
                             KD=gate == 2 or rec, VARLEN=varlen, HALVES=True, OUT=False, STORE=True, QG=True), 4, 2)
                    if not rec:  # the output fused into the carry (the default where the sequence-heads fill the GPU:
                        # B4 H16 at chunks of 32, forward.fuse_out_default)
                        out["state_fused", prec, gate, delta, varlen] = _ptx(
                            fw._state_kernel, dict(k=p, G=f, Kd=m, Dec=f, Ub=m, W=m, U=m, Hs=m, s0=f, sT=f, cu="*i32",
                                                   T="i32", N="i32", q=p, Qg=m, Pm=m, o=p, scale="fp32"),
                            dict(H=16, K=128, V=128, C=32, BK=128, BV=32, GATE=gate, DELTA=delta, HAS_S0=True, PREC=prec,
                                 KD=gate == 2, VARLEN=varlen, HALVES=False, OUT=True, STORE=False, QG=gate == 2), 4, 2)
                    out["dstate", prec, gate, delta, varlen] = _ptx(
                        bw._dstate_kernel, dict(q=p, k=p, do=p, Kd=f, Dec=f, Qg=f, W=f, Pm=f, dU=f, dHs=f, dsT=f, ds0=f,
                                                cu="*i32", scale="fp32", T="i32", N="i32", G=f),
                        dict(H=16, K=128, V=128, C=64, BK=128, BV=32, GATE=gate, DELTA=delta, HAS_DST=True, PREC=prec,
                             VARLEN=varlen, HALVES=True, KD=True), 4, 1)  # KD: stored at chunks of 64 (backward._store_kd)
                for sp in (0, 1, 2):
                    out["dkey", prec, gate, delta, sp] = _ptx(
                        bw._dkey_kernel, dict(q=p, k=p, beta=p, U=f, dU=f, W=f, Tm=f, Am=f, dPm=f, dAm=f, G=f, Hs=f, dHs=f,
                                              dB=f, do=p, dq=p, dk=p, dg=f, db_out=p, XQ=f, XW=f, XC=f, scale="fp32",
                                              T="i32", N="i32"),
                        dict(H=16, K=128, V=128, C=64, SC=16, BK=64 if sp else 128, BKF=128, BV=32, SPREAD=40.0,
                             GATE=gate, DELTA=delta, HAS_BETA=True, PREC=prec, ABLATE=0, SPLIT=sp), 8, 1)
            out["out", prec, gate] = _ptx(
                fw._out_kernel, dict(q=p, G=f, U=m, Pm=m, Hs=m, o=p, scale="fp32", T="i32", N="i32"),
                dict(H=16, K=128, V=128, C=64, BK=128, BV=64, GATE=gate, PREC=prec, DOT16=not rec, KB=64), 4, 2)
        for delta in (True, False):
            out["dvalue", prec, delta] = _ptx(
                bw._dvalue_kernel, dict(v=p, beta=p, do=p, Ub=f, U=f, dU=f, Tm=f, dPm=f, dAm=f, dB=f, dv=p, scale="fp32",
                                        T="i32", N="i32"),
                dict(H=16, V=128, C=64, BV=64, DELTA=delta, HAS_BETA=True, PREC=prec), 8, 1)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as old:
        archive = subprocess.run(["git", "archive", a.rev, "evict"], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", old], input=archive, check=True)
        before = kernels(*_load(old))
    now = kernels(*_load("."))
    differ = [k for k in before if before[k] != now.get(k)]
    print(f"{len(before) - len(differ)} of {len(before)} kernel specialisations compile to the same PTX as {a.rev}")
    for k in differ:
        print("differs:", *k)
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
