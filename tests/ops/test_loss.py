"""Chunked linear cross-entropy against float64 F.cross_entropy(h @ W.T): loss, dh, dW, accuracy counts; the Triton
chunk kernel (evict/ops/loss_triton.py) in the CPU interpreter and on CUDA."""

import json

import pytest
import torch
import torch.nn.functional as F

from evict.ops.loss import linear_cross_entropy
from tests.conftest import interpreter_fixture


def _reference(h, w, t, ignore_index=-100):
    h, w = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    logits = h @ w.t()
    loss = F.cross_entropy(logits, t, ignore_index=ignore_index)
    loss.backward()
    keep = t != ignore_index
    correct = ((logits.argmax(-1) == t) & keep).sum()
    return loss.detach(), h.grad, w.grad, int(correct), int(keep.sum())


def _row_reference(x, t, inv, ignore_index=-100):
    """float64 per row of logits x [c, V]: loss (0 on ignored rows), argmax == target, gradient (softmax - one-hot) *
    inv (0 on ignored rows)."""
    x, valid = x.double(), t != ignore_index
    safe = torch.where(valid, t, torch.zeros_like(t))
    lse = torch.logsumexp(x, -1)
    loss = torch.where(valid, lse - x.gather(1, safe[:, None])[:, 0], torch.zeros_like(lse))
    g = torch.softmax(x, -1)
    g[torch.arange(len(g)), safe] -= 1
    return loss, valid & (x.argmax(-1) == t), g * (valid.double() * float(inv))[:, None]


def _draw(N, D, V, dtype=torch.float64, ignore=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g, dtype=dtype)
    w = torch.randn(V, D, generator=g, dtype=dtype) / D ** 0.5
    t = torch.randint(0, V, (N,), generator=g)
    if ignore:
        t[torch.randperm(N, generator=g)[:ignore]] = -100
    return h.requires_grad_(), w.requires_grad_(), t


@pytest.mark.parametrize("N,D,V,rows,ignore", [(37, 13, 101, 8, 0), (37, 13, 101, 8, 11), (5, 7, 3, 1, 2),
                                               (64, 16, 50, None, 0), (19, 9, 257, 19, 4), (23, 11, 29, 100, 0)])
def test_matches_float64_reference(N, D, V, rows, ignore):
    h, w, t = _draw(N, D, V, ignore=ignore, seed=N + V)
    out = linear_cross_entropy(h, w, t, rows=rows)
    out.loss.backward()
    loss, dh, dw, correct, n = _reference(h, w, t)
    assert out.loss.dtype == h.grad.dtype == w.grad.dtype == torch.float64
    torch.testing.assert_close(out.loss, loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h.grad, dh, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w.grad, dw, rtol=1e-12, atol=1e-12)
    assert (int(out.correct), int(out.labelled)) == (correct, n)


def test_upstream_gradient_scales_and_float32():
    h, w, t = _draw(29, 10, 41, dtype=torch.float32, ignore=3, seed=3)
    out = linear_cross_entropy(h, w, t, rows=7)
    (2.5 * out.loss).backward()
    loss, dh, dw, _, _ = _reference(h, w, t)
    assert h.grad.dtype == w.grad.dtype == torch.float32
    torch.testing.assert_close(out.loss.double(), loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.grad.double(), 2.5 * dh, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w.grad.double(), 2.5 * dw, rtol=1e-4, atol=1e-6)


def test_bf16_autocast_as_close_as_the_unchunked_head():
    """Under CPU bf16 autocast the products run in bf16: the error against float64 is that of the plain
    autocast head + float32 cross-entropy (the loop's old path), not more."""
    h, w, t = _draw(96, 64, 300, dtype=torch.float32, ignore=5, seed=7)
    loss, dh, dw, _, _ = _reference(h, w, t)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear_cross_entropy(h, w, t, rows=17)
    out.loss.backward()
    ch, cw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = h @ w.t()
    assert logits.dtype == torch.bfloat16
    plain = F.cross_entropy(logits.float(), t, ignore_index=-100)
    plain.backward()

    def err(a, b):
        return float((a.double() - b).norm() / b.norm())

    assert ch.dtype == cw.dtype == torch.float32
    assert abs(float(out.loss.detach()) - float(loss)) <= 2 * abs(float(plain.detach()) - float(loss)) + 1e-3
    assert err(ch, dh) <= 1.5 * err(h.grad, dh) + 1e-3
    assert err(cw, dw) <= 1.5 * err(w.grad, dw) + 1e-3
    assert err(ch, dh) < 2e-2 and err(cw, dw) < 2e-2


