"""Attention Residuals: the op against its token-by-token loop, the zero-query mean, the read point and blocks."""

import pytest
import torch

from evict.layers.attn_res import AttnResRead
from evict.ops.attn_res import attn_res, attn_res_reference
from tests.conftest import rel


def _sources(S, B, T, D, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(S, 1, 1, 1, generator=g, dtype=torch.float64) * 10 + 0.1  # sources of very different norms
    return [(scale[i] * torch.randn(B, T, D, generator=g, dtype=torch.float64)).to(dtype) for i in range(S)]


@pytest.mark.parametrize("S,B,T,D", [(1, 1, 1, 4), (2, 2, 7, 13), (5, 1, 11, 60), (9, 2, 3, 100)])
@pytest.mark.parametrize("with_norm", [False, True])
def test_matches_loop_reference_float64(S, B, T, D, with_norm):
    src = _sources(S, B, T, D, seed=S * 1000 + T)
    g = torch.Generator().manual_seed(D)
    q = 2 * torch.randn(D, generator=g, dtype=torch.float64)
    nw = torch.rand(D, generator=g, dtype=torch.float64) + 0.5 if with_norm else None
    out = attn_res(src, q, norm_weight=nw)
    assert out.shape == (B, T, D) and out.dtype == torch.float64
    assert rel(out, attn_res_reference(src, q, norm_weight=nw)) < 1e-13
    assert rel(attn_res(torch.stack(src), q, norm_weight=nw), out) == 0.0  # stacked input, same answer


def test_zero_query_is_uniform_mean():
    src = _sources(4, 2, 9, 16, seed=1)
    out = attn_res(src, torch.zeros(16, dtype=torch.float64))
    assert rel(out, torch.stack(src).mean(0)) < 1e-15
    read = AttnResRead(16).double()
    assert rel(read(src), torch.stack(src).mean(0)) < 1e-15


def test_positions_never_mix():
    src = _sources(3, 2, 8, 12, seed=2)
    q = torch.randn(12, dtype=torch.float64)
    out = attn_res(src, q)
    changed = [s.clone() for s in src]
    for s in changed:
        s[1, 5] += 100.0
    out2 = attn_res(changed, q)
    diff = (out2 - out).abs().sum(-1)  # [B, T]
    assert diff[1, 5] > 0 and diff.sum() == diff[1, 5]


def test_low_precision_computes_in_float32():
    src = _sources(3, 1, 5, 32, seed=3)
    q = torch.randn(32, dtype=torch.float64)
    out = attn_res([s.to(torch.bfloat16) for s in src], q.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    ref = attn_res_reference([s.to(torch.bfloat16) for s in src], q.to(torch.bfloat16))
    assert rel(out, ref) < 1e-2


def test_read_point_gradients_and_init():
    torch.manual_seed(4)
    read = AttnResRead(10).double()
    assert torch.equal(read.query, torch.zeros(10)) and torch.equal(read.norm.weight, torch.ones(10))
    src = [torch.randn(2, 3, 10, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    (read(src) * torch.randn(2, 3, 10, dtype=torch.float64)).sum().backward()
    assert read.query.grad.abs().sum() > 0 and all(s.grad.abs().sum() > 0 for s in src)
    with torch.no_grad():
        read.query.normal_()
    read.reset_parameters()
    assert torch.equal(read.query, torch.zeros(10))


@pytest.mark.parametrize("args,name", [
    (([], torch.zeros(4)), "sources"),
    (([torch.zeros(1, 2, 4), torch.zeros(1, 3, 4)], torch.zeros(4)), "sources"),
    ((torch.zeros(2, 3, 4), torch.zeros(4)), "sources"),
    (([torch.zeros(1, 2, 4)], torch.zeros(5)), "query"),
])
def test_validation(args, name):
    with pytest.raises(ValueError, match=name):
        attn_res(*args)


def test_validation_norm_weight_and_layer():
    with pytest.raises(ValueError, match="norm_weight"):
        attn_res([torch.zeros(1, 2, 4)], torch.zeros(4), norm_weight=torch.ones(3))
    with pytest.raises(ValueError, match="d_model"):
        AttnResRead(0)


def _grads(fn, src, q, nw, go):
    leaves = [s.detach().requires_grad_() for s in src] + [q.detach().requires_grad_()]
    leaves += [] if nw is None else [nw.detach().requires_grad_()]
    out = fn(leaves[:len(src)], leaves[len(src)], norm_weight=None if nw is None else leaves[-1])
    return torch.autograd.grad(out, leaves, go)


@pytest.mark.parametrize("S,B,T,D", [(1, 1, 1, 4), (2, 2, 7, 13), (5, 1, 11, 60), (4, 3, 2, 33)])
@pytest.mark.parametrize("with_norm", [False, True])
def test_gradients_match_loop_reference_float64(S, B, T, D, with_norm):
    """Every gradient (each source, the query, the key norm's weight) of the fast form's written-out backward
    against autograd through the token-by-token loop."""
    src = _sources(S, B, T, D, seed=S * 100 + D)
    g = torch.Generator().manual_seed(T)
    q = 2 * torch.randn(D, generator=g, dtype=torch.float64)
    nw = torch.rand(D, generator=g, dtype=torch.float64) + 0.5 if with_norm else None
    go = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    fast, ref = _grads(attn_res, src, q, nw, go), _grads(attn_res_reference, src, q, nw, go)
    for a, b in zip(fast, ref):
        assert rel(a, b) < 1e-12


def test_gradcheck_and_mixed_dtypes():
    """torch.autograd.gradcheck (finite differences) on odd sizes; a float32 + bfloat16 list (the LM's embedding and
    block sums under autocast) mixes in float32, returns float32, and gives each source a gradient of its own dtype."""
    src = [s.requires_grad_() for s in _sources(3, 2, 3, 5, seed=7)]
    q = torch.randn(5, dtype=torch.float64, requires_grad=True)
    nw = (torch.rand(5, dtype=torch.float64) + 0.5).requires_grad_()
    assert torch.autograd.gradcheck(lambda q, nw, *s: attn_res(list(s), q, norm_weight=nw), (q, nw, *src))
    mixed = [s.detach().float().requires_grad_() for s in src[:1]] + [s.detach().bfloat16().requires_grad_() for s in src[1:]]
    out = attn_res(mixed, q.detach().float())
    assert out.dtype == torch.float32
    assert rel(out, attn_res_reference([m.detach() for m in mixed], q.detach().float())) < 1e-6
    out.sum().backward()
    assert [m.grad.dtype for m in mixed] == [torch.float32, torch.bfloat16, torch.bfloat16]


def test_saves_sources_by_reference_and_never_stacks():
    """The autograd graph of one read keeps the sources themselves (no copy) and only [S, B, T] or [D] tensors
    besides: the stacked form saved S normalized [S, B, T, D] copies per read (the +85 % step time, issue 79)."""
    S, B, T, D = 4, 2, 16, 32
    src = [torch.randn(B, T, D, requires_grad=True) for _ in range(S)]
    q, nw = torch.randn(D, requires_grad=True), torch.rand(D, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = attn_res(src, q, norm_weight=nw)
    big = [t for t in saved if t.numel() >= B * T * D]
    assert sorted(t.data_ptr() for t in big) == sorted(s.data_ptr() for s in src)
    assert sum(t.numel() for t in saved if t.numel() < B * T * D) <= 3 * S * B * T + 3 * D
    out.sum().backward()
    assert all(s.grad is not None and s.grad.shape == (B, T, D) for s in src)


def test_bf16_autocast_keeps_float32_logits():
    """Under a bf16 autocast the dot products and the backward's products stay float32 (autocast would round them)."""
    src = [s.float() for s in _sources(3, 2, 5, 24, seed=8)]
    q = torch.randn(24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attn_res(src, q)
    assert out.dtype == torch.float32 and torch.equal(out, attn_res(src, q))


def test_compiles_whole_with_its_backward():
    """torch.compile (fullgraph: no graph break; aot_eager: AOTAutograd derives the backward of the plain ops that
    compiled code traces, `_mix`) against the float64 loop, output and every gradient; odd sizes."""
    import torch._dynamo

    torch._dynamo.reset()
    src = _sources(3, 2, 5, 23, seed=9)
    g = torch.Generator().manual_seed(9)
    q, nw = torch.randn(23, generator=g, dtype=torch.float64), torch.rand(23, generator=g, dtype=torch.float64) + 0.5
    go = torch.randn(2, 5, 23, generator=g, dtype=torch.float64)
    compiled = torch.compile(attn_res, backend="aot_eager", fullgraph=True)
    assert rel(compiled(src, q, norm_weight=nw), attn_res_reference(src, q, norm_weight=nw)) < 1e-13
    for a, b in zip(_grads(compiled, src, q, nw, go), _grads(attn_res_reference, src, q, nw, go)):
        assert rel(a, b) < 1e-12


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_gpu_eager_and_inductor_match_float64_loop(compiled):
    """On CUDA: float32 sources (eager: mv / addr / tensordot; Inductor: the fused forms) against the float64 loop,
    output and every gradient, odd sizes; and a bf16 source under a bf16 autocast mixes in float32."""
    import torch._dynamo

    torch._dynamo.reset()
    src = _sources(4, 2, 37, 97, seed=11)
    g = torch.Generator().manual_seed(11)
    q, nw = torch.randn(97, generator=g, dtype=torch.float64), torch.rand(97, generator=g, dtype=torch.float64) + 0.5
    go = torch.randn(2, 37, 97, generator=g, dtype=torch.float64)
    fn = torch.compile(attn_res, fullgraph=True) if compiled else attn_res
    cuda = [s.float().cuda() for s in src]
    args = (q.float().cuda(), nw.float().cuda(), go.float().cuda())
    ref_in = [s.float().double() for s in src]
    out = fn(cuda, args[0], norm_weight=args[1])
    assert out.dtype == torch.float32
    assert rel(out.cpu(), attn_res_reference(ref_in, q.float().double(), norm_weight=nw.float().double())) < 1e-5
    fast = _grads(fn, cuda, *args)
    ref = _grads(attn_res_reference, ref_in, q.float().double(), nw.float().double(), go.float().double())
    for a, b in zip(fast, ref):
        assert rel(a.cpu(), b) < 1e-4
    with torch.autocast("cuda", dtype=torch.bfloat16):
        mixed = fn([cuda[0]] + [c.bfloat16() for c in cuda[1:]], args[0])
    assert mixed.dtype == torch.float32
    assert rel(mixed.cpu(), attn_res_reference([ref_in[0]] + [c.bfloat16().double().cpu() for c in cuda[1:]],
                                               q.float().double())) < 1e-5
