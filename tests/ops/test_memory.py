"""The memory op: every faster form against the float64 token-by-token reference."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from evict.ops import memory, memory_step
from tests.conftest import rel

GATES = ("none", "scalar", "channel")


HARD_RESET = torch.finfo(torch.float32).min  # log alpha at float32's most negative value: alpha = 0, a "hard reset"


def make_inputs(B, T, H, K, V, *, gate, beta_max, dtype=torch.float64, init=False, seed=None, strong=False, reset=0.0):
    """Random op inputs in float64 (cast to dtype). `reset`: the fraction of gate entries set to HARD_RESET."""
    g = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    q = r(B, T, H, K)
    k = F.normalize(r(B, T, H, K), dim=-1)
    v = r(B, T, H, V)
    if gate == "none":
        la = None
    else:
        shape = (B, T, H) if gate == "scalar" else (B, T, H, K)
        la = -20 * torch.rand(*shape, generator=g, dtype=torch.float64) if strong else F.logsigmoid(r(*shape) + 2.5)
    if la is not None and reset:
        la = torch.where(torch.rand(la.shape, generator=g, dtype=torch.float64) < reset, HARD_RESET, la)
    beta = None if beta_max is None else beta_max * torch.rand(B, T, H, generator=g, dtype=torch.float64)
    S0 = r(B, H, K, V) if init else None
    cast = lambda x: None if x is None else x.to(dtype)
    return dict(q=cast(q), k=cast(k), v=cast(v), log_alpha=cast(la), beta=cast(beta), initial_state=S0 if S0 is None else S0.to(torch.float64 if dtype == torch.float64 else torch.float32))


def rounded(inputs, dtype=torch.float32):
    """The inputs rounded to `dtype` and back to float64: the reference on what a `dtype` kernel sees."""
    return {n: None if t is None else t.to(dtype).double() for n, t in inputs.items()}


def run(inputs, delta, **kw):
    x = dict(inputs)
    return memory(x.pop("q"), x.pop("k"), x.pop("v"), delta=delta, output_final_state=True, **x, **kw)


@pytest.mark.parametrize("gate,delta,beta_max", list(itertools.product(GATES, (False, True), (1.0, 2.0))))
@pytest.mark.parametrize("T", [1, 2, 63, 64, 65, 200])
def test_chunked_matches_reference_float64(gate, delta, beta_max, T):
    for cs, init in ((16, False), (32, True), (64, True), (64, False)):
        x = make_inputs(2, T, 3, 12, 7, gate=gate, beta_max=beta_max, init=init)
        o_ref, s_ref = run(x, delta, impl="reference")
        o, s = run(x, delta, impl="chunked", chunk_size=cs)
        assert o.dtype == torch.float64 and s.dtype == torch.float64
        assert rel(o, o_ref) <= 1e-10, (cs, init)
        assert rel(s, s_ref) <= 1e-10, (cs, init)


@pytest.mark.parametrize("gate", GATES)
def test_chunked_every_chunk_size_matches_reference(gate):
    """The chunk dial's sizes below 16 and above 128: 1 (one token per chunk) up to one padded chunk for everything."""
    x = make_inputs(1, 37, 2, 12, 7, gate=gate, beta_max=2.0, init=True)
    o_ref, s_ref = run(x, True, impl="reference")
    for cs in (1, 2, 4, 8, 256):
        o, s = run(x, True, impl="chunked", chunk_size=cs)
        assert rel(o, o_ref) <= 1e-10 and rel(s, s_ref) <= 1e-10, cs


def test_chunk_size_none_is_64_on_the_pytorch_forms():
    """chunk_size=None (the default; the Triton path picks its own) runs the chunked form at 64, packed or not."""
    x = make_inputs(1, 150, 2, 12, 7, gate="channel", beta_max=2.0, init=True)
    o, s = run(x, True, impl="chunked")
    o64, s64 = run(x, True, impl="chunked", chunk_size=64)
    o32, _ = run(x, True, impl="chunked", chunk_size=32)
    assert torch.equal(o, o64) and torch.equal(s, s64) and not torch.equal(o, o32)
    offsets = torch.tensor([0, 70, 150])
    x2 = {**x, "initial_state": x["initial_state"].expand(2, -1, -1, -1).contiguous()}
    o, s = run(x2, True, impl="chunked", cu_seqlens=offsets)
    o64, s64 = run(x2, True, impl="chunked", chunk_size=64, cu_seqlens=offsets)
    assert torch.equal(o, o64) and torch.equal(s, s64)


