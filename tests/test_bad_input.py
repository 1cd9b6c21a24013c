"""Bad input, kind by kind: each ends in one ValueError naming the argument (API) or one line on stderr, exit code 2
and nothing written (CLI) — never a deep traceback, never a silent wrong result. Plus the state that must not
outlive its owner: a reused cache, a model after an interrupted `generate`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from evict import LM, ModelConfig, presets
from evict.cli import main
from evict.ops import attention, memory, memory_step
from evict.tasks.tokenizers import ByteTokenizer, CharTokenizer, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
META = torch.device("meta")  # "another device than q" without needing a GPU


pytestmark = pytest.mark.usefixtures("one_thread")

# -- the memory op and softmax attention ---------------------------------------------------------------------


def _op(**kw):
    x = {"q": torch.randn(1, 5, 2, 4), "k": torch.randn(1, 5, 2, 4), "v": torch.randn(1, 5, 2, 3), **kw}
    return memory(x.pop("q"), x.pop("k"), x.pop("v"), **x)


@pytest.mark.parametrize("kw,match", [
    (dict(scale="0.5"), r"^scale: expected a finite number"),
    (dict(scale=torch.tensor(0.5)), r"^scale: expected a finite number"),
    (dict(scale=float("nan")), r"^scale: expected a finite number"),
    (dict(scale=True), r"^scale: expected a finite number"),
    (dict(log_alpha=torch.zeros(1, 5, 2, device=META)), r"^log_alpha: expected device cpu"),
    (dict(beta=torch.ones(1, 5, 2, device=META)), r"^beta: expected device cpu"),
    (dict(initial_state=torch.zeros(1, 2, 4, 3, device=META)), r"^initial_state: expected device cpu"),
    (dict(log_alpha=torch.zeros(1, 5, 2, dtype=torch.int64)), r"^log_alpha: expected a floating dtype"),
    (dict(log_alpha=torch.full((1, 5, 2), float("-inf"))), r"^log_alpha: contains NaN or Inf"),
    (dict(delta="no"), r"^delta: expected True or False"),
    (dict(delta=torch.tensor(True)), r"^delta: expected True or False"),
    (dict(output_final_state=1), r"^output_final_state: expected True or False"),
    (dict(keep_factors="tf32"), r"^keep_factors: expected True or False"),
    (dict(q=torch.randn(1, 5, 2, 0), k=torch.randn(1, 5, 2, 0)), r"^q: expected a key dim Dk >= 1"),
])
def test_memory_op_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        _op(**kw)


def test_memory_step_arguments():
    q, S = torch.randn(1, 2, 4), torch.zeros(1, 2, 4, 4)
    with pytest.raises(ValueError, match=r"^scale: expected a finite number"):
        memory_step(q, q, q, S, scale=[1.0])
    with pytest.raises(ValueError, match=r"^state: expected device cpu"):
        memory_step(q, q, q, S.to(META))
    with pytest.raises(ValueError, match=r"^delta: expected True or False"):
        memory_step(q, q, q, S, delta=1)


@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_attention_rejects_nan_like_the_memory_op(where):
    """SDPA turns a NaN query row into zeros where the reference gives NaN: the checked call rejects both alike."""
    x = {n: torch.randn(1, 4, 1, 8) for n in "qkv"}
    x[where][0, 1, 0, 2] = float("nan")
    for impl in ("reference", "sdpa"):
        with pytest.raises(ValueError, match=rf"^{where}: contains NaN or Inf"):
            attention(x["q"], x["k"], x["v"], impl=impl)
    with pytest.raises(ValueError, match=rf"^{where}: contains NaN or Inf"):
        memory(x["q"], x["k"], x["v"])


@pytest.mark.parametrize("mutate,match", [
    (lambda q: (q, q.double(), q), r"^k: expected dtype torch.float32"),
    (lambda q: (q.long(), q.long(), q.long()), r"^q: expected a floating dtype"),
    (lambda q: (q, q, q.to(META)), r"^v: expected dtype torch.float32 on cpu"),
])
def test_attention_arguments(mutate, match):
    with pytest.raises(ValueError, match=match):
        attention(*mutate(torch.randn(1, 4, 2, 8)))
    with pytest.raises(ValueError, match=r"^scale:"):
        attention(*(torch.randn(1, 4, 2, 8),) * 3, scale="x")
    with pytest.raises(ValueError, match=r"^causal: expected True or False"):
        attention(*(torch.randn(1, 4, 2, 8),) * 3, causal="yes")
    with pytest.raises(ValueError, match=r"^q: expected a head dim D >= 1"):
        attention(*(torch.randn(1, 4, 2, 0),) * 3)


# -- configs ---------------------------------------------------------------------------------------------------

BAD_CONFIGS = [  # (field, value); each must fail naming the field (they used to crash later, or give NaN)
    ("rope_theta", 0.0), ("rope_theta", -1.0), ("rope_theta", float("inf")), ("norm_eps", -1e-6), ("norm_eps", 0.0),
    ("norm_eps", float("nan")), ("n_kv_heads", 0), ("n_kv_heads", -2), ("n_kv_heads", 3), ("head_dim", 0),
    ("head_dim", -8), ("d_ff", 0), ("d_ff", -1), ("conv_size", 1), ("conv_size", 0), ("vocab_size", 0),
    ("vocab_size", 2.5), ("d_model", True), ("n_layers", -1), ("n_heads", 0), ("max_seq_len", 0), ("kv_lora_rank", 0),
    ("qk_nope_dim", 0), ("qk_rope_dim", -2), ("v_head_dim", 0), ("q_lora_rank", 0), ("out_gate_rank", -1),
    ("chunk_size", 48), ("chunk_size", 16.0), ("init_std", -0.02), ("bias", "yes"), ("tie_embeddings", 1),
    ("pos", "alibi"), ("gate_form", "relu"), ("ffn", None), ("pattern", "KQ"), ("final_mixer", "XY"),
    ("attn_res_block", 0), ("extra", []),
    ("moe", {"n_routed": 0}), ("moe", {"top_k": 0}), ("moe", {"d_expert": -1}), ("moe", {"n_shared": -1}),
    ("moe", {"latent_dim": 0}), ("moe", {"routed_scaling": 0.0}), ("moe", {"bias_update_rate": -1.0}),
    ("moe", {"aux_loss_coef": float("nan")}), ("moe", {"first_dense": 9}), ("moe", {"nope": 1}), ("moe", 3),
]


@pytest.mark.parametrize("field,value", BAD_CONFIGS, ids=[f"{f}={v!r}" for f, v in BAD_CONFIGS])
def test_bad_config_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field}[.:]"):
        ModelConfig(**{field: value})


def test_every_preset_passes_validation():
    for name in presets.names():
        presets.get(name).validate()
    with pytest.raises(ValueError, match=r"^overrides: unknown ModelConfig field\(s\) \['colour'\]"):
        presets.get("kda", colour="red")


# -- the LM, its cache, generate -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def kda():
    torch.manual_seed(0)
    return LM(presets.get("kda", n_layers=2, d_model=32, n_heads=2, head_dim=16, d_ff=64))


@pytest.mark.parametrize("tokens,match", [
    (torch.tensor([[1, 256]]), r"^tokens: expected ids in \[0, vocab_size=256\), got range \[1, 256\]"),
    (torch.tensor([[-1, 3]]), r"^tokens: expected ids in \[0, vocab_size=256\)"),
    (torch.tensor([[1.0, 2.0]]), r"^tokens: expected an int64 tensor"),
    (torch.tensor([1, 2]), r"^tokens: expected an int64 tensor"),
    ([[1, 2]], r"^tokens: expected an int64 tensor"),
    (torch.tensor([[1, 2]], device=META), r"^tokens: expected a tensor on the model's device cpu"),
    (torch.zeros(1, 0, dtype=torch.int64), r"^tokens: expected at least one sequence of at least one token"),
    (torch.zeros(0, 3, dtype=torch.int64), r"^tokens: expected at least one sequence of at least one token"),
])
def test_lm_tokens(kda, tokens, match):
    with pytest.raises(ValueError, match=match):
        kda(tokens)


@pytest.mark.parametrize("args,kw,match", [
    ((0, 8), {}, r"^batch_size: expected a positive integer"),
    ((1, -1), {}, r"^max_len: expected a positive integer"),
    ((1, 8.0), {}, r"^max_len: expected a positive integer"),
    ((1, 8), dict(dtype=torch.int64), r"^dtype: expected a floating torch dtype"),
    ((1, 8), dict(dtype="float32"), r"^dtype: expected a floating torch dtype"),
    ((1, 8), dict(device="gpu"), r"^device: expected a torch device"),
])
def test_new_cache_arguments(kda, args, kw, match):
    with pytest.raises(ValueError, match=match):
        kda.new_cache(*args, **kw)


def test_forward_rejects_a_foreign_cache(kda):
    other = LM(presets.get("kda", n_layers=3, d_model=32, n_heads=2, head_dim=16, d_ff=64))
    with pytest.raises(ValueError, match=r"^cache: expected a HybridCache from this model"):
        kda(torch.zeros(1, 2, dtype=torch.int64), cache=other.new_cache(1, 4))
    with pytest.raises(ValueError, match=r"^cache: expected a HybridCache"):
        kda(torch.zeros(1, 2, dtype=torch.int64), cache={})


PROMPT = torch.tensor([[1, 2, 3]])


@pytest.mark.parametrize("kw,match", [
    (dict(prompt=[[1, 2]]), r"^prompt: expected a non-empty int64 tensor"),
    (dict(prompt=torch.tensor([[1.0, 2.0]])), r"^prompt: expected a non-empty int64 tensor"),
    (dict(prompt=torch.tensor([1, 2])), r"^prompt: expected a non-empty int64 tensor"),
    (dict(prompt=torch.zeros(1, 0, dtype=torch.int64)), r"^prompt: expected a non-empty int64 tensor"),
    (dict(prompt=torch.tensor([[1, 999]])), r"^prompt: expected token ids in \[0, vocab_size=256\)"),
    (dict(prompt=torch.tensor([[-3, 1]])), r"^prompt: expected token ids in \[0, vocab_size=256\)"),
    (dict(max_new_tokens=-1), r"^max_new_tokens: expected an integer >= 0"),
    (dict(max_new_tokens=2.5), r"^max_new_tokens: expected an integer >= 0"),
    (dict(max_new_tokens=True), r"^max_new_tokens: expected an integer >= 0"),
    (dict(temperature=-0.5), r"^temperature: expected a finite number >= 0"),
    (dict(temperature=float("nan")), r"^temperature: expected a finite number >= 0"),
    (dict(temperature="hot"), r"^temperature: expected a finite number >= 0"),
    (dict(top_k=0), r"^top_k: expected a positive integer"),
    (dict(top_k=2.0), r"^top_k: expected a positive integer"),
    (dict(top_p=0.0), r"^top_p: expected a value in \(0, 1\]"),
    (dict(top_p=1.5), r"^top_p: expected a value in \(0, 1\]"),
    (dict(seed=-1), r"^seed: expected None or an integer"),
    (dict(seed="0"), r"^seed: expected None or an integer"),
    (dict(stop_tokens=5), r"^stop_tokens: expected a sequence of token ids"),
    (dict(stop_tokens="ab"), r"^stop_tokens: expected a sequence of token ids"),
    (dict(stop_tokens=[256]), r"^stop_tokens: expected integer ids in \[0, vocab_size=256\)"),
    (dict(stop_tokens=[-1]), r"^stop_tokens: expected integer ids"),
    (dict(stop_tokens=[1.0]), r"^stop_tokens: expected integer ids"),
    (dict(prefill_chunk=0), r"^prefill_chunk: expected a positive integer"),
    (dict(on_token=5), r"^on_token: expected None or a callable"),
])
def test_generate_arguments(kda, kw, match):
    kw = {"prompt": PROMPT, "max_new_tokens": 2, **kw}
    with pytest.raises(ValueError, match=match):
        kda.generate(kw.pop("prompt"), **kw)


def test_generate_needs_an_lm():
    from evict.models.generate import generate

    with pytest.raises(ValueError, match=r"^model: expected an evict LM, got str"):
        generate("model.safetensors", PROMPT)


def test_generate_beyond_learned_positions_fails_before_work():
    m = LM(presets.get("gpt2", n_layers=1, d_model=32, n_heads=2, head_dim=16, d_ff=64, max_seq_len=8))
    with pytest.raises(ValueError, match=r"^max_new_tokens: prompt \(3\) \+ 6 new tokens exceed the model's 8"):
        m.generate(PROMPT, max_new_tokens=6)
    assert m.generate(PROMPT, max_new_tokens=5, temperature=0).shape == (1, 8)


@pytest.mark.parametrize("training", [True, False])
def test_generate_interrupted_restores_training_mode(kda, training):
    def boom(tokens):
        raise KeyboardInterrupt

    kda.train(training)
    with pytest.raises(KeyboardInterrupt):
        kda.generate(PROMPT, max_new_tokens=3, on_token=boom)
    assert kda.training is training and all(m.training is training for m in kda.modules())
    kda.train(True)


@pytest.mark.parametrize("name", presets.FAMILIES)
def test_reset_cache_equals_a_fresh_one(name):
    """Reusing a cache for a new prompt after reset() gives exactly the logits of a fresh cache (prefill + decode)."""
    torch.manual_seed(0)
    m = LM(presets.get(name, n_layers=2, d_model=32, n_heads=2, head_dim=16, d_ff=64, kv_lora_rank=16, qk_nope_dim=8,
                       qk_rope_dim=8, v_head_dim=16))
    a, b = torch.randint(0, 256, (2, 21)), torch.randint(0, 256, (2, 21))

    def run(cache, tok):
        out = [m(tok[:, :18], cache=cache)]
        out += [m(tok[:, t : t + 1], cache=cache) for t in range(18, 21)]
        return torch.cat(out, 1)

    cache = m.new_cache(2, 24)
    run(cache, a)
    cache.reset()
    assert cache.pos == 0
    assert torch.equal(run(cache, b), run(m.new_cache(2, 24), b))


# -- tokenizers ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tok", [CharTokenizer("abc"), ByteTokenizer()], ids=["char", "byte"])
@pytest.mark.parametrize("ids,match", [
    ([-1], r"^ids: expected token ids in \[0, "), ([999], r"^ids: expected token ids in \[0, "),
    ([1.7], r"^ids: expected integer token ids"), (np.array([1.0]), r"^ids: expected integer token ids"),
    (torch.tensor([0.5]), r"^ids: expected integer token ids"), ([True], r"^ids: expected integer token ids"),
    ([[1, "a"]], r"^ids: expected integer token ids"),
])
def test_decode_rejects_out_of_range_ids(tok, ids, match):
    with pytest.raises(ValueError, match=match):
        tok.decode(ids)
    assert tok.decode(torch.tensor([0, 1])) == tok.decode([0, 1])


@pytest.mark.parametrize("tok", [CharTokenizer("abc"), ByteTokenizer()], ids=["char", "byte"])
def test_encode_needs_text(tok):
    for bad in (5, b"abc", ["a"], None):
        with pytest.raises(ValueError, match=r"^text: expected a str"):
            tok.encode(bad)


def test_bpe_decode_rejects_out_of_range_ids():
    from evict.tasks.tokenizers import BPETokenizer

    tok = BPETokenizer.train(iter(["hello world, hello there"] * 20), 270)
    with pytest.raises(ValueError, match=r"^ids: expected token ids in \[0, "):
        tok.decode([tok.vocab_size])


@pytest.mark.parametrize("content,match", [
    (None, r"^tokenizer: no such file"), ("{bad", r"^tokenizer: .* is not readable JSON"),
    ("[1, 2]", r"^tokenizer: .* holds a JSON list"), ('{"kind": "char"}', r"^tokenizer: .* without a non-empty 'chars'"),
    ('{"kind": "what"}', r"^tokenizer: .* is neither"), ('{"model": 3}', r"^tokenizer: .* is not a valid BPE tokenizer"),
])
def test_load_tokenizer_bad_files(tmp_path, content, match):
    path = tmp_path / "tokenizer.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=match):
        load_tokenizer(path)


def test_truncated_token_cache_is_rebuilt(tmp_path):
    from evict.tasks.text import TextTask

    (tmp_path / "c.txt").write_text("to be or not to be, that is the question. " * 50)
    first = np.array(TextTask(corpus=tmp_path / "c.txt", seq_len=8, cache_dir=tmp_path / "cache").train)  # a copy
    npy = next((tmp_path / "cache").rglob("char-eot.npy"))
    npy.write_bytes(npy.read_bytes()[: npy.stat().st_size // 2])
    again = TextTask(corpus=tmp_path / "c.txt", seq_len=8, cache_dir=tmp_path / "cache")
    assert np.array_equal(np.asarray(again.train), first)
    tok = next((tmp_path / "cache").rglob("char-eot.json"))
    tok.write_text('{"kind": "ch')
    rebuilt = TextTask(corpus=tmp_path / "c.txt", seq_len=8, cache_dir=tmp_path / "cache")
    assert rebuilt.vocab_size == again.vocab_size and np.array_equal(np.asarray(rebuilt.train), first)


# -- checkpoints -----------------------------------------------------------------------------------------------

def _corrupt(folder: Path, how: str) -> None:
    from safetensors.torch import load_file, save_file

    file = folder / "model.safetensors"
    t = load_file(str(file))
    name = "blocks.0.mixer.wqkv.weight"
    if how == "nan":
        t[name] = t[name].clone()
        t[name].view(-1)[5] = float("nan")
    elif how == "inf":
        t[name] = t[name].clone()
        t[name].view(-1)[0] = float("-inf")
    elif how == "shape":
        t[name] = t[name][:-1].clone()
    elif how == "dtype":
        t[name] = t[name].to(torch.int32)
    elif how == "missing":
        del t[name]
    elif how == "extra":
        t["blocks.9.mixer.wqkv.weight"] = t[name].clone()
    if how in ("nan", "inf", "shape", "dtype", "missing", "extra"):
        save_file(t, str(file))
    elif how == "flipped_bit":  # the lowest mantissa bit of the last float: finite, right shape, wrong value
        data = bytearray(file.read_bytes())
        data[-4] ^= 1
        file.write_bytes(bytes(data))
    elif how == "truncated":
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    elif how == "garbage":
        file.write_bytes(b"\x00" * 64)
    elif how == "no_weights":
        file.unlink()
    elif how == "bad_json":
        (folder / "config.json").write_text('{"vocab_size": ')
    elif how == "json_list":
        (folder / "config.json").write_text("[]")
    elif how == "bad_config":
        d = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**d, "norm_eps": -1.0}))
    elif how == "unknown_field":
        d = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**d, "colour": "red"}))


CORRUPTIONS = [
    ("nan", r"model.safetensors: blocks.0.mixer.wqkv.weight holds NaN or Inf"),
    ("inf", r"model.safetensors: blocks.0.mixer.wqkv.weight holds NaN or Inf"),
    ("shape", r"model.safetensors: blocks.0.mixer.wqkv.weight has shape \[95, 32\], the config gives \[96, 32\]"),
    ("dtype", r"model.safetensors: blocks.0.mixer.wqkv.weight has dtype torch.int32, expected torch.float32"),
    ("missing", r"model.safetensors lacks tensors of this model: \['blocks.0.mixer.wqkv.weight'\]"),
    ("extra", r"model.safetensors holds tensors this model does not have"),
    ("flipped_bit", r"model.safetensors: the tensor data does not match the checksum written at save"),
    ("truncated", r"model.safetensors is not a readable safetensors file"),
    ("garbage", r"model.safetensors is not a readable safetensors file"),
    ("no_weights", r"no such file: .*model.safetensors"),
    ("bad_json", r"config.json is not readable JSON"),
    ("json_list", r"config.json holds a JSON list"),
    ("bad_config", r"config.json: norm_eps: expected a finite number > 0"),
    ("unknown_field", r"config.json: config: unknown field\(s\) \['colour'\]"),
]


@pytest.mark.parametrize("how,match", CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
def test_corrupted_checkpoints_fail_naming_the_file(kda, tmp_path, how, match):
    kda.save(tmp_path / "m")
    _corrupt(tmp_path / "m", how)
    with pytest.raises(ValueError, match=r"^checkpoint: .*" + match) as e:
        LM.load(tmp_path / "m")
    assert "\n" not in str(e.value)


def test_a_good_checkpoint_still_loads(kda, tmp_path):
    kda.save(tmp_path / "m")
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["config.json", "model.safetensors"]  # no temporaries
    tok = torch.randint(0, 256, (1, 9))
    assert torch.equal(LM.load(tmp_path / "m")(tok), kda(tok))
    from safetensors.torch import save_model  # a file without a checksum (an older save) still loads

    save_model(kda, str(tmp_path / "m" / "model.safetensors"))
    assert torch.equal(LM.load(tmp_path / "m")(tok), kda(tok))


# -- the CLI: one line on stderr, exit code 2, nothing written -------------------------------------------------

def _files(root: Path) -> set:
    return {p for p in root.rglob("*")}


@pytest.fixture
def model_dir(tmp_path_factory):
    """A saved tiny text model with a char tokenizer of its vocabulary (what `evict train` writes in model/)."""
    folder = tmp_path_factory.mktemp("model")
    torch.manual_seed(0)
    chars = "".join(chr(32 + i) for i in range(64))
    m = LM(presets.get("gpt2", vocab_size=len(chars), n_layers=1, d_model=32, n_heads=2, head_dim=16, d_ff=64))
    m.save(folder)
    CharTokenizer(chars).save(folder / "tokenizer.json")
    return folder


def _cli(argv, tmp_path, monkeypatch, capsys):
    """Run `evict argv` in tmp_path; return (exit code, stderr lines). Asserts nothing was written there."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path.parent / f"{tmp_path.name}_cache"))  # a cache is not output
    before = _files(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert _files(tmp_path) == before, sorted(map(str, _files(tmp_path) - before))
    return e.value.code, err


CLI_CASES = [
    ["train", "--seq-len", "0"], ["train", "--steps", "0"], ["train", "--steps", "-3"], ["train", "--batch-size", "x"],
    ["train", "--lr", "nan"], ["train", "--lr", "0"], ["train", "--warmup", "-1"], ["train", "--eval-every", "0"],
    ["train", "--threads", "0"], ["train", "--device", "gpu"], ["train", "--seed", "-1"], ["train", "--pairs", "0"],
    ["train", "--seed", "99999999999999999999999"], ["generate", "--model", "{model}", "--seed", "-1"],
    ["train", "--bpe-vocab", "0"], ["train", "--tokenizer", "word"], ["train", "--set", "novalue"],
    ["train", "--set", "rope_theta=0", "--corpus", "{corpus}"], ["train", "--set", "conv_size=1", "--corpus", "{corpus}"],
    ["train", "--set", "n_kv_heads=0", "--corpus", "{corpus}"], ["train", "--config", "/no/such.json"],
    ["train", "--out", "/proc/evict-run"], ["train", "--out", "{file}"], ["train", "--corpus", "/no/such.txt"],
    ["train", "--warmup", "50", "--steps", "10", "--corpus", "{corpus}"],
    ["recall", "--workers", "0"], ["recall", "--train-examples", "0"],
    ["recall", "--vocab", "40000", "--train-examples", "10", "--out", "{new}"], ["recall", "--gate-dt", "0.1", "0.01"],
    ["recall", "--gate-dt", "0", "1"], ["recall", "--steps", "0"], ["recall", "--setting", "0", "4"],
    ["recall", "--lr", "-1"], ["recall", "--device", "tpu"], ["recall", "--archs", "rnn", "--out", "{new}"],
    ["recall", "--out", "{file}"], ["recall", "--d-model", "3", "--archs", "attention", "--out", "{new}"],
    ["lab"], ["lab", "state", "--steps", "0"], ["lab", "state", "--models", "rnn"], ["lab", "state", "--tasks", "s4"],
    ["lab", "state", "--workers", "0"], ["lab", "state", "--out", "{file}"], ["lab", "state", "--quick", "--full"],
    ["lab", "capacity", "--steps", "0"], ["lab", "capacity", "--rules", "rnn"], ["lab", "capacity", "--overwrite", "x"],
    ["lab", "capacity", "--sizes", "1", "--out", "{new}"], ["lab", "capacity", "--out", "{file}"],
    ["lab", "pairs", "--dims", "64", "--out", "{new}"], ["lab", "pairs", "--pairs", "200", "--out", "{new}"],
    ["lab", "pairs", "--threshold", "0"], ["lab", "pairs", "--rules", "gla"], ["lab", "pairs", "--out", "{file}"],
    ["lab", "stories", "--models", "attention"], ["lab", "stories", "--steps", "0"], ["lab", "stories", "--out", "{file}"],
    ["lab", "ttt", "--steps", "0"], ["lab", "ttt", "--rules", "adam"], ["lab", "ttt", "--tasks", "parity"],
    ["lab", "ttt", "--pairs", "40", "--out", "{new}"], ["lab", "ttt", "--sizes", "1", "--out", "{new}"],
    ["lab", "ttt", "--out", "{file}"],
    ["size", "gpt5"], ["size", "gpt2", "--context", "0"], ["size", "gpt2", "--bytes", "0"],
    ["size", "gpt2", "--plot", "/proc/x.png"], ["size", "gpt2", "--json", "{dir}"],
    ["bench", "ops", "--out", "/proc/x.json"], ["bench", "ops", "--lengths", "0"], ["bench", "ops", "--device", "cuda:x"],
    ["bench", "decode", "--threads", "0"], ["bench", "decode", "--contexts", "0"], ["bench", "decode", "--out", "{dir}"],
    ["bench", "decode", "--d-model", "-4"], ["bench", "flops"], ["bench", "train", "--procs", "0"],
    ["bench", "train", "--train-steps", "-1"], ["bench", "train", "--setting", "0", "64"],
    ["generate", "--model", "/no/such/folder"], ["generate", "--model", "{model}", "--max-new-tokens", "0"],
    ["generate", "--model", "{model}", "--temperature", "-1"], ["generate", "--model", "{model}", "--top-p", "1.5"],
    ["generate", "--model", "{model}", "--top-k", "0"], ["generate", "--model", "{model}", "--threads", "0"],
    ["generate", "--model", "{model}", "--device", "cpu:0:1"], ["generate", "--model", "{model}", "--prompt", "\u00e9"],
    ["demo", "--unknown"], [], ["nonsense"],
]
if not torch.cuda.is_available():
    CLI_CASES += [["train", "--device", "cuda"], ["generate", "--model", "{model}", "--device", "cuda"]]


def _fill(argv, tmp_path, model_dir):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "corpus.txt").write_text("ROMEO: what light through yonder window breaks?\n" * 20)
    subs = {"{corpus}": str(tmp_path / "corpus.txt"), "{file}": str(tmp_path / "a_file"), "{dir}": str(tmp_path),
            "{model}": str(model_dir), "{new}": str(tmp_path / "new_folder")}
    return [subs.get(a, a) for a in argv]


