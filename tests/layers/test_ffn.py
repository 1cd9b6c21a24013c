"""SwiGLU and SiTU: the formulas in float64, SiTU's bound, shapes, gradients and validation."""

import pytest
import torch
import torch.nn.functional as F

from evict.layers.ffn import SiTU, SwiGLU, situ
from tests.conftest import rel


def test_situ_matches_formula_float64():
    g = torch.Generator().manual_seed(0)
    a = 8 * torch.randn(50, 37, generator=g, dtype=torch.float64)
    b = 40 * torch.randn(50, 37, generator=g, dtype=torch.float64)
    want = (4 * torch.tanh(a / 4) * torch.sigmoid(a)) * (25 * torch.tanh(b / 25))
    assert situ(a, b).dtype == torch.float64
    assert rel(situ(a, b), want) < 1e-15
    b1, b2 = 2.5, 7.0
    want2 = (b1 * torch.tanh(a / b1) / (1 + torch.exp(-a))) * (b2 * torch.tanh(b / b2))
    assert rel(situ(a, b, b1, b2), want2) < 1e-14


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_situ_bounded_for_huge_inputs(dtype):
    big = torch.tensor([-1e30, -1e4, -50.0, 0.0, 50.0, 1e4, 1e30], dtype=torch.float64)
    a, b = torch.meshgrid(big, big, indexing="ij")
    if dtype == torch.float16:
        a, b = a.clamp(-6e4, 6e4), b.clamp(-6e4, 6e4)
    h = situ(a.to(dtype), b.to(dtype))
    assert h.dtype == dtype
    assert torch.isfinite(h).all()
    assert h.abs().max().item() <= 100.0
    assert h.double().abs().max().item() > 99.0  # the caps saturate, they do not clip early


def test_swiglu_matches_formula_float64():
    torch.manual_seed(1)
    m = SwiGLU(12, 20).double()
    x = torch.randn(2, 7, 12, dtype=torch.float64)
    want = m.w2.weight @ (F.silu(m.w1.weight @ x[..., None]) * (m.w3.weight @ x[..., None]))
    assert rel(m(x), want[..., 0]) < 1e-14


def test_situ_module_matches_formula_and_casts_back():
    torch.manual_seed(2)
    m = SiTU(12, 20, beta1=3.0, beta2=10.0).double()
    x = 30 * torch.randn(2, 7, 12, dtype=torch.float64)
    a, b = x @ m.w1.weight.T, x @ m.w3.weight.T
    h = (3 * torch.tanh(a / 3) * torch.sigmoid(a)) * (10 * torch.tanh(b / 10))
    assert rel(m(x), h @ m.w2.weight.T) < 1e-14
    mb = SiTU(12, 20).to(torch.bfloat16)
    assert mb(x.to(torch.bfloat16)).dtype == torch.bfloat16


@pytest.mark.parametrize("cls", [SwiGLU, SiTU])
def test_shapes_init_and_gradients(cls):
    torch.manual_seed(3)
    m = cls(16, 40)
    assert {n for n, _ in m.named_parameters()} == {"w1.weight", "w2.weight", "w3.weight"}
    assert all(p.bias is None for p in (m.w1, m.w2, m.w3))
    assert m.w1.weight.shape == (40, 16) and m.w3.weight.shape == (40, 16) and m.w2.weight.shape == (16, 40)
    for p in m.parameters():
        assert abs(p.std().item() - 0.02) < 0.004
    x = torch.randn(3, 5, 16)
    y = m(x)
    assert y.shape == x.shape
    y.square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())


@pytest.mark.parametrize("kw,name", [
    (dict(d_model=0, d_hidden=4), "d_model"),
    (dict(d_model=4, d_hidden=-1), "d_hidden"),
    (dict(d_model=4.0, d_hidden=4), "d_model"),
])
@pytest.mark.parametrize("cls", [SwiGLU, SiTU])
def test_validation(cls, kw, name):
    with pytest.raises(ValueError, match=name):
        cls(**kw)


@pytest.mark.parametrize("kw,name", [(dict(beta1=0.0), "beta1"), (dict(beta2=-1.0), "beta2")])
def test_situ_validation(kw, name):
    with pytest.raises(ValueError, match=name):
        SiTU(4, 8, **kw)