@pytest.mark.parametrize("gate,delta", list(itertools.product(GATES, (False, True))))
def test_chunked_matches_reference_long(gate, delta):
    x = make_inputs(1, 1000, 2, 16, 8, gate=gate, beta_max=1.0, init=True)
    o_ref, s_ref = run(x, delta, impl="reference")
    for cs in (16, 64, 128):
        o, s = run(x, delta, impl="chunked", chunk_size=cs)
        assert rel(o, o_ref) <= 1e-10 and rel(s, s_ref) <= 1e-10, cs


@pytest.mark.parametrize("gate,delta,beta_max", list(itertools.product(GATES, (False, True), (1.0, 2.0))))
def test_chunked_float32_matches_reference(gate, delta, beta_max):
    x64 = make_inputs(2, 200, 2, 16, 8, gate=gate, beta_max=beta_max, init=True, seed=7)
    o_ref, s_ref = run(x64, delta, impl="reference")
    x32 = {n: None if t is None else t.float() for n, t in x64.items()}
    o, s = run(x32, delta, impl="chunked", chunk_size=32)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    assert rel(o, o_ref) <= 1e-5 and rel(s, s_ref) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("gate,delta,reset", [("channel", False, 0.0), ("channel", True, 0.0), ("channel", True, 0.05),
                                              ("scalar", True, 0.05)])
def test_gpu_chunked_captures_in_a_cuda_graph(gate, delta, reset):
    """The torch chunked form on CUDA has no host sync (per-channel gates take the exact sub-chunked Gram off the CPU),
    so a CUDA graph captures its forward and backward; the replay equals the float64 reference."""
    x64 = make_inputs(2, 200, 2, 16, 8, gate=gate, beta_max=2.0, init=True, seed=3, reset=reset)
    o_ref, s_ref = run(x64, delta, impl="reference")
    g_ref = _grads(x64, delta, impl="reference")
    leaves = {n: t.float().cuda().requires_grad_(True) for n, t in x64.items() if t is not None}
    wo, ws = (w.float().cuda() for w in _loss_weights(o_ref, s_ref))

    def step():
        o, s = run(leaves, delta, impl="chunked", chunk_size=32, check=False)  # check=True syncs (value checks)
        return (o, s, *torch.autograd.grad((o * wo).sum() + (s * ws).sum(), list(leaves.values())))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, s, *grads = step()
    graph.replay()
    torch.cuda.synchronize()
    assert rel(o.cpu(), o_ref) <= 1e-5 and rel(s.cpu(), s_ref) <= 1e-5
    for name, gr in zip(leaves, grads):
        assert torch.isfinite(gr).all() and rel(gr.cpu(), g_ref[name]) <= 1e-4, name


