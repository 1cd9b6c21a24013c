"""evict's Triton kernels against the float64 token-by-token reference.

GPU tests (marked `gpu`) cover bf16/fp32 inputs, every gate x delta, odd T, strong decay and gradients.
The same kernels also run in Triton's CPU interpreter at tiny float32 shapes, in a subprocess (TRITON_INTERPRET must be
set before triton compiles a kernel), so CI exercises them; those tests skip when triton is not installed.
"""

import itertools
import json

import pytest
import torch

from evict.ops import memory, memory_step
from tests.conftest import interpreter_fixture, rel, run_interpreted
from tests.ops.test_memory import GATES, OFFSETS, make_inputs, make_packed, packed_grads, per_sequence, run

TOL = {torch.float32: 1e-3, torch.bfloat16: 1e-2, torch.float16: 1e-2}

# -- CPU: the interpreter, one subprocess for every case ----------------------------------------------------------

INTERP_CASES = [  # (name, gate, delta, beta_max, T, chunk, strong)
    ("none_add", "none", False, 1.0, 40, 16, False),
    ("scalar_delta", "scalar", True, 2.0, 65, 32, False),
    ("channel_add", "channel", False, 1.0, 33, 16, False),
    ("channel_delta", "channel", True, 2.0, 65, 32, False),
    ("channel_delta_strong", "channel", True, 1.0, 47, 16, True),
    ("scalar_delta_T1", "scalar", True, 1.0, 1, 16, True),
    ("channel_delta_long", "channel", True, 2.0, 200, 64, False),
]

GRAD_CASES = [  # (name, gate, delta, beta_max (None: no beta), T, strong: "no" | "all" | "mixed", loss on: o and/or S)
    ("none_add", "none", False, 1.0, 70, "no", "oS"),
    ("none_delta", "none", True, 1.5, 65, "no", "oS"),
    ("scalar_delta_strong", "scalar", True, 1.5, 135, "all", "oS"),
    ("channel_add", "channel", False, 1.0, 64, "no", "oS"),
    ("channel_delta", "channel", True, 2.0, 130, "no", "oS"),
    ("channel_delta_mixed", "channel", True, 1.0, 100, "mixed", "oS"),
    ("channel_delta_strong", "channel", True, 1.0, 70, "all", "oS"),
    ("scalar_delta_T1", "scalar", True, 1.0, 1, "no", "oS"),
    ("channel_delta_no_beta", "channel", True, None, 77, "no", "oS"),
    ("scalar_delta_output_only", "scalar", True, None, 77, "no", "o"),
    ("channel_delta_state_only", "channel", True, 1.0, 77, "no", "S"),
]

INTERP_SCRIPT = r"""
import json, sys
from evict.ops import memory
from evict.ops.memory.triton.forward import forward_triton
from evict.ops.memory.triton.step import step_triton
from evict.ops.memory.reference import rule
from tests.conftest import rel, run_interpreted
from tests.ops.test_memory import make_inputs, rounded, run, step_rows_case

out = {}
for name, gate, delta, bmax, T, cs, strong in json.loads(sys.argv[1]):
    # the reference runs on the float32-rounded inputs the kernel sees: at T = 1 one dot q.k can nearly cancel, and
    # the rounding of the inputs alone then moves the float64 answer by 1e-5 and more (a failing fresh clone, s63)
    x64 = rounded(make_inputs(1, T, 1, 12, 20, gate=gate, beta_max=bmax, init=True, strong=strong))
    o_ref, s_ref = run(x64, delta, impl="reference")
    x = {n: None if t is None else t.float() for n, t in x64.items()}
    o, s = run(x, delta, impl="triton", chunk_size=cs)
    la = x64["log_alpha"]  # the largest within-chunk cumulative log decay (0 without a gate)
    G = 0.0 if la is None else max(float(la[:, c:c + cs].sum(1).abs().max()) for c in range(0, T, cs))
    out[name] = [rel(o, o_ref), rel(s, s_ref), bool(torch.isfinite(o).all() and torch.isfinite(s).all()), G]
for gate in ("none", "scalar", "channel"):
    for delta in (False, True):
        x64 = rounded(make_inputs(2, 1, 3, 12, 20, gate=gate, beta_max=2.0, init=True))  # the kernel's own inputs
        sq = lambda n: None if x64[n] is None else x64[n][:, 0]
        o_ref, s_ref = rule(sq("q"), sq("k"), sq("v"), x64["initial_state"], sq("log_alpha"), sq("beta"), delta, 0.3)
        f = lambda n: None if sq(n) is None else sq(n).float()
        S = x64["initial_state"].float().clone()
        o, s = step_triton(f("q"), f("k"), f("v"), S, log_alpha=f("log_alpha"), beta=f("beta"), delta=delta, scale=0.3, out=S)
        out[f"step_{gate}_{delta}"] = [rel(o, o_ref), rel(S, s_ref), s is S]
        xr, pool, rows, o_ref, pool_ref = step_rows_case(gate, delta, torch.float32)
        kw = dict(log_alpha=xr["log_alpha"], beta=xr["beta"], delta=delta, scale=0.3, rows=rows)
        o_copy, s_copy = step_triton(xr["q"], xr["k"], xr["v"], pool, **kw)
        before = pool.clone()
        o, s = step_triton(xr["q"], xr["k"], xr["v"], pool, out=pool, **kw)
        out[f"step_rows_{gate}_{delta}"] = [rel(o, o_ref), rel(pool, pool_ref), rel(o_copy, o_ref), rel(s_copy, pool_ref),
                                            s is pool and bool(torch.equal(before[[1, 2, 4, 6]], pool[[1, 2, 4, 6]]))]
def grads(x, delta, on="oS", **kw):
    leaves = {n: t.clone().requires_grad_(True) for n, t in x.items() if t is not None}
    o, s = run(leaves, delta, **kw)
    g = torch.Generator().manual_seed(1)
    wo, ws = (torch.randn(t.shape, generator=g, dtype=torch.float64) for t in (o, s))
    loss = ((o.double() * wo).sum() if "o" in on else 0) + ((s.double() * ws).sum() if "S" in on else 0)
    got = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    return {n: torch.zeros_like(t) if d is None else d for (n, t), d in zip(leaves.items(), got)}
out["grads"] = {}
for name, gate, delta, bmax, T, strong, on in json.loads(sys.argv[2]):
    x64 = make_inputs(1, T, 2, 12, 20, gate=gate, beta_max=bmax, init=True, strong=strong == "all")
    if strong == "mixed":  # strong decay in the first 24 tokens only: exact and factored sub-chunks in one run
        x64["log_alpha"][:, :24] *= 40
    x64 = rounded(x64)  # the kernel's own inputs
    g_ref = grads(x64, delta, on, impl="reference")
    g = grads({n: None if t is None else t.float() for n, t in x64.items()}, delta, on, impl="triton")
    out["grads"][name] = {n: rel(g[n], g_ref[n]) if g_ref[n].norm() > 0 else float(g[n].norm()) for n in g_ref}
# float16 inputs (the interpreter has no bfloat16): the 16-bit load / store paths, against the reference on the
# same rounded inputs
for gate16 in ("channel", "scalar"):  # per-channel keys stored decayed; a scalar gate decays them in the carry kernel
    x16 = {n: None if t is None else (t.float() if n == "initial_state" else t.half())
           for n, t in make_inputs(1, 70, 2, 16, 16, gate=gate16, beta_max=1.5, init=True).items()}
    x16_64 = {n: None if t is None else t.double() for n, t in x16.items()}
    o16, s16 = run(x16, True, impl="triton")
    o_ref, s_ref = run(x16_64, True, impl="reference")
    g16, g_ref = grads(x16, True, impl="triton"), grads(x16_64, True, impl="reference")
    from evict.ops.memory.triton import backward as _bw

    _bw.FORM_KD = True  # opt-in: 16-bit at chunks <= 32, a scalar gate's K e^{g_C - g} formed in the kernels
    g16_32 = grads(x16, True, impl="triton", chunk_size=32)
    _bw.FORM_KD = False
    kw16 = dict(log_alpha=x16["log_alpha"], beta=x16["beta"], delta=True, scale=16 ** -0.5,
                initial_state=x16["initial_state"])
    o_one = forward_triton(x16["q"], x16["k"], x16["v"], **kw16, out_dot16=False, fuse_out=False)[0]
    o_dot16 = forward_triton(x16["q"], x16["k"], x16["v"], **kw16, fuse_out=False)[0]  # the output kernel's default at C 64
    o_fused = forward_triton(x16["q"], x16["k"], x16["v"], **kw16, fuse_out=True)[0]  # the output in the carry
    o_noqg = forward_triton(x16["q"], x16["k"], x16["v"], **kw16, fuse_out=True, out_qg=False)[0]
    out["fp16_" + gate16] = {"o": rel(o16, o_ref), "S": rel(s16, s_ref), "o_dtype": str(o16.dtype),
                             **{f"d{n}": rel(g16[n], g_ref[n]) for n in g_ref},
                             **{f"d{n}_c32": rel(g16_32[n], g_ref[n]) for n in g_ref},
                             "grad_dtypes": [str(g16[n].dtype) for n in g16],
                             "out_dot16": [rel(o_dot16, o_ref), rel(o_dot16, o_one)],
                             "fuse_out": [rel(o_fused, o_ref), rel(o_fused, o_one), rel(o_noqg, o_ref), rel(o_noqg, o_one)]}
print("RESULT" + json.dumps(out))
"""


