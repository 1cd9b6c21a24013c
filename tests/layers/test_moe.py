"""MoE: routing, load and balance (ops), every expert dispatch against per-token loops, the layer end to end."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from evict.layers.ffn import situ, swiglu
from evict.layers.moe import MoE
from evict.ops import moe as ops
from tests.conftest import rel


def _rand_routing(N, E, k, g):
    index = torch.rand(N, E, generator=g).topk(k, dim=-1).indices  # [N, k] distinct experts per token
    weights = torch.rand(N, k, generator=g, dtype=torch.float64)
    return weights, index


def _rms(u, w, eps=1e-6):
    return u / torch.sqrt(u.pow(2).mean(-1, keepdim=True) + eps) * w


# ---- ops ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scaling", [1.0, 2.5])
def test_route_weights_sum_to_scaling_and_follow_scores(scaling):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(41, 9, generator=g, dtype=torch.float64)
    w, idx, s = ops.route(logits, torch.zeros(9, dtype=torch.float64), 3, scaling)
    assert w.shape == (41, 3) and idx.shape == (41, 3) and s.shape == (41, 9)
    assert torch.allclose(w.sum(-1), torch.full((41,), scaling, dtype=torch.float64), rtol=0, atol=1e-14)
    assert torch.equal(s, torch.sigmoid(logits))
    assert torch.equal(idx.sort(-1).values, s.topk(3, dim=-1).indices.sort(-1).values)
    chosen = s.gather(-1, idx)
    assert rel(w, chosen / chosen.sum(-1, keepdim=True) * scaling) < 1e-15


def test_bias_changes_selection_not_weight_values():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(30, 6, generator=g, dtype=torch.float64)
    bias = torch.zeros(6, dtype=torch.float64)
    bias[4] = 10.0  # expert 4 always wins the choice
    w0, i0, s = ops.route(logits, None, 2)
    w1, i1, _ = ops.route(logits, bias, 2)
    assert (i1 == 4).any(-1).all() and not torch.equal(i0, i1)
    chosen = s.gather(-1, i1)  # weights come from the raw scores of whatever was chosen, never s + b
    assert rel(w1, chosen / chosen.sum(-1, keepdim=True)) < 1e-15
    same = (i0.sort(-1).values == i1.sort(-1).values).all(-1)  # tokens whose choice did not change
    assert rel(w1[same].sort(-1).values, w0[same].sort(-1).values) < 1e-15


def test_route_gradient_reaches_logits_not_bias():
    logits = torch.randn(20, 5, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(5, dtype=torch.float64, requires_grad=True)
    w, _, _ = ops.route(logits, bias, 2)
    (w * torch.randn_like(w)).sum().backward()
    assert logits.grad.abs().sum() > 0 and bias.grad is None


def test_expert_load_and_aux_loss():
    index = torch.tensor([[0, 1], [0, 2], [0, 1]])
    load = ops.expert_load(index, 4)
    assert torch.equal(load, torch.tensor([3, 2, 1, 0]) / 6.0)
    scores = torch.full((3, 4), 0.5, dtype=torch.float64, requires_grad=True)  # P uniform = 1/4
    loss = ops.switch_aux_loss(scores, index, 4, 2)
    assert abs(loss.item() - 4 * (1 / 4)) < 1e-15  # E * sum f_i * (1/E) = 1 for any f
    loss.backward()
    assert scores.grad.abs().sum() > 0
    skewed = torch.tensor([[0.9, 0.9, 0.1, 0.1]] * 3, dtype=torch.float64)
    assert ops.switch_aux_loss(skewed, index, 4, 2).item() > 1.0  # mass where the load is
    with pytest.raises(ValueError, match="index"):
        ops.switch_aux_loss(scores, index, 4, 3)


def test_balance_bias_update_sign():
    bias = torch.zeros(4)
    ops.balance_bias_update(bias, torch.tensor([0.5, 0.25, 0.25, 0.0]), 0.1)
    assert torch.allclose(bias, torch.tensor([-0.1, 0.0, 0.0, 0.1]))


@pytest.mark.parametrize("kw,name", [
    (dict(logits=torch.zeros(3, 4, 1), bias=None, top_k=1), "logits"),
    (dict(logits=torch.zeros(3, 4), bias=torch.zeros(5), top_k=1), "bias"),
    (dict(logits=torch.zeros(3, 4), bias=None, top_k=5), "top_k"),
    (dict(logits=torch.zeros(3, 4), bias=None, top_k=0), "top_k"),
])
def test_route_validation(kw, name):
    with pytest.raises(ValueError, match=name):
        ops.route(**kw)


def _experts_case(N, E, k, D, H, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    w1, w3 = (torch.randn(E, H, D, generator=g, dtype=torch.float64) for _ in range(2))
    w2 = torch.randn(E, D, H, generator=g, dtype=torch.float64)
    weights, index = _rand_routing(N, E, k, g)
    dy = torch.randn(N, D, generator=g, dtype=torch.float64)
    inputs = [t.to(dtype).requires_grad_(True) for t in (x, weights, w1, w3, w2)]
    return inputs, index, dy.to(dtype)


def _check_against_reference(dispatch, act, N, E, k, D, H, dtype, tol, seed):
    """experts(dispatch) in `dtype` against experts_reference in float64 on the same values: output and gradients
    of x, weights, w1, w3, w2."""
    inputs, index, dy = _experts_case(N, E, k, D, H, dtype, seed)
    exact = [t.detach().double().requires_grad_(True) for t in inputs]
    y = ops.experts(inputs[0], inputs[1], index, *inputs[2:], act, dispatch=dispatch)
    ref = ops.experts_reference(exact[0], exact[1], index, *exact[2:], act)
    assert y.dtype == dtype and rel(y, ref) < tol
    for name, a, b in zip(("x", "weights", "w1", "w3", "w2"), torch.autograd.grad(y, inputs, dy),
                          torch.autograd.grad(ref, exact, dy.double())):
        assert rel(a, b) < tol, name


# (3, 8, 2): 6 assignments for 8 experts, so some experts get no token; (1, 3, 1): a single token
CASES = [(37, 5, 2), (3, 8, 2), (16, 4, 4), (1, 3, 1)]


@pytest.mark.parametrize("dispatch", [d for d in ops.DISPATCH if d != "grouped"])
@pytest.mark.parametrize("act", [swiglu, situ], ids=["swiglu", "situ"])
@pytest.mark.parametrize("N,E,k", CASES)
def test_dispatch_matches_per_token_loop(act, N, E, k, dispatch):
    _check_against_reference(dispatch, act, N, E, k, 13, 7, torch.float64, 1e-10, N * 100 + E * 10 + k)


@pytest.mark.skipif(ops.grouped_mm_support(torch.zeros(1, 4), *[torch.zeros(1, 4, 4)] * 3) is not None,
                    reason="torch._grouped_mm needs torch >= 2.9")
@pytest.mark.parametrize("act", [swiglu, situ], ids=["swiglu", "situ"])
@pytest.mark.parametrize("N,E,k", CASES)
def test_grouped_dispatch_matches_per_token_loop(act, N, E, k):
    """torch._grouped_mm runs bfloat16 / float32 only: float32 against the float64 reference."""
    _check_against_reference("grouped", act, N, E, k, 12, 8, torch.float32, 1e-5, N * 100 + E * 10 + k)


def test_grouped_dispatch_refuses_what_grouped_mm_cannot_run():
    (x, weights, w1, w3, w2), index, _ = _experts_case(5, 4, 2, 12, 8, torch.float64, 0)
    with pytest.raises(ValueError, match="dispatch: 'grouped' needs bfloat16 or float32"):
        ops.experts(x, weights, index, w1, w3, w2, swiglu, dispatch="grouped")
    (x, weights, w1, w3, w2), index, _ = _experts_case(5, 4, 2, 13, 8, torch.float32, 0)
    with pytest.raises(ValueError, match="dispatch: 'grouped' needs .*multiples of 4"):
        ops.experts(x, weights, index, w1, w3, w2, swiglu, dispatch="grouped")


class _CountOps(TorchDispatchMode):
    """Counts the aten ops run below autograd (forward and backward): on CUDA about one kernel launch each."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _ops_per_step(dispatch, E):
    inputs, index, dy = _experts_case(64, E, 2, 16, 8, torch.float32, E)
    with _CountOps() as c:
        y = ops.experts(inputs[0], inputs[1], index, *inputs[2:], swiglu, dispatch=dispatch)
        torch.autograd.grad(y, inputs, dy)
    return c.n