def _loss_weights(o, s):
    """The fixed random weights of the gradient tests' loss sum(o * wo) + sum(s * ws), in o's and s's dtypes."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(o.shape, generator=g, dtype=o.dtype), torch.randn(s.shape, generator=g, dtype=s.dtype)


def _grads(x, delta, **kw):
    leaves = {n: t.clone().requires_grad_(True) for n, t in x.items() if t is not None}
    o, s = run(leaves, delta, **kw)
    wo, ws = _loss_weights(o, s)
    return dict(zip(leaves, torch.autograd.grad((o * wo).sum() + (s * ws).sum(), list(leaves.values()))))


@pytest.mark.parametrize("gate,delta,beta_max", list(itertools.product(GATES, (False, True), (1.0, 2.0))))
@pytest.mark.parametrize("T,cs", [(1, 16), (63, 32), (65, 64), (200, 16)])
def test_gradients_match_reference(gate, delta, beta_max, T, cs):
    x = make_inputs(2, T, 2, 10, 6, gate=gate, beta_max=beta_max, init=True)
    g_ref = _grads(x, delta, impl="reference")
    g = _grads(x, delta, impl="chunked", chunk_size=cs)
    assert set(g) == set(g_ref) == {n for n, t in x.items() if t is not None}
    for name in g_ref:
        assert rel(g[name], g_ref[name]) <= 1e-10, name


@pytest.mark.parametrize("gate,delta", list(itertools.product(GATES, (False, True))))
def test_split_sequence_equals_whole(gate, delta):
    x = make_inputs(2, 150, 2, 8, 8, gate=gate, beta_max=1.0, init=True)
    o, s = run(x, delta, impl="chunked", chunk_size=32)
    cut = 77
    first = {n: (t[:, :cut] if t is not None and n != "initial_state" else t) for n, t in x.items()}
    o1, s1 = run(first, delta, impl="chunked", chunk_size=32)
    second = {n: (t[:, cut:] if t is not None and n != "initial_state" else t) for n, t in x.items()}
    second["initial_state"] = s1
    o2, s2 = run(second, delta, impl="chunked", chunk_size=32)
    assert rel(torch.cat([o1, o2], 1), o) <= 1e-12 and rel(s2, s) <= 1e-12


@pytest.mark.parametrize("gate,delta", list(itertools.product(GATES, (False, True))))
def test_step_iterated_equals_sequence(gate, delta):
    x = make_inputs(2, 40, 3, 8, 5, gate=gate, beta_max=2.0, init=True)
    o_seq, s_seq = run(x, delta, impl="chunked", chunk_size=16)
    S = x["initial_state"]
    for t in range(40):
        la = None if x["log_alpha"] is None else x["log_alpha"][:, t]
        o, S = memory_step(x["q"][:, t], x["k"][:, t], x["v"][:, t], S, log_alpha=la, beta=x["beta"][:, t], delta=delta, check=True)
        assert rel(o, o_seq[:, t]) <= 1e-12
    assert rel(S, s_seq) <= 1e-12


def step_rows_case(gate, delta, dtype=torch.float64, device="cpu", seed=None):
    """A pool of 7 states and a step of 3 of its rows [5, 0, 3]: (inputs of the step in dtype, pool, rows, and the
    float64 o and pool after the step by the reference on the gathered rows, from the same rounded inputs; all on
    device)."""
    x = make_inputs(7, 1, 2, 12, 5, gate=gate, beta_max=2.0, init=True, seed=seed)
    rows = torch.tensor([5, 0, 3])
    sq = {n: None if t is None or n == "initial_state" else t[rows, 0].to(dtype) for n, t in x.items()}  # [3, H, ...]
    pool = x["initial_state"].to(torch.float64 if dtype == torch.float64 else torch.float32)
    d = {n: None if t is None else t.double() for n, t in sq.items()}
    o_ref, S_rows = memory_step(d["q"], d["k"], d["v"], pool.double()[rows], log_alpha=d["log_alpha"], beta=d["beta"],
                                delta=delta, scale=0.3)
    pool_ref = pool.to(torch.float64, copy=True)
    pool_ref[rows] = S_rows
    on = lambda t: None if t is None else t.to(device)
    return {n: on(t) for n, t in sq.items()}, on(pool), on(rows), on(o_ref), on(pool_ref)


@pytest.mark.parametrize("gate,delta", list(itertools.product(GATES, (False, True))))
def test_step_rows_updates_the_pool_rows_in_place(gate, delta):
    """rows: the step reads and writes rows of a larger pool of states, as the step on the gathered rows does; the
    other rows stay exactly; out=None leaves the pool alone (a copy), out=pool writes in place."""
    x, pool, rows, o_ref, pool_ref = step_rows_case(gate, delta)
    kw = dict(log_alpha=x["log_alpha"], beta=x["beta"], delta=delta, scale=0.3, rows=rows)
    before = pool.clone()
    o, S = memory_step(x["q"], x["k"], x["v"], pool, **kw)
    assert torch.equal(pool, before) and S is not pool
    assert rel(o, o_ref) <= 1e-12 and rel(S, pool_ref) <= 1e-12
    o, S = memory_step(x["q"], x["k"], x["v"], pool, out=pool, **kw)
    assert S is pool and rel(o, o_ref) <= 1e-12 and rel(pool, pool_ref) <= 1e-12
    assert torch.equal(pool[[1, 2, 4, 6]], before[[1, 2, 4, 6]])


def test_step_rows_bad_input():
    x, pool, rows, _, _ = step_rows_case("scalar", True)
    for bad in (rows[:2], rows.float(), [5, 0, 3], rows[:, None]):
        with pytest.raises(ValueError, match="^rows: expected an int64/int32 tensor"):
            memory_step(x["q"], x["k"], x["v"], pool, log_alpha=x["log_alpha"], beta=x["beta"], delta=True, rows=bad)
    with pytest.raises(ValueError, match="^state: expected shape"):
        memory_step(x["q"], x["k"], x["v"], pool[:, :1], log_alpha=x["log_alpha"], beta=x["beta"], delta=True, rows=rows)
    for bad in ([7, 0, 3], [5, -1, 3]):  # ids outside the pool of 7: refused (on a CPU always; on CUDA with check)
        with pytest.raises(ValueError, match=r"^rows: expected slot ids in \[0, 7\)"):
            memory_step(x["q"], x["k"], x["v"], pool, log_alpha=x["log_alpha"], beta=x["beta"], delta=True,
                        rows=torch.tensor(bad), out=pool)
    with pytest.raises(ValueError, match="^state: expected a tensor"):  # the state named, not rows
        memory_step(x["q"], x["k"], x["v"], None, log_alpha=x["log_alpha"], beta=x["beta"], delta=True, rows=rows)
    with pytest.raises(ValueError, match="^q: expected a tensor"):  # a bad q with rows: its own line, no traceback
        memory_step([1.0], x["k"], x["v"], pool, log_alpha=x["log_alpha"], beta=x["beta"], delta=True, rows=rows)


def test_step_dtypes():
    q = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    S = torch.zeros(2, 3, 8, 4)
    o, S2 = memory_step(q, q, torch.randn(2, 3, 4, dtype=torch.bfloat16), S, delta=True, beta=torch.rand(2, 3, dtype=torch.bfloat16))
    assert o.dtype == torch.bfloat16 and S2.dtype == torch.float32


@pytest.mark.parametrize("gate,delta", [("scalar", True), ("channel", True), ("channel", False)])
def test_strong_decay_long_sequence_float32(gate, delta):
    """log alpha down to -20 per step over T = 65,536: finite, and equal to the reference."""
    x64 = make_inputs(1, 65536, 1, 8, 4, gate=gate, beta_max=1.0, init=True, strong=True, seed=3)
    x32 = {n: None if t is None else t.float() for n, t in x64.items()}
    o, s = run(x32, delta, impl="chunked", chunk_size=64)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    o_ref, s_ref = run(x64, delta, impl="reference")
    assert rel(o, o_ref) <= 1e-5 and rel(s, s_ref) <= 1e-5


@pytest.mark.parametrize("gate,delta", [("scalar", True), ("scalar", False), ("channel", True), ("channel", False)])
@pytest.mark.parametrize("reset", [0.05, 0.3, 1.0])
def test_hard_resets_are_finite_and_equal_the_reference(gate, delta, reset):
    """log alpha at float32's most negative value, on consecutive tokens too, mixed with ordinary small decays: every
    form is finite and equals the float64 token loop on the raw (unclamped) gates, at the ordinary tolerances."""
    from evict.ops.memory.reference import memory_reference

    x64 = make_inputs(2, 150, 2, 12, 7, gate=gate, beta_max=2.0, init=True, seed=21, reset=reset)
    x = dict(x64)
    o_ref, s_ref = memory_reference(x.pop("q"), x.pop("k"), x.pop("v"), delta=delta, scale=12 ** -0.5, **x)
    assert torch.isfinite(o_ref).all() and torch.isfinite(s_ref).all()
    x32 = {n: None if t is None else t.float() for n, t in x64.items()}
    for inputs, tol in ((x64, 1e-10), (x32, 1e-5)):
        for impl, cs in (("reference", 64), ("chunked", 16), ("chunked", 64)):
            o, s = run(inputs, delta, impl=impl, chunk_size=cs)
            assert torch.isfinite(o).all() and torch.isfinite(s).all(), (impl, cs)
            assert rel(o, o_ref) <= tol and rel(s, s_ref) <= tol, (impl, cs, o.dtype, rel(o, o_ref), rel(s, s_ref))
    S = x32["initial_state"]
    for t in range(150):
        o, S = memory_step(x32["q"][:, t], x32["k"][:, t], x32["v"][:, t], S, log_alpha=x32["log_alpha"][:, t],
                           beta=x32["beta"][:, t], delta=delta)
        assert rel(o, o_ref[:, t]) <= 1e-5, t
    assert rel(S, s_ref) <= 1e-5


@pytest.mark.parametrize("gate", ["scalar", "channel"])
def test_hard_reset_gradients_match_reference(gate):
    x = make_inputs(2, 70, 2, 8, 5, gate=gate, beta_max=1.0, init=True, seed=4, reset=0.2)
    x["log_alpha"] = torch.where(x["log_alpha"] == HARD_RESET, -1e30, x["log_alpha"])  # another extreme value
    g_ref = _grads(x, True, impl="reference")
    g = _grads(x, True, impl="chunked", chunk_size=16)
    for name in g_ref:
        assert torch.isfinite(g[name]).all() and rel(g[name], g_ref[name]) <= 1e-10, name


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_per_channel_two_factor_form_equals_exact_form(dtype):
    """Both per-channel Gram forms (two-factor matmul below the safe spread, exact sub-chunk ratios) agree."""
    from evict.ops.memory.chunked import _decayed_dots

    g = torch.Generator().manual_seed(11)
    x, y = torch.randn(3, 64, 16, generator=g, dtype=dtype), torch.randn(3, 64, 16, generator=g, dtype=dtype)
    la = torch.nn.functional.logsigmoid(torch.randn(3, 64, 16, generator=g, dtype=dtype) + 2)
    gc = la.cumsum(-2)
    assert float((-gc[..., -1, :]).max()) < 30  # inside the safe spread for both dtypes
    (a,), (b,) = _decayed_dots((x,), y, gc, factor=True), _decayed_dots((x,), y, gc, factor=False)
    assert rel(a, b) <= (1e-12 if dtype == torch.float64 else 1e-5)


def test_constant_minus_20_decay_forgets_everything():
    x = make_inputs(1, 300, 2, 8, 4, gate="channel", beta_max=1.0, init=True, seed=5)
    x = {n: None if t is None else t.float() for n, t in x.items()}
    x["log_alpha"] = torch.full_like(x["log_alpha"], -20.0)
    o, s = run(x, True, impl="chunked", chunk_size=128)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    # with alpha = e^-20 the state is (to float32) just the last write: S = beta_T k_T^T v_T
    last = x["beta"][:, -1, :, None, None] * x["k"][:, -1, :, :, None] * x["v"][:, -1, :, None, :]
    assert rel(s, last) <= 1e-6


# -- packed variable-length sequences (cu_seqlens) --------------------------------------------------------------

OFFSETS = [0, 1, 66, 70, 200]  # odd lengths 1, 65, 4, 130: sequences shorter than, equal to and longer than a chunk


def make_packed(offsets, H, K, V, *, gate, beta_max=1.0, seed=0, strong=False, reset=0.0, init=True):
    """make_inputs for sequences packed along T (batch of one), with one initial state per sequence."""
    x = make_inputs(1, offsets[-1], H, K, V, gate=gate, beta_max=beta_max, seed=seed, strong=strong, reset=reset)
    g = torch.Generator().manual_seed(seed + 1)
    x["initial_state"] = torch.randn(len(offsets) - 1, H, K, V, generator=g, dtype=torch.float64) if init else None
    return x


def per_sequence(x, offsets, delta, **kw):
    """The obviously-correct packed run: `memory` on each sequence alone, outputs concatenated, final states stacked."""
    outs, states = [], []
    for n, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
        one = {name: None if t is None else (t[n:n + 1] if name == "initial_state" else t[:, a:b]) for name, t in x.items()}
        o, s = run(one, delta, **kw)
        outs.append(o)
        states.append(s)
    return torch.cat(outs, 1), torch.cat(states, 0)


def packed_grads(x, offsets, delta, *, packed: bool, cu_device="cpu", **kw):
    """Gradients of every input of a fixed random loss on o and the final states, packed (cu_seqlens) or per sequence."""
    leaves = {n: t.clone().requires_grad_(True) for n, t in x.items() if t is not None}
    if packed:
        o, s = run(leaves, delta, cu_seqlens=torch.tensor(offsets, device=cu_device), **kw)
    else:
        o, s = per_sequence(leaves, offsets, delta, **kw)
    g = torch.Generator().manual_seed(1)
    w = lambda t: torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.device)  # noqa: E731
    loss = (o.double() * w(o)).sum() + (s.double() * w(s)).sum()
    got = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)  # unused: every sequence empty
    return {n: torch.zeros_like(t) if d is None else d for (n, t), d in zip(leaves.items(), got)}


@pytest.mark.parametrize("gate,delta", list(itertools.product(GATES, (False, True))))
@pytest.mark.parametrize("impl,cs", [("reference", 64), ("chunked", 16), ("chunked", 64)])
def test_packed_sequences_equal_each_sequence_alone(gate, delta, impl, cs):
    """cu_seqlens: outputs, final states and every input's gradient (initial states too) equal the reference run on
    each sequence alone, float64; and an empty sequence passes its initial state through."""
    for offsets in (OFFSETS, [0, 0, 37, 37, 40]):
        x = make_packed(offsets, 2, 10, 6, gate=gate, beta_max=1.5, seed=len(offsets) + offsets[2])
        o_ref, s_ref = per_sequence(x, offsets, delta, impl="reference")
        o, s = run(x, delta, cu_seqlens=torch.tensor(offsets), impl=impl, chunk_size=cs)
        assert o.shape == o_ref.shape and s.shape == s_ref.shape == (len(offsets) - 1, 2, 10, 6)
        assert rel(o, o_ref) <= 1e-10 and rel(s, s_ref) <= 1e-10, (offsets, rel(o, o_ref), rel(s, s_ref))
        g_ref = packed_grads(x, offsets, delta, packed=False, impl="reference")
        g = packed_grads(x, offsets, delta, packed=True, impl=impl, chunk_size=cs)
        for name in g_ref:
            assert rel(g[name], g_ref[name]) <= 1e-10, (offsets, name)
    empty = [n for n, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])) if a == b]
    assert empty and torch.equal(s[empty], x["initial_state"][empty])


@pytest.mark.parametrize("gate", ["scalar", "channel"])
@pytest.mark.parametrize("kind", ["strong", "reset"])
def test_packed_sequences_strong_decay_and_hard_resets(gate, kind):
    """log alpha ~ U(-20, 0), or 20% hard resets, packed: float32 chunked equals the float64 reference per sequence."""
    x64 = make_packed(OFFSETS, 2, 8, 5, gate=gate, seed=5, strong=kind == "strong", reset=0.2 if kind == "reset" else 0.0)
    o_ref, s_ref = per_sequence(x64, OFFSETS, True, impl="reference")
    x32 = {n: None if t is None else t.float() for n, t in x64.items()}
    o, s = run(x32, True, cu_seqlens=torch.tensor(OFFSETS, dtype=torch.int32), impl="chunked", chunk_size=32)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel(o, o_ref) <= 1e-5 and rel(s, s_ref) <= 1e-5, (rel(o, o_ref), rel(s, s_ref))
    g_ref = packed_grads(x64, OFFSETS, True, packed=False, impl="reference")
    g = packed_grads(x64, OFFSETS, True, packed=True, impl="chunked", chunk_size=16)
    for name in g_ref:
        assert torch.isfinite(g[name]).all() and rel(g[name], g_ref[name]) <= 1e-10, name


def test_packed_equal_lengths_equal_the_batch():
    """Offsets [0, T, 2T, 3T] over the batch laid end to end give the batched op's outputs and states."""
    x = make_inputs(3, 50, 2, 8, 4, gate="channel", beta_max=1.0, init=True, seed=2)
    o_b, s_b = run(x, True, impl="chunked", chunk_size=16)
    packed = {n: None if t is None else (t if n == "initial_state" else t.reshape(1, 150, *t.shape[2:])) for n, t in x.items()}
    o, s = run(packed, True, cu_seqlens=torch.tensor([0, 50, 100, 150]), impl="chunked", chunk_size=16)
    assert rel(o, o_b.reshape(1, 150, 2, 4)) <= 1e-12 and rel(s, s_b) <= 1e-12