@pytest.mark.parametrize("argv", CLI_CASES, ids=[" ".join(a) or "(none)" for a in CLI_CASES])
def test_cli_bad_flags_one_line_exit_2_nothing_written(argv, tmp_path, monkeypatch, capsys, model_dir):
    code, err = _cli(_fill(argv, tmp_path, model_dir), tmp_path, monkeypatch, capsys)
    assert code == 2, (code, err)
    assert len(err) == 1 and err[0].startswith("evict") and "error:" in err[0], err
    assert "Traceback" not in err[0]


@pytest.mark.parametrize("how", ["nan", "truncated", "shape"])
def test_cli_generate_refuses_a_corrupted_model(model_dir, tmp_path, monkeypatch, capsys, how):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(model_dir, folder)
    name = "blocks.0.mixer.wqkv.weight"
    from safetensors.torch import load_file, save_file

    if how == "truncated":
        f = folder / "model.safetensors"
        f.write_bytes(f.read_bytes()[:1000])
    else:
        t = load_file(str(folder / "model.safetensors"))
        t[name] = t[name][:-1].clone() if how == "shape" else t[name].clone().fill_(float("nan"))
        save_file(t, str(folder / "model.safetensors"))
    code, err = _cli(["generate", "--model", str(folder), "--max-new-tokens", "3"], tmp_path, monkeypatch, capsys)
    assert code == 2 and len(err) == 1 and "model.safetensors" in err[0], err


