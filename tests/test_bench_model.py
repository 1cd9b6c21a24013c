"""The model-level training bench: FLOP counting against hand counts, a CPU run of its loop, bad input."""

import pytest
import torch

from evict.bench.model import NAMED, attention_flops_per_token, bench_model, matmul_params, model_config
from evict.models import LM


def test_gpt2_124m_flops_by_hand():
    cfg = model_config("gpt2_124m")
    with torch.device("meta"):
        model = LM(cfg)
    d, L, V, T = 768, 12, 50257, 1024
    per_layer = 4 * d * d + 4 * d + 2 * 4 * d * d + 4 * d + d + 4 * d  # qkv+o (+biases), MLP (+biases), two LayerNorms
    assert matmul_params(model, model.head) == V * d + L * per_layer + 2 * d  # tied head once, final LayerNorm; no wpe
    assert attention_flops_per_token(cfg, T) == L * 12 * T * d


def test_named_shapes():
    with torch.device("meta"):
        kda = LM(NAMED["kda_226m"]())
    n = sum(p.numel() for p in kda.parameters())
    assert 220e6 < n < 232e6  # issue 74's "226M"
    assert attention_flops_per_token(NAMED["kda_226m"](), 4096) == 0
    assert attention_flops_per_token(NAMED["kkka_226m"](), 4096) == 3 * 12 * 4096 * 1024
    assert attention_flops_per_token(NAMED["kkkm_226m"](), 4096) == 3 * 6 * 4096 * 8 * (128 + 64 + 128)


@pytest.mark.slow
def test_cpu_run_beside_transformers(tmp_path):
    pytest.importorskip("transformers")
    rows = bench_model(models=("gpt2",), size="tiny", batch=2, seq_len=16, warmup=1, steps=1, device="cpu",
                       out=tmp_path / "b.json")
    assert [(r["impl"], r["mode"]) for r in rows] == [("evict", "eager"), ("transformers", "eager")]
    assert all(r["tok/s"] > 0 and r["peak GiB"] is None for r in rows)
    assert rows[0]["vs"] == "transformers" and rows[0]["tok/s ratio"] > 0
    # same shapes, same FLOP count: the two models are the same architecture
    assert rows[0]["GFLOP/token"] == rows[1]["GFLOP/token"] and rows[0]["params M"] == rows[1]["params M"]
    assert (tmp_path / "b.json").exists()


def test_profile_writes_each_rows_kernel_table(tmp_path):
    """profile=N: one more step under torch.profiler per row, its top-N table in the JSON row and in the .kernels.txt."""
    rows = bench_model(models=("gpt2",), size="tiny", batch=1, seq_len=8, warmup=1, steps=1, device="cpu",
                       references=False, profile=4, out=tmp_path / "b.json")
    table = rows[0]["kernels"]
    assert "Self CPU" in table and "aten::" in table
    text = (tmp_path / "b.kernels.txt").read_text()
    assert text.startswith("## gpt2 evict eager B1 T8:") and table in text


@pytest.mark.parametrize("kw,name", [(dict(models=("nope",)), "model"), (dict(modes=("fast",)), "modes"),
                                     (dict(batch=0), "batch"), (dict(profile=-1), "profile"), (dict(models=("gpt2",), seq_len=4096), "seq_len")])
def test_bad_input_one_line(kw, name, tmp_path):
    with pytest.raises(ValueError, match=f"^{name}: expected|^{name}: gpt2 has"):
        bench_model(**{"device": "cpu", "out": tmp_path / "x.json", **kw})
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("argv", [["--lm", "nope"], ["--lm", "gpt2", "--batch-size", "0"],
                                  ["--lm", "gpt2", "--modes", "fast"], ["--lm", "gpt2", "--seq-len", "5000"],
                                  ["--lm", "gpt2", "--profile", "0"]])
def test_cli_bad_flags_one_line_exit_2(argv, tmp_path, monkeypatch, capsys):
    from evict.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["bench", "train", "--device", "cpu", "--out", str(tmp_path / "b.json"), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) <= 2 and "Traceback" not in "\n".join(err), err
    assert not (tmp_path / "b.json").exists()