@pytest.mark.parametrize("cu,kw,match", [
    (torch.tensor([0, 2, 5]).float(), {}, r"^cu_seqlens: expected dtype int64 \(or int32\), got torch.float32$"),
    ([0, 2, 5], {}, r"^cu_seqlens: expected a 1-D tensor of offsets \[N \+ 1\]"),
    (torch.tensor([[0, 2, 5]]), {}, r"^cu_seqlens: expected a 1-D tensor of offsets \[N \+ 1\] \(N >= 1 sequences\), got \[1, 3\]$"),
    (torch.tensor([0]), {}, r"^cu_seqlens: expected a 1-D tensor of offsets"),
    (torch.tensor([1, 2, 5]), {}, r"^cu_seqlens: expected the first offset 0, got 1$"),
    (torch.tensor([0, 2, 4]), {}, r"^cu_seqlens: expected the last offset T = 5 \(q's length\), got 4$"),
    (torch.tensor([0, 3, 2, 5]), {}, r"^cu_seqlens: expected non-decreasing offsets, got 2 after 3 at index 2$"),
    (torch.tensor([0, 2, 5]), {"batch": 2}, r"^cu_seqlens: expected q, k, v with batch size 1 \(sequences packed along T\), got q \[2, 5, 3, 4\]$"),
    (torch.tensor([0, 2, 5]), {"initial_state": torch.zeros(1, 3, 4, 6)},
     r"^initial_state: expected shape \[2, 3, 4, 6\] \(\[N, H, Dk, Dv\]: one per sequence of cu_seqlens\), got \[1, 3, 4, 6\]$"),
    (torch.tensor([0, 2, 5]), {"check": False, "initial_state": torch.zeros(2, 3, 4, 6)}, None),
    (torch.tensor([0, 6, 5]), {"check": False}, r"^cu_seqlens: expected non-decreasing offsets"),
])
def test_cu_seqlens_bad_inputs_raise_clear_errors(cu, kw, match):
    """One-line errors naming the argument; offsets are checked even with check=False (an offset out of range would
    index outside the tensors). The None row is the valid call, so the cases above differ from it in one thing."""
    kw = dict(kw)
    q, k, v = _ok(B=kw.pop("batch", 1))
    if match is None:
        o, s = memory(q, k, v, cu_seqlens=cu, output_final_state=True, **kw)
        assert o.shape == (1, 5, 3, 6) and s.shape == (2, 3, 4, 6)
        return
    with pytest.raises(ValueError, match=match):
        memory(q, k, v, cu_seqlens=cu, **kw)


