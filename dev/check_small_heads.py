"""Triton fwd+bwd against the float64 reference at small head dims, one (K, V, gate, delta) per subprocess.

    python3 dev/check_small_heads.py          # prints one line per case: ok / error / rel errors
"""

from concurrent.futures import ThreadPoolExecutor
import subprocess
import sys

CASE = r"""
import sys, torch
from tests.ops.test_memory import make_inputs, run
from tests.conftest import rel
K, V, gate, delta, T = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1", int(sys.argv[5])
x64 = make_inputs(4, T, 2, K, V, gate=gate, beta_max=1.0, init=True)
x = {n: None if t is None else t.float().cuda() for n, t in x64.items()}
x64 = {n: None if t is None else t.cuda() for n, t in x64.items()}
def grads(x, **kw):
    leaves = {n: t.clone().requires_grad_(True) for n, t in x.items() if t is not None}
    o, s = run(leaves, delta, **kw)
    loss = o.double().square().sum() + s.double().square().sum()
    return o, dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
o_ref, g_ref = grads(x64, impl="reference")
o, g = grads(x, impl="triton")
torch.cuda.synchronize()
print(f"o {rel(o, o_ref):.1e} " + " ".join(f"d{n} {rel(g[n], g_ref[n]):.1e}" for n in g_ref))
"""

def one(case):
    K, V, gate, delta, T = case
    r = subprocess.run([sys.executable, "-c", CASE, str(K), str(V), gate, delta, str(T)], capture_output=True, text=True)
    last = (r.stdout.strip().splitlines() or [""])[-1] if r.returncode == 0 else "ERROR " + r.stderr.strip().splitlines()[-1][:120]
    return f"K={K} V={V} gate={gate} delta={delta} T={T}: {last}"


cases = [(K, K, g, d, 70) for K in (16, 32) for g in ("none", "scalar", "channel") for d in ("0", "1")] + [(16, 32, "channel", "1", 70), (32, 16, "channel", "1", 70)]
with ThreadPoolExecutor(7) as ex:
    for line in ex.map(one, cases):
        print(line, flush=True)
