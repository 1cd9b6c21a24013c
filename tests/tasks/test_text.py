"""Text task: tokenizers round-trip, corpus loading, cached split, deterministic shifted batches, errors."""

import math

import numpy as np
import pytest
import torch

from evict.tasks import Task
from evict.tasks import text
from evict.tasks.text import TextTask, corpus_files, iter_chunks
from evict.tasks.tokenizers import EOT, BPETokenizer, ByteTokenizer, CharTokenizer, load_tokenizer

SAMPLE = "Ünïcode ✓ and\ttabs\r\n  indented line\n\n'tis: the end"


def _corpus(n_lines: int = 400, seed: int = 0) -> str:
    """Small deterministic English-like text with indentation and blank lines (odd sizes on purpose)."""
    words = "the king shall hold his crown and she doth speak of love 'tis night good lord".split()
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(n_lines):
        line = " ".join(words[j] for j in rng.integers(0, len(words), size=rng.integers(1, 12)))
        lines.append(("  " if i % 3 == 0 else "") + line.capitalize() + ("\n" if i % 7 == 0 else ""))
    return "\n".join(lines) + "\n"


@pytest.fixture
def corpus_file(tmp_path):
    path = tmp_path / "small.txt"
    path.write_text(_corpus(), encoding="utf-8")
    return path


def test_char_roundtrip_and_unknown(tmp_path):
    tok = CharTokenizer.from_chunks([SAMPLE[:20], SAMPLE[20:]])
    assert tok.vocab_size == len(set(SAMPLE)) + 1 and tok.chars == "".join(sorted(set(SAMPLE)))
    assert tok.eos_token_id == len(tok.chars)  # end-of-text: the id after the characters
    ids = tok.encode(SAMPLE)
    assert ids.dtype == np.int64 and ids.shape == (len(SAMPLE),) and ids.max() < tok.vocab_size
    assert tok.decode(ids) == SAMPLE and tok.decode(torch.from_numpy(ids)) == SAMPLE
    assert np.all(np.diff(tok.encode(tok.chars)) == 1)  # id = rank of the character
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.encode("Z")
    tok.save(tmp_path / "c.json")
    assert load_tokenizer(tmp_path / "c.json").encode(SAMPLE).tolist() == ids.tolist()


def test_byte_roundtrip(tmp_path):
    tok = ByteTokenizer()
    ids = tok.encode(SAMPLE)
    assert tok.vocab_size == 256 and len(ids) == len(SAMPLE.encode()) and tok.decode(ids) == SAMPLE
    assert tok.decode(ids[:1]) == "\ufffd"  # a cut multi-byte character decodes to the replacement mark
    tok.save(tmp_path / "b.json")
    assert isinstance(load_tokenizer(tmp_path / "b.json"), ByteTokenizer)


def test_bpe_roundtrip_deterministic(tmp_path):
    pytest.importorskip("tokenizers")
    corpus = _corpus()
    tok = BPETokenizer.train(iter([corpus[:5003], corpus[5003:]]), vocab_size=300)
    assert 256 < tok.vocab_size <= 300
    ids = tok.encode(corpus)
    assert len(ids) < 0.7 * len(corpus) and ids.max() < tok.vocab_size
    assert tok.decode(ids) == corpus and tok.decode(tok.encode(SAMPLE)) == SAMPLE  # unseen text: byte fallback
    again = BPETokenizer.train(iter([corpus[:5003], corpus[5003:]]), vocab_size=300)
    assert again.encode(corpus).tolist() == ids.tolist()
    tok.save(tmp_path / "bpe.json")
    assert load_tokenizer(tmp_path / "bpe.json").encode(corpus).tolist() == ids.tolist()


def test_chunks_are_exact_and_do_not_change_bpe_tokens(corpus_file):
    pytest.importorskip("tokenizers")
    whole = corpus_file.read_text(encoding="utf-8")
    chunks = list(iter_chunks([corpus_file], chunk_chars=997))
    assert len(chunks) > 5 and "".join(chunks) == whole
    tok = BPETokenizer.train(iter([whole]), vocab_size=320)
    assert np.concatenate([tok.encode(c) for c in chunks]).tolist() == tok.encode(whole).tolist()


def test_split_cache_and_batches(corpus_file, tmp_path, monkeypatch):
    task = TextTask(corpus_file, tokenizer="char", seq_len=33, val_fraction=0.1, seed=3, cache_dir=tmp_path / "c")
    assert isinstance(task, Task) and task.name == "text:small:char"
    ids = task.tokenizer.encode(corpus_file.read_text(encoding="utf-8"))
    ids = np.append(ids, task.tokenizer.eos_token_id)  # the document ends with end-of-text
    n_val = int(len(ids) * 0.1)
    assert task.val.tolist() == ids[-n_val:].tolist() and task.train.tolist() == ids[:-n_val].tolist()

    def no_rebuild(*args):
        raise AssertionError("cache miss: the corpus was tokenized again")

    monkeypatch.setattr(text, "build_tokenizer", no_rebuild)
    monkeypatch.setattr(CharTokenizer, "encode", no_rebuild)
    again = TextTask(corpus_file, tokenizer="char", seq_len=33, val_fraction=0.1, seed=3, cache_dir=tmp_path / "c")
    assert again.val.tolist() == task.val.tolist()

    for split in ("train", "val"):
        x, y = task.get_batch(split, 5, 7)
        assert x.shape == y.shape == (7, 33) and x.dtype == y.dtype == torch.int64 and x.device.type == "cpu"
        assert torch.equal(x[:, 1:], y[:, :-1])  # next-token targets
        x2, y2 = again.get_batch(split, 5, 7)
        assert torch.equal(x, x2) and torch.equal(y, y2)
        assert not torch.equal(x, task.get_batch(split, 6, 7)[0])
        data = task.train if split == "train" else task.val
        stream = task.tokenizer.decode(data)  # every window is a contiguous piece of its split
        for row_x, row_y in zip(x, y):
            assert task.tokenizer.decode(torch.cat([row_x, row_y[-1:]])) in stream
    other_seed = TextTask(corpus_file, seq_len=33, seed=4, cache_dir=tmp_path / "c")
    assert not torch.equal(other_seed.get_batch("train", 5, 7)[0], task.get_batch("train", 5, 7)[0])