# -- the worked examples of MEMORY.md (d = 4, scale = 1) -------------------------------------------------------

def seq(*rows):
    """[T, D] rows -> [1, T, 1, D] float64."""
    return torch.tensor(rows, dtype=torch.float64)[None, :, None, :]


K_CAT, K_DOG = [1.0, 0, 0, 0], [0.6, 0.8, 0, 0]
V_MOCHI, V_REX, V_BISCUIT = [2.0, 1, 0, 1], [0.0, 3, 1, 2], [1.0, 0, 2, 2]


@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_example_interference(impl):
    o, S = memory(seq(K_CAT, K_DOG, K_CAT), seq(K_CAT, K_DOG, [0.0] * 4), seq(V_MOCHI, V_REX, [0.0] * 4),
                  scale=1.0, impl=impl, output_final_state=True)
    read = o[0, 2, 0]
    assert torch.allclose(read, torch.tensor([2, 2.8, 0.6, 2.2], dtype=torch.float64), atol=1e-14)
    assert torch.allclose(read - torch.tensor(V_MOCHI, dtype=torch.float64), 0.6 * torch.tensor(V_REX, dtype=torch.float64), atol=1e-14)


@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_example_delta_overwrite(impl):
    k_other = [0.0, 0, 1, 0]
    ks = seq(K_CAT, k_other, K_CAT, [0.0] * 4, [0.0] * 4)
    vs = seq(V_MOCHI, V_REX, V_BISCUIT, [0.0] * 4, [0.0] * 4)
    qs = seq(K_CAT, k_other, K_CAT, K_CAT, k_other)
    o, _ = memory(qs, ks, vs, beta=torch.ones(1, 5, 1, dtype=torch.float64), delta=True, scale=1.0, impl=impl)
    assert torch.equal(o[0, 3, 0], torch.tensor(V_BISCUIT, dtype=torch.float64))
    assert torch.equal(o[0, 4, 0], torch.tensor(V_REX, dtype=torch.float64))


