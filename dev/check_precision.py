"""bf16 inputs: error of every gradient against float64 autograd through the reference, per tl.dot precision of the
Triton backward (GPU). Shows what TF32 rounding does to log alpha's gradient under strong decay; the 4-part names
set it per kernel (recompute / dstate / dvalue / dkey; x3 = tf32x3, t = tf32), the 5-part ones "a+b/..." the
recompute's first stage (a) and carry (b) apart.

    python dev/check_precision.py [GATE ...] [--factors]
        GATE: channel / scalar (default both). Each precision compiles every kernel anew (~10 s), so one gate's rows
        take about a minute and a half. --factors: only the rows at the default precision, with the first stage's
        factors recomputed or kept by the forward at tf32 / tf32x3 (the default since session 11), or every
        intermediate kept (`keep_states`).
"""

import sys

if {"-h", "--help"} & set(sys.argv[1:]):  # the docstring is the help; nothing below runs
    print(__doc__.strip())
    sys.exit(0)

import torch

from evict.ops.memory.triton.backward import backward_triton
from evict.ops.memory.triton.forward import forward_triton
from tests.conftest import rel
from tests.ops.test_memory import make_inputs, run

ONLY_FACTORS = "--factors" in sys.argv  # only the default-precision rows (recomputed / kept factors)
for gate in [a for a in sys.argv[1:] if not a.startswith("--")] or ("channel", "scalar"):
    for strong in (False, True):
        x = make_inputs(1, 130, 2, 128, 96, gate=gate, beta_max=1.5, init=True, strong=strong, seed=3)
        xd = {n: (t.float() if n == "initial_state" else t.to(torch.bfloat16)).cuda() for n, t in x.items()}
        x64 = {n: t.double() for n, t in xd.items()}
        leaves = {n: t.clone().requires_grad_(True) for n, t in x64.items()}
        o, s = run(leaves, True, impl="reference")
        g = torch.Generator(device="cuda").manual_seed(1)
        do, ds = (torch.randn(t.shape, generator=g, device="cuda", dtype=torch.float64) for t in (o, s))
        ref = dict(zip(leaves, torch.autograd.grad((o * do).sum() + (s * ds).sum(), list(leaves.values()))))
        x3, t = "tf32x3", "tf32"
        for prec in () if ONLY_FACTORS else ("tf32", "tf32x3", (t, t, t, x3), (x3, t, t, x3), (t, x3, x3, x3), (x3, x3, t, x3), (x3, x3, x3, t),
                     (x3, t, x3, x3, x3), (x3, t, t, t, x3)):  # 5 values: the recompute's carry apart
            got = backward_triton(xd["q"], xd["k"], xd["v"], xd["log_alpha"], xd["beta"], xd["initial_state"],
                                  do.to(torch.bfloat16), ds.float(), delta=True, scale=128 ** -0.5, precision=prec)
            errs = {n: rel(gg, ref[n]) for n, gg in zip(("q", "k", "v", "log_alpha", "beta", "initial_state"), got)}
            parts = [prec] if isinstance(prec, str) else ["x3" if p == x3 else "t" for p in prec]
            name = "/".join(parts) if len(parts) != 5 else f"{parts[0]}+{parts[1]}/" + "/".join(parts[2:])
            print(gate, "strong" if strong else "normal", name, " ".join(f"{n}:{e:.1e}" for n, e in errs.items()), flush=True)
        # the backward at its default precision, taking the forward's [C, C] factors (first stage at kf) instead of
        # recomputing them (`keep_factors` / `factors`, session 10)
        # session 11's `keep_states` rows: every intermediate kept (first stage at kf, carry at ks), no recompute
        for kf, ks in ((None, None), ("tf32", None), ("tf32x3", None), ("tf32", "tf32x3"), ("tf32x3", "tf32x3")):
            kept = {}
            if kf:
                res = forward_triton(xd["q"], xd["k"], xd["v"], log_alpha=xd["log_alpha"], beta=xd["beta"], delta=True,
                                     scale=128 ** -0.5, initial_state=xd["initial_state"], keep_factors=kf, keep_states=ks)
                kept = {"states" if ks else "factors": res[2]}
            got = backward_triton(xd["q"], xd["k"], xd["v"], xd["log_alpha"], xd["beta"], xd["initial_state"],
                                  do.to(torch.bfloat16), ds.float(), delta=True, scale=128 ** -0.5, **kept)
            errs = {n: rel(gg, ref[n]) for n, gg in zip(("q", "k", "v", "log_alpha", "beta", "initial_state"), got)}
            what = f"states kept (first stage {kf}, carry {ks})" if ks else f"factors {kf or 'recomputed'}"
            print(gate, "strong" if strong else "normal", f"default, {what}",
                  " ".join(f"{n}:{e:.1e}" for n, e in errs.items()), flush=True)
