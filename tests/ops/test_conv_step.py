"""conv_step: one decode token of a slot pool's rows, the tails shifted in place. Against the token formula (float64)
and, for the Triton kernel, bit-equal to the forward kernel run over [tail; x] (the path it replaces in a decode step).
CPU: the torch path; the kernel in Triton's interpreter (a subprocess). GPU (`gpu`): float32 / bf16, eager and graphed."""

import json

import pytest
import torch

from evict.ops.conv import conv_step
from tests.conftest import interpreter_fixture, rel
from tests.layers.test_conv import explicit

CASES = [(3, 130, 4), (2, 7, 3), (4, 300, 2)]  # (B, C, k): channels past one 128-wide block, odd widths


def pool_case(B, C, k, dtype=torch.float64, device="cpu", seed=0):
    """A pool of B + 3 tails, rows = B of them in a shuffled order, x [B, 1, C], w [C, k] float32; and the float64
    y and pool after the step by the token formula."""
    g = torch.Generator().manual_seed(seed)
    tails = torch.randn(B + 3, k - 1, C, generator=g).to(dtype)
    rows = torch.randperm(B + 3, generator=g)[:B]
    x = torch.randn(B, 1, C, generator=g).to(dtype)
    w = torch.randn(C, k, generator=g)
    y_ref = explicit(x.double(), w.double(), tails[rows].double())
    pool_ref = tails.double().clone()
    pool_ref[rows] = torch.cat([tails[rows].double(), x.double()], 1)[:, 1:]
    on = lambda t: t.to(device)
    return on(x), on(w), on(tails), on(rows), on(y_ref), on(pool_ref)



@pytest.fixture(autouse=True)
def _fused_on_cuda(monkeypatch):
    """This file tests the fused CUDA form (FUSED_STEP, on by default; set here should a caller turn it off); on the CPU the
    flag changes nothing."""
    import importlib

    monkeypatch.setattr(importlib.import_module("evict.ops.conv"), "FUSED_STEP", True)

@pytest.mark.parametrize("B,C,k", CASES)
def test_torch_path_matches_formula_rows_in_place(B, C, k):
    x, w, tails, rows, y_ref, pool_ref = pool_case(B, C, k)
    keep = tails.clone()
    y = conv_step(x, w, tails, rows)
    assert rel(y, y_ref) <= 1e-12 and torch.equal(tails, pool_ref)
    others = [i for i in range(B + 3) if i not in rows.tolist()]
    assert torch.equal(tails[others], keep[others])
    t2 = keep[rows].clone()  # rows None: the batch's own tails, N = B
    assert torch.equal(conv_step(x, w, t2), y) and torch.equal(t2, pool_ref[rows])


def test_conv_step_bad_input():
    x, w, tails, rows, _, _ = pool_case(3, 7, 4)
    for bad_x, bad_t in ((x.expand(3, 2, 7), tails), (x, tails[:, :2]), (x, tails[..., :5]), (x, tails[:2])):
        with pytest.raises(ValueError, match="^conv_step: expected x"):
            conv_step(bad_x, w, bad_t, rows if bad_t.shape[0] == tails.shape[0] else None)


SCRIPT = r"""
import json, sys
from evict.ops.conv import short_conv
from evict.ops.conv_triton import conv_step_triton
from tests.conftest import rel
from tests.ops.test_conv_step import pool_case
out = {}
for B, C, k in json.loads(sys.argv[1]):
    for dtype in (torch.float32, torch.float16):
        x, w, tails, rows, y_ref, pool_ref = pool_case(B, C, k, dtype)
        y_fwd, new = short_conv(x, w, tails[rows], impl="triton")  # the forward kernel over [tail; x]
        keep = tails.clone()
        y = conv_step_triton(x, w, tails, rows)
        others = [i for i in range(B + 3) if i not in rows.tolist()]
        out[f"{B}_{C}_{k}_{dtype}"] = [rel(y, y_ref), bool(torch.equal(y, y_fwd)), bool(torch.equal(tails[rows], new)),
                                       bool(torch.equal(tails[others], keep[others])), str(y.dtype)]
print("RESULT" + json.dumps(out))
"""


interpreted = interpreter_fixture(SCRIPT, json.dumps(CASES))


@pytest.mark.parametrize("case", CASES, ids=lambda c: "_".join(map(str, c)))
@pytest.mark.parametrize("dtype", ["torch.float32", "torch.float16"])
def test_interpreter_kernel_matches_formula_and_the_forward_kernel(interpreted, case, dtype):
    """float32 sums: 1e-6 of the formula on the same rounded inputs (float16: its output rounding), and bit-equal to
    the forward kernel over [tail; x]; the rows' tails shifted, the pool's other rows untouched."""
    err, same_y, same_tails, untouched, out_dtype = interpreted[f"{'_'.join(map(str, case))}_{dtype}"]
    assert err <= (1e-6 if dtype == "torch.float32" else 1e-3) and same_y and same_tails and untouched
    assert out_dtype == dtype


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: "_".join(map(str, c)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_kernel_equals_the_forward_kernel_eager_and_graphed(case, dtype):
    B, C, k = case
    x, w, tails, rows, y_ref, pool_ref = pool_case(B, C, k, dtype, "cuda")
    w = w.to(dtype)  # a bf16 model's weight: cast to float32 in the kernel, by short_conv before its kernel
    y_fwd, new = short_conv_triton(x, w, tails[rows])
    start = tails.clone()
    y = conv_step(x, w, tails, rows)
    assert torch.equal(y, y_fwd) and torch.equal(tails[rows], new)
    tails.copy_(start)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_g = conv_step(x, w, tails, rows)
    tails.copy_(start)
    graph.replay()
    assert torch.equal(y_g, y_fwd) and torch.equal(tails[rows], new)
    if dtype == torch.float32:
        assert rel(y, y_ref) <= 1e-6


def short_conv_triton(x, w, tail):
    from evict.ops.conv import short_conv

    return short_conv(x, w, tail, impl="triton")
