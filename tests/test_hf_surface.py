"""The transformers surface users reach for: AutoModel, inputs_embeds, hidden states, logits_to_keep, gradient
checkpointing, resize_token_embeddings, AutoTokenizer on a converted folder, Trainer (left padding: test_hf_padding)."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from evict.cli import main  # noqa: E402
from evict.hf import EvictForCausalLM, EvictModel, to_hf  # noqa: E402
from evict.models import LM, presets  # noqa: E402
from evict.tasks.tokenizers import EOT, CharTokenizer  # noqa: E402
from tests.test_hf import SMALL, _model  # noqa: E402  (vocab 61)


def test_automodel_hidden_states_inputs_embeds_logits_to_keep(tmp_path, one_thread):
    lm = _model("gpt2", seed=1)
    to_hf(lm).save_pretrained(tmp_path)
    base = transformers.AutoModel.from_pretrained(tmp_path)
    causal = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(base, EvictModel) and isinstance(causal, EvictForCausalLM)
    x = torch.randint(0, 61, (2, 7))
    with torch.no_grad():
        want = lm(x)
        out = causal(x, output_hidden_states=True)
        hidden = base(x).last_hidden_state
        assert torch.equal(out.logits, want)
        assert torch.allclose(lm.head(hidden), want, atol=1e-6, rtol=0)
        hs = out.hidden_states
        assert len(hs) == lm.cfg.n_layers + 1 and torch.equal(hs[-1], hidden)
        assert torch.equal(hs[0], lm.embed(x) + lm.wpe(torch.arange(7)))
        embeds = lm.embed(x)
        assert torch.allclose(causal(inputs_embeds=embeds).logits, want, atol=1e-6, rtol=0)
        kept = causal(x, logits_to_keep=1).logits
        # float32: the head over 1 row vs all rows sums in another order (logits up to ~8: ~1e-6 apart)
        assert kept.shape == (2, 1, 61) and torch.allclose(kept, want[:, -1:], atol=1e-5, rtol=0)
        assert torch.allclose(causal(x, logits_to_keep=torch.tensor([0, 3])).logits, want[:, [0, 3]], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="exactly one of input_ids and inputs_embeds"):
        causal(x, inputs_embeds=embeds)


@pytest.mark.filterwarnings("ignore:.*gradient_checkpointing_enable.*:FutureWarning")
def test_gradient_checkpointing_same_gradients_blocks_recomputed(one_thread):
    def grads(checkpointing: bool):
        model = to_hf(_model("kimi_linear", seed=2)).train()
        if checkpointing:
            model.gradient_checkpointing_enable()  # the name most code still calls (transformers 5: a deprecated alias)
        calls, ffn = [], model.model.blocks[0].ffn
        inner = ffn.forward
        ffn.forward = lambda *a: calls.append(1) or inner(*a)  # counts runs (hooks do not fire in the recompute)
        x = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(0))
        model(x, labels=x).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, len(calls)

    plain, n_plain = grads(False)
    ckpt, n_ckpt = grads(True)
    assert n_plain == 1 and n_ckpt == 2  # the block ran again in the backward
    assert plain.keys() == ckpt.keys()
    for name in plain:
        assert torch.allclose(plain[name], ckpt[name], atol=1e-6, rtol=1e-5), name


def test_resize_token_embeddings(tmp_path, one_thread):
    model = to_hf(_model("gpt2", seed=3))
    x = torch.randint(0, 61, (1, 6))
    with torch.no_grad():
        before = model(x).logits
    for bad in (0, -3, 2.5, "70"):
        with pytest.raises(ValueError, match="new_num_tokens"):
            model.resize_token_embeddings(bad)
    assert model.model.cfg.vocab_size == 61 and model.model.embed.weight.shape[0] == 61  # nothing changed
    emb = model.resize_token_embeddings(65, pad_to_multiple_of=8)
    assert emb.weight.shape[0] == 72 == model.config.vocab_size == model.model.cfg.vocab_size
    assert model.model.head.weight is model.model.embed.weight  # still tied
    with torch.no_grad():
        after = model(torch.cat([x, torch.tensor([[71]])], 1)).logits
    assert torch.allclose(after[:, :6, :61], before, atol=1e-6, rtol=0)
    model.save_pretrained(tmp_path)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert again.model.cfg.vocab_size == 72
    base = transformers.AutoModel.from_pretrained(tmp_path)  # the base model (no head of its own) resizes too
    base.resize_token_embeddings(80)
    assert base.model.cfg.vocab_size == 80 == base.config.vocab_size and base.model.head.weight.shape[0] == 80
    with torch.no_grad():
        assert base(torch.tensor([[79, 2]])).last_hidden_state.shape == (1, 2, 64)


def test_convert_writes_a_folder_autotokenizer_loads(tmp_path, one_thread):
    tok = CharTokenizer("abcdefghij ", eos=True)
    torch.manual_seed(0)
    lm = LM(presets.get("gpt2", **{**SMALL, "vocab_size": tok.vocab_size}))
    lm.save(tmp_path / "model")
    tok.save(tmp_path / "model" / "tokenizer.json")
    assert main(["convert", "hf", str(tmp_path / "model"), "--out", str(tmp_path / "hf")]) == 0
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_tok.eos_token == hf_tok.pad_token == EOT and hf_tok.eos_token_id == tok.eos_token_id
    assert hf_tok("bad cafe")["input_ids"] == tok.encode("bad cafe").tolist()  # no added bos/eos
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.generation_config.eos_token_id == tok.eos_token_id
    hf_tok.padding_side = "left"
    batch = hf_tok(["abc", "hij ab"], return_tensors="pt", padding=True)
    # transformers 4.x otherwise adds token_type_ids, which generate(**batch) refuses (checked by hand on 4.56.0)
    assert set(batch) == {"input_ids", "attention_mask"}
    assert json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())["model_input_names"] == list(batch)
    out = model.generate(**batch, max_new_tokens=4, do_sample=False)
    alone = model.generate(**hf_tok(["abc"], return_tensors="pt"), max_new_tokens=4, do_sample=False)
    assert hf_tok.decode(out[0], skip_special_tokens=True) == hf_tok.decode(alone[0], skip_special_tokens=True)


def test_trainer_runs_a_few_steps(tmp_path, one_thread):
    pytest.importorskip("accelerate")
    model = to_hf(_model("kimi_linear", seed=5)).train()
    before = model.model.embed.weight.detach().clone()
    data = [{"input_ids": torch.randint(0, 61, (12,)).tolist()} for _ in range(8)]
    for d in data:
        d["labels"] = d["input_ids"]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4,
                                          learning_rate=1e-2, report_to=[], save_strategy="no", logging_steps=1,
                                          use_cpu=True, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    result = trainer.train()
    assert result.global_step == 3 and torch.isfinite(torch.tensor(result.training_loss))
    assert not torch.equal(model.model.embed.weight, before)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_convert_keeps_the_saved_dtype(tmp_path, capsys, dtype, one_thread):
    """A bfloat16 (or float64) evict folder converts to a transformers / fla folder in that dtype, not float32."""
    from safetensors import safe_open

    lm = _model("kda", seed=6).to(dtype)
    lm.save(tmp_path / "model")
    assert main(["convert", "hf", str(tmp_path / "model"), "--out", str(tmp_path / "hf")]) == 0
    assert f"weights in the source's dtype, {str(dtype).removeprefix('torch.')}" in capsys.readouterr().out
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == str(dtype).removeprefix("torch.")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype="auto")  # 4.x's default: float32
    assert {p.dtype for p in loaded.parameters()} == {dtype}
    assert all(torch.equal(a, b) for a, b in zip(loaded.model.state_dict().values(), lm.state_dict().values()))
    assert main(["convert", "fla", str(tmp_path / "model"), "--out", str(tmp_path / "fla")]) == 0
    with safe_open(str(tmp_path / "fla" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.attn.q_proj.weight").dtype == dtype
    assert main(["convert", "hf", str(tmp_path / "model"), "--out", str(tmp_path / "hf32"), "--dtype", "float32"]) == 0
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf32", dtype="auto")
    assert {p.dtype for p in again.parameters()} == {torch.float32}