def test_example_chunk_equals_sequence_pseudo_value():
    """With S0 = 0, beta = 1, keys k_cat, k_dog in one chunk: u_2 = v_Rex - 0.6 v_Mochi = [-1.2, 2.4, 1, 1.4]."""
    from evict.ops.memory.chunked import _decayed_dots

    k = torch.tensor([K_CAT, K_DOG], dtype=torch.float64)
    v = torch.tensor([V_MOCHI, V_REX], dtype=torch.float64)
    A = _decayed_dots((k,), k, None)[0].tril(-1)
    u = torch.linalg.solve_triangular(A, v, upper=False, unitriangular=True)
    assert torch.allclose(u[1], torch.tensor([-1.2, 2.4, 1, 1.4], dtype=torch.float64), atol=1e-14)
    # and the sequential rule writes the same pseudo-value: u_2 = v_2 - k_2 S_1
    S1 = torch.outer(k[0], v[0])
    assert torch.allclose(v[1] - k[1] @ S1, u[1], atol=1e-14)
    # so the chunked op's state equals the sequential one
    _, S = memory(k[None, :, None], k[None, :, None], v[None, :, None], delta=True, impl="chunked", output_final_state=True)
    assert torch.allclose(S[0, 0], S1 + torch.outer(k[1], u[1]), atol=1e-14)


