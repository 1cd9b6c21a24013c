"""What 16-bit storage of the backward's recomputed intermediates would cost (session 11; fla stores 16-bit tiles).

bf16 inputs, strong decay, K 64 V 32, chunks of 32, three input draws (seeds 0-2): every gradient's error against float64 autograd on the same
rounded inputs, with the recompute storing (a) everything in float32 (evict's backward), (b) everything in bf16,
(c) only the first stage's U_bar / W / P / K e^{g_C - g} in bf16, (d) only the carry's U and chunk start states in
bf16. The storage is switched by wrapping the recompute's `intra` / `carry`; the kernels widen every load to float32.
On a machine without CUDA it runs under Triton's interpreter, whose tl.dot is float32: the errors there come from the
storage alone. Usage: python dev/store16_precision.py
"""

import json

import sys

if {"-h", "--help"} & set(sys.argv[1:]):  # the docstring is the help; nothing below runs
    print(__doc__.strip())
    sys.exit(0)

import torch

SCRIPT = r"""
import json, sys
import torch
from evict.ops.memory.triton import backward as bw
from tests.conftest import rel
from tests.ops.test_memory import make_inputs, run

dev = sys.argv[1]
intra, carry = bw.intra, bw.carry
MODES = {"float32 (evict)": (None, None), "all bf16": (torch.bfloat16, None),
         "first stage bf16": (torch.bfloat16, torch.float32), "states bf16": (None, torch.bfloat16)}
out = {}
for rule, gate, seed in [(r, g, s) for r, g in (("kda", "channel"), ("gated_deltanet", "scalar")) for s in (0, 1, 2)]:
    x64 = make_inputs(1, 70, 2, 64, 32, gate=gate, beta_max=1.5, init=True, strong=True, seed=seed)
    xb = {n: None if t is None else (t.float() if n == "initial_state" else t.bfloat16()).to(dev) for n, t in x64.items()}
    x64 = {n: None if t is None else t.double() for n, t in xb.items()}
    leaves = {n: t.clone().requires_grad_(True) for n, t in x64.items() if t is not None}
    o_ref, s_ref = run(leaves, True, impl="reference")
    g = torch.Generator(device=dev).manual_seed(1)
    do, ds = (torch.randn(t.shape, generator=g, device=dev, dtype=torch.float64) for t in (o_ref, s_ref))
    ref = torch.autograd.grad((o_ref * do).sum() + (s_ref * ds).sum(), list(leaves.values()))
    for mode, (first, states) in MODES.items():
        bw.intra = lambda *a, **kw: intra(*a, **kw, **({"store": first} if first else {}))
        bw.carry = lambda k, x, *a, **kw: carry(k, {**x, "store": states} if states else x, *a, **kw)
        gr = bw.backward_triton(xb["q"], xb["k"], xb["v"], xb["log_alpha"], xb["beta"], xb["initial_state"],
                                do.bfloat16(), ds.float(), delta=True, scale=64 ** -0.5, chunk=32)
        out[f"{rule} seed {seed}: {mode}"] = dict(zip(("q", "k", "v", "log_alpha", "beta", "initial_state"),
                                          (rel(a, b) for a, b in zip(gr, ref))))
print("RESULT" + json.dumps(out))
"""


def main():
    if torch.cuda.is_available():
        import contextlib
        import io
        import sys

        sys.argv = ["", "cuda"]
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            exec(SCRIPT, {"__name__": "store16"})
        res = json.loads(buf.getvalue().split("RESULT", 1)[1])
    else:
        from tests.conftest import run_interpreted

        res = run_interpreted(SCRIPT, "cpu", timeout=900)
    for name, errs in res.items():
        print(f"{name:41s}", " ".join(f"{n}:{e:.1e}" for n, e in errs.items()))


if __name__ == "__main__":
    main()