interpreted = interpreter_fixture(INTERP_SCRIPT, json.dumps(INTERP_CASES), json.dumps(GRAD_CASES))


@pytest.mark.parametrize("case", [c[0] for c in INTERP_CASES])
def test_interpreter_forward_matches_reference(interpreted, case):
    """float32 kernels vs float64 on the same (float32-rounded) inputs: 1e-5, plus float32's own error in the decays.
    The kernels form decay ratios e^(G_i - G_j) from within-chunk cumulative sums G of log alpha, which float32 holds
    to ~2^-24 |G| absolute, so the ratios carry up to ~2 * 2^-24 * max |G| relative error whatever the algorithm
    (strong decay, chunk 16: |G| ~ 160, ~2e-5; observed 6e-7 ... 1.1e-5 over fresh random inputs). Small decays keep
    the bound at ~1e-5."""
    err_o, err_s, finite, G = interpreted[case]
    tol = 1e-5 + 2 * 2**-24 * G
    assert finite and err_o <= tol and err_s <= tol, (err_o, err_s, tol)


@pytest.mark.parametrize("gate,delta", list(itertools.product(GATES, (False, True))))
def test_interpreter_step_matches_reference(interpreted, gate, delta):
    err_o, err_s, in_place = interpreted[f"step_{gate}_{delta}"]
    assert in_place and err_o <= 1e-5 and err_s <= 1e-5, (err_o, err_s)


@pytest.mark.parametrize("gate,delta", list(itertools.product(GATES, (False, True))))
def test_interpreter_step_rows_match_reference(interpreted, gate, delta):
    """The step kernel reading and writing rows [5, 0, 3] of a pool of 7 states in place (and into a copy), against
    the float64 step on the gathered rows; the pool's other rows untouched."""
    *errs, untouched = interpreted[f"step_rows_{gate}_{delta}"]
    assert untouched and max(errs) <= 1e-5, errs


@pytest.mark.parametrize("case", [c[0] for c in GRAD_CASES])
def test_interpreter_gradients_match_reference(interpreted, case):
    """The Triton backward (float32, exact dots in the interpreter) against float64 autograd through the reference.
    log alpha's gradient is a reverse cumulative sum over the sequence: 1e-4 under strong decay, 1e-5 otherwise."""
    strong = [c for c in GRAD_CASES if c[0] == case][0][5] != "no"
    for name, err in interpreted["grads"][case].items():
        assert err <= (1e-4 if strong and name == "log_alpha" else 1e-5), (name, err)


@pytest.mark.parametrize("gate", ["channel", "scalar"])
def test_interpreter_float16_inputs(interpreted, gate):
    """16-bit inputs: the forward stores its intermediates in float16 (states carried in float32), the backward
    recomputes them in float32; both within float16 rounding of the reference on the same rounded inputs, the
    gradients also at chunks of 32 (where the backward forms a scalar gate's K e^{g_C - g} instead of storing it)."""
    r = interpreted["fp16_" + gate]
    assert r["o_dtype"] == "torch.float16" and r["grad_dtypes"] == ["torch.float16"] * 5 + ["torch.float32"]
    for name, err in r.items():
        if name.startswith("d") or name in ("o", "S"):
            assert err <= TOL[torch.float16], (name, err)
    # `out_dot16` (the default at chunks of 64): the output kernel's 16-bit dots, against the reference (float16
    # rounding) and against the float32-operand form, out_dot16=False (Q e^g rounded to float16 once more: observed
    # 1.8e-4, about a float16 ulp)
    vs_ref, vs_f32_operands = r["out_dot16"]
    assert vs_ref <= TOL[torch.float16] and vs_f32_operands <= 2e-3, r["out_dot16"]
    # `fuse_out`: the output from the carry kernel's float32 state, Q e^g stored by the first stage (or formed
    # in the carry: out_qg=False), against the reference and the output kernel's float32-operand form (its start
    # states and U were rounded to float16: observed 3.5e-4 ... 4e-4)
    fused, fused_vs_one, noqg, noqg_vs_one = r["fuse_out"]
    assert max(fused, noqg) <= TOL[torch.float16] and max(fused_vs_one, noqg_vs_one) <= 2e-3, r["fuse_out"]