@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_example_survival(impl):
    zeros = [0.0] * 4
    la = torch.log(torch.tensor([1.0, 0.9, 0.5, 0.9], dtype=torch.float64))[None, :, None]
    o, _ = memory(seq(zeros, zeros, zeros, K_CAT), seq(K_CAT, zeros, zeros, zeros), seq(V_MOCHI, zeros, zeros, zeros),
                  log_alpha=la, scale=1.0, impl=impl)
    assert torch.allclose(o[0, 3, 0], 0.405 * torch.tensor(V_MOCHI, dtype=torch.float64), atol=1e-14)


@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_example_same_key_twice(impl):
    k = torch.tensor([[1.0, 3.0]] * 2, dtype=torch.float64)[None, :, None]
    v = torch.tensor([[2.0, 4.0], [0.0, 1.0]], dtype=torch.float64)[None, :, None]
    o_add, _ = memory(k, k, v, scale=1.0, impl=impl)
    assert torch.allclose(o_add[0, 1, 0], torch.tensor([20.0, 50.0], dtype=torch.float64), atol=1e-12)
    beta = torch.full((1, 2, 1), 0.1, dtype=torch.float64)
    o_delta, _ = memory(k, k, v, beta=beta, delta=True, scale=1.0, impl=impl)
    assert torch.allclose(o_delta[0, 1, 0], torch.tensor([0.0, 1.0], dtype=torch.float64), atol=1e-12)


