"""MoE expert dispatch on CUDA (issue 16): every form agrees in bfloat16 at a kimi_linear-like size, `auto` picks the
grouped kernel for bf16 training on sm90 / sm100, and that path trains with no host sync and inside a CUDA graph."""

import pytest
import torch

from evict.layers.ffn import swiglu
from evict.layers.moe import MoE
from evict.ops import moe as ops
from tests.conftest import rel

pytestmark = pytest.mark.gpu

N, D, E, K, H = 4096, 256, 16, 2, 128


@pytest.fixture(autouse=True)
def _production_kernels():
    """The suite runs in deterministic mode; training does not (its deterministic scatter / index kernels may sync)."""
    torch.use_deterministic_algorithms(False)
    yield
    torch.use_deterministic_algorithms(True, warn_only=True)


def _fast() -> bool:
    x, w = torch.zeros(1, D, device="cuda", dtype=torch.bfloat16), torch.zeros(E, H, D, device="cuda",
                                                                               dtype=torch.bfloat16)
    return ops.grouped_mm_fast(x, w, w, w.mT.contiguous())


def _case(dtype, seed=0, unused=0):
    """N tokens routed at random, except that the first `unused` experts get none."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g)
    w1, w3 = (torch.randn(E, H, D, generator=g) * D**-0.5 for _ in range(2))
    w2 = torch.randn(E, D, H, generator=g) * H**-0.5
    logits = torch.randn(N, E, generator=g)
    logits[:, :unused] = -100.0
    weights, index, _ = ops.route(logits, None, K)
    dy = torch.randn(N, D, generator=g)
    leaves = [t.cuda().to(dtype).requires_grad_(True) for t in (x, weights, w1, w3, w2)]
    return leaves, index.cuda(), dy.cuda().to(dtype)


@pytest.mark.parametrize("unused", [0, 3])
@pytest.mark.parametrize("dispatch", ["sort", "padded", "grouped", "dense", "auto"])
def test_cuda_bf16_dispatches_agree(dispatch, unused):
    """Output and gradients of each form in bfloat16 against the float64 padded form (tested = experts_reference),
    also with experts that get no token (their weight gradients must be exactly zero)."""
    ins, index, dy = _case(torch.bfloat16, unused=unused)
    if dispatch == "grouped" and ops.grouped_mm_support(ins[0], *ins[2:]) is not None:
        pytest.skip(f"grouped needs {ops.grouped_mm_support(ins[0], *ins[2:])}")
    exact = [t.detach().double().requires_grad_(True) for t in ins]
    want = ops.experts(exact[0], exact[1], index, *exact[2:], swiglu, dispatch="padded")
    y = ops.experts(ins[0], ins[1], index, *ins[2:], swiglu, dispatch=dispatch)
    assert y.dtype == torch.bfloat16 and rel(y, want) < 2e-2
    for name, a, b in zip(("x", "weights", "w1", "w3", "w2"), torch.autograd.grad(y, ins, dy),
                          torch.autograd.grad(want, exact, dy.double())):
        assert rel(a, b) < 2e-2, name
        if name in ("w1", "w3", "w2"):
            assert torch.equal(a[:unused], torch.zeros_like(a[:unused])), name


def test_cuda_autocast_grouped_matches_float32():
    """float32 weights under bf16 autocast (how `evict train` runs on CUDA): grouped casts to bf16 like the others."""
    ins, index, dy = _case(torch.float32)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        if ops.grouped_mm_support(ins[0], *ins[2:]) is not None:
            pytest.skip("torch._grouped_mm needs torch >= 2.9")
        y = ops.experts(ins[0], ins[1], index, *ins[2:], swiglu, dispatch="grouped")
        ref = ops.experts(ins[0], ins[1], index, *ins[2:], swiglu, dispatch="sort")
    assert y.dtype == ref.dtype == torch.bfloat16 and rel(y, ref) < 1e-2
    for a, b in zip(torch.autograd.grad(y, ins, dy), torch.autograd.grad(ref, ins, dy)):
        assert a.dtype == torch.float32 and rel(a, b) < 1e-2


def test_cuda_auto_dispatch_choice():
    """On CUDA "auto" picks grouped where it is one fused kernel (bf16, or float32 weights under bf16 autocast, on
    sm90 / sm100) and sort elsewhere (float32), gather for small no-grad batches, dense while capturing without
    gradients."""
    (x, wt, w1, w3, w2), index, _ = _case(torch.bfloat16)
    (xf, wtf, w1f, w3f, w2f), _, _ = _case(torch.float32)
    fused = "grouped" if _fast() else "sort"
    assert ops.auto_dispatch(x, wt, index, w1, w3, w2) == fused
    assert ops.auto_dispatch(xf, wtf, index, w1f, w3f, w2f) == "sort"
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert ops.auto_dispatch(xf, wtf, index, w1f, w3f, w2f) == fused
    with torch.no_grad():
        assert ops.auto_dispatch(x, wt, index, w1, w3, w2) == fused
        assert ops.auto_dispatch(x[:8], wt[:8], index[:8], w1, w3, w2) == "gather"
        picked = []
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            picked.append(ops.auto_dispatch(x, wt, index, w1, w3, w2))
            x.detach() * 2  # a graph needs at least one kernel
    assert picked == ["dense"]


def _layer_step(m, x):
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        y = m(x)
    loss = y.float().square().mean() + m.aux_loss
    return torch.autograd.grad(loss, list(m.parameters()))


def _grouped_layer():
    """A CUDA MoE layer dispatching through grouped (opt-in on CUDA until measured); skips where it is not fused."""
    if not _fast():
        pytest.skip("the fused torch._grouped_mm kernel needs CUDA sm90 / sm100 and torch >= 2.9")
    torch.manual_seed(0)
    m = MoE(D, E, K, H, aux_loss_coef=0.01).cuda()
    m.dispatch = "grouped"
    return m


def test_cuda_grouped_moe_training_step_has_no_host_sync():
    """The MoE layer's training forward (routing, load, aux loss, grouped experts) and backward never wait for the
    GPU: torch's sync debug mode turns any device -> host sync into an error."""
    m = _grouped_layer()
    x = torch.randn(2, N // 2, D, device="cuda")
    _layer_step(m, x)  # first-call setup (cuBLAS handles, workspaces) may sync; the steps after it may not
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _layer_step(m, x)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_cuda_graph_captures_grouped_moe_training_step():
    """With no host sync the MoE layer's whole training step captures in a CUDA graph (`evict train --graphs`);
    replayed on new input it gives the eager step's gradients."""
    m = _grouped_layer()
    x_static = torch.randn(2, N // 2, D, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            _layer_step(m, x_static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grads = _layer_step(m, x_static)
    x_new = torch.randn_like(x_static)
    x_static.copy_(x_new)
    graph.replay()
    torch.cuda.synchronize()
    want = _layer_step(m, x_new)
    for (name, _), a, b in zip(m.named_parameters(), grads, want):
        assert rel(a, b) < 1e-3, name
