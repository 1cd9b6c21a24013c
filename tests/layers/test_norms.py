"""RMSNorm against its written-out float64 formula: outputs and gradients (input and weight), 16-bit inputs computed in
float32 and cast back, on the CPU and (gpu) on CUDA under bf16 autocast, where F.rms_norm is torch's fused kernel."""

import pytest
import torch

from evict.layers.norms import RMSNorm


def _formula(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _case(device, dtype, shape=(3, 5, 37), eps=1e-6, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g).to(device, dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(device)
    dy = torch.randn(*shape, generator=g).to(device, dtype)
    norm = RMSNorm(shape[-1], eps=eps).to(device)
    with torch.no_grad():
        norm.weight.copy_(w)
    return norm, x, dy


@pytest.mark.parametrize("shape,eps", [((3, 5, 37), 1e-6), ((2, 1, 1), 1e-5), ((4, 128), 1e-8)])
def test_float64_matches_formula(shape, eps):
    norm, x, dy = _case("cpu", torch.float64, shape, eps)
    norm.double()
    xg = x.clone().requires_grad_()
    y = norm(xg)
    dx, dw = torch.autograd.grad(y, (xg, norm.weight), dy)
    x64, w64 = x.clone().requires_grad_(), norm.weight.detach().clone().requires_grad_()
    want = _formula(x64, w64, eps)
    rdx, rdw = torch.autograd.grad(want, (x64, w64), dy)
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, rdx, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dw, rdw, rtol=1e-12, atol=1e-12)


def _sixteen_bit(device, dtype, autocast):
    norm, x, dy = _case(device, dtype, (4, 9, 256))
    xg = x.clone().requires_grad_()
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        y = norm(xg)
    dx, dw = torch.autograd.grad(y, (xg, norm.weight), dy)
    x64, w64 = x.double().requires_grad_(), norm.weight.detach().double().requires_grad_()
    want = _formula(x64, w64, norm.eps)
    rdx, rdw = torch.autograd.grad(want, (x64, w64), dy.double())
    assert y.dtype == dx.dtype == dtype and dw.dtype == torch.float32
    unit = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10  # the output's rounding
    rel = lambda a, b: float((a.detach().double() - b.detach()).norm() / b.detach().norm())  # noqa: E731
    assert rel(y, want) <= unit and rel(dx, rdx) <= 2 * unit and rel(dw, rdw) <= 1e-5, (rel(y, want), rel(dx, rdx),
                                                                                          rel(dw, rdw))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sixteen_bit_inputs_in_float32(dtype):
    _sixteen_bit("cpu", dtype, autocast=False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,autocast", [(torch.bfloat16, False), (torch.float32, True), (torch.bfloat16, True)])
def test_cuda_fused_kernel(dtype, autocast):
    if dtype == torch.float32:  # a float32 residual stream under autocast stays float32 through the norm
        norm, x, dy = _case("cuda", dtype, (4, 9, 256))
        xg = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = norm(xg)
        dx, dw = torch.autograd.grad(y, (xg, norm.weight), dy)
        x64, w64 = x.double().requires_grad_(), norm.weight.detach().double().requires_grad_()
        want = _formula(x64, w64, norm.eps)
        rdx, rdw = torch.autograd.grad(want, (x64, w64), dy.double())
        assert y.dtype == torch.float32
        for a, b in ((y, want), (dx, rdx), (dw, rdw)):
            torch.testing.assert_close(a.detach().double(), b.detach(), rtol=1e-5, atol=1e-5)
    else:
        _sixteen_bit("cuda", dtype, autocast)
