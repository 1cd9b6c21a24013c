"""The one LM: every preset decodes like it trains, MLA's two forms agree, gradients reach everything, configs fail clearly."""

import pytest
import torch

from evict import LM, ModelConfig, presets
from evict.layers.mla import MLA
from tests.conftest import rel

TINY = presets.FAMILIES


def _model(name, **kw):
    torch.manual_seed(0)
    cfg = presets.get(name, size="tiny", **kw)
    return LM(cfg).double()


@pytest.mark.parametrize("name,kw", [(n, {}) for n in TINY] + [(n, {"short_conv": True}) for n in ("attention", "linear", "mla")])
def test_prefill_then_decode_equals_full_forward(name, kw):
    m = _model(name, **kw)
    tok = torch.randint(0, m.cfg.vocab_size, (2, 45))
    full = m(tok)
    cache = m.new_cache(2, 45)
    parts = [m(tok[:, :30], cache=cache)]
    for t in range(30, 45):
        parts.append(m(tok[:, t : t + 1], cache=cache))
    assert cache.pos == 45
    assert rel(torch.cat(parts, 1), full) <= 1e-10


@pytest.mark.parametrize("name", TINY)
def test_two_prefills_equal_one(name):
    m = _model(name)
    tok = torch.randint(0, m.cfg.vocab_size, (2, 70))
    c1, c2 = m.new_cache(2, 70), m.new_cache(2, 70)
    one = m(tok, cache=c1)
    two = torch.cat([m(tok[:, :33], cache=c2), m(tok[:, 33:], cache=c2)], 1)
    assert rel(two, one) <= 1e-10
    nxt = torch.randint(0, m.cfg.vocab_size, (2, 1))
    c1.max_len = c2.max_len = 70  # full: one more token must be refused clearly
    with pytest.raises(ValueError, match="^tokens: cache holds 70 positions"):
        m(nxt, cache=c1)


@pytest.mark.parametrize("name", TINY)
def test_gradients_reach_every_parameter(name):
    torch.manual_seed(1)
    cfg = presets.get(name, size="tiny")
    m = LM(cfg)
    if cfg.attn_res:  # zero-initialised queries get grads, but make the mix non-uniform so every path is exercised
        for p in m.parameters():
            if p.dim() == 1 and float(p.detach().abs().sum()) == 0:
                p.data.normal_(std=0.1)
    tok = torch.randint(0, cfg.vocab_size, (2, 20))
    loss = torch.nn.functional.cross_entropy(m(tok).flatten(0, 1), tok.flatten())
    aux = m.aux_loss()
    (loss if aux is None else loss + aux).backward()
    missing = [n for n, p in m.named_parameters() if p.grad is None or float(p.grad.abs().sum()) == 0]
    assert not missing, missing


@pytest.mark.parametrize("rope", [False, True])
def test_mla_absorbed_equals_naive(rope):
    torch.manual_seed(2)
    cfg = presets.get("mla", mla_rope=rope, q_lora_rank=32, mla_gate=True)
    mla = MLA(cfg).double()
    x = torch.randn(2, 23, cfg.d_model, dtype=torch.float64)
    naive = mla(x, absorb=False)
    absorbed = mla(x, absorb=True)
    assert rel(absorbed, naive) <= 1e-12
    st = mla.new_state(2, 23, dtype=torch.float64)
    assert st.c.shape[-1] + st.k_rope.shape[-1] == cfg.kv_lora_rank + cfg.qk_rope_dim


def test_layer_pattern_tiles_with_final_override():
    cfg = presets.get("kimi_linear_48b")
    letters = cfg.layer_mixers()
    assert [i + 1 for i, c in enumerate(letters) if c == "M"] == [4, 8, 12, 16, 20, 24, 27]
    assert letters.count("K") == 20
    k3 = presets.get("kimi_k3").layer_mixers()
    assert k3.count("M") == 24 and k3.count("K") == 69 and k3[-1] == "M" and k3[91] == "M"


