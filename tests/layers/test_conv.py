"""ShortConv against the explicit formula y_t = sum_s w[k-1-s] x_{t-s}, at odd sizes, in float64."""

import pytest
import torch

from evict.layers.conv import ShortConv


def explicit(x: torch.Tensor, w: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """The token loop: x [B, T, C], w [C, k], tail [B, k-1, C] (inputs before x) -> [B, T, C]."""
    k = w.shape[1]
    xt = torch.cat([tail, x], dim=1)  # [B, k-1+T, C]; x_t sits at k-1+t
    return torch.stack([sum(w[:, k - 1 - s] * xt[:, k - 1 + t - s] for s in range(k)) for t in range(x.shape[1])], 1)


@pytest.mark.parametrize("B,T,C,k", [(3, 37, 7, 4), (2, 1, 13, 4), (1, 2, 5, 3), (2, 11, 9, 5), (3, 6, 4, 1)])
@pytest.mark.parametrize("with_tail", [False, True])
def test_matches_explicit_formula_with_gradients(B, T, C, k, with_tail):
    g = torch.Generator().manual_seed(1000 * T + 10 * C + k)
    conv = ShortConv(C, k).double()
    x = torch.randn(B, T, C, dtype=torch.float64, generator=g, requires_grad=True)
    tail = torch.randn(B, k - 1, C, dtype=torch.float64, generator=g) if with_tail else None
    y, new_tail = conv(x, tail)
    want = explicit(x, conv.weight[:, 0], tail if with_tail else x.new_zeros(B, k - 1, C))
    assert y.shape == (B, T, C) and y.is_contiguous()
    torch.testing.assert_close(y, want, rtol=0, atol=1e-13)
    # the tail is the last k-1 inputs seen, reaching into the old tail when T < k-1
    full = torch.cat([tail if with_tail else x.new_zeros(B, k - 1, C), x], 1)
    assert torch.equal(new_tail, full[:, full.shape[1] - (k - 1):])
    dy = torch.randn(B, T, C, dtype=torch.float64, generator=g)
    gx, gw = torch.autograd.grad(y, (x, conv.weight), dy)
    gx_ref, gw_ref = torch.autograd.grad(want, (x, conv.weight), dy)
    torch.testing.assert_close(gx, gx_ref, rtol=0, atol=1e-13)
    torch.testing.assert_close(gw, gw_ref, rtol=0, atol=1e-12)


def test_token_by_token_decode_equals_full_sequence():
    conv = ShortConv(11, 4).double()
    x = torch.randn(2, 23, 11, dtype=torch.float64)
    y, _ = conv(x)
    tail, steps = None, []
    for t in range(x.shape[1]):
        y_t, tail = conv(x[:, t : t + 1], tail)
        steps.append(y_t)
    torch.testing.assert_close(torch.cat(steps, 1), y, rtol=0, atol=1e-14)


def test_non_contiguous_input_and_float32():
    conv = ShortConv(6, 4)
    base = torch.randn(3, 6, 17)
    x = base.transpose(1, 2)  # [3, 17, 6], channel stride 17
    y, _ = conv(x)
    want = explicit(x.double(), conv.weight[:, 0].double(), x.new_zeros(3, 3, 6, dtype=torch.float64))
    torch.testing.assert_close(y.double(), want, rtol=0, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("autocast", [False, True])
def test_cuda_matches_explicit_formula(dtype, autocast):
    conv = ShortConv(13, 4).cuda().to(dtype)
    x = torch.randn(3, 37, 13, device="cuda", dtype=dtype, requires_grad=True)
    tail = torch.randn(3, 3, 13, device="cuda", dtype=dtype)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        y, new_tail = conv(x, tail)
    want = explicit(x.double(), conv.weight[:, 0].double(), tail.double())
    tol = 1e-5 if dtype == torch.float32 and not autocast else 3e-2
    assert y.is_contiguous() and torch.equal(new_tail, x[:, -3:])
    torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol)
    dy = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, conv.weight), dy)
    gx_ref, gw_ref = torch.autograd.grad(want, (x, conv.weight), dy.double())
    assert torch.isfinite(gx).all() and torch.isfinite(gw).all()
    torch.testing.assert_close(gx.double(), gx_ref.double(), rtol=tol, atol=tol)
    torch.testing.assert_close(gw.double(), gw_ref.to(gw.dtype).double(), rtol=tol, atol=tol * 10)
