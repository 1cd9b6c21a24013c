"""Blocks are modules: meta-device build + to_empty + init_weights() equals eager init; every module resets itself."""

import pytest
import torch
from torch import nn

from evict import LM, presets
from evict.models.lm import Block

FAMILIES = presets.FAMILIES


def _meta_then_init(cfg, seed):
    with torch.device("meta"):
        m = LM(cfg)
    assert all(p.is_meta for p in m.parameters())
    m.to_empty(device="cpu")
    torch.manual_seed(seed)
    m.init_weights()
    return m


@pytest.mark.parametrize("name", FAMILIES)
def test_meta_init_equals_eager_init(name):
    cfg = presets.get(name, size="tiny")
    torch.manual_seed(3)
    eager = LM(cfg)
    meta = _meta_then_init(cfg, 3)
    e, m = eager.state_dict(), meta.state_dict()
    assert e.keys() == m.keys()
    differ = [k for k in e if not torch.equal(e[k], m[k])]
    assert not differ, differ
    if cfg.tie_embeddings:
        assert meta.head.weight is meta.embed.weight


@pytest.mark.parametrize("name", ["kimi_linear", "k3_mini", "gpt2"])
def test_init_distributions(name):
    """Per parameter, the rule init_weights documents (not just equality with eager init, which shares the code)."""
    cfg = presets.get(name, size="small")
    torch.manual_seed(0)
    m = _meta_then_init(cfg, 0)
    std, out_std = cfg.init_std, cfg.init_std / (2 * cfg.n_layers) ** 0.5
    for name_, p in m.named_parameters():
        p = p.detach()
        leaf = name_.split(".")[-1]
        if leaf == "weight" and ("norm" in name_ or name_.endswith("latent_norm.weight")):
            assert torch.equal(p, torch.ones_like(p)), name_
        elif leaf == "query" or leaf == "bias":
            assert torch.equal(p, torch.zeros_like(p)), name_
        elif leaf == "A_log":
            assert p.exp().min() >= 1 and p.exp().max() <= 16 and p.std() > 0, name_
        elif leaf == "dt_bias":
            assert torch.isfinite(p).all() and p.std() > 0, name_
        elif name_.endswith("conv.weight"):
            k = p.shape[-1]
            assert p.abs().max() <= k**-0.5 and abs(p.std().item() - (k**-0.5) / 3**0.5) < 0.1 * k**-0.5, name_
        elif p.numel() >= 4096:  # normal weights: check the std (depth-scaled for residual writers)
            if name_.endswith(("wo.weight", "w2.weight", "w_up.weight")):
                want = out_std
            elif p.ndim == 3 and ".ffn." in name_:  # MoE expert stacks: their own 0.02, w2 depth-scaled without latent
                want = out_std if leaf == "w2" and cfg.moe.latent_dim is None else 0.02
            else:
                want = std
            assert abs(p.std().item() / want - 1) < 0.1 and abs(p.mean().item()) < 0.1 * want, (name_, p.std().item(), want)
    for buf_name, b in m.named_buffers():
        assert torch.equal(b, torch.zeros_like(b)), buf_name  # MoE selection bias


@pytest.mark.parametrize("name", ["kimi_linear", "k3_mini", "gpt2", "gla"])
def test_every_module_resets_itself(name):
    """Scramble every parameter and buffer; the module tree's reset_parameters restores the eager init's values."""
    torch.manual_seed(5)
    m = LM(presets.get(name, size="tiny"))
    assert all(callable(getattr(mod, "reset_parameters", None)) for mod in m.modules()
               if not isinstance(mod, (nn.ModuleList, nn.Sequential))), "a module without reset_parameters"
    want = {k: v.clone() for k, v in m.state_dict().items()}
    with torch.no_grad():
        for t in list(m.parameters()) + list(m.buffers()):
            t.fill_(float("nan"))
    torch.manual_seed(5)
    m.reset_parameters()
    assert all(torch.equal(want[k], v) for k, v in m.state_dict().items())


def test_block_forward_is_the_lm_step():
    """LM.forward is only a loop over Block.forward: a block called alone gives the residual update."""
    torch.manual_seed(0)
    m = LM(presets.get("kimi_linear", size="tiny", n_layers=1, vocab_size=64)).double()
    blk = m.blocks[0]
    assert isinstance(blk, Block)
    h = torch.randn(2, 9, m.cfg.d_model, dtype=torch.float64)
    mid = h + blk.mixer(blk.norm1(h))
    assert torch.allclose(blk(h), mid + blk.ffn(blk.norm2(mid)), rtol=0, atol=1e-12)


def test_activation_checkpointing_per_block_keeps_gradients():
    """Each block recomputed in backward (torch.utils.checkpoint around Block.forward): the same loss and gradients."""
    import torch.utils.checkpoint as ckpt

    torch.manual_seed(2)
    cfg = presets.get("k3_mini", size="tiny", n_layers=4, vocab_size=64)  # AttnRes sources, KDA, MLA, latent MoE
    tok = torch.randint(0, cfg.vocab_size, (2, 12))
    grads = []
    for recompute in (False, True):
        torch.manual_seed(0)
        m = LM(cfg).double()
        if recompute:
            for blk in m.blocks:
                blk.forward = lambda *a, _f=blk.forward, **k: ckpt.checkpoint(_f, *a, use_reentrant=False, **k)
        torch.nn.functional.cross_entropy(m(tok).flatten(0, 1), tok.flatten()).backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    assert all(torch.allclose(a, b, rtol=1e-10, atol=1e-12) for a, b in zip(*grads))


@pytest.mark.parametrize("name,form", [("gated_deltanet", "softplus"), ("kda", "softplus"), ("kda", "bounded")])
def test_gate_dt_range_sets_the_initial_decay_rate(name, form):
    """gate_dt_min / gate_dt_max: the decay gate's initial per-step rate is A dt with dt log-uniform in that range
    (at f_gate(x) = 0): the default [1e-3, 1e-1], a slow start [1e-4, 1e-3], a single value."""
    import torch.nn.functional as F

    from evict.layers.memory_mixer import MemoryMixer

    for lo, hi in ((1e-3, 1e-1), (1e-4, 1e-3), (2e-3, 2e-3)):
        torch.manual_seed(0)
        m = LM(presets.get(name, size="tiny", gate_form=form, gate_dt_min=lo, gate_dt_max=hi))
        for mix in (x for x in m.modules() if isinstance(x, MemoryMixer)):
            A = mix.A_log.exp().repeat_interleave(mix.dt_bias.numel() // mix.H)
            rate = A * F.softplus(mix.dt_bias) if form == "softplus" else 5 * torch.sigmoid(A * mix.dt_bias)
            dt = (rate / A).detach()
            assert dt.min() >= lo * (1 - 1e-4) and dt.max() <= hi * (1 + 1e-4), (lo, hi, dt.min(), dt.max())
            if lo < hi and dt.numel() >= 16:  # per-channel gates: spread over the range, not one value
                assert dt.max() / dt.min() > (hi / lo) ** 0.5


@pytest.mark.parametrize("lo,hi,msg", [(0.0, 1e-1, "gate_dt_min"), (1e-2, 1e-3, "gate_dt_max: expected >= gate_dt_min"),
                                       (1e-3, float("inf"), "gate_dt_max")])
def test_gate_dt_range_is_validated(lo, hi, msg):
    with pytest.raises(ValueError, match=msg):
        presets.get("kda", size="tiny", gate_dt_min=lo, gate_dt_max=hi)