@pytest.mark.parametrize("kw,match", [
    (dict(pattern="KXZ"), r"^pattern: unknown mixer letter\(s\) \['X', 'Z'\]"),
    (dict(pattern=""), r"^pattern: expected a non-empty string"),
    (dict(d_model=100, n_heads=3), r"^n_heads: expected a divisor of d_model=100"),
    (dict(n_heads=4, n_kv_heads=3), r"^n_kv_heads: expected a divisor of n_heads=4"),
    (dict(moe={"n_routed": 4, "top_k": 5}), r"^moe.top_k: expected 1 <= top_k <= n_routed=4"),
    (dict(ffn="relu"), r"^ffn: expected one of"),
    (dict(n_layers=0), r"^n_layers: expected a positive integer"),
])
def test_bad_configs_raise_clear_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**kw)


def test_unknown_preset():
    with pytest.raises(ValueError, match=r"^name: unknown preset 'gpt5'"):
        presets.get("gpt5")


def test_bad_tokens():
    m = LM(presets.get("kda"))
    with pytest.raises(ValueError, match=r"^tokens: expected an int64 tensor \[B, T\]"):
        m(torch.zeros(2, 3))


def test_save_load_roundtrip_and_mismatch(tmp_path):
    m = LM(presets.get("k3_mini"))
    tok = torch.randint(0, 256, (1, 12))
    m.save(tmp_path / "a")
    m2 = LM.load(tmp_path / "a")
    assert torch.equal(m(tok), m2(tok))
    other = LM(presets.get("kda"))
    with pytest.raises(ValueError, match=r"^checkpoint: .* was saved from another config \("):
        other.load_weights(tmp_path / "a")


def test_generate_is_seeded_and_stops():
    m = LM(presets.get("kimi_linear"))
    prompt = torch.randint(0, 256, (3, 9))
    a = m.generate(prompt, max_new_tokens=12, temperature=0.8, top_k=20, top_p=0.9, seed=5)
    b = m.generate(prompt, max_new_tokens=12, temperature=0.8, top_k=20, top_p=0.9, seed=5)
    assert torch.equal(a, b) and a.shape == (3, 21) and torch.equal(a[:, :9], prompt)
    greedy = m.generate(prompt, max_new_tokens=5, temperature=0)
    stop = int(greedy[0, 9])
    s = m.generate(prompt, max_new_tokens=12, temperature=0, stop_tokens=[stop])
    assert s[0, 9] == stop and (s.shape[1] == 21 or bool((s[:, 9:] == stop).any(1).all()))
    # greedy generation equals argmax of the full forward, token by token
    full = m(greedy[:, :-1])
    assert torch.equal(full[:, 8:].argmax(-1), greedy[:, 9:])


@pytest.mark.parametrize("name", ["gpt2", "kimi_linear", "k3_mini"])
def test_trains_a_few_steps(name):
    torch.manual_seed(0)
    m = LM(presets.get(name, n_layers=4))
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    tok = torch.randint(0, 256, (4, 32))
    losses = []
    for _ in range(8):
        loss = torch.nn.functional.cross_entropy(m(tok[:, :-1]).flatten(0, 1), tok[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        m.after_step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


def test_short_conv_is_a_causal_depthwise_convolution():
    from evict.layers.conv import ShortConv

    conv = ShortConv(5, 4).double()
    x = torch.randn(2, 9, 5, dtype=torch.float64)
    y, tail = conv(x)
    w = conv.weight[:, 0]  # [C, k], w[:, -1] multiplies the current token
    for t in (0, 3, 8):
        want = sum(w[:, 3 - s] * x[:, t - s] for s in range(4) if t - s >= 0)
        assert torch.allclose(y[:, t], want, atol=1e-14)
    y2, _ = conv(x[:, 6:], tail=conv(x[:, :6])[1])
    assert torch.allclose(y2, y[:, 6:], atol=1e-14) and torch.equal(tail, x[:, -3:])


def test_attn_res_sources_keep_the_stream_dtype_under_autocast():
    """Under a bf16 autocast every AttnRes depth source (the embedding, each block's running sum) stays float32, as
    the plain residual stream does: a block's sum starts from its first sublayer's bf16 output, cast once."""
    torch.manual_seed(3)
    m = LM(presets.get("kda", pattern="KM", vocab_size=61, n_layers=4, d_model=32, n_heads=2, head_dim=16, d_ff=48,
                       attn_res=True, attn_res_block=2))
    seen = []
    for mod in m.modules():
        if type(mod).__name__ == "AttnResRead":
            mod.register_forward_pre_hook(lambda _, args: seen.extend(s.dtype for s in args[0]))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m(torch.randint(0, 61, (2, 9)))
    assert len(seen) >= 8 and set(seen) == {torch.float32}