def test_no_grad_and_frozen_weight():
    h, w, t = _draw(11, 5, 13, seed=1)
    with torch.no_grad():
        out = linear_cross_entropy(h, w, t, rows=4)
    loss, dh, _, _, _ = _reference(h, w, t)
    assert out.loss.grad_fn is None
    torch.testing.assert_close(out.loss, loss, rtol=1e-12, atol=1e-12)
    w.requires_grad_(False)
    linear_cross_entropy(h, w, t, rows=4).loss.backward()
    assert w.grad is None
    torch.testing.assert_close(h.grad, dh, rtol=1e-12, atol=1e-12)


def test_no_labelled_row_gives_zero():
    h, w, t = _draw(6, 4, 9, seed=2)
    t[:] = -100
    out = linear_cross_entropy(h, w, t)
    out.loss.backward()
    assert float(out.loss.detach()) == 0.0 and int(out.labelled) == 0
    assert not h.grad.any() and not w.grad.any()


# (N, D, V, rows, ignored rows): rows of one and of several of the kernel's 4,096-logit blocks, a last partial block
TRITON_CASES = [(37, 13, 101, 8, 11), (5, 7, 3, 1, 2), (20, 9, 5000, 64, 6), (3, 4, 9000, 2, 0), (6, 5, 4096, 4, 1)]

TRITON_SCRIPT = r"""
import json, sys
from evict.ops.loss import linear_cross_entropy
from tests.ops.test_loss import _draw, _reference
out = {}
for N, D, V, rows, ignore in json.loads(sys.argv[1]):
    h, w, t = _draw(N, D, V, dtype=torch.float32, ignore=ignore, seed=N + V)
    t[0] = int((h[0] @ w.t()).argmax())  # at least one argmax hit
    res = linear_cross_entropy(h, w, t, rows=rows, impl="triton")
    dh, dw = torch.autograd.grad(res.loss * 1.7, (h, w))
    loss, rdh, rdw, correct, n = _reference(h, w, t)

    def rel(a, b):
        return float((a.double() - b).norm() / b.norm().clamp_min(1e-30))

    out[f"{N}_{V}"] = [abs(float(res.loss) - float(loss)) / abs(float(loss)), rel(dh, 1.7 * rdh), rel(dw, 1.7 * rdw),
                       [int(res.correct), int(res.labelled)], [correct, n], str(res.loss.dtype), str(dh.dtype)]
from evict.ops.loss_triton import ce_rows_triton
from tests.ops.test_loss import _row_reference
V, VP = 5001, 5056  # the row kernel alone over padded rows: ties within a lane across blocks and across lanes
x = torch.zeros(5, VP)
x[:, :V] = torch.randn(5, V, generator=torch.Generator().manual_seed(1)) * 4
x[0, [7, 9, 7 + 2048, 7 + 4096]] = x[0, :V].max() + 1  # the first maximum (7) counts
x[1, [40, 3000]] = x[1, :V].max() + 1
t = torch.tensor([7, 40, -100, 11, 4999])
inv = torch.tensor(0.25)
want_loss, want_ok, want_g = _row_reference(x[:, :V], t, inv)
work = x.clone()
loss, ok = ce_rows_triton(work, t, inv, vocab=V)
out["ties"] = [float((loss.double() - want_loss).abs().max()), float((work[:, :V].double() - want_g).abs().max()),
               ok.tolist(), want_ok.int().tolist(), bool((work[:, V:] == 0).all())]
print("RESULT" + json.dumps(out))
"""