SPLIT_SCRIPT = r"""
import json, sys
import torch
from evict.ops.memory.triton.forward import forward_triton
from evict.ops.memory.triton.backward import backward_triton
from evict.ops.memory.triton.autograd import memory_triton
from tests.conftest import rel
from tests.ops.test_memory import make_inputs, run
out = {}
for name, gate, delta, T, K, V, strong in json.loads(sys.argv[1]):
    x64 = make_inputs(1, T, 2, K, V, gate=gate, beta_max=1.5, init=True)
    if strong:
        x64["log_alpha"][:, :24] *= 40  # strong decay in the first sub-chunks only: exact and factored blocks in one run
    leaves = {n: t.clone().requires_grad_(True) for n, t in x64.items() if t is not None}
    o_ref, s_ref = run(leaves, delta, impl="reference")
    g = torch.Generator().manual_seed(1)
    do, ds = torch.randn(o_ref.shape, generator=g, dtype=torch.float64), torch.randn(s_ref.shape, generator=g, dtype=torch.float64)
    ref = torch.autograd.grad((o_ref * do).sum() + (s_ref * ds).sum(), list(leaves.values()))
    x = {n: None if t is None else t.float() for n, t in x64.items()}
    args = (x["q"], x["k"], x["v"])
    kw = dict(log_alpha=x["log_alpha"], beta=x["beta"], delta=delta, scale=K ** -0.5, initial_state=x["initial_state"])
    res = {}
    o, s = forward_triton(*args, **kw, carry_halves=False)  # the one-tile forms: each knob below is checked alone
    for split in (False, True):
        gr = backward_triton(*args, x["log_alpha"], x["beta"], x["initial_state"], do.float(), ds.float(), delta=delta,
                             scale=K ** -0.5, split=split, halves=False)
        res[split] = [o, s, *[t for t in gr if t is not None]]
    # intra's key-blocked form (`intra_kb`, per-channel gates): forward and the backward's recompute
    kb = max(16, 1 << (K - 1).bit_length()) // 2
    o_kb, s_kb = forward_triton(*args, **kw, intra_kb=kb, carry_halves=False)
    gr_kb = backward_triton(*args, x["log_alpha"], x["beta"], x["initial_state"], do.float(), ds.float(), delta=delta,
                            scale=K ** -0.5, split=True, intra_kb=kb, halves=False)
    res_kb = [o_kb, s_kb, *[t for t in gr_kb if t is not None]]
    # the carry and the state gradient as two tiles of key rows (`carry_halves` / `halves`; padded K >= 64; the default
    # at chunks of 64)
    o_h, s_h = forward_triton(*args, **kw)
    gr_h = backward_triton(*args, x["log_alpha"], x["beta"], x["initial_state"], do.float(), ds.float(), delta=delta,
                           scale=K ** -0.5, split=True, halves=True)
    res_h = [o_h, s_h, *[t for t in gr_h if t is not None]]
    # the forward's [C, C] factors kept for the backward (`keep_factors` / `factors`): the recompute skips its Gram
    # strips and inverse
    o_f, s_f, fac = forward_triton(*args, **kw, carry_halves=False, keep_factors="tf32x3")
    gr_f = backward_triton(*args, x["log_alpha"], x["beta"], x["initial_state"], do.float(), ds.float(), delta=delta,
                           scale=K ** -0.5, split=True, halves=False, factors=fac)
    res_f = [o_f, s_f, *[t for t in gr_f if t is not None]]
    # the same through autograd (memory_triton: auto chunk, the factors saved on the autograd context)
    lv = {n: t.clone().requires_grad_(True) for n, t in x.items() if t is not None}
    o_a, s_a = memory_triton(lv["q"], lv["k"], lv["v"], log_alpha=lv.get("log_alpha"), beta=lv.get("beta"), delta=delta,
                             scale=K ** -0.5, initial_state=lv["initial_state"], keep_factors="tf32x3")
    gr_a = torch.autograd.grad((o_a.double() * do).sum() + (s_a.double() * ds).sum(), list(lv.values()))
    # every intermediate kept (`keep_states` / `states`): the backward recomputes nothing; directly and through autograd
    o_s, s_s, kept = forward_triton(*args, **kw, carry_halves=False, keep_factors="tf32x3", keep_states="tf32x3")
    gr_s = backward_triton(*args, x["log_alpha"], x["beta"], x["initial_state"], do.float(), ds.float(), delta=delta,
                           scale=K ** -0.5, split=True, halves=False, states=kept)
    res_s = [o_s, s_s, *[t for t in gr_s if t is not None]]
    lv = {n: t.clone().requires_grad_(True) for n, t in x.items() if t is not None}
    o_sa, s_sa = memory_triton(lv["q"], lv["k"], lv["v"], log_alpha=lv.get("log_alpha"), beta=lv.get("beta"),
                               delta=delta, scale=K ** -0.5, initial_state=lv["initial_state"], keep_states=True)
    gr_sa = torch.autograd.grad((o_sa.double() * do).sum() + (s_sa.double() * ds).sum(), list(lv.values()))
    # the split key kernel with 16-column tiles (`dkey_block`; 64 by default)
    gr_d = backward_triton(*args, x["log_alpha"], x["beta"], x["initial_state"], do.float(), ds.float(), delta=delta,
                           scale=K ** -0.5, split=True, dkey_block=16, halves=False)
    res_d = [o, s, *[t for t in gr_d if t is not None]]
    # shorter chunks (`chunk`: forward and the backward's recompute), against float64
    res_c = {}
    for c in (32, 16):
        o_c, s_c = forward_triton(*args, **kw, chunk=c)
        gr_c = backward_triton(*args, x["log_alpha"], x["beta"], x["initial_state"], do.float(), ds.float(), delta=delta,
                               scale=K ** -0.5, chunk=c)
        res_c[c] = [rel(o_c, o_ref), rel(s_c, s_ref), *[rel(a, b) for a, b in zip([t for t in gr_c if t is not None], ref)]]
    out[name] = {"vs_reference": [rel(res[True][0], o_ref), rel(res[True][1], s_ref),
                                  *[rel(a, b) for a, b in zip(res[True][2:], ref)]],
                 "vs_one_kernel": [rel(a, b) for a, b in zip(res[True], res[False])],
                 "kb_vs_reference": [rel(res_kb[0], o_ref), rel(res_kb[1], s_ref),
                                     *[rel(a, b) for a, b in zip(res_kb[2:], ref)]],
                 "kb_vs_one_tile": [rel(a, b) for a, b in zip(res_kb, res[True])],
                 "halves_vs_reference": [rel(res_h[0], o_ref), rel(res_h[1], s_ref),
                                         *[rel(a, b) for a, b in zip(res_h[2:], ref)]],
                 "halves_vs_one_tile": [rel(a, b) for a, b in zip(res_h, res[True])],
                 "factors_vs_reference": [rel(res_f[0], o_ref), rel(res_f[1], s_ref),
                                          *[rel(a, b) for a, b in zip(res_f[2:], ref)]],
                 "factors_vs_recompute": [rel(a, b) for a, b in zip(res_f, res[True])],
                 "factors_autograd_vs_reference": [rel(o_a, o_ref), rel(s_a, s_ref),
                                                   *[rel(a, b) for a, b in zip(gr_a, ref)]],
                 "states_vs_reference": [rel(res_s[0], o_ref), rel(res_s[1], s_ref),
                                         *[rel(a, b) for a, b in zip(res_s[2:], ref)]],
                 "states_vs_recompute": [rel(a, b) for a, b in zip(res_s, res[True])],
                 "states_autograd_vs_reference": [rel(o_sa, o_ref), rel(s_sa, s_ref),
                                                  *[rel(a, b) for a, b in zip(gr_sa, ref)]],
                 "dkey16_vs_reference": [rel(a, b) for a, b in zip(res_d[2:], ref)],
                 "dkey16_vs_64": [rel(a, b) for a, b in zip(res_d, res[True])],
                 "chunk32_vs_reference": res_c[32], "chunk16_vs_reference": res_c[16]}
print("RESULT" + json.dumps(out))
"""
SPLIT_CASES = [  # (name, gate, delta, T, K, V, strong): odd lengths, key dims across two 64-column blocks, strong decay
    ("kda_k96_strong", "channel", True, 70, 96, 16, True), ("kda_strong", "channel", True, 130, 32, 20, True),
    ("kda_k32_v80", "channel", True, 100, 32, 80, False),
    ("gdn", "scalar", True, 70, 32, 16, False), ("delta_nogate", "none", True, 65, 32, 16, False),
    ("gla", "channel", False, 70, 32, 16, False), ("linear", "none", False, 64, 32, 16, False),
    ("gdn_k64", "scalar", True, 70, 64, 16, False), ("delta_k64", "none", True, 65, 64, 16, False),
    # key dims above 128 (padded to 256: four 64-column blocks, the last partly masked), the pairs lab's top head dim
    ("kda_k200_strong", "channel", True, 45, 200, 24, True), ("gdn_k256", "scalar", True, 37, 256, 16, False),
]


def _same_as_default(errs, strong):
    """Another form of the same kernels against the default form, [o, S, dq, dk, dv, dlog_alpha, dbeta, dS0]: float32
    sums in another order. The interpreter's tl.dot (numpy) rounds differently with the buffers' addresses, so the
    same kernel run twice differs by up to ~5e-7 here: 3e-6 (other forms: up to ~1e-6 seen). log alpha's gradient
    under strong decay, a long cancelling sum already held to 10x the others against float64 (1e-4 vs 1e-5): 1e-5."""
    return all(e <= (1e-5 if strong and i == 5 else 3e-6) for i, e in enumerate(errs))


interpreted_split = interpreter_fixture(SPLIT_SCRIPT, cases=SPLIT_CASES, parts=4)  # the suite's longest run: 4 parts


def _check_form(r, case, vs_reference, vs_default):
    """A form's errors against float64 (the default form's bounds: 1e-5, log alpha's gradient under strong decay
    1e-4) and against the default form (`_same_as_default`)."""
    strong = [c for c in SPLIT_CASES if c[0] == case][0][6]
    for i, err in enumerate(vs_reference):
        assert err <= (1e-4 if strong else 1e-5), (i, err)
    for errs in vs_default:
        assert _same_as_default(errs, strong), errs


@pytest.mark.parametrize("case", [c[0] for c in SPLIT_CASES])
def test_interpreter_intra_key_blocks_match_reference(interpreted_split, case):
    """`intra_kb` (per-channel gates; other gates run the one-tile kernel): the first stage half the padded key dim
    at a time (K 96: two 64-column blocks, the second partly masked; K 32: two of 16), forward and the backward's
    recompute, against float64 (the one-tile form's bounds) and against the one-tile form (`_same_as_default`)."""
    r = interpreted_split[case]
    _check_form(r, case, r["kb_vs_reference"], [r["kb_vs_one_tile"]])


