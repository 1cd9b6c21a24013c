"""`evict train` → `evict generate` round trip, resume, `evict bench decode`, and one-line argument errors (CPU, seconds)."""

import contextlib
import io
import json
import math
from types import SimpleNamespace

import pytest
import torch

from evict.bench import decode
from evict.cli import main
from evict.commands.generate import Streamer, run_generate
from evict.models import LM
from evict.tasks.text import TextTask
from evict.tasks.tokenizers import ByteTokenizer
from evict.train import TrainConfig, evaluate

TINY = ["--set", "n_layers=1", "--set", "d_model=32", "--set", "n_heads=2", "--set", "head_dim=16", "--set", "d_ff=64"]


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "tiny.txt"
    path.write_text("ROMEO: what light through yonder window breaks?\nJULIET: ay me!\n" * 40)
    return path


def _train(corpus, out, steps=4, preset="gpt2"):
    main(["train", "--preset", preset, "--corpus", str(corpus), "--seq-len", "16", "--batch-size", "4",
          "--steps", str(steps), "--warmup", "1", "--eval-every", "2", "--eval-batches", "2", "--threads", "1",
          "--out", str(out), *TINY])
    return json.loads((out / "summary.json").read_text())


def _generate(model_dir, **kw):
    args = dict(model=str(model_dir), prompt="ROMEO:", max_new_tokens=20, temperature=0.8, top_k=50, top_p=0.95,
                seed=0, stop=None, device="cpu", threads=1)
    args.update(kw)
    with contextlib.redirect_stdout(io.StringIO()) as out:
        stats = run_generate(SimpleNamespace(**args))
    return stats, out.getvalue()


def test_train_save_load_generate_round_trip(corpus, tmp_path):
    out = tmp_path / "run"
    summary = _train(corpus, out)
    assert summary["steps"] == 4
    assert math.isclose(summary["val_ppl"], math.exp(summary["val_loss"]), rel_tol=1e-9)
    for f in ("metrics.jsonl", "loss.png", "checkpoint.pt", "model/config.json", "model/model.safetensors",
              "model/tokenizer.json"):
        assert (out / f).is_file(), f
    # the saved weights are the trained ones: their val loss is the one reported
    model = LM.load(out / "model")
    task = TextTask(corpus=corpus, tokenizer="char", seq_len=16)
    cfg = TrainConfig(batch_size=4, eval_batches=2, device="cpu")
    val = evaluate(model, task, cfg, torch.device("cpu"), contextlib.nullcontext)
    assert val["loss"] == pytest.approx(summary["val_loss"], rel=1e-5)

    a, printed = _generate(out)  # the run folder is accepted as well as its model/ folder
    b, _ = _generate(out / "model")
    c, _ = _generate(out, seed=1)
    assert a["new_tokens"] == 20 and a["text"] == b["text"]
    assert a["text"] != c["text"]
    assert printed.startswith("ROMEO:" + a["text"])
    assert a["prefill_tok_s"] > 0 and a["decode_tok_s"] > 0


def test_stop_text_ends_generation(corpus, tmp_path):
    _train(corpus, tmp_path / "run", steps=2)
    full, _ = _generate(tmp_path / "run", max_new_tokens=60, temperature=0.0)
    stop = full["text"][3:5]  # two characters the greedy continuation produces: a multi-token stop text
    stopped, _ = _generate(tmp_path / "run", max_new_tokens=60, temperature=0.0, stop=stop)
    assert stopped["text"] == full["text"][: full["text"].index(stop) + len(stop)]


