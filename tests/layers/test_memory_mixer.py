"""The linear mixer's ELU + 1 feature map (`_elu1`, written from where / exp so compiled backwards can view its
gradient) against float64 F.elu + 1: values and gradients, odd sizes, extreme-but-valid inputs."""

import torch
import torch.nn.functional as F

from evict.layers.memory_mixer import _elu1


def test_elu1_is_elu_plus_one_in_value_and_gradient():
    torch.manual_seed(0)
    x = torch.cat([torch.randn(3, 7, 5).flatten() * 4, torch.tensor([-1e4, -88.0, -1e-8, 0.0, 1e-8, 88.0, 1e4])])
    for dtype in (torch.float64, torch.float32):
        a = x.to(dtype).clone().requires_grad_()
        b = x.double().clone().requires_grad_()
        ya, yb = _elu1(a), F.elu(b) + 1
        g = torch.randn_like(yb)
        ya.backward(g.to(dtype))
        yb.backward(g)
        # the reference's expm1(x) + 1 cancels for x << 0 (absolute error up to float64's eps at 1, 2.2e-16; _elu1's
        # exp(x) does not), so values agree to that absolute bound in float64, to float32's rounding in float32
        rtol, atol = (0.0, 2.3e-16) if dtype == torch.float64 else (1.3e-6, 1e-30)
        assert torch.isfinite(ya).all() and torch.isfinite(a.grad).all()
        torch.testing.assert_close(ya.double(), yb.detach(), rtol=rtol, atol=atol)
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=rtol, atol=atol)