@pytest.mark.parametrize("dispatch", ["padded", "grouped"])
def test_batched_dispatch_runs_a_fixed_number_of_ops_whatever_E(dispatch):
    """The issue-16 cost: the loop form runs ops per expert (forward and backward); padded and grouped do not."""
    if dispatch == "grouped" and ops.grouped_mm_support(torch.zeros(1, 16), *[torch.zeros(4, 8, 16)] * 3):
        pytest.skip("torch._grouped_mm needs torch >= 2.9")
    assert _ops_per_step(dispatch, 4) == _ops_per_step(dispatch, 32)
    assert _ops_per_step("sort", 32) > _ops_per_step("sort", 4) + 5 * 28  # ~5 forward ops per expert alone


@contextlib.contextmanager
def _host_reads_fail():
    """Tensor -> Python conversions (a device -> host sync on CUDA) raise inside the block."""
    names = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def fail(self, *args):
        raise AssertionError("host sync")

    try:
        for n in names:
            setattr(torch.Tensor, n, fail)
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


def test_auto_dispatch_needs_no_host_sync_in_inference():
    """Without gradients and with N k <= E, `auto` never reads a device value on the host (gather)."""
    g = torch.Generator().manual_seed(0)
    x, w1, w3, w2 = torch.randn(2, 5), torch.randn(8, 3, 5), torch.randn(8, 3, 5), torch.randn(8, 5, 3)
    weights, index = _rand_routing(2, 8, 2, g)
    want = ops.experts(x, weights, index, w1, w3, w2, swiglu, dispatch="sort")
    with _host_reads_fail(), torch.no_grad():
        got = ops.experts(x, weights, index, w1, w3, w2, swiglu)
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="dispatch"):
        ops.experts(x, weights, index, w1, w3, w2, swiglu, dispatch="fast")


