"""Every tokenizer saves a Hugging Face tokenizer.json: transformers loads it with the same ids; a pretrained
tokenizer.json trains a model (`evict train --tokenizer PATH`); the corpus fast path gives HF's ids exactly."""

import json

import numpy as np
import pytest

from evict.cli import main
from evict.tasks.tokenizers import EOT, BPETokenizer, ByteTokenizer, CharTokenizer, load_tokenizer

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

TEXT = ("ROMEO: But, soft! what light through yonder window breaks?\n\tIt's 2 o'clock —  déjà vu, 東京 😀\r\n"
        "x\u00a0y\u2028z\u3000w\x85v  \n\n   end ")


def _bpe(vocab: int = 300) -> BPETokenizer:
    return BPETokenizer.train(iter([TEXT * 3, "the quick brown fox jumps over the lazy dog 0123456789\n" * 5]), vocab)


@pytest.mark.parametrize("make", [lambda: CharTokenizer(TEXT), ByteTokenizer, _bpe], ids=["char", "byte", "bpe"])
def test_saved_tokenizer_loads_in_transformers_with_the_same_ids(tmp_path, make):
    tok = make()
    tok.save(tmp_path / "tokenizer.json")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    ids = tok.encode(TEXT)
    assert hf.encode(TEXT, add_special_tokens=False) == ids.tolist()
    assert hf.decode(ids.tolist()) == TEXT == tok.decode(ids)
    assert len(hf) == tok.vocab_size
    again = load_tokenizer(tmp_path / "tokenizer.json")
    assert type(again) is type(tok) and np.array_equal(again.encode(TEXT), ids)
    if isinstance(tok, ByteTokenizer):
        assert ids.tolist() == list(TEXT.encode("utf-8"))  # id = byte value, in HF as here


def test_legacy_char_and_byte_files_still_load(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"kind": "char", "chars": "ab"}))
    (tmp_path / "b.json").write_text(json.dumps({"kind": "byte"}))
    assert load_tokenizer(tmp_path / "c.json").encode("ba").tolist() == [1, 0]
    assert isinstance(load_tokenizer(tmp_path / "b.json"), ByteTokenizer)


def test_encode_many_equals_hf_encode():
    tok = _bpe(400)
    chunks = [TEXT, TEXT[7:] + "words words words ", "", "\n\n\n", "🙂" * 5 + " a  b\t\tc"]
    want = np.concatenate([tok.encode(c) for c in chunks])
    assert tok._split is not None  # the fast path is the one under test
    assert np.array_equal(tok.encode_many(chunks), want)


def test_encode_many_with_added_tokens_takes_hf_path(tmp_path):
    tok = _bpe()
    tok._tok.add_special_tokens(["<|endoftext|>"])
    tok.save(tmp_path / "t.json")
    tok = load_tokenizer(tmp_path / "t.json")
    chunks = ["a<|endoftext|>b yonder", TEXT]
    assert np.array_equal(tok.encode_many(chunks), np.concatenate([tok.encode(c) for c in chunks]))
    assert tok.vocab_size - 1 in tok.encode_many(chunks[:1])


def test_train_with_a_pretrained_tokenizer_json(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    corpus = tmp_path / "c.txt"
    corpus.write_text("ROMEO: what light through yonder window breaks?\nJULIET: ay me!\n" * 40)
    tok = _bpe(320)  # built elsewhere: another corpus, its own vocabulary
    tok.save(tmp_path / "pre.json")
    out = tmp_path / "run"
    main(["train", "--preset", "gpt2", "--corpus", str(corpus), "--tokenizer", str(tmp_path / "pre.json"),
          "--seq-len", "16", "--batch-size", "4", "--steps", "2", "--warmup", "1", "--eval-every", "2",
          "--eval-batches", "1", "--threads", "1", "--out", str(out), "--set", "n_layers=1", "--set", "d_model=32",
          "--set", "n_heads=2", "--set", "head_dim=16", "--set", "d_ff=64"])
    assert json.loads((out / "model" / "config.json").read_text())["vocab_size"] == tok.vocab_size
    assert (out / "model" / "tokenizer.json").read_text() == (tmp_path / "pre.json").read_text()
    with pytest.raises(SystemExit) as e:
        main(["train", "--tokenizer", str(tmp_path / "missing.json"), "--out", str(tmp_path / "r2")])
    assert e.value.code == 2 and not (tmp_path / "r2").exists()


@pytest.mark.parametrize("make", [lambda: CharTokenizer(TEXT, eos=True), lambda: ByteTokenizer(eos=True), _bpe],
                         ids=["char", "byte", "bpe"])
def test_end_of_text_token_saved_and_loaded_with_the_same_id(tmp_path, make):
    tok = make()
    assert tok.eos_token_id == tok.vocab_size - 1 == tok.pad_token_id  # the last id
    ids = np.concatenate([tok.encode(TEXT), [tok.eos_token_id], tok.encode("abc")])
    assert tok.decode(ids) == TEXT + EOT + "abc"
    tok.save(tmp_path / "tokenizer.json")
    again = load_tokenizer(tmp_path / "tokenizer.json")
    assert type(again) is type(tok) and again.eos_token_id == tok.eos_token_id and again.vocab_size == tok.vocab_size
    assert np.array_equal(again.encode(TEXT), tok.encode(TEXT))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    assert hf.convert_tokens_to_ids(EOT) == tok.eos_token_id and len(hf) == tok.vocab_size
    assert hf.decode(ids.tolist()) == TEXT + EOT + "abc"


def test_tokenizers_without_end_of_text_still_load(tmp_path):
    """Model folders written before end-of-text existed keep their vocabulary: no EOT, eos_token_id None."""
    for tok in (CharTokenizer("ab"), ByteTokenizer()):
        tok.save(tmp_path / "t.json")
        again = load_tokenizer(tmp_path / "t.json")
        assert again.eos_token_id is None and again.vocab_size == tok.vocab_size == (2 if tok.kind == "char" else 256)
    (tmp_path / "c.json").write_text(json.dumps({"kind": "char", "chars": "ab"}))
    assert load_tokenizer(tmp_path / "c.json").eos_token_id is None
