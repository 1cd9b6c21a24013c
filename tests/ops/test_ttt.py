"""The test-time-training frame (evict/ops/memory/ttt.py): every extension at its neutral setting is the op, the step
form against the float64 reference (outputs, every state field, gradients), the chunked inner steps against the
literal ones, a hand-computed case, and one-line errors for bad settings."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from evict.ops import memory, memory_step
from evict.ops.memory.ttt import TTT, TTTState, inner_steps_beta, ttt_memory, ttt_step
from tests.conftest import rel
from tests.ops.test_memory import GATES, make_inputs

SETTINGS = {  # name -> (TTT, uses momentum)
    "momentum": (TTT(), True),
    "inner3": (TTT(inner_steps=3), False),
    "adaptive": (TTT(adaptive=0.7), False),
    "second_order": (TTT(second_order=1.3, stat_decay=0.9), False),
    "all": (TTT(inner_steps=2, adaptive=0.5, second_order=0.4, stat_decay=0.8), True),
}


def inputs(B, T, H, K, V, *, gate, beta_max=2.0, momentum=True, init=False, dtype=torch.float64, seed=None):
    x = make_inputs(B, T, H, K, V, gate=gate, beta_max=beta_max, dtype=dtype, init=init, seed=seed)
    g = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    x["momentum"] = torch.rand(B, T, H, generator=g, dtype=torch.float64).to(dtype) if momentum else None
    return x


def run_steps(x, ttt, state=None):
    """The step form over a sequence: o [B, T, H, V] and the last TTTState."""
    B, T, H, K = x["q"].shape
    st = state if state is not None else torch.zeros(B, H, K, x["v"].shape[-1], dtype=torch.float64)
    at = lambda name, t: None if x.get(name) is None else x[name][:, t]  # noqa: E731
    outs = []
    for t in range(T):
        o, st = ttt_step(x["q"][:, t], x["k"][:, t], x["v"][:, t], st, log_alpha=at("log_alpha", t),
                         beta=at("beta", t), momentum=at("momentum", t), ttt=ttt)
        outs.append(o)
    return torch.stack(outs, dim=1), st


def ref(x, ttt, **kw):
    y = {n: x.get(n) for n in ("log_alpha", "beta", "momentum", "initial_state")}
    return ttt_memory(x["q"], x["k"], x["v"], **y, ttt=ttt, **kw)


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("beta_max", [None, 2.0])
def test_neutral_settings_are_the_op_exactly(gate, beta_max):
    for dtype in (torch.float64, torch.float32):
        x = inputs(2, 13, 3, 5, 7, gate=gate, beta_max=beta_max, momentum=False, init=True, dtype=dtype)
        args = dict(log_alpha=x["log_alpha"], beta=x["beta"], delta=True)
        o0, S0 = memory(x["q"], x["k"], x["v"], **args, initial_state=x["initial_state"], impl="reference",
                        output_final_state=True)
        o1, st = ref(x, TTT())
        assert torch.equal(o0, o1) and torch.equal(S0, st.S) and st[1:] == (None, None, None)
        o2, st2 = ref(x, TTT(), impl="chunked", chunk_size=4)
        oc, Sc = memory(x["q"], x["k"], x["v"], **args, initial_state=x["initial_state"], impl="chunked",
                        chunk_size=4, output_final_state=True)
        assert torch.equal(o2, oc) and torch.equal(st2.S, Sc)
        s0 = x["initial_state"]
        a = {n: (None if t is None else t[:, 5]) for n, t in args.items() if n != "delta"}
        o3, S3 = memory_step(x["q"][:, 5], x["k"][:, 5], x["v"][:, 5], s0, **a, delta=True)
        o4, st4 = ttt_step(x["q"][:, 5], x["k"][:, 5], x["v"][:, 5], s0, **a)
        assert torch.equal(o3, o4) and torch.equal(S3, st4.S)


@pytest.mark.parametrize("gate", GATES)
def test_zero_momentum_and_zero_strengths_are_the_op_to_rounding(gate):
    """μ = 0 keeps a momentum state (S' + (X − S') instead of X): the op to float64 rounding, not bit for bit."""
    x = inputs(2, 11, 2, 6, 3, gate=gate)
    x["momentum"] = torch.zeros_like(x["momentum"])
    o0, S0 = memory(x["q"], x["k"], x["v"], log_alpha=x["log_alpha"], beta=x["beta"], delta=True, impl="reference",
                    output_final_state=True)
    o1, st = ref(x, TTT(stat_decay=0.5))
    assert rel(o1, o0) <= 1e-14 and rel(st.S, S0) <= 1e-14 and st.M is not None


@pytest.mark.parametrize("name,gate", list(itertools.product(SETTINGS, GATES)))
@pytest.mark.parametrize("T", [1, 13])
def test_step_form_matches_the_float64_reference(name, gate, T):
    ttt, use_mu = SETTINGS[name]
    x = inputs(2, T, 3, 5, 7, gate=gate, momentum=use_mu, init=True)
    x["k"] = x["k"] * 1.3  # unnormalised keys: λ = Σ p k² is not 1
    o_ref, st_ref = ref(x, ttt)
    o, st = run_steps(x, ttt, state=TTTState(x["initial_state"], *(None,) * 3))
    o_seq, st_seq = ref(x, ttt, impl="step")  # the step form over the sequence: the same token function
    assert torch.equal(o_seq, o) and all(a is None or torch.equal(a, b) for a, b in zip(st_seq, st))
    assert rel(o, o_ref) <= 1e-12
    for a, b in zip(st, st_ref):
        assert (a is None) == (b is None)
        if a is not None:
            assert rel(a, b) <= 1e-12


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("m", [2, 5])
def test_chunked_inner_steps_match_the_literal_steps(gate, m):
    x = inputs(2, 37, 2, 6, 5, gate=gate, momentum=False, init=True, beta_max=1.0)
    o_ref, st_ref = ref(x, TTT(inner_steps=m))
    for cs in (1, 4, 16):
        o, st = ref(x, TTT(inner_steps=m), impl="chunked", chunk_size=cs)
        assert rel(o, o_ref) <= 1e-10 and rel(st.S, st_ref.S) <= 1e-10, cs


@pytest.mark.parametrize("gate", ["none", "scalar"])
@pytest.mark.parametrize("m", [1, 3])
def test_chunked_momentum_matches_the_reference(gate, m):
    """(S, M) in chunks (ttt_momentum.py): odd T, a shorter last chunk, μ = 0 on some tokens, hard resets."""
    x = inputs(2, 37, 3, 5, 4, gate=gate, init=True)
    x["momentum"][:, ::4] = 0.0
    if gate == "scalar":
        x["log_alpha"][:, 7] = torch.finfo(torch.float64).min  # a hard reset (clamped to the float64 floor)
    x["initial_state"] = TTTState(x["initial_state"], torch.randn_like(x["initial_state"]))
    o_ref, st_ref = ref(x, TTT(inner_steps=m))
    for cs in (1, 4, 16, 64):
        o, st = ref(x, TTT(inner_steps=m), impl="chunked", chunk_size=cs)
        assert rel(o, o_ref) <= 1e-10 and rel(st.S, st_ref.S) <= 1e-10 and rel(st.M, st_ref.M) <= 1e-10, cs


def test_gradients_of_the_chunked_momentum_match_the_reference():
    x = inputs(1, 19, 2, 5, 3, gate="scalar", init=True, beta_max=1.0)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items() if t is not None}
    grads = []
    for impl in ("reference", "chunked"):
        o, st = ref(leaves, TTT(inner_steps=2), impl=impl, chunk_size=8)
        grads.append(torch.autograd.grad(o.pow(2).sum() + st.S.sum() + st.M.pow(2).sum(), list(leaves.values())))
    for n, a, b in zip(leaves, *grads):
        assert rel(a, b) <= 1e-10, n


def test_inner_steps_by_hand():
    """One unit key, S' holding `old` at k, β = ½: each SGD step halves the residual, so after m steps the read is
    v − 2^{-m} (v − old); the closed form says β_m = 1 − 2^{-m}."""
    K, V = 4, 3
    k = torch.tensor([0.6, 0.8, 0.0, 0.0], dtype=torch.float64)
    old, v = torch.tensor([2.0, 1.0, 0.0], dtype=torch.float64), torch.tensor([1.0, 0.0, 2.0], dtype=torch.float64)
    S = torch.outer(k, old)[None, None]  # [1, 1, K, V]: reading k gives `old`
    for m in (1, 2, 3, 6):
        o, st = ttt_step(k[None, None], k[None, None], v[None, None], S, beta=torch.full((1, 1), 0.5, dtype=torch.float64),
                         scale=1.0, ttt=TTT(inner_steps=m))
        assert torch.allclose(o[0, 0], v - 0.5**m * (v - old), rtol=0, atol=1e-14), m
        assert float(inner_steps_beta(k[None], torch.tensor([0.5], dtype=torch.float64), m)) == pytest.approx(1 - 0.5**m)


def test_momentum_by_hand():
    """Two writes of the same unit key with β = 1, μ = ½: M₁ = kᵀv₁, S₁ = kᵀv₁; the second step's displacement is
    kᵀ(v₂ − v₁), M₂ = ½ kᵀv₁ + kᵀ(v₂ − v₁), so the read overshoots to v₂ + ½ v₁."""
    k = torch.tensor([[[1.0, 0.0]]], dtype=torch.float64)[:, :, None].expand(1, 2, 1, 2)  # [1, 2, 1, 2]
    v = torch.tensor([[[[2.0, 4.0]], [[0.0, 1.0]]]], dtype=torch.float64)
    o, _ = ttt_memory(k, k, v, momentum=torch.full((1, 2, 1), 0.5, dtype=torch.float64), scale=1.0)
    assert torch.equal(o[0, 1, 0], v[0, 1, 0] + 0.5 * v[0, 0, 0])


@pytest.mark.parametrize("name", list(SETTINGS))
def test_gradients_of_the_step_form_match_the_reference(name):
    ttt, use_mu = SETTINGS[name]
    x = inputs(1, 9, 2, 5, 3, gate="channel", momentum=use_mu, init=True, beta_max=1.0)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items() if t is not None}
    grads = []
    for form in ("reference", "step"):
        if form == "reference":
            o, st = ref(leaves, ttt)
        else:
            o, st = run_steps(leaves, ttt, state=TTTState(leaves["initial_state"]))
        w = torch.linspace(-1, 1, o.numel(), dtype=torch.float64).reshape(o.shape)
        loss = (o * w).sum() + st.S.pow(2).sum()
        grads.append(torch.autograd.grad(loss, list(leaves.values())))
    for n, a, b in zip(leaves, *grads):
        assert rel(a, b) <= 1e-10, n


def test_gradients_of_the_chunked_inner_steps_match_the_reference():
    x = inputs(1, 21, 2, 5, 3, gate="scalar", momentum=False, init=True, beta_max=1.0)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items() if t is not None}
    grads = []
    for impl in ("reference", "chunked"):
        o, st = ref(leaves, TTT(inner_steps=3), impl=impl, chunk_size=8)
        grads.append(torch.autograd.grad(o.pow(2).sum() + st.S.sum(), list(leaves.values())))
    for n, a, b in zip(leaves, *grads):
        assert rel(a, b) <= 1e-10, n


def test_the_reference_gradient_is_the_finite_difference():
    x = inputs(1, 4, 1, 3, 2, gate="scalar", init=True, beta_max=1.0, seed=3)
    names = [n for n, t in x.items() if t is not None]
    ttt = TTT(inner_steps=2, adaptive=0.5, second_order=0.3, stat_decay=0.9)

    def f(*ts):
        o, st = ttt_memory(*ts[:3], **dict(zip(names[3:], ts[3:])), ttt=ttt)
        return o, st.S, st.M

    assert torch.autograd.gradcheck(f, tuple(x[n].clone().requires_grad_() for n in names))


def test_float32_inputs_keep_a_float32_state():
    x = inputs(2, 5, 2, 4, 3, gate="scalar", dtype=torch.float32)
    o, st = ref(x, SETTINGS["all"][0])
    assert o.dtype == torch.float32 and all(t.dtype == torch.float32 for t in st)
    x64 = {n: None if t is None else t.double() for n, t in x.items()}
    o64, _ = ref(x64, SETTINGS["all"][0])
    assert rel(o, o64) <= 1e-5


@pytest.mark.parametrize("kw,message", [
    (dict(inner_steps=0), "inner_steps: expected an int in 1"),
    (dict(inner_steps=2.0), "inner_steps: expected an int in 1"),
    (dict(inner_steps=True), "inner_steps: expected an int in 1"),
    (dict(adaptive=-1.0), "adaptive: expected a finite number >= 0"),
    (dict(second_order=float("nan")), "second_order: expected a finite number >= 0"),
    (dict(stat_decay=1.5), "stat_decay: expected a number in [0, 1]"),
])
def test_bad_settings_get_one_line(kw, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[")) as e:
        TTT(**kw)
    assert "\n" not in str(e.value)


def test_bad_calls_get_one_line():
    x = inputs(1, 3, 2, 4, 3, gate="none")
    q, k, v = x["q"], x["k"], x["v"]
    cases = [
        (lambda: ttt_memory(q, k, v, momentum=torch.zeros(1, 3)), "momentum: expected a floating tensor of shape"),
        (lambda: ttt_memory(q, k, v, momentum=torch.full((1, 3, 2), 1.5, dtype=torch.float64)),
         "momentum: expected values in [0, 1]"),
        (lambda: ttt_memory(q, k, v, ttt={"inner_steps": 2}), "ttt: expected a TTT(...)"),
        (lambda: ttt_memory(q, k, v, impl="triton"), "impl: expected one of ('reference', 'step', 'chunked')"),
        (lambda: ttt_memory(q, k, v, momentum=x["momentum"], log_alpha=torch.zeros_like(q), impl="chunked"),
         "channel has none here"),
        (lambda: ttt_memory(q, k, v, ttt=TTT(adaptive=1.0), impl="chunked"), "adaptive has none here"),
        (lambda: ttt_memory(q, k, v, ttt=TTT(second_order=1.0), impl="chunked"), "second_order has none here"),
        (lambda: ttt_memory(q, k, v, ttt=TTT(inner_steps=2), impl="chunked", chunk_size=3), "chunk_size: expected"),
        (lambda: ttt_step(q[:, 0], k[:, 0], v[:, 0], None), "state: expected a TTTState"),
        (lambda: ttt_step(q[:, 0], k[:, 0], v[:, 0], TTTState(torch.zeros(1, 2, 4, 3, dtype=torch.float64),
                                                              n=torch.zeros(1, 2, 4, dtype=torch.float64))),
         "state.n: given, but the settings do not use it"),
        (lambda: ttt_step(q[:, 0], k[:, 0], v[:, 0], TTTState(torch.zeros(1, 2, 4, 3, dtype=torch.float64),
                                                              n=torch.zeros(1, 2, 3, dtype=torch.float64)),
                          ttt=TTT(adaptive=1.0)), "state.n: expected a torch.float64 tensor of shape [1, 2, 4]"),
        (lambda: ttt_memory(q, k[..., :3], v), "k: expected the shape of q"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError) as e:
            call()
        assert message in str(e.value) and "\n" not in str(e.value), (message, str(e.value))


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=40, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 2), T=st.integers(1, 6), H=st.integers(1, 2), K=st.integers(1, 5), V=st.integers(1, 4),
       gate=st.sampled_from(GATES), m=st.integers(1, 4), a=st.sampled_from([0.0, 0.3, 4.0]),
       c=st.sampled_from([0.0, 0.5, 3.0]), rho=st.sampled_from([0.0, 0.7, 1.0]), use_mu=st.booleans(),
       seed=st.integers(0, 2**20))
def test_property_step_form_equals_reference(B, T, H, K, V, gate, m, a, c, rho, use_mu, seed):
    ttt = TTT(inner_steps=m, adaptive=a, second_order=c, stat_decay=rho)
    x = inputs(B, T, H, K, V, gate=gate, momentum=use_mu, seed=seed)
    o_ref, st_ref = ref(x, ttt)
    o, st_ = run_steps(x, ttt)
    assert torch.isfinite(o).all() and rel(o, o_ref) <= 1e-11
    assert rel(st_.S, st_ref.S) <= 1e-11


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(x=st.floats(0.0, 2.0), m=st.integers(1, 12))
def test_property_inner_steps_close_to_one_step(x, m):
    """β_m λ = 1 − (1 − βλ)^m for a unit key: the residual after m steps is (1 − βλ)^m of the first."""
    k = F.normalize(torch.ones(1, 3, dtype=torch.float64), dim=-1)
    bm = inner_steps_beta(k, torch.tensor([x], dtype=torch.float64), m)
    assert float(bm) == pytest.approx(1 - (1 - x) ** m, abs=1e-12)