@pytest.mark.parametrize("dispatch", ["grouped", "padded", "sort"])
def test_only_grouped_trains_without_host_reads(dispatch):
    """grouped keeps the expert offsets on the device (forward and backward, routing and load included); padded
    reads its capacity and sort its slice sizes."""
    inputs, index, dy = _experts_case(40, 8, 2, 16, 8, torch.float32, 1)
    if ops.grouped_mm_support(inputs[0], *inputs[2:]) is not None:
        pytest.skip("torch._grouped_mm needs torch >= 2.9")
    with contextlib.ExitStack() as stack:
        if dispatch != "grouped":
            stack.enter_context(pytest.raises(AssertionError, match="host sync"))
        stack.enter_context(_host_reads_fail())
        weights, index, scores = ops.route(inputs[0] @ inputs[2][:, 0].T, torch.zeros(8), 2)
        ops.expert_load(index, 8)
        loss = ops.switch_aux_loss(scores, index, 8, 2)
        y = ops.experts(inputs[0], weights, index, *inputs[2:], swiglu, dispatch=dispatch)
        torch.autograd.grad((y * dy).sum() + loss, [inputs[0], *inputs[2:]])


def test_auto_dispatch_choice_on_cpu():
    """CPU: gather for small no-grad batches; else grouped where torch._grouped_mm runs, else sort."""
    grouped = ops.grouped_mm_support(torch.zeros(1, 16), *[torch.zeros(4, 8, 16)] * 3) is None
    for dtype, D, want in ((torch.float32, 16, "grouped" if grouped else "sort"), (torch.float32, 13, "sort"),
                           (torch.float64, 16, "sort")):
        (x, weights, w1, w3, w2), index, _ = _experts_case(40, 8, 2, D, 8, dtype, 2)
        assert ops.auto_dispatch(x, weights, index, w1, w3, w2) == want
        with torch.no_grad():
            assert ops.auto_dispatch(x, weights, index, w1, w3, w2) == want
            assert ops.auto_dispatch(x[:4], weights[:4], index[:4], w1, w3, w2) == "gather"
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the compute dtype is autocast's
        (x, weights, w1, w3, w2), index, _ = _experts_case(40, 8, 2, 16, 8, torch.float64, 2)
        assert ops.auto_dispatch(x, weights, index, w1, w3, w2) == ("grouped" if grouped else "sort")


# ---- layer --------------------------------------------------------------------------------------------