# -- validation ------------------------------------------------------------------------------------------------

def _ok(B=2, T=5, H=3, K=4, V=6):
    return torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, V)


@pytest.mark.parametrize("mutate,match", [
    (lambda a: {**a, "q": a["q"][0]}, r"^q: expected shape \[B, T, H, D\]"),
    (lambda a: {**a, "k": a["k"][:, :4]}, r"^k: expected the shape of q"),
    (lambda a: {**a, "v": a["v"][:1]}, r"^v: expected leading dims"),
    (lambda a: {**a, "k": a["k"].double()}, r"^k: expected dtype"),
    (lambda a: {**a, "q": a["q"].long(), "k": a["k"].long()}, r"^q: expected a floating dtype"),
    (lambda a: {**a, "log_alpha": torch.zeros(2, 5, 3, 6)}, r"^log_alpha: expected shape \[2, 5, 3\]"),
    (lambda a: {**a, "log_alpha": torch.full((2, 5, 3), 0.5)}, r"^log_alpha: expected values <= 0"),
    (lambda a: {**a, "beta": torch.zeros(2, 5)}, r"^beta: expected shape \[2, 5, 3\]"),
    (lambda a: {**a, "beta": torch.full((2, 5, 3), 2.5)}, r"^beta: expected values in \[0, 2\]"),
    (lambda a: {**a, "initial_state": torch.zeros(2, 3, 4, 4)}, r"^initial_state: expected shape \[2, 3, 4, 6\]"),
    (lambda a: {**a, "initial_state": torch.zeros(2, 3, 4, 6, dtype=torch.bfloat16)}, r"^initial_state: expected float32"),
    (lambda a: {**a, "v": a["v"].index_fill(1, torch.tensor([2]), float("nan"))}, r"^v: contains NaN or Inf"),
    (lambda a: {**a, "chunk_size": 48}, r"^chunk_size: expected None or one of"),
    (lambda a: {**a, "chunk_size": 16.0}, r"^chunk_size: expected None or one of"),
    (lambda a: {**a, "impl": "fast"}, r"^impl: expected one of"),
    (lambda a: {**a, "q": a["q"].new_zeros(*a["q"].shape[:-1], 320), "k": a["k"].new_zeros(*a["k"].shape[:-1], 320),
                "impl": "triton"}, r"^impl: 'triton' takes key dims up to 256"),
])
def test_bad_inputs_raise_clear_errors(mutate, match):
    q, k, v = _ok()
    args = mutate(dict(q=q, k=k, v=v))
    with pytest.raises(ValueError, match=match):
        memory(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def test_step_requires_state():
    q = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match=r"^state: expected"):
        memory_step(q, q, q, None)
    with pytest.raises(ValueError, match=r"^q: expected shape \[B, H, D\]"):
        memory_step(q[None], q, q, torch.zeros(2, 3, 4, 4))


def test_dispatch_check_compiles_without_warnings(monkeypatch):
    """The Triton dispatch check sits inside every compiled mixer; Dynamo used to warn on each compile that it traced
    through its functools.cache wrapper (session 26's lab hybrid logs were mostly that warning). Its first call may
    come inside the trace (a compiled block before any eager call): it compiles, and the flag is set after."""
    import importlib
    import warnings

    tri = importlib.import_module("evict.ops.memory.triton")
    monkeypatch.setattr(tri, "_AVAILABLE", None)
    runs_on = tri.runs_on

    def pick(t):
        return t * 2 if runs_on(t) else t - 1

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(pick, backend="eager", fullgraph=True)(torch.ones(3))
    assert isinstance(tri._AVAILABLE, bool)
    assert torch.equal(out, pick(torch.ones(3)))
    assert not [w for w in caught if "lru_cache" in str(w.message)], [str(w.message) for w in caught]
