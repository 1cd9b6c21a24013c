"""The README's "Fine-tune on your own data" commands, read from the README and run as written (plus flags that make
them fast) on what a new user has: a transformers GPT-2 folder whose tokenizer.json comes from the `tokenizers`
library (end-of-text `<|endoftext|>`, as the Hub's gpt2), and a .jsonl of their own notes."""

import json
import re
import shlex
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from evict.cli import main  # noqa: E402
from tests.conftest import ROOT  # noqa: E402

FAST = {"train": ["--seq-len", "16", "--batch-size", "2", "--steps", "2", "--warmup", "1", "--eval-every", "2",
                  "--eval-batches", "1", "--threads", "1", "--device", "cpu"],
        "generate": ["--max-new-tokens", "4", "--threads", "1", "--seed", "0"]}


def _readme_commands() -> list[list[str]]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Fine-tune on your own data", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README: the fine-tuning section lost its command block"
    return [shlex.split(line, comments=True) for line in block.group(1).splitlines() if line.strip()]


def test_readme_finetune_commands_run_as_written(tmp_path, monkeypatch, capsys):
    cmds = _readme_commands()
    assert [c[:2] for c in cmds] == [["evict", "convert"], ["evict", "train"], ["evict", "generate"]]
    convert, train, generate = cmds
    src = Path(tmp_path / convert[3])  # ./gpt2: a local transformers GPT-2 folder
    data = tmp_path / train[train.index("--data") + 1]
    notes = [f"Note {i}: the {w} meeting moved to {d}." for i, (w, d) in
             enumerate(zip(["budget", "design", "hiring", "launch"] * 6, ["monday", "tuesday", "friday"] * 8))]
    data.write_text("".join(json.dumps({"text": n, "id": i}) + "\n" for i, n in enumerate(notes)))
    tok = tokenizers.ByteLevelBPETokenizer()
    tok.train_from_iterator(notes, vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=tok.get_vocab_size(), n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                  eos_token_id=tok.token_to_id("<|endoftext|>"))
    transformers.GPT2LMHeadModel(cfg).eval().save_pretrained(src)
    tok.save(str(src / "tokenizer.json"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert main(convert[1:]) == 0
    assert main(train[1:] + FAST["train"]) == 0
    out = Path(train[train.index("--out") + 1])
    run = json.loads((out / "run.json").read_text())
    assert run["model"]["vocab_size"] == tok.get_vocab_size() and run["task"]["init_from"].endswith(convert[-1])
    assert run["task"]["corpus"] == data.name and run["task"]["text_field"] == "text"  # the notes, by their field
    capsys.readouterr()
    assert main(generate[1:] + FAST["generate"]) == 0
    assert capsys.readouterr().out.startswith(generate[generate.index("--prompt") + 1])
