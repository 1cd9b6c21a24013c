"""Per-kernel CUDA time of evict's Triton forward and backward across knob variants (H200 tuning aid).

Each variant sets every knob at once; each kernel's time depends only on its own knobs, so the best value of each
knob is read off its kernel's row. Usage (GPU): python dev/triton_tune.py [--shapes 4x8192,1x32768]
"""

import argparse

import torch

from evict.bench.ops import kernel_profile, rule_inputs
from evict.ops.memory.triton.backward import backward_triton
from evict.ops.memory.triton.forward import forward_triton
from evict.report import markdown_table

VARIANTS = {  # name -> (forward knobs, backward knobs); a* = ablations (timing only: stages skipped)
    "v0": (dict(), dict()),
    "t32": (dict(), dict(precision="tf32")),
    "a1": (dict(), dict(precision="tf32", ablate=(1, 1))),
    "a2": (dict(), dict(precision="tf32", ablate=(2, 2))),
    "a4": (dict(), dict(precision="tf32", ablate=(4, 0))),
    "a7": (dict(), dict(precision="tf32", ablate=(7, 3))),
    # session 5: the forward's 16-bit intermediates (lowp, the default) against float32 ones, launch shapes, and the
    # backward's tl.dot precision per kernel (recompute, dstate, dvalue, dkey)
    "f32": (dict(lowp=False), dict()),
    "iw8": (dict(warps=(8, 4, 4)), dict()),
    "bv64": (dict(block_v=64), dict()),
    "sw8": (dict(warps=(4, 8, 4)), dict()),
    "sw8bv64": (dict(warps=(4, 8, 4), block_v=64), dict()),
    "ow8": (dict(warps=(4, 4, 8), out_block_v=128), dict()),
    "pk3": (dict(), dict(precision=("tf32", "tf32", "tf32", "tf32x3"))),
    "pr3": (dict(), dict(precision=("tf32x3", "tf32", "tf32", "tf32x3"))),
    # the key kernel in one launch or two (session 6: two is the default for per-channel gates, one for scalar ones)
    "dk1": (dict(), dict(split=False)),
    "dk2": (dict(), dict(split=True)),
    # session 6, not yet run: the output kernel's products as 16-bit dots, key columns 64 at a time (184 -> 128
    # registers, 48 -> 16 KB shared memory on the sm_90 compile, per-channel gates)
    "o16": (dict(out_dot16=True), dict()),
    "o16bv128": (dict(out_dot16=True, out_block_v=128), dict()),
    "o16w8": (dict(out_dot16=True, out_block_v=128, warps=(4, 4, 8)), dict()),
    # session 6, not yet run: the first stage KB key columns at a time (per-channel gates; sm_90 spills at K 128:
    # forward 424 -> 56 B (KB 64) / 4 B (KB 32), backward's recompute 1,868 -> 200 / 44 B)
    "ikb64": (dict(intra_kb=64), dict(intra_kb=64)),
    "ikb32": (dict(intra_kb=32), dict(intra_kb=32)),
    "ikb32o16": (dict(intra_kb=32, out_dot16=True), dict(intra_kb=32)),
    # the state and its gradient as two tiles of key rows (sm_90 at tf32x3, K 128: recompute carry 528 -> 0 B spills,
    # dstate 1,024 -> 460 B); "all" = every prepared form at once
    "hv": (dict(carry_halves=True), dict(halves=True)),
    "dkb32": (dict(), dict(dkey_block=32)),  # the split key kernel's tiles: 32 key columns (tf32x3: 572 -> 260 B)
    "all": (dict(intra_kb=32, out_dot16=True, carry_halves=True), dict(intra_kb=32, halves=True, dkey_block=32)),
    # the recompute's carry at tf32 apart from its first stage (5-value precision; accuracy: dev/check_precision.py)
    "rc3": (dict(), dict(precision=("tf32x3", "tf32", "tf32x3", "tf32x3", "tf32x3"))),
    "rc3t": (dict(), dict(precision=("tf32x3", "tf32", "tf32", "tf32", "tf32x3"))),
    # small heads (the lab's D 32): the backward's warps (dstate, dvalue, dkey) at 4 where D 128 wanted 8
    "bw4": (dict(), dict(warps=(4, 4, 4))),
    "dk2bw4": (dict(), dict(split=True, warps=(4, 4, 4))),
    # session 7, not yet run: the first stage at 8 warps for D 32 (sm_90, per-channel gates, delta: 255 -> 175
    # registers, no spills either way), in the forward and in the backward's recompute (bw4 is the default at D <= 32)
    "iw8bw4": (dict(warps=(8, 4, 4)), dict(fwd_warps=(8, 4))),
    # session 7, not yet run: shorter chunks (the first stage's [C, C] work per token halves with C; sequential
    # kernels take twice the chunks) — for the lab's D 32, where that work does not shrink with the head dim
    "c32": (dict(chunk=32), dict(chunk=32)),
    "c16": (dict(chunk=16), dict(chunk=16)),
    "c32iw8": (dict(chunk=32, warps=(8, 4, 4)), dict(chunk=32, fwd_warps=(8, 4))),
    # session 10: session 6's prepared forms at chunk 32 (auto_chunk's pick at B4 T8192 H16)
    "c32o16": (dict(chunk=32, out_dot16=True), dict(chunk=32)),
    "c32ikb32": (dict(chunk=32, intra_kb=32), dict(chunk=32, intra_kb=32)),
    "c32ikb64": (dict(chunk=32, intra_kb=64), dict(chunk=32, intra_kb=64)),
    "c32hv": (dict(chunk=32, carry_halves=True), dict(chunk=32, halves=True)),
    "c32dkb32": (dict(chunk=32), dict(chunk=32, dkey_block=32)),
    "o16hv": (dict(out_dot16=True, carry_halves=True), dict(halves=True)),
    "o16hvpr3": (dict(out_dot16=True, carry_halves=True), dict(halves=True, precision=("tf32x3", "tf32", "tf32", "tf32x3"))),
    "c32pr3": (dict(chunk=32), dict(chunk=32, precision=("tf32x3", "tf32", "tf32", "tf32x3"))),
    "c32bhv": (dict(chunk=32), dict(chunk=32, halves=True)),
    "c32bhvpr3": (dict(chunk=32), dict(chunk=32, halves=True, precision=("tf32x3", "tf32", "tf32", "tf32x3"))),
    "c16pr3": (dict(chunk=16), dict(chunk=16, precision=("tf32x3", "tf32", "tf32", "tf32x3"))),
    # session 10, prepared: the backward takes the forward's T, A~, P (first stage at tf32x3 / at the forward's tf32)
    "fk": (dict(keep_factors="tf32x3"), dict()),
    "fkt": (dict(keep_factors="tf32"), dict()),
    "c32fk": (dict(chunk=32, keep_factors="tf32x3"), dict(chunk=32)),
    "c32fkt": (dict(chunk=32, keep_factors="tf32"), dict(chunk=32)),
    "c32ds2": (dict(chunk=32), dict(chunk=32, dstate_stages=2)),  # dstate pipelined (fits at C <= 32)
    "c16ds2": (dict(chunk=16), dict(chunk=16, dstate_stages=2)),
    "c32fkds2": (dict(chunk=32, keep_factors="tf32x3"), dict(chunk=32, dstate_stages=2)),
    "c32dk2": (dict(chunk=32), dict(chunk=32, split=True)),  # scalar gates' key kernel in two launches at C 32
    "c32dkw4": (dict(chunk=32), dict(chunk=32, warps=(4, 8, 4))),  # the key kernel at 4 warps
    "c32bv64": (dict(chunk=32, block_v=64), dict(chunk=32, block_v=64)),  # the sequential kernels' V columns at C 32
    "c32bv16": (dict(chunk=32, block_v=16), dict(chunk=32, block_v=16)),
    "c32st3": (dict(chunk=32, stages=3), dict(chunk=32, stages=3)),  # the carry's software pipelining
    "kb64": (dict(intra_kb=64), dict(intra_kb=64)),  # session 10's defaults plus key blocks at C 64
    # session 11: the forward's tf32 factors kept (fkt, measured best) with the key kernel at 4 warps (c32dkw4: 8.75 ->
    # 5.45 ms at C 32), and at the lab's chunk of 16
    "w4": (dict(), dict(warps=(4, 8, 4))),
    "fktw4": (dict(keep_factors="tf32"), dict(warps=(4, 8, 4))),
    "c32fktw4": (dict(chunk=32, keep_factors="tf32"), dict(chunk=32, warps=(4, 8, 4))),
    "c32fktw444": (dict(chunk=32, keep_factors="tf32"), dict(chunk=32, warps=(4, 4, 4))),
    "c16fkt": (dict(chunk=16, keep_factors="tf32"), dict(chunk=16)),
    "c16fktds2": (dict(chunk=16, keep_factors="tf32"), dict(chunk=16, dstate_stages=2)),
    # session 11, for the next device session: the value kernel at 4 warps at C 64 too (today's default there: 8), and
    # what fla's precision would buy — the recompute's carry at tf32 (log alpha's strong-decay gradient 2.1e-3 ->
    # 9.7e-3, session 10), on top of today's defaults (factors kept; these pass them explicitly)
    "fktw444": (dict(keep_factors="tf32"), dict(warps=(4, 4, 4))),
    "fkrc": (dict(keep_factors="tf32"), dict(precision=("tf32x3", "tf32", "tf32", "tf32", "tf32x3"))),
    "c32fkrc": (dict(chunk=32, keep_factors="tf32"), dict(chunk=32, precision=("tf32x3", "tf32", "tf32", "tf32", "tf32x3"))),
    # session 11, prepared: every intermediate kept by the forward (carry at tf32x3), the backward recomputes nothing
    "ks": (dict(keep_factors="tf32", keep_states="tf32x3"), dict()),
    "c32ks": (dict(chunk=32, keep_factors="tf32", keep_states="tf32x3"), dict(chunk=32)),
    "c16ks": (dict(chunk=16, keep_factors="tf32", keep_states="tf32x3"), dict(chunk=16)),
    "c32all": (dict(chunk=32, intra_kb=32, out_dot16=True, carry_halves=True),
               dict(chunk=32, intra_kb=32, halves=True, dkey_block=32)),
    # session 59, prepared (not yet timed): the output fused into the carry (no output kernel, no Hs / U stores), Q e^g
    # stored by the first stage or formed in the carry (noqg), and the carry's V columns / warps with the extra work
    "fo": (dict(fuse_out=True), dict()),
    "fonoqg": (dict(fuse_out=True, out_qg=False), dict()),
    "c32fo": (dict(chunk=32, fuse_out=True), dict(chunk=32)),
    "c32fonoqg": (dict(chunk=32, fuse_out=True, out_qg=False), dict(chunk=32)),
    "c32fobv64": (dict(chunk=32, fuse_out=True, block_v=64), dict(chunk=32)),
    "c32fosw8": (dict(chunk=32, fuse_out=True, warps=(4, 8, 4)), dict(chunk=32)),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4x8192")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--fwd-only", action="store_true", help="time the forward alone")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128, help="head dim (the lab's full grid: --shapes 256x512 --heads 4 --dim 32)")
    a = ap.parse_args()
    for shape in a.shapes.split(","):
        B, T = map(int, shape.split("x"))
        for rule in ("kda", "gated_deltanet"):
            x = rule_inputs(rule, B, T, a.heads, a.dim, dtype=torch.bfloat16, device="cuda")
            q, k, v, la, beta = x["q"], x["k"], x["v"], x["log_alpha"], x["beta"]
            do = torch.randn_like(v)
            table = {}
            for name in a.variants.split(","):
                fk, bk = VARIANTS[name]

                def run():
                    res = forward_triton(q, k, v, log_alpha=la, beta=beta, delta=True, scale=a.dim ** -0.5, **fk)
                    if not a.fwd_only:
                        kept = {}  # the forward's [C, C] factors, or every intermediate (keep_states)
                        if fk.get("keep_factors"):
                            kept = {"states" if fk.get("keep_states") else "factors": res[2]}
                        backward_triton(q, k, v, la, beta, None, do, None, delta=True, scale=a.dim ** -0.5, **bk, **kept)
                    torch.cuda.synchronize()
                try:
                    times = dict(kernel_profile(run))
                except Exception as e:  # e.g. a variant asking for more shared memory than the SM has
                    print(f"{name}: {type(e).__name__}: {str(e)[:120]}")
                    continue
                times["TOTAL"] = sum(times.values())
                for kname, ms in times.items():
                    table.setdefault(kname[:40], {})[name] = round(ms, 4)
            rows = [{"kernel": kn, **t} for kn, t in sorted(table.items(), key=lambda kv: -max(kv[1].values()))]
            what = "forward alone" if a.fwd_only else "forward kernels appear twice: fwd + bwd recompute"
            print(f"\n{rule} B{B} T{T} H{a.heads} D{a.dim} bf16 (ms per call; {what})")
            print(markdown_table(rows, ["kernel", *a.variants.split(",")]), flush=True)


if __name__ == "__main__":
    main()