def _shared(m, x):
    a, b = x @ m.shared.w1.weight.T, x @ m.shared.w3.weight.T
    h = F.silu(a) * b if m.expert == "swiglu" else situ(a, b)
    return h @ m.shared.w2.weight.T


def _expert(m, e, x):
    a, b = x @ m.w1[e].T, x @ m.w3[e].T
    return (F.silu(a) * b if m.expert == "swiglu" else situ(a, b)) @ m.w2[e].T


@pytest.mark.parametrize("expert", ["swiglu", "situ"])
@pytest.mark.parametrize("scaling", [1.0, 2.0])
def test_all_experts_selected_equals_dense_mixture(expert, scaling):
    torch.manual_seed(3)
    E, D = 5, 12
    m = MoE(D, E, E, 9, n_shared=2, routed_scaling=scaling, expert=expert).double()
    m.select_bias.copy_(torch.randn(E))  # irrelevant when every expert is chosen
    x = 5 * torch.randn(2, 7, D, dtype=torch.float64)
    s = torch.sigmoid(x @ m.router.weight.T)  # [B, T, E]
    p = s / s.sum(-1, keepdim=True) * scaling
    dense = sum(p[..., e: e + 1] * _expert(m, e, x) for e in range(E))
    assert rel(m(x), _shared(m, x) + dense) < 1e-12


@pytest.mark.parametrize("expert", ["swiglu", "situ"])
@pytest.mark.parametrize("latent", [None, 6])
def test_layer_matches_explicit_loop(expert, latent):
    torch.manual_seed(4)
    E, k, D = 7, 3, 11
    m = MoE(D, E, k, 5, n_shared=1, latent_dim=latent, routed_scaling=1.7, expert=expert).double()
    m.select_bias.copy_(0.3 * torch.randn(E))
    x = torch.randn(3, 5, D, dtype=torch.float64)
    xf = x.reshape(-1, D)
    want = []
    for n in range(xf.shape[0]):
        s = torch.sigmoid(m.router.weight @ xf[n])  # [E]
        chosen = (s + m.select_bias).topk(k).indices.tolist()
        z = sum(s[e] for e in chosen)
        xin = xf[n] if latent is None else m.w_down.weight @ xf[n]
        u = sum(s[e] / z * 1.7 * _expert(m, e, xin) for e in chosen)
        y = u if latent is None else m.w_up.weight @ _rms(u, m.latent_norm.weight)
        want.append(y + _shared(m, xf[n]))
    assert rel(m(x), torch.stack(want).view_as(x)) < 1e-12


@pytest.mark.parametrize("expert", ["swiglu", "situ"])
@pytest.mark.parametrize("latent", [None, 8])
def test_gradients_reach_every_parameter(expert, latent):
    torch.manual_seed(5)
    m = MoE(16, 6, 2, 8, n_shared=1, latent_dim=latent, expert=expert).double()
    x = torch.randn(4, 16, 16, dtype=torch.float64)  # 64 tokens x 2 slots: every expert is used
    m(x).square().sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert "select_bias" not in dict(m.named_parameters()) and "select_bias" in dict(m.named_buffers())


def test_training_state_aux_loss_and_eval():
    torch.manual_seed(6)
    m = MoE(10, 4, 1, 6, aux_loss_coef=0.01)
    x = torch.randn(2, 9, 10)
    m(x)
    assert m.last_load.shape == (4,) and not m.last_load.requires_grad
    assert abs(m.last_load.sum().item() - 1) < 1e-6
    assert m.aux_loss.requires_grad and m.aux_loss.dim() == 0
    m.aux_loss.backward()  # top_k = 1: weights are constant, only the aux loss trains the router
    assert m.router.weight.grad.abs().sum() > 0
    m.eval()
    before = m.last_load
    m(x)
    assert m.aux_loss is None and m.last_load is before
    m.train()
    m.aux_loss_coef = 0.0
    m(x)
    assert m.aux_loss is None