@pytest.mark.parametrize("case", [c[0] for c in SPLIT_CASES])
def test_interpreter_kept_factors_match_reference(interpreted_split, case):
    """`forward_triton(keep_factors=...)` / `backward_triton(factors=...)`: the backward takes the forward's T, A~ and P
    instead of recomputing them (the recompute forms only gates, W and U_bar), against float64 (the recompute's bounds)
    and against the recompute (`_same_as_default`)."""
    r = interpreted_split[case]
    _check_form(r, case, r["factors_vs_reference"], [r["factors_vs_recompute"]])
    _check_form(r, case, r["factors_autograd_vs_reference"], [])


@pytest.mark.parametrize("case", [c[0] for c in SPLIT_CASES])
def test_interpreter_kept_states_match_reference(interpreted_split, case):
    """`forward_triton(keep_states=...)` / `backward_triton(states=...)`: the forward keeps every intermediate (float32)
    and its chunk start states, the backward recomputes nothing — against float64 (the recompute's bounds) and
    against the recompute (`_same_as_default`); and through autograd (`memory_triton(keep_states=True)`)."""
    r = interpreted_split[case]
    _check_form(r, case, r["states_vs_reference"], [r["states_vs_recompute"]])
    _check_form(r, case, r["states_autograd_vs_reference"], [])


def test_kept_states_need_kept_factors_and_their_chunk():
    """`keep_states` without `keep_factors`, and states kept at one chunk used at another: refused before a kernel
    runs, one line each."""
    from evict.ops.memory.triton.backward import backward_triton
    from evict.ops.memory.triton.forward import forward_triton

    x = torch.zeros(1, 8, 1, 32)
    with pytest.raises(ValueError, match="^keep_states: needs keep_factors"):
        forward_triton(x, x, x, scale=0.25, keep_states="tf32x3")
    with pytest.raises(ValueError, match="^states: kept at chunks of 64, used at 32"):
        backward_triton(x, x, x, None, None, None, x, None, delta=True, scale=0.25, chunk=32, states=dict(C=64))


@pytest.mark.parametrize("case", [c[0] for c in SPLIT_CASES])
def test_interpreter_state_halves_match_reference(interpreted_split, case):
    """`carry_halves` / `halves` (padded K >= 64: K 96 and 64 here; smaller K run the one-tile kernels): the state and
    its gradient as two tiles of key rows, forward and backward, against float64 (the one-tile form's bounds) and
    against the one-tile form (`_same_as_default`)."""
    r = interpreted_split[case]
    _check_form(r, case, r["halves_vs_reference"], [r["halves_vs_one_tile"]])


@pytest.mark.parametrize("case", [c[0] for c in SPLIT_CASES])
@pytest.mark.parametrize("chunk", [32, 16])
def test_interpreter_shorter_chunks_match_reference(interpreted_split, case, chunk):
    """`chunk` 32 / 16 (opt-in: the first stage's [C, C] work per token halves with C; for the lab's heads of 32):
    forward and backward against float64, with the default form's bounds. Not compared with the default form: other
    chunks split the sums (and strong decay's exact and factored blocks) elsewhere."""
    _check_form(interpreted_split[case], case, interpreted_split[case][f"chunk{chunk}_vs_reference"], [])


@pytest.mark.parametrize("case", [c[0] for c in SPLIT_CASES])
def test_interpreter_split_key_kernel_matches_reference(interpreted_split, case):
    """`split=True` (the default for per-channel gates at K > 64): the key kernel as two launches (phases 1-2 per
    chunk, then phase 3 per sub-chunk strip), with 64-column tiles and with 16 (`dkey_block`), against float64 (as the
    one-kernel form is: 1e-5, log alpha's gradient under strong decay 1e-4) and against the one-kernel form (float32
    sums over key columns in another order: `_same_as_default`)."""
    r = interpreted_split[case]
    _check_form(r, case, r["vs_reference"] + r["dkey16_vs_reference"], [r["vs_one_kernel"], r["dkey16_vs_64"]])


RESET_SCRIPT = r"""
import json
from evict.ops import memory
from tests.conftest import rel
from tests.ops.test_memory import make_inputs, run
out = {}
for gate in ("scalar", "channel"):
    x64 = make_inputs(1, 130, 2, 12, 20, gate=gate, beta_max=1.5, init=True, seed=9, reset=0.3)
    o_ref, s_ref = run(x64, True, impl="reference")
    o, s = run({n: None if t is None else t.float() for n, t in x64.items()}, True, impl="triton")
    out[gate] = [rel(o, o_ref), rel(s, s_ref), bool(torch.isfinite(o).all() and torch.isfinite(s).all())]
print("RESULT" + json.dumps(out))
"""


def test_interpreter_hard_resets_are_finite():
    """Hard resets (log alpha at float32's most negative value) through the kernels: clamped at the op's entry, so
    finite; the kernels do not restart their in-chunk prefix sums at a reset (the chunked PyTorch form does), so
    with 30% resets they keep ~4e-5 rather than ~1e-7: held to the kernels' float32 tolerance on the GPU, TOL."""
    for gate, (err_o, err_s, finite) in run_interpreted(RESET_SCRIPT, timeout=300).items():
        assert finite and err_o <= TOL[torch.float32] and err_s <= TOL[torch.float32], (gate, err_o, err_s)


VARLEN_CASES = [  # (name, gate, delta, beta_max (None: no beta), offsets, K, gates: "small" | "strong" | "reset")
    ("none_add", "none", False, 1.0, OFFSETS, 32, "small"),
    ("scalar_delta", "scalar", True, 1.5, OFFSETS, 32, "small"),
    ("channel_delta", "channel", True, 2.0, OFFSETS, 32, "small"),
    ("channel_add_K12_empty", "channel", False, 1.0, [0, 0, 40, 41, 41, 130], 12, "small"),  # MIN_K padding
    ("channel_delta_strong", "channel", True, 1.0, [0, 70, 133], 32, "strong"),
    ("scalar_delta_N1_no_beta", "scalar", True, None, [0, 77], 32, "small"),
    ("channel_delta_reset", "channel", True, 1.5, OFFSETS, 32, "reset"),
    ("scalar_delta_all_empty", "scalar", True, 1.0, [0, 0, 0], 32, "small"),
    ("channel_delta_aligned", "channel", True, 1.5, [0, 64, 64, 192], 32, "small"),  # whole chunks: no copies
]

VARLEN_SCRIPT = r"""
import json, sys
from tests.conftest import rel
from tests.ops.test_memory import make_packed, packed_grads, per_sequence, run
out = {}
for name, gate, delta, bmax, offsets, K, gates in json.loads(sys.argv[1]):
    x64 = make_packed(offsets, 2, K, 16, gate=gate, beta_max=bmax, seed=len(name), strong=gates == "strong",
                      reset=0.3 if gates == "reset" else 0.0)
    x = {n: None if t is None else t.float() for n, t in x64.items()}
    o_ref, s_ref = per_sequence(x64, offsets, delta, impl="reference")
    o, s = run(x, delta, cu_seqlens=torch.tensor(offsets), impl="triton")
    la = x64["log_alpha"]  # the largest within-chunk cumulative log decay, chunks from each sequence's start
    G = 0.0 if la is None else max([float(la[:, c:min(c + 64, b)].sum(1).abs().max())
                                    for a, b in zip(offsets[:-1], offsets[1:]) for c in range(a, b, 64)] + [0.0])
    g_ref = packed_grads(x64, offsets, delta, packed=False, impl="reference")
    g = packed_grads(x, offsets, delta, packed=True, impl="triton")
    out[name] = {"o": rel(o, o_ref), "S": rel(s, s_ref), "G": G, "shapes": [list(o.shape), list(s.shape)],
                 "finite": bool(torch.isfinite(o).all() and torch.isfinite(s).all()),
                 "grads": {n: rel(g[n], g_ref[n]) if g_ref[n].norm() > 0 else float(g[n].norm()) for n in g_ref}}
print("RESULT" + json.dumps(out))
"""


