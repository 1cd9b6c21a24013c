"""`--data`: .jsonl / .parquet / datasets folders as documents separated by end-of-text, `evict data prepare` into a
.bin (parallel workers) that training memory-maps, nanoGPT .bin files, and one-line refusals."""

import json

import numpy as np
import pytest

from evict.cli import main
from evict.data import open_corpus, read_bin
from evict.tasks.prepare import prepare
from evict.tasks.text import TextTask
from evict.tasks.tokenizers import EOT, ByteTokenizer

DOCS = [f"record {i}: " + "the king shall hold his crown " * (1 + i % 5) for i in range(60)]
TINY = ["--preset", "gpt2", "--seq-len", "16", "--batch-size", "4", "--steps", "2", "--warmup", "1", "--eval-every",
        "2", "--eval-batches", "1", "--threads", "1", "--set", "n_layers=1", "--set", "d_model=32", "--set", "n_heads=2",
        "--set", "head_dim=16", "--set", "d_ff=64"]


@pytest.fixture
def jsonl(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(DOCS)))
    return path


def _docs(corpus) -> list[str]:
    return ["".join(doc) for doc in corpus.documents()]


def test_jsonl_documents_are_separated_by_end_of_text(jsonl, tmp_path):
    assert _docs(open_corpus(jsonl, "body")) == DOCS
    task = TextTask(jsonl, tokenizer="byte", seq_len=16, text_field="body", cache_dir=tmp_path / "c")
    stream = task.tokenizer.decode(np.concatenate([task.train, task.val]))
    assert stream == "".join(d + EOT for d in DOCS)  # the JSON itself is not trained on
    with pytest.raises(ValueError, match=r"^data: .* line 1 has no string field 'text' \(got id, body\)") as e:
        TextTask(jsonl, tokenizer="byte", seq_len=16, cache_dir=tmp_path / "c")
    assert "\n" not in str(e.value)


def test_prepare_writes_a_bin_that_training_reads(jsonl, tmp_path):
    out = tmp_path / "prep" / "docs.bin"
    meta = prepare(str(jsonl), out, tokenizer="byte", text_field="body", workers=2, progress=False)
    want = np.concatenate([np.append(ByteTokenizer().encode(d), 256) for d in DOCS])  # each doc, then EOT (256)
    ids, on_disk = read_bin(out)
    assert meta == on_disk and meta["dtype"] == "uint16" and meta["documents"] == len(DOCS)
    assert ids.dtype == np.uint16 and np.array_equal(ids, want) and meta["tokens"] == len(want)
    prepare(str(jsonl), tmp_path / "one.bin", tokenizer="byte", text_field="body", workers=1, progress=False)
    assert (tmp_path / "one.bin").read_bytes() == out.read_bytes()  # in-process = the pool's, in order
    task = TextTask(out, seq_len=16)  # memory-mapped, with the tokenizer the meta names
    assert isinstance(task.train, np.memmap) and task.tokenizer.eos_token_id == 256
    assert np.array_equal(np.concatenate([task.train, task.val]), want)
    main(["train", "--data", str(out), "--out", str(tmp_path / "run"), *TINY])
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 2


def test_nanogpt_bin_needs_a_tokenizer(tmp_path):
    tok = ByteTokenizer(eos=True)
    tok.save(tmp_path / "tok.json")
    path = tmp_path / "train.bin"
    np.arange(200, dtype=np.uint16).tofile(path)  # nanoGPT's layout: flat uint16, no meta
    with pytest.raises(ValueError, match="no meta JSON naming its tokenizer; give --tokenizer PATH"):
        TextTask(path, seq_len=8)
    task = TextTask(path, tokenizer=str(tmp_path / "tok.json"), seq_len=8)
    assert task.vocab_size == 257 and np.array_equal(np.concatenate([task.train, task.val]), np.arange(200))
    np.full(20, 300, dtype=np.uint16).tofile(path)
    with pytest.raises(ValueError, match=r"holds id 300, past the vocabulary \(257 tokens\)"):
        TextTask(path, tokenizer=str(tmp_path / "tok.json"), seq_len=8)
    path.write_bytes(b"\x01\x02\x03")
    with pytest.raises(ValueError, match="has 3 bytes, not a whole number"):
        read_bin(path)


def test_bad_data_paths_are_one_line_cli_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "x.csv").write_text("a,b\n")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
    for argv, msg in [(["--data", str(tmp_path / "x.csv")], "expected .txt, .jsonl, .parquet, .bin"),
                      (["--data", str(tmp_path / "bad.jsonl")], "line 2 is not JSON")]:
        with pytest.raises(SystemExit) as e:
            main(["train", *argv, "--out", str(tmp_path / "r"), *TINY])
        err = capsys.readouterr().err
        assert e.value.code == 2 and msg in err and err.count("\n") == 1 and not (tmp_path / "r").exists()
    with pytest.raises(SystemExit) as e:
        main(["data", "prepare", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "p.bin"), "--tokenizer", "byte",
              "--workers", "1"])
    assert e.value.code == 2 and not list(tmp_path.glob("p.*")) and not list(tmp_path.glob(".*p.*"))


def test_parquet_and_datasets_folders(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": DOCS}), tmp_path / "d.parquet")
    assert _docs(open_corpus(tmp_path / "d.parquet", "content")) == DOCS
    with pytest.raises(ValueError, match="has no column 'text'"):
        _docs(open_corpus(tmp_path / "d.parquet"))
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS})}).save_to_disk(tmp_path / "ds")
    assert _docs(open_corpus(tmp_path / "ds")) == DOCS
