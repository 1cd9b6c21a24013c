"""A transformers GPT-2 (random weights, no download) converted to evict's LM: same logits, same greedy generation."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from evict.cli import main  # noqa: E402
from evict.convert import from_hf_gpt2  # noqa: E402
from evict.models import LM, presets  # noqa: E402
from evict.models.accounting import param_report  # noqa: E402


def _hf_gpt2(seed: int, **kw):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=101, n_positions=48, n_embd=48, n_layer=3, n_head=4,
                                  initializer_range=0.2, bos_token_id=None, eos_token_id=None, **kw)
    return transformers.GPT2LMHeadModel(cfg).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_logits_match_transformers(dtype):
    hf = _hf_gpt2(1).to(dtype)
    with torch.no_grad():  # LayerNorm's weight and bias leave their init values, so a dropped or swapped one shows
        for name, p in hf.named_parameters():
            if "ln_" in name:
                p.add_(0.3 * torch.randn_like(p))
    lm = from_hf_gpt2(hf)
    assert lm.cfg.norm == "layernorm" and lm.cfg.vocab_size == 101 and lm.head.weight is lm.embed.weight
    x = torch.randint(0, 101, (2, 31))
    with torch.no_grad():
        want, got = hf(x).logits, lm(x)
    assert got.dtype == dtype
    assert (got - want).abs().max().item() <= 1e-5
    assert (want - want.mean()).abs().max().item() > 1.0  # the logits are not all alike


def test_greedy_generation_matches_transformers():
    hf = _hf_gpt2(2)
    lm = from_hf_gpt2(hf)
    prompt = torch.randint(0, 101, (1, 6))
    want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False)
    got = lm.generate(prompt, max_new_tokens=24, temperature=0)
    assert torch.equal(got, want)
    assert len(set(got[0, 6:].tolist())) > 2  # not one token repeated


def test_untied_head_is_kept():
    hf = _hf_gpt2(3, tie_word_embeddings=False)
    with torch.no_grad():
        hf.lm_head.weight.add_(torch.randn_like(hf.lm_head.weight))
    lm = from_hf_gpt2(hf)
    assert not lm.cfg.tie_embeddings
    x = torch.randint(0, 101, (1, 9))
    with torch.no_grad():
        assert torch.allclose(lm(x), hf(x).logits, atol=1e-5)


def test_refuses_what_does_not_map():
    with pytest.raises(ValueError, match="activation_function"):
        from_hf_gpt2(_hf_gpt2(0, activation_function="relu"))
    with pytest.raises(ValueError, match="hf_model: expected a transformers GPT2LMHeadModel"):
        from_hf_gpt2(torch.nn.Linear(2, 2))


def test_gpt2_124m_is_gpt2_small_shape():
    cfg = presets.get("gpt2_124m")
    assert (cfg.vocab_size, cfg.norm, cfg.norm_eps, cfg.pos, cfg.bias) == (50257, "layernorm", 1e-5, "learned", True)
    with torch.device("meta"):  # transformers' own GPT-2 small (its default config), shapes only
        hf = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    assert param_report(cfg)["total"] == sum(p.numel() for p in hf.parameters()) == 124_439_808


def test_cli_convert_gpt2(tmp_path, capsys):
    hf = _hf_gpt2(4)
    hf.save_pretrained(tmp_path / "hf")
    assert main(["convert", "gpt2", str(tmp_path / "hf"), "--out", str(tmp_path / "ev")]) == 0
    lm = LM.load(tmp_path / "ev")
    x = torch.randint(0, 101, (1, 12))
    with torch.no_grad():
        assert torch.allclose(lm(x), hf(x).logits, atol=1e-5)
    with pytest.raises(SystemExit) as e:
        main(["convert", "gpt2", str(tmp_path / "nothing"), "--out", str(tmp_path / "ev2")])
    assert e.value.code == 2 and not (tmp_path / "ev2").exists()
    assert "nothing" in capsys.readouterr().err.strip().splitlines()[-1]