interpreted_varlen = interpreter_fixture(VARLEN_SCRIPT, cases=VARLEN_CASES)


@pytest.mark.parametrize("case", [c[0] for c in VARLEN_CASES])
def test_interpreter_packed_sequences_match_reference(interpreted_varlen, case):
    """cu_seqlens through the kernels (float32, chunk-aligned packing) against the float64 reference run on each
    sequence alone: outputs, final states and every input's gradient, at the tolerances of the tests above (the
    forward's float32 decay bound; 1e-5 for gradients, 1e-4 for log alpha's under strong decay; hard resets: TOL)."""
    name, gate, delta, bmax, offsets, K, gates = [c for c in VARLEN_CASES if c[0] == case][0]
    r = interpreted_varlen[case]
    assert r["finite"] and r["shapes"] == [[1, offsets[-1], 2, 16], [len(offsets) - 1, 2, K, 16]], r
    tol = TOL[torch.float32] if gates == "reset" else 1e-5 + 2 * 2**-24 * r["G"]
    assert r["o"] <= tol and r["S"] <= tol, (r["o"], r["S"], tol)
    for n, err in r["grads"].items():
        bound = TOL[torch.float32] if gates == "reset" else (1e-4 if gates == "strong" and n == "log_alpha" else 1e-5)
        assert err <= bound, (n, err)


def test_backward_precision_tuple_length_is_checked():
    """backward_triton's `precision`: one value, or 4 (recompute, dstate, dvalue, dkey), or 5 (the recompute's first
    stage and carry apart); anything else is refused before a kernel runs."""
    pytest.importorskip("triton")
    from evict.ops.memory.triton.backward import backward_triton

    x = torch.zeros(1, 4, 1, 16)
    with pytest.raises(ValueError, match="precision: expected one value or a tuple of 4 or 5"):
        backward_triton(x, x, x, None, None, None, x, None, delta=True, scale=0.25, precision=("tf32",) * 3)


def test_factors_kept_at_another_chunk_are_refused():
    """`factors` from a forward at chunks of 64 cannot serve a backward at 32: refused before a kernel runs."""
    pytest.importorskip("triton")
    from evict.ops.memory.triton.backward import backward_triton

    x = torch.zeros(1, 4, 1, 16)
    kept = {"Tm": x, "Am": x, "Pm": x, "C": 64}
    with pytest.raises(ValueError, match="factors: kept at chunks of 64, used at 32"):
        backward_triton(x, x, x, None, None, None, x, None, delta=True, scale=0.25, chunk=32, factors=kept)


LONG_SCRIPT = r"""
import torch
from tests.conftest import rel
from tests.ops.test_memory import make_inputs, run

x64 = make_inputs(1, 65536, 1, 8, 4, gate="channel", beta_max=1.0, init=True, strong=True, seed=3)
o_ref, s_ref = run(x64, True, impl="chunked")  # float64: equal to the reference (test_memory's long test)
o, s = run({n: None if t is None else t.float() for n, t in x64.items()}, True, impl="triton", chunk_size=64)
print("RESULT" + __import__("json").dumps([rel(o, o_ref), rel(s, s_ref), bool(torch.isfinite(o).all() and torch.isfinite(s).all())]))
"""


@pytest.mark.slow
def test_interpreter_strong_decay_65536_tokens():
    """The Triton kernels over T = 65,536 with log alpha in [-20, 0] per channel, delta on, float32 (about 4.5 min
    in the interpreter on one core; measured 1.5e-6 / 4.9e-7): finite, and equal to the float64 form."""
    err_o, err_s, finite = run_interpreted(LONG_SCRIPT, timeout=900)
    assert finite and err_o <= 1e-5 and err_s <= 1e-5, (err_o, err_s)


# -- GPU -------------------------------------------------------------------------------------------------------

def _cuda(x, dtype):
    """Inputs on the GPU in `dtype` (state float32), and the float64 reference inputs rounded the same way."""
    xd = {n: None if t is None else (t.float() if n == "initial_state" else t.to(dtype)).cuda() for n, t in x.items()}
    x64 = {n: None if t is None else t.double() for n, t in xd.items()}
    return xd, x64


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate,delta,beta_max", list(itertools.product(GATES, (False, True), (1.0, 2.0))))
def test_gpu_forward_matches_reference(dtype, gate, delta, beta_max):
    for T, cs, init, strong in ((1, 64, False, False), (63, 64, True, False), (65, 64, True, True), (200, 32, True, False),
                                (333, 64, False, False), (130, 64, True, True)):
        xd, x64 = _cuda(make_inputs(2, T, 3, 128, 96, gate=gate, beta_max=beta_max, init=init, strong=strong), dtype)
        o_ref, s_ref = run(x64, delta, impl="reference")
        o, s = run(xd, delta, impl="auto", chunk_size=cs)
        assert o.dtype == dtype and s.dtype == torch.float32
        assert torch.isfinite(o).all() and torch.isfinite(s).all(), (T, cs)
        assert rel(o, o_ref) <= TOL[dtype] and rel(s, s_ref) <= TOL[dtype], (T, cs, rel(o, o_ref), rel(s, s_ref))


OUT_FORMS = {  # the output's forms, each named (the default picks by shape: `fuse_out_default`): the output kernel with
    # 16-bit dots (its default at chunks of 64) and with float32 operands; the output fused into the carry
    "out_kernel": dict(fuse_out=False), "out_f32": dict(out_dot16=False, fuse_out=False), "fused": dict(fuse_out=True),
    "fused_no_qg": dict(fuse_out=True, out_qg=False)}


@pytest.mark.gpu
@pytest.mark.parametrize("gate,delta", list(itertools.product(GATES, (False, True))))
@pytest.mark.parametrize("form", list(OUT_FORMS))
@pytest.mark.parametrize("chunk", [None, 32])
def test_gpu_out_forms_match_reference(gate, delta, form, chunk):
    """The output's forms on bf16 inputs, each asked for by name (the default picks one by shape): the output kernel
    with 16-bit dots and with float32 operands (out_dot16=False), and the output fused into the carry (fuse_out=True)
    with Q e^g stored by the first stage or formed in the carry (out_qg=False); within bf16 rounding of the reference,
    odd T, strong decay, K 128 (two key blocks) and K 96 (a masked one), chunks of 64 and 32."""
    from evict.ops.memory.triton.forward import forward_triton

    for T, K, strong in ((63, 128, False), (130, 128, True), (333, 96, False)):
        xd, x64 = _cuda(make_inputs(2, T, 3, K, 64, gate=gate, beta_max=1.5, init=True, strong=strong), torch.bfloat16)
        o_ref, s_ref = run(x64, delta, impl="reference")
        o, s = forward_triton(xd["q"], xd["k"], xd["v"], log_alpha=xd["log_alpha"], beta=xd["beta"], delta=delta,
                              scale=K ** -0.5, initial_state=xd["initial_state"], chunk=chunk, **OUT_FORMS[form])
        assert rel(o, o_ref) <= TOL[torch.bfloat16] and rel(s, s_ref) <= TOL[torch.bfloat16], (T, K, rel(o, o_ref))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate", ["scalar", "channel"])
def test_gpu_hard_resets_forward_and_gradients(dtype, gate):
    """Hard resets mixed with small decays (30% of gate entries at float32's most negative value): finite, and equal
    to the float64 reference at the kernels' tolerance, forward and backward."""
    x = make_inputs(2, 200, 2, 64, 64, gate=gate, beta_max=1.5, init=True, seed=12, reset=0.3)
    xd, x64 = _cuda(x, dtype)
    # gates stay float32 as the mixers give them: float32's most negative value is -inf in bfloat16, which the op refuses
    xd["log_alpha"] = x["log_alpha"].float().cuda()
    x64["log_alpha"] = xd["log_alpha"].double()
    o_ref, s_ref = run(x64, True, impl="reference")
    o, s = run(xd, True, impl="triton")
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel(o, o_ref) <= TOL[dtype] and rel(s, s_ref) <= TOL[dtype], (rel(o, o_ref), rel(s, s_ref))
    g_ref, g = _grads(x64, True, impl="reference"), _grads(xd, True, impl="triton")
    for name in g_ref:
        assert torch.isfinite(g[name]).all() and rel(g[name], g_ref[name]) <= TOL[dtype], (name, rel(g[name], g_ref[name]))