def test_interrupted_run_resumes_exactly_and_refuses_another_model(corpus, tmp_path, monkeypatch):
    import evict.train

    whole = _train(corpus, tmp_path / "whole", steps=4)
    real_save = evict.train.save_checkpoint

    def save_then_stop(path, state):  # the run dies right after its step-2 checkpoint
        real_save(path, state)
        raise KeyboardInterrupt

    out = tmp_path / "run"
    monkeypatch.setattr(evict.train, "save_checkpoint", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        _train(corpus, out, steps=4)
    monkeypatch.setattr(evict.train, "save_checkpoint", real_save)
    resumed = _train(corpus, out, steps=4)
    assert resumed["steps"] == 4
    assert resumed["val_loss"] == pytest.approx(whole["val_loss"], rel=1e-6)
    val_steps = [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == "val"]
    assert val_steps == [2, 4]
    with pytest.raises(SystemExit, match="^--out: .* another model config"):
        _train(corpus, out, steps=6, preset="kda")


def test_streamer_holds_back_incomplete_utf8():
    sink = io.StringIO()
    s = Streamer(ByteTokenizer(), out=sink)
    for b in "aé".encode():
        s(torch.tensor([b]))
        if b == 0xC3:
            assert sink.getvalue() == "a"
    assert sink.getvalue() == "aé"


@pytest.mark.parametrize("argv, message", [
    (["generate", "--model", "/no/such/folder"], "^--model: no such folder"),
    (["train", "--corpus", "/no/such/file.txt", "--steps", "1"], "^--task text: data: no such file"),
    (["train", "--set", "n_layers", "--steps", "1"], "^--set: expected KEY=VALUE"),
    (["train", "--config", "/no/such.json", "--steps", "1"], "^--config: no such file"),
    (["bench", "decode", "--contexts", "0"], "^bench decode: contexts: expected positive"),
])
def test_bad_arguments_give_one_line_errors(argv, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match=message) as e:
        main(argv)
    assert "\n" not in str(e.value)


def test_generate_refuses_a_folder_without_a_model(tmp_path):
    with pytest.raises(SystemExit, match="^--model: .* holds no config.json"):
        _generate(tmp_path)


def test_filled_cache_sits_at_context_with_random_contents():
    torch.manual_seed(0)
    cfgs = decode.model_configs(("attention", "hybrid"), "tiny", dict(n_layers=4))
    att, hyb = LM(cfgs["attention"]), LM(cfgs["hybrid"])
    cache = decode.filled_cache(att, 2, 24, extra=1)
    assert cache.pos == 24 and cache.states[0].k[:, :24].abs().min() > 0
    c = att.cfg
    assert decode.cache_bytes(cache, 24) == 4 * c.n_layers * 2 * c.n_heads * c.head_dim * 24  # K and V, float32
    # the hybrid's one MLA layer grows with context, its three KDA states do not
    grow = decode.cache_bytes(decode.filled_cache(hyb, 1, 48, 1), 48) - decode.cache_bytes(decode.filled_cache(hyb, 1, 24, 1), 24)
    assert grow == 4 * 24 * (c.kv_lora_rank + c.qk_rope_dim)


def test_bench_decode_end_to_end(tmp_path, capsys):
    out = tmp_path / "decode.json"
    main(["bench", "decode", "--models", "attention", "kda", "hybrid", "--contexts", "16", "32", "--steps", "2",
          "--warmup", "0", "--threads", "1", "--max-batch", "4", "--out", str(out)])
    payload = json.loads(out.read_text())
    rows = payload["rows"]
    assert len(rows) == 3 * 2 * 2  # models × contexts × {batch 1, max batch}
    assert {r["batch"] for r in rows if r["batch_mode"] == "max"} == {4}
    assert all(r["speedup_vs_attention"] == pytest.approx(1.0) for r in rows if r["model"] == "attention")
    assert all(r["ms_per_token"] > 0 for r in rows)
    assert out.with_suffix(".png").is_file()
    assert "| hybrid | 32 |" in capsys.readouterr().out


def test_a_diverged_run_saves_no_model_and_exits_with_one_line(corpus, tmp_path, monkeypatch):
    """A training loss that stops being finite (a NaN weight injected after step 2) ends `evict train` with a one-line
    message naming --lr and the step, a non-zero exit, and no model or summary — only the metrics and checkpoint of
    what ran."""
    from evict import train as train_mod

    real = train_mod.train

    def breaking(model, task, cfg, *args, **kw):
        n = []

        def after_step():
            n.append(1)
            if len(n) == 2:
                with torch.no_grad():
                    next(model.parameters()).fill_(math.nan)

        model.after_step = after_step
        return real(model, task, cfg, *args, **kw)

    monkeypatch.setattr("evict.commands.train.train", breaking)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        _train(corpus, out, steps=6)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--lr ") and "not finite by step" in msg and "no model saved" in msg
    assert not (out / "model").exists() and not (out / "summary.json").exists()
    assert (out / "checkpoint.pt").exists() and json.loads((out / "run.json").read_text())["diverged_at"] >= 3