def test_bias_update_moves_toward_balance():
    torch.manual_seed(7)
    E, D = 4, 8
    m = MoE(D, E, 1, 4, n_shared=0, bias_update_rate=0.02)
    with torch.no_grad():
        m.router.weight.normal_(std=0.3)
        m.router.weight[0, 0] = 3.0  # channel 0 is constant 1: expert 0 takes nearly every token
    x = torch.randn(1, 256, D)
    x[..., 0] = 1.0
    m(x)
    first = m.last_load.clone()
    assert first[0].item() > 0.9
    m.update_bias()
    assert m.select_bias[0] < 0 and (m.select_bias[1:] > 0).all()
    for _ in range(40):
        m(x)
        m.update_bias()
    m(x)
    assert m.last_load.max() < 0.5 and (m.last_load - 1 / E).abs().max() < (first - 1 / E).abs().max()


def test_update_bias_averages_micro_batches():
    m = MoE(4, 3, 1, 2, bias_update_rate=1.0)
    m._load_sum, m._load_n = torch.tensor([0.9, 0.1, 0.0]) + torch.tensor([0.1, 0.1, 0.8]), 2
    m.update_bias()  # mean load [0.5, 0.1, 0.4] vs 1/3
    assert torch.equal(m.select_bias, torch.tensor([-1.0, 1.0, -1.0]))
    m.update_bias()  # nothing since: no-op
    assert torch.equal(m.select_bias, torch.tensor([-1.0, 1.0, -1.0]))


def test_param_counts():
    D, E, k, H, S, L = 10, 6, 2, 4, 2, 5
    m = MoE(D, E, k, H, n_shared=S, latent_dim=L)
    shared, router, expert, latent = 3 * D * S * H, D * E, 3 * L * H, 2 * D * L + L
    c = m.param_counts()
    assert c == {"total": shared + router + E * expert + latent, "active": shared + router + k * expert + latent}
    assert c["total"] == sum(p.numel() for p in m.parameters())
    m0 = MoE(D, E, k, H, n_shared=0)
    assert m0.param_counts()["active"] == D * E + k * 3 * D * H
    assert len(m.output_weights()) == 2 and m.output_weights()[-1] is m.w_up.weight


def test_bf16_forward_runs():
    m = MoE(16, 4, 2, 8, latent_dim=8, expert="situ").to(torch.bfloat16)
    y = m(torch.randn(2, 5, 16, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and y.shape == (2, 5, 16) and torch.isfinite(y).all()


@pytest.mark.parametrize("kw,name", [
    (dict(top_k=5), "top_k"),
    (dict(top_k=0), "top_k"),
    (dict(d_model=0), "d_model"),
    (dict(n_routed=0, top_k=1), "n_routed"),
    (dict(d_expert=-2), "d_expert"),
    (dict(n_shared=-1), "n_shared"),
    (dict(latent_dim=0), "latent_dim"),
    (dict(routed_scaling=0.0), "routed_scaling"),
    (dict(bias_update_rate=-1e-3), "bias_update_rate"),
    (dict(aux_loss_coef=-1.0), "aux_loss_coef"),
    (dict(expert="gelu"), "expert"),
])
def test_validation(kw, name):
    args = dict(d_model=8, n_routed=4, top_k=2, d_expert=4)
    args.update(kw)
    with pytest.raises(ValueError, match=name):
        MoE(**args)


def test_dispatch_from_the_model_config_and_the_cli(tmp_path):
    """`moe.dispatch` in the config reaches every MoE layer; a partial `--set moe={...}` edits the preset's MoE (its
    shape kept); a bad name is one line naming moe.dispatch."""
    from evict import LM, presets
    from evict.cli import main
    from evict.layers.moe import MoE

    base = presets.get("kimi_linear", size="tiny")
    cfg = presets.get("kimi_linear", size="tiny", moe={"dispatch": "padded"})
    assert cfg.moe.n_routed == base.moe.n_routed and cfg.moe.d_expert == base.moe.d_expert and cfg.moe.dispatch == "padded"
    layers = [m for m in LM(cfg).modules() if isinstance(m, MoE)]
    assert layers and all(m.dispatch == "padded" for m in layers)
    with pytest.raises(ValueError, match="moe.dispatch: expected one of"):
        presets.get("kimi_linear", size="tiny", moe={"dispatch": "fast"})
    with pytest.raises(SystemExit) as e:
        main(["train", "--preset", "kimi_linear", "--task", "mqar", "--steps", "1", "--set", 'moe={"dispatch": "fast"}',
              "--out", str(tmp_path / "r")])
    assert "moe.dispatch: expected one of" in str(e.value) and not (tmp_path / "r").exists()
