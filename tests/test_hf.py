"""transformers interop: generate() through evict's cache equals evict's own generate; save/load round trip."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from evict.cli import main  # noqa: E402
from evict.hf import EvictConfig, EvictForCausalLM, to_hf  # noqa: E402
from evict.models import LM, presets  # noqa: E402

SMALL = dict(vocab_size=61, n_layers=4, d_model=64, n_heads=2, head_dim=32, d_ff=128, kv_lora_rank=16, qk_nope_dim=16,
             qk_rope_dim=8, v_head_dim=16, init_std=0.3)


def _model(name: str, seed: int = 0) -> LM:
    torch.manual_seed(seed)
    return LM(presets.get(name, **SMALL)).eval()


def _count_tokens(lm: LM) -> tuple[dict, object]:
    seen = {"tokens": 0}
    hook = lm.embed.register_forward_hook(lambda mod, inp, out: seen.__setitem__("tokens", seen["tokens"] + inp[0].numel()))
    return seen, hook


@pytest.mark.parametrize("name,n_new", [("gpt2", 70), ("kimi_linear", 12), ("k3_mini", 12)])
def test_generate_equals_evict_and_feeds_each_token_once(name, n_new, one_thread):
    lm = _model(name)
    model = to_hf(lm)
    prompt = torch.randint(0, 61, (2, 7))  # gpt2 runs past the adapter's first 64 positions: the cache grows once
    seen, hook = _count_tokens(lm)
    try:
        got = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n_new, do_sample=False)
        with_cache = seen["tokens"]
        seen["tokens"] = 0
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False, use_cache=False)
        without_cache = seen["tokens"]
    finally:
        hook.remove()
    want = lm.generate(prompt, max_new_tokens=n_new, temperature=0)
    assert torch.equal(got, want)
    assert len(set(got[0, 7:].tolist())) > 2
    assert with_cache == 2 * (7 + n_new - 1)  # the prompt once, then one token per step
    assert without_cache == 2 * sum(range(7, 7 + 8))  # the check above can fail: no cache recomputes the prefix


def test_save_pretrained_from_pretrained_round_trip(tmp_path, one_thread):
    model = to_hf(_model("kimi_linear", seed=1))
    model.save_pretrained(tmp_path)
    assert transformers.AutoConfig.from_pretrained(tmp_path).model_type == "evict"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(loaded, EvictForCausalLM) and loaded.model.cfg == model.model.cfg
    for (na, a), (nb, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert na == nb and torch.equal(a, b), na
    x = torch.randint(0, 61, (1, 11))
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


def test_tied_head_survives_round_trip(tmp_path):
    model = to_hf(_model("gpt2", seed=2))
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.model.head.weight.data_ptr() == loaded.model.embed.weight.data_ptr()
    assert torch.equal(loaded.model.embed.weight, model.model.embed.weight)


def test_loss_is_next_token_cross_entropy():
    model = to_hf(_model("gpt2", seed=3))
    x = torch.randint(0, 61, (2, 9))
    out = model(x, labels=x)
    want = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 61), x[:, 1:].reshape(-1))
    assert torch.allclose(out.loss, want)


def test_bad_input_is_one_clear_error():
    model = to_hf(_model("gpt2"))
    x = torch.randint(0, 61, (2, 5))
    mask = torch.ones_like(x)
    mask[0, -1] = 0  # right padding
    with pytest.raises(ValueError, match="attention_mask: expected left padding"):
        model(x, attention_mask=mask)
    with pytest.raises(ValueError, match="pattern"):
        EvictConfig(evict={"pattern": "Q"})
    with pytest.raises(ValueError, match="unknown field"):
        EvictConfig(evict={"no_such_field": 1})
    with pytest.raises(ValueError, match="lm: expected an evict LM"):
        to_hf(torch.nn.Linear(2, 2))


def test_cli_convert_hf(tmp_path):
    lm = _model("kda", seed=4)
    lm.save(tmp_path / "model")
    assert main(["convert", "hf", str(tmp_path / "model"), "--out", str(tmp_path / "hf")]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    x = torch.randint(0, 61, (1, 10))
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, lm(x))


def test_assisted_decoding_is_refused_with_the_documented_message():
    model = to_hf(_model("gpt2"))
    x = torch.randint(0, 61, (1, 5))
    for kw in ({"assistant_model": to_hf(_model("gpt2"))}, {"prompt_lookup_num_tokens": 3}):
        with pytest.raises(ValueError, match=r"^cache: evict's recurrent states cannot be cropped \(assisted decoding"):
            model.generate(x, max_new_tokens=3, do_sample=False, **kw)
    assert model.generate(x, max_new_tokens=3, do_sample=False).shape == (1, 8)  # plain decoding still runs
