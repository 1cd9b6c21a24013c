"""`evict train --init-from`: fine-tuning a converted GPT-2 starts at its pre-trained loss (not ln(vocab)), keeps its
vocabulary and tokenizer; mismatches are one-line refusals that write nothing."""

import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from evict.cli import main  # noqa: E402
from evict.tasks.text import TextTask  # noqa: E402
from evict.tasks.tokenizers import BPETokenizer, ByteTokenizer  # noqa: E402

TEXT = "ROMEO: what light through yonder window breaks? It is the east, and Juliet is the sun.\n" * 30
FLAGS = ["--seq-len", "32", "--batch-size", "4", "--steps", "2", "--warmup", "1", "--eval-every", "2",
         "--eval-batches", "1", "--log-every", "1", "--threads", "1", "--device", "cpu"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A tiny GPT-2 (transformers), briefly pre-trained on the corpus with its own BPE, then `evict convert gpt2`."""
    root = tmp_path_factory.mktemp("ft")
    (root / "corpus.txt").write_text(TEXT)
    tok = BPETokenizer.train(iter([TEXT]), 300)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: more threads only contend on a shared machine
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=tok.vocab_size, n_positions=64, n_embd=32,
                                                              n_layer=2, n_head=2, eos_token_id=tok.eos_token_id))
    ids = torch.as_tensor(tok.encode(TEXT))
    opt = torch.optim.Adam(hf.parameters(), lr=1e-2)
    for step in range(40):
        starts = torch.randint(0, len(ids) - 33, (8,), generator=torch.Generator().manual_seed(step))
        x = torch.stack([ids[s : s + 33] for s in starts])
        hf(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    torch.set_num_threads(threads)
    hf.eval().save_pretrained(root / "hf")
    tok.save(root / "hf" / "tokenizer.json")
    assert main(["convert", "gpt2", str(root / "hf"), "--out", str(root / "conv")]) == 0
    return root, hf, tok


@pytest.mark.parametrize("source", ["conv", "conv-hf"])  # `convert gpt2`'s evict folder; then `convert hf` of it
def test_finetuning_starts_at_the_pretrained_loss(converted, monkeypatch, source):
    root, hf, tok = converted
    monkeypatch.setenv("XDG_CACHE_HOME", str(root / "cache"))
    if source == "conv-hf" and not (root / source).exists():
        assert main(["convert", "hf", str(root / "conv"), "--out", str(root / source)]) == 0
    out = root / f"run-{source}"
    main(["train", "--init-from", str(root / source), "--data", str(root / "corpus.txt"), "--out", str(out), *FLAGS])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in rows if r["split"] == "train")
    # the same first batch under transformers' own forward of the pre-trained model
    task = TextTask(root / "corpus.txt", tokenizer=str(root / "conv" / "tokenizer.json"), seq_len=32)
    x, y = task.get_batch("train", 0, 4)
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).item()
    assert first["step"] == 1 and first["loss"] == pytest.approx(want, abs=1e-4)
    assert want < math.log(tok.vocab_size) - 1.5  # pre-trained: far below a fresh model's ln(vocab)
    assert first["lr"] < 3e-4 + 1e-12  # the fine-tuning default, in warmup
    run = json.loads((out / "run.json").read_text())
    assert run["model"]["vocab_size"] == tok.vocab_size and run["task"]["init_from"].endswith(source)
    assert (out / "model" / "tokenizer.json").read_text() == (root / "conv" / "tokenizer.json").read_text()


@pytest.mark.parametrize("extra,msg", [
    (["--preset", "gpt2"], "--preset: not with --init-from"),
    (["--tokenizer", "byte"], "--tokenizer: not with --init-from"),
    (["--task", "mqar"], "fine-tuning is for the text task"),
])
def test_conflicting_flags_are_refused(converted, tmp_path, capsys, extra, msg):
    root, _, _ = converted
    with pytest.raises(SystemExit) as e:
        main(["train", "--init-from", str(root / "conv"), "--out", str(tmp_path / "r"), *extra, *FLAGS])
    err = capsys.readouterr().err
    assert e.value.code == 2 and msg in err and err.count("\n") == 1 and not (tmp_path / "r").exists()


def test_mismatched_or_missing_tokenizer_is_refused(converted, tmp_path, capsys, monkeypatch):
    root, _, _ = converted
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ("config.json", "model.safetensors"):
        (bad / f).write_bytes((root / "conv" / f).read_bytes())
    with pytest.raises(SystemExit) as e:
        main(["train", "--init-from", str(bad), "--out", str(tmp_path / "r"), *FLAGS])
    assert e.value.code == 2 and "holds no tokenizer.json" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # an unconverted transformers folder
        main(["train", "--init-from", str(root / "hf"), "--out", str(tmp_path / "r"), *FLAGS])
    assert e.value.code == 2 and "a transformers 'gpt2' folder; convert it first" in capsys.readouterr().err
    ByteTokenizer(eos=True).save(bad / "tokenizer.json")  # 257 tokens, the model has 300
    with pytest.raises(SystemExit) as e:
        main(["train", "--init-from", str(bad), "--data", str(root / "corpus.txt"), "--out", str(tmp_path / "r"), *FLAGS])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "has 257 tokens but the model's vocab_size is 300" in err and err.count("\n") == 1
    assert not (tmp_path / "r").exists()