@pytest.mark.gpu
@pytest.mark.parametrize("gate", ["scalar", "channel"])
def test_gpu_strong_decay_long(gate):
    xd, x64 = _cuda(make_inputs(1, 4096, 2, 64, 64, gate=gate, beta_max=1.0, init=True, strong=True), torch.float32)
    xd["log_alpha"] = torch.full_like(xd["log_alpha"], -20.0)
    x64["log_alpha"] = xd["log_alpha"].double()
    o, s = run(xd, True, impl="triton")
    o_ref, s_ref = run(x64, True, impl="chunked")
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel(o, o_ref) <= 1e-3 and rel(s, s_ref) <= 1e-3


def _grads(x, delta, **kw):
    leaves = {n: t.clone().requires_grad_(True) for n, t in x.items() if t is not None}
    o, s = run(leaves, delta, **kw)
    g = torch.Generator(device=o.device).manual_seed(1)
    loss = (o.double() * torch.randn(o.shape, generator=g, device=o.device, dtype=torch.float64)).sum()
    loss = loss + (s.double() * torch.randn(s.shape, generator=g, device=o.device, dtype=torch.float64)).sum()
    return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))


def test_fuse_out_default_rule():
    """forward_triton(fuse_out=None): the output in the carry for 16-bit inputs at key dims <= 128 and chunks of 32 / 64
    exactly where the sequence-heads in 32-column value blocks fill the SMs (H100: 132), else the output kernel
    (session 60's timings)."""
    pytest.importorskip("triton")
    from evict.ops.memory.triton.forward import fuse_out_default

    assert fuse_out_default(4, 16, 128, 128, 32, True, 132) and fuse_out_default(33, 1, 64, 128, 64, True, 132)
    assert not fuse_out_default(1, 16, 128, 128, 64, True, 132) and not fuse_out_default(2, 16, 128, 128, 64, True, 132)
    assert not fuse_out_default(4, 16, 128, 128, 32, False, 132) and not fuse_out_default(4, 16, 256, 128, 32, True, 132)
    assert fuse_out_default(2, 16, 128, 128, 64, True, 128) and not fuse_out_default(32, 1, 128, 128, 32, True, 132)
    assert not fuse_out_default(256, 4, 32, 32, 16, True, 132)  # the lab's K 32 at chunks of 16: not timed fused