def test_cli_generate_refuses_a_tokenizer_of_another_vocab(model_dir, tmp_path, monkeypatch, capsys):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(model_dir, folder)
    ByteTokenizer().save(folder / "tokenizer.json")
    code, err = _cli(["generate", "--model", str(folder)], tmp_path, monkeypatch, capsys)
    assert code == 2 and len(err) == 1 and "has 256 tokens but the model's vocab_size is 64" in err[0], err


def test_cli_out_of_memory_is_one_line_and_a_bug_keeps_its_traceback(monkeypatch, capsys):
    import evict.demo

    def oom():
        raise MemoryError("Unable to allocate 745. GiB")

    monkeypatch.setattr(evict.demo, "run_demo", oom)
    with pytest.raises(SystemExit) as e:
        main(["demo"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err == ["evict demo: error: out of memory (Unable to allocate 745. GiB); try smaller sizes"]

    def bug():
        raise RuntimeError("an internal error")

    monkeypatch.setattr(evict.demo, "run_demo", bug)
    with pytest.raises(RuntimeError, match="an internal error"):  # not a user error: the traceback stays
        main(["demo"])


MISSING = [  # (hidden package, argv, what the line says): parquet data and the BPE tokenizer are optional (the
    # default corpus is shipped inside evict since session 57)
    ("pyarrow", ["train", "--data", "{parquet}", "--steps", "1", "--out", "new"],
     "reading a .parquet file needs the `pyarrow` package: pip install pyarrow"),
    ("tokenizers", ["train", "--task", "text", "--corpus", "{corpus}", "--tokenizer", "bpe", "--steps", "1", "--out",
                    "new"], "needs the `tokenizers` package: pip install tokenizers"),
]


@pytest.mark.parametrize("package, argv, message", MISSING, ids=[f"{m[0]} {m[1][1]}" for m in MISSING])
def test_cli_a_missing_optional_package_is_one_line(package, argv, message, tmp_path, monkeypatch, capsys):
    """Session 15 found `evict lab hybrid` on a machine without the corpus package ending in a traceback."""
    corpus = tmp_path.parent / f"{tmp_path.name}_corpus.txt"
    corpus.write_text("ROMEO: what light through yonder window breaks?\n" * 40)
    parquet = corpus.with_suffix(".parquet")
    parquet.write_bytes(b"PAR1")  # never read: the missing package is named first
    monkeypatch.setitem(sys.modules, package, None)  # `import package` now raises ModuleNotFoundError
    paths = {"{corpus}": str(corpus), "{parquet}": str(parquet)}
    code, err = _cli([paths.get(a, a) for a in argv], tmp_path, monkeypatch, capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("evict ") and message in err[0], err
    assert not (tmp_path / "new").exists()


def test_cli_a_missing_module_of_our_own_keeps_its_traceback_with_evict_debug(monkeypatch, capsys):
    import evict.demo

    def missing():
        raise ModuleNotFoundError("No module named 'evict.nothing'", name="evict.nothing")

    monkeypatch.setattr(evict.demo, "run_demo", missing)
    monkeypatch.setenv("EVICT_DEBUG", "1")
    with pytest.raises(ModuleNotFoundError):
        main(["demo"])


def test_failed_train_leaves_nothing_that_blocks_a_retry(tmp_path, monkeypatch):
    """A run.json left by a run that failed before its first checkpoint does not block a retry into the same folder."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / ".cache"))
    (tmp_path / "c.txt").write_text("ROMEO: what light through yonder window breaks?\n" * 40)
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"model": {"pattern": "K"}, "task": {"name": "other"}}))
    argv = ["train", "--preset", "kda", "--corpus", str(tmp_path / "c.txt"), "--seq-len", "8", "--batch-size", "2",
            "--steps", "1", "--eval-every", "1", "--eval-batches", "1", "--threads", "1", "--out", str(out),
            "--set", "n_layers=1", "--set", "d_model=32", "--set", "n_heads=2", "--set", "head_dim=16", "--set", "d_ff=64"]
    main(argv)
    assert json.loads((out / "summary.json").read_text())["steps"] == 1
    (out / "checkpoint.pt").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(SystemExit, match=r"^--out: .*checkpoint.pt is not a complete checkpoint"):
        main(argv)


@pytest.mark.parametrize("argv", [["train", "--seq-len", "0"], ["generate", "--model", "/no/such/folder"],
                                  ["bench", "ops", "--out", "/proc/evict.json"]])
def test_cli_process_exit_code_and_stderr(argv, tmp_path):
    """The real process: exit code 2, exactly one line on stderr, no traceback."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "evict.cli", *argv], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert not any(tmp_path.iterdir())


def test_silent_replacement_is_gone():
    """--seq-len 0 used to become 256 and --workers 0 became 1: both are now refused while parsing."""
    from evict.cli import build_parser

    for argv in (["train", "--seq-len", "0"], ["recall", "--workers", "0"]):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(argv)
        assert e.value.code == 2
