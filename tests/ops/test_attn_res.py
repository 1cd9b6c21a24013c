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