def test_val_steps_cover_split_once(corpus_file, tmp_path):
    task = TextTask(corpus_file, seq_len=17, val_fraction=0.2, cache_dir=tmp_path)
    B, n = 3, task.n_val_windows
    ys = torch.cat([task.get_batch("val", s, B)[1] for s in range(task.val_steps(B))])[:n]  # [n, T]
    assert ys.reshape(-1).tolist() == task.val[1 : 1 + n * 17].tolist()


def test_folder_corpus_sorted_txt_only(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "b.txt").write_text("second file\n" * 40)
    (folder / "a.txt").write_text("first file\n" * 40)
    (folder / "notes.md").write_text("ignored")
    name, files = corpus_files(folder)
    assert name == "texts" and [f.name for f in files] == ["a.txt", "b.txt"]
    task = TextTask(folder, tokenizer="byte", seq_len=8, cache_dir=tmp_path / "c")
    stream = task.tokenizer.decode(np.concatenate([task.train, task.val]))
    assert stream == "first file\n" * 40 + EOT + "second file\n" * 40 + EOT  # one document per file


def test_unigram_loss_exact_on_two_letters(tmp_path):
    path = tmp_path / "ab.txt"
    path.write_text("ab" * 500)
    task = TextTask(path, seq_len=4, val_fraction=0.2, cache_dir=tmp_path)
    train, val = task.train.tolist(), task.val.tolist()  # "abab...ab" + end-of-text: V = 3
    assert task.vocab_size == 3 and val[-1] == task.tokenizer.eos_token_id and train.count(2) == 0
    p = {t: (train.count(t) + 1) / (len(train) + 3) for t in range(3)}  # add-one smoothed unigram
    want = -sum(math.log(p[t]) for t in val) / len(val)
    assert task.unigram_loss() == pytest.approx(want, abs=1e-9)


def test_errors(tmp_path, corpus_file):
    cases = [
        ({"corpus": tmp_path / "missing.txt"}, "data: no such file"),
        ({"corpus": tmp_path / "empty"}, "data: folder .* holds no"),  # folder without *.txt
        ({"corpus": corpus_file, "tokenizer": "word"}, "tokenizer"),
        ({"corpus": corpus_file, "tokenizer": "bpe", "bpe_vocab_size": 200}, "bpe_vocab_size"),
        ({"corpus": corpus_file, "seq_len": 10_000}, "seq_len"),
        ({"corpus": corpus_file, "val_fraction": 1.0}, "val_fraction"),
    ]
    (tmp_path / "empty").mkdir()
    for kwargs, word in cases:
        with pytest.raises(ValueError, match=word) as info:
            TextTask(cache_dir=tmp_path / "c", **kwargs)
        assert "\n" not in str(info.value)
    (tmp_path / "empty" / "e.txt").write_text("")
    with pytest.raises(ValueError, match="corpus: the corpus is empty"):
        TextTask(tmp_path / "empty", cache_dir=tmp_path / "c")
    task = TextTask(corpus_file, seq_len=8, cache_dir=tmp_path / "c")
    with pytest.raises(ValueError, match="split"):
        task.get_batch("test", 0, 2)


@pytest.fixture(scope="module")
def shakespeare_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def test_shakespeare_char(shakespeare_cache):
    files = text.shakespeare_files(shakespeare_cache)  # shipped inside evict: no other package needed
    assert len(files) == 42 and sum(f.stat().st_size for f in files) == 5_057_198
    task = TextTask(tokenizer="char", seq_len=256, cache_dir=shakespeare_cache)
    assert task.name == "text:shakespeare:char" and task.vocab_size == 84 + 1  # 84 characters + end-of-text
    assert len(task.train) + len(task.val) == 5_057_198 + 42 and task.train.dtype == np.uint8
    assert 2.0 < task.unigram_loss() < 5.0  # 3.33 nats; log(84) = 4.43 would be uniform
    x, y = task.get_batch("train", 0, 4)
    assert x.shape == (4, 256) and torch.equal(x[:, 1:], y[:, :-1])
    assert "Hamlet" in task.tokenizer.decode(task.train[: 2_000_000])


@pytest.mark.slow
def test_shakespeare_bpe(shakespeare_cache):
    pytest.importorskip("tokenizers")
    task = TextTask(tokenizer="bpe", bpe_vocab_size=2048, cache_dir=shakespeare_cache)
    assert task.vocab_size == 2048 and task.train.dtype == np.uint16
    whole = "".join(f.read_text() + EOT for f in text.shakespeare_files(shakespeare_cache))
    assert task.tokenizer.decode(np.concatenate([task.train, task.val])) == whole
    assert 4.0 < task.unigram_loss() < 8.0
