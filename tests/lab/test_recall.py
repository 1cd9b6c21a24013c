"""The recall lab end to end on a micro configuration: runs, resumes, writes the table, plots and scorecard."""

import json
from dataclasses import replace

import pytest

from evict.cli import main
from evict.lab.recall import QUICK, best_over_lr, jobs_for, model_config, run_sweep

MICRO = replace(QUICK, archs=("attention", "deltanet", "kimi_linear"), settings=((16, 2), (24, 4)), d_models=(32,),
                lrs=(1e-3, 3e-3), steps=4, batch_size=4, eval_every=2, eval_batches=1, workers=1, vocab_size=32)


def test_sweep_runs_resumes_and_writes_outputs(tmp_path, capsys):
    root = run_sweep(MICRO, out=tmp_path / "sweep")
    for name in ("config.json", "results.jsonl", "table.md", "scorecard.md", "recall_vs_pairs.png", "recall_vs_state.png"):
        assert (root / name).stat().st_size > 0, name
    rows = [json.loads(line) for line in (root / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * 2 * 2
    assert {r["arch"] for r in rows} == set(MICRO.archs)
    table = (root / "table.md").read_text()
    assert "| deltanet |" in table and "K=4 (L=24)" in table
    card = (root / "scorecard.md").read_text()
    assert "| DeltaNet |" in card and "not in this sweep" in card  # linear etc. were not run
    # resuming the finished sweep trains nothing: result files are reused as they are
    stamps = {p: p.stat().st_mtime_ns for p in (root / "runs").glob("*/result.json")}
    run_sweep(MICRO, out=root)
    assert stamps == {p: p.stat().st_mtime_ns for p in (root / "runs").glob("*/result.json")}
    with pytest.raises(ValueError, match=r"^out: .* holds a sweep with another config"):
        run_sweep(replace(MICRO, steps=5), out=root)


def test_best_over_lr_and_state_sizes():
    jobs = jobs_for(MICRO, __import__("pathlib").Path("/nonexistent"))
    assert len(jobs) == 12
    rows = [dict(arch="a", seq_len=16, pairs=2, d_model=32, lr=lr, accuracy=acc) for lr, acc in ((1e-3, 0.4), (3e-3, 0.7))]
    assert best_over_lr(rows)[("a", 16, 2, 32)]["lr"] == 3e-3
    # the fixed memories hold the same numbers at any length; attention's grows with it
    from evict import LM

    att, dn = LM(model_config("attention", 32, MICRO, 64)), LM(model_config("deltanet", 32, MICRO, 64))
    kv_per_token = 2 * 2 * 32  # 2 layers x (K + V) x d_model (heads x head_dim)
    assert att.state_size(128) - att.state_size(64) == kv_per_token * 64
    assert dn.state_size(128) == dn.state_size(64)


def test_cli_rejects_unknown_arch(tmp_path):
    with pytest.raises(SystemExit, match="archs: unknown architecture"):
        main(["recall", "--archs", "transformerxl", "--out", str(tmp_path / "x")])
