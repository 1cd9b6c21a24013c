"""`evict serve` and `evict bench serve` from the command line: one command starts a server from a model folder,
loads it, and checks completeness and equality; bad flags are one line, exit 2."""

import json

import pytest
import torch

pytest.importorskip("httpx")

from evict.cli import main  # noqa: E402
from evict.models import LM, presets  # noqa: E402
from evict.tasks.tokenizers import ByteTokenizer  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("run") / "model"
    LM(presets.get("kimi_linear", n_layers=2, init_std=0.2)).save(folder)
    ByteTokenizer().save(folder / "tokenizer.json")
    return folder.parent


def test_bench_serve_starts_its_server_and_checks(model_dir, tmp_path, capsys):
    out = tmp_path / "serve.json"
    main(["bench", "serve", "--model", str(model_dir), "--requests", "12", "--clients", "6", "--rate", "200",
          "--prompt-len", "2", "30", "--output-len", "2", "8", "--check", "3", "--max-batch", "4", "--block-size", "8",
          "--cache-budget", "2M", "--threads", "1", "--out", str(out)])
    s = json.loads(out.read_text())["summary"]
    assert s["errors"] == 0 and s["complete"] == "12/12" and s["equal_alone"] == "3/3"
    assert s["ttft_p50_s"] > 0 and s["output_tokens_per_s"] > 0 and s["peak_memory_gib"] > 0
    assert "| model |" in capsys.readouterr().out


def test_served_text_equals_evict_generate(model_dir, capsys):
    """`evict serve --model DIR`'s engine and app answer a text prompt with `evict generate --temperature 0`'s text."""
    import httpx

    from evict.cli import build_parser
    from evict.serve.load import build_engine
    from evict.serve.server import ServerThread, build_app

    main(["generate", "--model", str(model_dir), "--prompt", "To be", "--temperature", "0", "--max-new-tokens", "20",
          "--threads", "1"])
    want = capsys.readouterr().out.split("\n\n[prefill")[0].removeprefix("To be")
    engine, tok, name = build_engine(build_parser().parse_args(["serve", "--model", str(model_dir), "--threads", "1"]))
    engine.start()
    try:
        with ServerThread(build_app(engine, tok, name)) as url:
            got = httpx.post(f"{url}/v1/completions", json={"prompt": "To be", "max_tokens": 20, "temperature": 0}).json()
    finally:
        engine.stop()
    assert got["choices"][0]["text"] == want and got["usage"]["completion_tokens"] == 20


@pytest.mark.parametrize("argv, flag", [
    (["serve"], "--model"), (["serve", "--model", "/nonexistent/run"], "--model"),
    (["serve", "--preset", "attention", "--cache-budget", "12X"], "--cache-budget"),
    (["serve", "--preset", "attention", "--cache-budget", "1K"], "--cache-budget"),
    (["serve", "--preset", "attention", "--set", "vocab_size=300"], "--set"),
    (["serve", "--preset", "attention", "--max-len", "999999999"], "--max-len"),
    (["bench", "serve"], "--url"),
])
def test_bad_flags_are_one_line_exit_2(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err
