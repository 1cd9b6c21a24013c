"""The short conv's Triton form against the float64 token formula: outputs, dx and dw, at sizes that cross the kernel's
tiles (64 rows, 128 channels), in Triton's CPU interpreter (float32 and float16) and on CUDA (float32, bf16, autocast)."""

import json

import pytest
import torch

from evict.ops.conv import short_conv
from tests.conftest import interpreter_fixture, rel
from tests.layers.test_conv import explicit

CASES = [(2, 70, 130, 4), (1, 5, 7, 3), (3, 64, 128, 4), (2, 1, 9, 4), (1, 131, 33, 2), (2, 3, 5, 1)]

SCRIPT = r"""
import json, sys
from evict.ops.conv import short_conv
from tests.conftest import rel
from tests.layers.test_conv import explicit
out = {}
for B, T, C, k in json.loads(sys.argv[1]):
    for dtype in (torch.float32, torch.float16):
        g = torch.Generator().manual_seed(100 * T + C + k)
        x = torch.randn(B, T, C, generator=g).to(dtype)
        w = torch.randn(C, k, generator=g)
        dy = torch.randn(B, T, C, generator=g).to(dtype)
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        y, tail = short_conv(xg, wg, impl="triton")
        dx, dw = torch.autograd.grad(y, (xg, wg), dy)
        x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
        want = explicit(x64, w64, x64.new_zeros(B, k - 1, C))
        dx64, dw64 = torch.autograd.grad(want, (x64, w64), dy.double())
        full = torch.cat([x.new_zeros(B, k - 1, C), x], 1)
        before = torch.randn(B, k - 1, C, generator=g).to(dtype)  # a decode / prefill tail: continued exactly
        yt, tail2 = short_conv(x, w, before, impl="triton")
        cont = rel(yt, explicit(x.double(), w.double(), before.double()))
        ok = bool(torch.equal(tail, full[:, T:])) and bool(torch.equal(tail2, torch.cat([before, x], 1)[:, T:]))
        out[f"{B}_{T}_{C}_{k}_{str(dtype)[6:]}"] = [max(rel(y, want), cont), rel(dx, dx64), rel(dw, dw64), str(y.dtype),
                                                    str(dx.dtype), str(dw.dtype), ok]
print("RESULT" + json.dumps(out))
"""


interpreted = interpreter_fixture(SCRIPT, json.dumps(CASES))


@pytest.mark.parametrize("case", [f"{B}_{T}_{C}_{k}" for B, T, C, k in CASES])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_interpreter_matches_token_formula(interpreted, case, dtype):
    ey, edx, edw, ty, tdx, tdw, tail_ok = interpreted[f"{case}_{dtype}"]
    # float32: k products summed in float32 (dw: a float32 sum over B T rows); float16: the output's rounding, 2^-11
    bound = 1e-6 if dtype == "float32" else 1e-3
    assert ey <= bound and edx <= bound and edw <= 2e-6, (ey, edx, edw)
    assert ty == tdx == f"torch.{dtype}" and tdw == "torch.float32" and tail_ok


def test_forms_refuse_bad_arguments():
    x = torch.randn(2, 5, 3)
    with pytest.raises(ValueError, match="impl must be one of"):
        short_conv(x, torch.randn(3, 4), impl="cuda")
    with pytest.raises(ValueError, match=r"x: expected \[B, T, C\] with w \[C, k\]"):
        short_conv(x, torch.randn(4, 4))
    with pytest.raises(ValueError, match=r"tail: expected shape \(2, 3, 3\)"):
        short_conv(x, torch.randn(3, 4), torch.randn(2, 2, 3))
    with pytest.raises(ValueError, match="impl='triton'"):  # a plain CPU tensor, outside the interpreter
        short_conv(x, torch.randn(3, 4), impl="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
def test_cuda_triton_matches_token_formula(dtype, autocast):
    g = torch.Generator(device="cuda").manual_seed(7)
    B, T, C, k = 4, 300, 384, 4
    x = torch.randn(B, T, C, device="cuda", generator=g)
    w = torch.randn(C, k, device="cuda", generator=g, requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        xin = x.to(dtype).requires_grad_()
        proj = xin @ torch.eye(C, device="cuda") if autocast else xin  # autocast hands the conv bf16, as a Linear does
        y, _ = short_conv(proj, w)
    dy = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (proj, w), dy)
    x64, w64 = proj.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want = explicit(x64, w64, x64.new_zeros(B, k - 1, C))
    dx64, dw64 = torch.autograd.grad(want, (x64, w64), dy.double())
    low = y.dtype != torch.float32
    assert y.dtype == proj.dtype and dw.dtype == torch.float32
    assert rel(y, want) <= (4e-3 if low else 2e-6)
    assert rel(dx, dx64) <= (4e-3 if low else 2e-6)
    assert rel(dw, dw64) <= 2e-6


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_decode_rows_with_tail_match_token_formula(T, dtype):
    """A serving step's shape: many rows of one (or a few) tokens continuing their tails (the kernel's short tiles)."""
    g = torch.Generator(device="cuda").manual_seed(8)
    B, C, k = 130, 3 * 384, 4
    x, tail = (torch.randn(B, n, C, device="cuda", generator=g).to(dtype) for n in (T, k - 1))
    w = torch.randn(C, k, device="cuda", generator=g)
    y, new_tail = short_conv(x, w, tail)
    want = explicit(x.double(), w.double(), tail.double())
    assert y.dtype == dtype and rel(y, want) <= (4e-3 if dtype != torch.float32 else 2e-6)
    assert torch.equal(new_tail, torch.cat([tail, x], 1)[:, T:])