@pytest.mark.gpu
@pytest.mark.parametrize("gate,delta", list(itertools.product(GATES, (False, True))))
def test_gpu_default_output_form_by_shape(gate, delta):
    """The default (fuse_out=None) through `memory` on bf16: with enough sequence-heads to fill the card (B2 H20, V 128:
    the output fused into the carry) and with few (B1 H3: the output kernel), output, state and every gradient against
    float64 (odd T, chunks of 64 and 32); each is bit-equal to its form asked for by name, so the rule chose it."""
    from evict.ops.memory.triton.forward import _sms, forward_triton, fuse_out_default

    sms = _sms(torch.device("cuda"))
    for B, H, T, cs in ((2, -(-sms // 8), 75, 64), (2, -(-sms // 8), 130, 32), (1, 3, 75, 64)):
        xd, x64 = _cuda(make_inputs(B, T, H, 64, 128, gate=gate, beta_max=1.5, init=True), torch.bfloat16)
        fused = fuse_out_default(B, H, 64, 128, cs, True, sms)
        assert fused == (H > 3)
        o, s = run(xd, delta, impl="triton", chunk_size=cs)
        o_ref, s_ref = run(x64, delta, impl="reference")
        assert rel(o, o_ref) <= TOL[torch.bfloat16] and rel(s, s_ref) <= TOL[torch.bfloat16], (B, H, cs, rel(o, o_ref))
        kw = dict(log_alpha=xd["log_alpha"], beta=xd["beta"], delta=delta, scale=64 ** -0.5,
                  initial_state=xd["initial_state"], chunk=cs)
        o_named = forward_triton(xd["q"], xd["k"], xd["v"], **kw, fuse_out=fused)[0]
        assert torch.equal(forward_triton(xd["q"], xd["k"], xd["v"], **kw)[0], o_named)
        g, g_ref = _grads(xd, delta, impl="triton", chunk_size=cs), _grads(x64, delta, impl="reference")
        for name in g_ref:
            assert torch.isfinite(g[name]).all() and rel(g[name], g_ref[name]) <= TOL[torch.bfloat16], (B, H, name)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate,delta", list(itertools.product(GATES, (False, True))))
def test_gpu_gradients_match_reference(dtype, gate, delta):
    """The Triton backward: every input's gradient against float64 autograd through the token loop, odd T."""
    for B, T, H, K, V, strong in ((2, 75, 2, 64, 32, False), (1, 333, 2, 128, 128, False), (1, 130, 1, 128, 96, True),
                                  (16, 32, 2, 16, 16, False)):  # the recall lab's heads of 16
        xd, x64 = _cuda(make_inputs(B, T, H, K, V, gate=gate, beta_max=1.5, init=True, strong=strong), dtype)
        g_ref = _grads(x64, delta, impl="reference")
        g = _grads(xd, delta, impl="triton")
        assert set(g) == set(g_ref)
        for name in g_ref:
            err = rel(g[name], g_ref[name])
            assert torch.isfinite(g[name]).all() and err <= TOL[dtype], (T, strong, name, err)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate,delta", list(itertools.product(GATES, (False, True))))
@pytest.mark.parametrize("chunk_size", [16, 32])
def test_gpu_chunk_size_reaches_the_kernels(dtype, gate, delta, chunk_size):
    """`memory(impl="triton", chunk_size=16 / 32)` runs the kernels in those chunks: output, state and every gradient
    against float64 (odd T, the lab's heads of 32, heads of 16 padded to 32, strong decay at 128), and not bit-equal
    to chunks of 64 (the sums split elsewhere), so the size reached the kernels."""
    for B, T, H, K, V, strong in ((2, 333, 2, 32, 32, False), (4, 75, 2, 16, 16, False), (1, 130, 1, 128, 96, True)):
        xd, x64 = _cuda(make_inputs(B, T, H, K, V, gate=gate, beta_max=1.5, init=True, strong=strong), dtype)
        o_ref, s_ref = run(x64, delta, impl="reference")
        o, s = run(xd, delta, impl="triton", chunk_size=chunk_size)
        o64, _ = run(xd, delta, impl="triton", chunk_size=64)
        assert rel(o, o_ref) <= TOL[dtype] and rel(s, s_ref) <= TOL[dtype], (T, K, rel(o, o_ref), rel(s, s_ref))
        assert not torch.equal(o, o64), (T, K)
        g_ref = _grads(x64, delta, impl="reference")
        g = _grads(xd, delta, impl="triton", chunk_size=chunk_size)
        for name in g_ref:
            err = rel(g[name], g_ref[name])
            assert torch.isfinite(g[name]).all() and err <= TOL[dtype], (T, K, strong, name, err)


def _opt_in_errors(gate, delta, dtype, T, K, V, strong, fwd_kw, bwd_kw):
    """Relative errors (output, state, every gradient) of forward_triton / backward_triton with opt-in knobs against
    float64 autograd through the token loop."""
    from evict.ops.memory.triton.backward import backward_triton
    from evict.ops.memory.triton.forward import forward_triton

    xd, x64 = _cuda(make_inputs(1, T, 2, K, V, gate=gate, beta_max=1.5, init=True, strong=strong), dtype)
    leaves = {n: t.clone().requires_grad_(True) for n, t in x64.items() if t is not None}
    o_ref, s_ref = run(leaves, delta, impl="reference")
    do, ds = torch.randn_like(o_ref), torch.randn_like(s_ref)
    ref = torch.autograd.grad((o_ref * do).sum() + (s_ref * ds).sum(), list(leaves.values()))
    args = (xd["q"], xd["k"], xd["v"])
    o, s, *kept = forward_triton(*args, log_alpha=xd["log_alpha"], beta=xd["beta"], delta=delta, scale=K ** -0.5,
                                 initial_state=xd["initial_state"], **fwd_kw)
    if kept:  # keep_factors: the forward's [C, C] factors go to the backward (keep_states: every intermediate)
        bwd_kw = {**bwd_kw, ("states" if fwd_kw.get("keep_states") else "factors"): kept[0]}
    got = backward_triton(*args, xd["log_alpha"], xd["beta"], xd["initial_state"], do.to(dtype), ds.float(),
                          delta=delta, scale=K ** -0.5, **bwd_kw)
    return [rel(o, o_ref), rel(s, s_ref), *[rel(a, b) for a, b in zip([t for t in got if t is not None], ref)]]


HEADS_128 = ((333, 128, 64, False), (130, 128, 96, True), (75, 96, 32, False))  # (T, K, V, strong): odd T, a masked K
HEADS_32_TO_128 = ((333, 32, 32, False), (130, 128, 96, True), (75, 64, 32, False))  # the lab's heads of 32 too


def _check_opt_in(gate, delta, dtype, fwd_kw, bwd_kw, cases=HEADS_128):
    """Every case's output, state and gradients within the dtype's tolerance of float64 (_opt_in_errors)."""
    for T, K, V, strong in cases:
        errs = _opt_in_errors(gate, delta, dtype, T, K, V, strong, fwd_kw, bwd_kw)
        assert max(errs) <= TOL[dtype], (T, K, strong, errs)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("delta", [False, True])
@pytest.mark.parametrize("kb", [32, 64])
def test_gpu_intra_key_blocks_match_reference(dtype, delta, kb):
    """`intra_kb` (opt-in): per-channel gates' first stage by key blocks, in the forward and the
    backward's recompute, against float64 (output, state, every gradient), odd T, strong decay, a masked key block."""
    _check_opt_in("channel", delta, dtype, dict(intra_kb=kb), dict(intra_kb=kb))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate,delta", list(itertools.product(GATES, (False, True))))
@pytest.mark.parametrize("chunk", [32, 16])
def test_gpu_shorter_chunks_match_reference(dtype, gate, delta, chunk):
    """`chunk` 32 / 16 (auto_chunk's picks by shape): forward and backward against float64, odd T, the lab's heads of
    32 and heads of 128, strong decay."""
    _check_opt_in(gate, delta, dtype, dict(chunk=chunk), dict(chunk=chunk), HEADS_32_TO_128)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("delta", [False, True])
def test_gpu_dkey_block_32_matches_reference(dtype, delta):
    """`dkey_block=32` (opt-in; slower on the H200): the split key kernel with 32-column tiles, per-channel gates."""
    _check_opt_in("channel", delta, dtype, {}, dict(dkey_block=32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,prec", [(torch.float32, "tf32x3"), (torch.bfloat16, "tf32"), (torch.bfloat16, "tf32x3")])
@pytest.mark.parametrize("gate,delta", list(itertools.product(GATES, (False, True))))
@pytest.mark.parametrize("chunk", [None, 32])
def test_gpu_kept_factors_match_reference(dtype, prec, gate, delta, chunk):
    """`keep_factors` / `factors` (memory_triton's default at the forward's precision): the backward takes the forward's
    T, A~, P (first stage at `prec`), against float64 (output, state, every gradient), odd T, strong decay, K 128 and
    a masked K 96. float32 inputs keep tf32x3 factors: tf32 ones missed their 1e-3 (1.0e-3, 1.1e-3; H200, session 11)."""
    _check_opt_in(gate, delta, dtype, dict(keep_factors=prec, chunk=chunk), dict(chunk=chunk))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,prec", [(torch.float32, "tf32x3"), (torch.bfloat16, "tf32"), (torch.bfloat16, "tf32x3")])
@pytest.mark.parametrize("gate,delta", list(itertools.product(GATES, (False, True))))
@pytest.mark.parametrize("chunk", [None, 32, 16])
def test_gpu_kept_states_match_reference(dtype, prec, gate, delta, chunk):
    """`keep_states` (opt-in until measured): the backward takes every intermediate of the forward (first stage at
    `prec`, carry at tf32x3) and recomputes nothing, against float64 (output, state, every gradient), odd T, strong
    decay, the lab's heads of 32 and heads of 128."""
    _check_opt_in(gate, delta, dtype, dict(keep_factors=prec, keep_states="tf32x3", chunk=chunk), dict(chunk=chunk),
                  HEADS_32_TO_128)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate", GATES)
def test_gpu_kept_factors_off_matches_reference(dtype, gate):
    """`memory_triton(keep_factors=False)`: the backward recomputes the factors, as before they were kept — every
    gradient against float64 autograd, and equal to the default's (kept) within the dtype's tolerance."""
    for B, T, H, K, V, strong in ((2, 75, 2, 64, 32, False), (1, 130, 1, 128, 96, True)):
        xd, x64 = _cuda(make_inputs(B, T, H, K, V, gate=gate, beta_max=1.5, init=True, strong=strong), dtype)
        g_ref = _grads(x64, True, impl="reference")
        g_off = _grads(xd, True, impl="triton", keep_factors=False)
        g_on = _grads(xd, True, impl="triton")
        for name in g_ref:
            for g in (g_off, g_on):
                err = rel(g[name], g_ref[name])
                assert torch.isfinite(g[name]).all() and err <= TOL[dtype], (T, strong, name, err)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate,delta", list(itertools.product(GATES, (False, True))))
@pytest.mark.parametrize("chunk", [32, 16])
def test_gpu_dstate_stages_match_reference(dtype, gate, delta, chunk):
    """`dstate_stages=2` (opt-in until measured): the state gradient kernel pipelined, against float64, odd T, strong
    decay, the lab's heads of 32 and heads of 128."""
    _check_opt_in(gate, delta, dtype, dict(chunk=chunk), dict(chunk=chunk, dstate_stages=2), HEADS_32_TO_128)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate,delta", list(itertools.product(GATES, (False, True))))
def test_gpu_one_tile_states_match_reference(dtype, gate, delta):
    """`carry_halves=False` / `halves=False`: the state and its gradient as one tile of key rows (the two-tile forms
    are the default at K >= 64 and covered by the default tests), against float64, odd T, strong decay, K 128 and a
    masked K 96."""
    _check_opt_in(gate, delta, dtype, dict(carry_halves=False), dict(halves=False))


# The packed cases (offsets, H, K, V, strong decay, offsets' device), one test item each so that pytest-xdist spreads
# their Triton compiles over its workers (as one test, the channel-gate delta cases ran past 250 s on an H100).
PACKED_GPU_CASES = {
    "odd": (OFFSETS, 3, 128, 96, False, "cuda"),
    "whole-chunks": ([0, 128, 128, 320], 2, 128, 128, False, "cpu"),
    "strong": ([0, 0, 333, 1000, 1001, 1064, 1300], 2, 64, 64, True, "cpu"),
    "40-short-K16": (list(range(0, 41 * 37, 37)), 2, 16, 16, False, "cuda"),
    "70-fused": (list(range(0, 71 * 23, 23)), 2, 32, 32, False, "cuda"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(PACKED_GPU_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate,delta", list(itertools.product(GATES, (False, True))))
def test_gpu_packed_sequences_match_each_sequence_alone(dtype, gate, delta, case):
    """cu_seqlens through the kernels equals the kernels run on each sequence alone, and the float64 reference per
    sequence, outputs, final states and every input's gradient: odd lengths, empty sequences, 40 short sequences,
    K = 16 (zero-padded to MIN_K), strong decay; offsets on the GPU and on the CPU; 70 sequences x 2 heads (bf16: enough
    to fill an H100 / H200, so the output is fused into the carry, `fuse_out_default`); whole chunks only (no copies)."""
    offsets, H, K, V, strong, dev = PACKED_GPU_CASES[case]
    xd, x64 = _cuda(make_packed(offsets, H, K, V, gate=gate, beta_max=1.5, strong=strong, seed=K), dtype)
    cu = torch.tensor(offsets, device=dev)
    o, s = run(xd, delta, cu_seqlens=cu, impl="triton")
    assert o.dtype == dtype and s.dtype == torch.float32 and s.shape == (len(offsets) - 1, H, K, V)
    assert torch.isfinite(o).all() and torch.isfinite(s).all(), offsets
    for impl, xs in (("triton", xd), ("reference", x64)):
        o_seq, s_seq = per_sequence(xs, offsets, delta, impl=impl)
        assert rel(o, o_seq) <= TOL[dtype] and rel(s, s_seq) <= TOL[dtype], (impl, K, rel(o, o_seq), rel(s, s_seq))
    g = packed_grads(xd, offsets, delta, packed=True, cu_device=dev, impl="triton")
    for impl, xs in (("triton", xd), ("reference", x64)):
        g_seq = packed_grads(xs, offsets, delta, packed=False, impl=impl)
        for name in g_seq:
            err = rel(g[name], g_seq[name])
            assert torch.isfinite(g[name]).all() and err <= TOL[dtype], (impl, K, name, err)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate,delta", list(itertools.product(GATES, (False, True))))
def test_gpu_step_matches_reference_in_place_and_graphed(dtype, gate, delta):
    xd, x64 = _cuda(make_inputs(3, 1, 4, 128, 128, gate=gate, beta_max=2.0, init=True), dtype)
    sq = lambda x, n: None if x[n] is None else x[n][:, 0]
    o_ref, s_ref = run(x64, delta, impl="reference")
    S = xd["initial_state"].clone()
    o, s = memory_step(sq(xd, "q"), sq(xd, "k"), sq(xd, "v"), S, log_alpha=sq(xd, "log_alpha"), beta=sq(xd, "beta"), delta=delta, out=S)
    assert s is S and o.dtype == dtype
    assert rel(o, o_ref[:, 0]) <= TOL[dtype] and rel(S, s_ref) <= TOL[dtype]
    # the same step captured in a CUDA graph and replayed from the initial state
    S.copy_(xd["initial_state"])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, _ = memory_step(sq(xd, "q"), sq(xd, "k"), sq(xd, "v"), S, log_alpha=sq(xd, "log_alpha"), beta=sq(xd, "beta"), delta=delta, out=S)
    S.copy_(xd["initial_state"])
    graph.replay()
    assert rel(o_g, o_ref[:, 0]) <= TOL[dtype] and rel(S, s_ref) <= TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate,delta", list(itertools.product(GATES, (False, True))))
def test_gpu_step_rows_match_reference_in_place_and_graphed(dtype, gate, delta):
    """rows of a slot pool updated in place (the serving engine's decode step), eager and replayed from a graph."""
    from tests.ops.test_memory import step_rows_case

    x, pool, rows, o_ref, pool_ref = step_rows_case(gate, delta, dtype, "cuda")
    kw = dict(log_alpha=x["log_alpha"], beta=x["beta"], delta=delta, scale=0.3, rows=rows)
    start = pool.clone()
    o, s = memory_step(x["q"], x["k"], x["v"], pool, out=pool, **kw)
    assert s is pool and rel(o, o_ref) <= TOL[dtype] and rel(pool, pool_ref) <= TOL[dtype]
    assert torch.equal(pool[[1, 2, 4, 6]], start[[1, 2, 4, 6]])
    pool.copy_(start)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, _ = memory_step(x["q"], x["k"], x["v"], pool, out=pool, **kw)
    pool.copy_(start)
    graph.replay()
    assert rel(o_g, o_ref) <= TOL[dtype] and rel(pool, pool_ref) <= TOL[dtype]


def test_auto_chunk_rule():
    """chunk_size=None on the Triton path: 16 at key dims <= 32, else 32 with >= 64 sequence-heads or key dims > 128
    (register spills at 64), else 64; packed sequences 64 (the H200 timings behind it: BENCHMARKS.md, session 9)."""
    pytest.importorskip("triton")
    from evict.ops.memory.triton.autograd import auto_chunk

    assert [auto_chunk(256, 4, 32), auto_chunk(1, 1, 16), auto_chunk(4, 16, 128), auto_chunk(2, 32, 64)] == [16, 16, 32, 32]
    assert [auto_chunk(1, 16, 128), auto_chunk(3, 21, 128), auto_chunk(256, 4, 32, packed=True)] == [64, 64, 64]
    assert [auto_chunk(1, 1, 256), auto_chunk(1, 1, 129), auto_chunk(1, 1, 256, packed=True)] == [32, 32, 64]


@pytest.mark.gpu
@pytest.mark.parametrize("gate", GATES)
def test_gpu_chunk_size_none_is_auto_chunk(gate):
    """`memory(chunk_size=None)` on CUDA runs `auto_chunk`'s size: bit-equal to that size given explicitly, forward and
    gradients (the sizes themselves are checked against float64 by test_gpu_chunk_size_reaches_the_kernels)."""
    from evict.ops.memory.triton.autograd import auto_chunk

    for B, T, H, K, V in ((8, 70, 2, 32, 32), (4, 75, 16, 128, 64), (1, 75, 4, 128, 64)):
        xd, _ = _cuda(make_inputs(B, T, H, K, V, gate=gate, beta_max=1.5, init=True), torch.bfloat16)
        o, s = run(xd, True, impl="triton")
        o2, s2 = run(xd, True, impl="triton", chunk_size=auto_chunk(B, H, K))
        assert torch.equal(o, o2) and torch.equal(s, s2), (B, H, K)
        g, g2 = _grads(xd, True, impl="triton"), _grads(xd, True, impl="triton", chunk_size=auto_chunk(B, H, K))
        assert all(torch.equal(g[n], g2[n]) for n in g), (B, H, K)


@pytest.mark.gpu
def test_gpu_auto_picks_triton_and_bad_impl_message():
    x = make_inputs(1, 5, 1, 16, 16, gate="scalar", beta_max=1.0)
    with pytest.raises(ValueError, match="^impl:"):
        memory(x["q"], x["k"], x["v"], impl="triton")  # float64 CPU tensors


@pytest.mark.gpu
def test_gpu_auto_falls_back_to_chunked_for_large_key_dims():
    """Key dims above the kernels' 256: "auto" warns once and runs the chunked form; "triton" refuses in one line."""
    xd, x64 = _cuda(make_inputs(1, 40, 1, 320, 32, gate="channel", beta_max=1.0), torch.float32)
    with pytest.warns(UserWarning, match="exceed the Triton kernels"):
        o, s = run(xd, True, impl="auto")
    o_ref, s_ref = run(x64, True, impl="reference")
    assert rel(o, o_ref) <= 1e-5 and rel(s, s_ref) <= 1e-5
    with pytest.raises(ValueError, match="^impl: 'triton' takes key dims up to 256"):
        run(xd, True, impl="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate,delta", list(itertools.product(GATES, (False, True))))
def test_gpu_key_dims_above_128_match_reference(dtype, gate, delta):
    """Key dims 129-256 (the pairs lab's heads of 256; padded to 256, K 200 partly masked): the Triton forward and
    every input's gradient against float64 autograd through the token loop, odd T, strong decay, at the automatic
    chunk (32 there) and at chunks of 64 (the carry and state-gradient kernels in one pipeline stage)."""
    for B, T, H, K, V, strong, cs in ((2, 75, 2, 256, 256, False, None), (1, 130, 1, 200, 96, True, None),
                                      (1, 97, 2, 256, 64, True, 64)):
        xd, x64 = _cuda(make_inputs(B, T, H, K, V, gate=gate, beta_max=1.5, init=True, strong=strong), dtype)
        o_ref, s_ref = run(x64, delta, impl="reference")
        o, s = run(xd, delta, impl="triton", chunk_size=cs)
        assert torch.isfinite(o).all() and torch.isfinite(s).all(), (K, cs)
        assert rel(o, o_ref) <= TOL[dtype] and rel(s, s_ref) <= TOL[dtype], (K, cs, rel(o, o_ref), rel(s, s_ref))
        g_ref = _grads(x64, delta, impl="reference")
        g = _grads(xd, delta, impl="triton", chunk_size=cs)
        for name in g_ref:
            err = rel(g[name], g_ref[name])
            assert torch.isfinite(g[name]).all() and err <= TOL[dtype], (K, cs, strong, name, err)