interpreted = interpreter_fixture(TRITON_SCRIPT, json.dumps(TRITON_CASES))


@pytest.mark.parametrize("case", [f"{N}_{V}" for N, _, V, _, _ in TRITON_CASES])
def test_triton_kernel_matches_float64_reference(interpreted, case):
    """float32 in the interpreter: loss and both gradients within float32 rounding of the float64 reference, the same
    argmax hits and labelled count, the float32 dtypes."""
    el, edh, edw, got, want, ldt, gdt = interpreted[case]
    assert el <= 1e-6 and edh <= 1e-5 and edw <= 1e-5, (el, edh, edw)
    assert got == want and ldt == gdt == "torch.float32"


def test_triton_row_kernel_ties_and_padding(interpreted):
    """The row kernel alone, float32 in the interpreter, over rows padded past V: the first of tied maxima is the
    argmax (ties in one lane across blocks, and across lanes), loss and gradient within float32 rounding of float64,
    the padding's gradient 0."""
    el, eg, got, want, padding = interpreted["ties"]
    assert el <= 1e-5 and eg <= 1e-7 and padding, (el, eg, padding)
    assert got == want and got[:3] == [1, 1, 0]


def test_triton_refused_where_it_cannot_run():
    h, w, t = _draw(4, 3, 5)
    with pytest.raises(ValueError, match="^impl='triton': needs CUDA"):
        linear_cross_entropy(h, w, t, impl="triton")  # float64 on the CPU
    with pytest.raises(ValueError, match="^impl: expected one of"):
        linear_cross_entropy(h, w, t, impl="fast")


@pytest.mark.parametrize("kw,name", [
    (dict(h=torch.zeros(2, 3, 4)), "h"), (dict(weight=torch.zeros(5, 4)), "weight"),
    (dict(targets=torch.zeros(6, dtype=torch.int32)), "targets"), (dict(rows=0), "rows")])
def test_bad_input_one_line(kw, name):
    args = dict(h=torch.zeros(6, 3), weight=torch.zeros(5, 3), targets=torch.zeros(6, dtype=torch.int64))
    args.update(kw)
    rows = args.pop("rows", None)
    with pytest.raises(ValueError, match=f"^{name}: expected"):
        linear_cross_entropy(args["h"], args["weight"], args["targets"], rows=rows)


@pytest.mark.gpu
@pytest.mark.parametrize("V", [32768, 50257])
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_gpu_bf16_autocast_as_close_as_the_unchunked_head(impl, V):
    """CUDA bf16 autocast at a model-like shape (several chunks; an aligned vocabulary and GPT-2's, which the Triton
    form pads), each form: loss and both gradients against float64, no worse than the plain autocast head + float32
    cross-entropy; the chunked loss's peak memory stays below the plain one's."""
    g = torch.Generator(device="cuda").manual_seed(0)
    N, D = 8192, 256
    h = torch.randn(N, D, device="cuda", generator=g).requires_grad_()
    w = (torch.randn(V, D, device="cuda", generator=g) / D ** 0.5).requires_grad_()
    t = torch.randint(0, V, (N,), device="cuda", generator=g)
    t[::7] = -100
    hd, wd = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = F.cross_entropy(hd @ wd.t(), t, ignore_index=-100)
    ref.backward()
    results = []
    for chunked in (True, False):
        h.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if chunked:
                loss = linear_cross_entropy(h, w, t, rows=2048, impl=impl).loss
            else:
                loss = F.cross_entropy((h @ w.t()).float(), t, ignore_index=-100)
        loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        results.append((float(loss.detach()), h.grad.double(), w.grad.double(), peak))

    def err(a, b):
        return float((a - b).norm() / b.norm())

    (lc, hc, wc, pc), (lp, hp, wp, pp) = results
    assert abs(lc - float(ref)) <= 2 * abs(lp - float(ref)) + 1e-3
    assert err(hc, hd.grad) <= 1.5 * err(hp, hd.grad) + 1e-3
    assert err(wc, wd.grad) <= 1.5 * err(wp, wd.grad) + 1e-3
    assert pc < pp / 2, (pc, pp)
