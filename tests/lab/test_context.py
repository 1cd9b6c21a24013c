"""The ratio-against-context lab: training FLOPs matched by hand arithmetic, the windows that score the same
characters at every context, the loss against a float64 reference, the measured cache against the accountant, the
sweep end to end (micro) and its flags."""

import csv
import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from evict.cli import main
from evict.lab import context
from evict.lab.context import (FULL, QUICK, Model, context_losses, matched_steps, model_config, models, run_sweep,
                               steps_for_budget, window_ends, window_rows)
from evict.models import LM, ModelConfig, accounting
from tests.test_bad_input import _cli

CORPUS = "ROMEO: But soft, what light through yonder window breaks?\nJULIET: Ay me!\n" * 200
MICRO = replace(QUICK, ratios=("1:0", "1:1", "0:1"), n_layers=2, scales=(8,), head_dim=8, train_len=8,
                contexts=(8, 16), decode_contexts=(32,), windows=4, steps=2, batch_size=2, decode_steps=1,
                decode_warmup=0, seeds=1, workers=1)


def test_flops_per_token_by_hand():
    """One KDA, one MLA and one attention layer at T = 64: 6 × matmul parameters + 3 × the mixing written out."""
    H, D, T = 2, 8, 64
    cfg = ModelConfig(pattern="KMA", n_layers=3, d_model=16, n_heads=H, head_dim=D, d_ff=32, vocab_size=50,
                      kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=4, v_head_dim=8, moe=None, tie_embeddings=True)
    kda = 7 * H * D * D  # write 2 D², read 2 D², retrieve 2 D², fade D², per head
    mla = 2 * H * (8 + 4 + 8) * T / 2  # q·k over d_nope + d_rope, p·v over d_v; a query sees T/2 keys
    attn = 2 * H * (D + D) * T / 2
    assert (kda, mla, attn) == (896, 2560, 2048)
    f = accounting.train_flops_per_token(cfg, T)
    assert f["mixing"] == 3 * (896 + 2560 + 2048) == 16512
    r = accounting.param_report(cfg)
    assert f["params"] == 6 * (r["total"] - r["embeddings"]["token"] - r["embeddings"]["position"]
                               + r["embeddings"]["token"])  # tied head: the token table is the head's matmul
    assert f["total"] == f["params"] + 16512
    assert accounting.train_flops_per_token(cfg, 2 * T)["mixing"] - f["mixing"] == 3 * (2560 + 2048)  # only attention grows


def test_matched_steps_by_hand():
    # budget 100 steps × 512 tokens × 717,216 FLOPs = 36,721,459,200; a model of 656,496 FLOPs a token:
    # 100 × 717,216 / 656,496 = 109.249 steps -> 109, spending 36,637,728,768 (110 would spend 36,973,854,720)
    assert steps_for_budget(36_721_459_200, 656_496, 512) == 109
    assert steps_for_budget(36_721_459_200, 717_216, 512) == 100
    assert steps_for_budget(36_721_459_200, 2 * 717_216, 512) == 50
    assert steps_for_budget(10.0, 1e9, 512) == 1  # at least one step
    m = matched_steps(MICRO, vocab_size=40)
    tokens = MICRO.batch_size * MICRO.train_len
    for d in MICRO.scales:
        group = [x for x in models(MICRO) if x.d_model == d]
        first = m[group[0].name]
        assert group[0].ratio == "1:0" and first["steps"] == MICRO.steps
        assert first["budget"] == MICRO.steps * tokens * first["flops_per_token"]
        for x in group:
            row = m[x.name]
            assert row["flops_per_token"] == accounting.train_flops_per_token(model_config(MICRO, x, 40),
                                                                               MICRO.train_len)["total"]
            assert row["steps"] == round(MICRO.steps * first["flops_per_token"] / row["flops_per_token"])
            assert abs(row["train_flops"] - row["budget"]) <= tokens * row["flops_per_token"] / 2


def test_models_per_scale_spread_and_one_shape():
    ms = models(replace(QUICK, kinds=("mla", "attention")))
    assert [m.pattern for m in ms if m.d_model == 16] == ["KKKK", "KKKM", "KKKA", "KMKM", "KAKA", "MMMM", "AAAA"]
    assert len(ms) == 14
    cfgs = [model_config(QUICK, m, 40) for m in ms if m.d_model == 32]
    assert {(c.d_model, c.d_ff, c.head_size, c.n_layers) for c in cfgs} == {(32, 64, 8, 4)}
    assert [m.pattern for m in models(FULL) if m.d_model == 128][:3] == ["K" * 8, "K" * 7 + "M", "K" * 7 + "A"]


def test_windows_score_the_same_characters_at_every_context():
    val = np.arange(1000)
    ends = window_ends(len(val), 64, 5)
    assert ends[0] == 64 and ends[-1] + 1 <= len(val) - 1 + 1
    tails = {T: window_rows(val, ends, T)[:, -9:] for T in (8, 16, 64)}  # the last 8 inputs and their targets
    for T in (16, 64):
        assert (tails[T] == tails[8]).all()
    rows = window_rows(val, ends, 64)
    assert rows.shape == (5, 65) and (rows[:, 1:] - rows[:, :-1] == 1).all()  # contiguous text
    with pytest.raises(ValueError, match="^contexts: the validation text"):
        window_ends(70, 64, 8)


def test_context_losses_match_a_float64_reference():
    torch.manual_seed(0)
    sweep = replace(MICRO, contexts=(8, 24), windows=3)
    model = LM(model_config(sweep, Model("mla", "1:1", "KM", 8), 40)).double()
    val = np.random.default_rng(0).integers(0, 40, 200)
    got = context_losses(model, val, sweep, torch.device("cpu"))
    ends = window_ends(200, 24, 3)
    for T in (8, 24):
        rows = torch.from_numpy(window_rows(val, ends, T))
        with torch.no_grad():
            logp = model(rows[:, :-1]).double().log_softmax(-1)  # [W, T, V]
        nll = -logp.gather(-1, rows[:, 1:, None])[..., 0]  # [W, T]
        assert got[str(T)]["loss"] == pytest.approx(nll.mean().item(), rel=1e-9)
        assert got[str(T)]["tail_loss"] == pytest.approx(nll[:, -8:].mean().item(), rel=1e-9)


@pytest.mark.parametrize("pattern", ["KK", "KM", "MM"])
def test_measured_cache_is_the_accountants_count(pattern):
    """The decode row's cache bytes (float32 on a CPU, as allocated) are the accountant's at 4 bytes a number."""
    m = Model("mla", "1:1", pattern, 8)
    job = {"model": m.__dict__, "sweep": MICRO.__dict__ | {"contexts": (8, 16), "decode_contexts": (64,)},
           "vocab_size": 40}
    row = context.time_one(json.loads(json.dumps(job)))
    cfg = model_config(MICRO, m, 40)
    for ctx in (8, 16, 64):
        assert row["decode"][str(ctx)]["cache_bytes"] == accounting.memory_report(cfg, [ctx], 4)[0]["total_bytes"]
        assert row["decode"][str(ctx)]["ms_per_token"] > 0
    grows = row["decode"]["64"]["cache_bytes"] > row["decode"]["8"]["cache_bytes"]
    assert grows == ("M" in pattern)


@pytest.fixture
def single_thread_runs(one_thread, monkeypatch):
    monkeypatch.setattr("evict.lab.sweep.os.cpu_count", lambda: 1)


def test_sweep_runs_resumes_and_writes_outputs(tmp_path, single_thread_runs):
    (tmp_path / "c.txt").write_text(CORPUS)
    sweep = replace(MICRO, corpus=str(tmp_path / "c.txt"))
    root = run_sweep(sweep, out=tmp_path / "sweep")
    for name in ("config.json", "results.jsonl", "decode.jsonl", "table.md", "table.csv", "context.png"):
        assert (root / name).stat().st_size > 0, name
    rows = [json.loads(line) for line in (root / "results.jsonl").read_text().splitlines()]
    assert sorted(r["model"] for r in rows) == sorted(m.name for m in models(sweep))
    first = next(r for r in rows if r["ratio"] == "1:0")
    for r in rows:
        assert set(r["contexts"]) == {"8", "16"} and all(v["tail_loss"] > 0 for v in r["contexts"].values())
        assert r["steps"] == round(sweep.steps * first["flops_per_token"] / r["flops_per_token"])
        assert (root / "runs" / f"{r['model']}_s0" / "result.json").exists()
    table = (root / "table.md").read_text()
    assert "| KDA only 1:0 | KK |" in table and "tail loss @16" in table and "ms/token @32" in table
    with (root / "table.csv").open() as f:
        lines = list(csv.DictReader(f))
    assert len(lines) == len(models(sweep)) * 3  # contexts 8, 16 and the decode-only 32
    assert {row["tail_loss_mean"] == "" for row in lines if row["context"] == "32"} == {True}
    stamps = {p: p.stat().st_mtime_ns for p in root.glob("*/*/result.json")}
    run_sweep(sweep, out=root)  # a finished sweep trains and times nothing again
    assert stamps == {p: p.stat().st_mtime_ns for p in root.glob("*/*/result.json")}
    with pytest.raises(ValueError, match=r"^out: .* holds a sweep with another config"):
        run_sweep(replace(sweep, steps=3), out=root)


def test_a_timed_piece_leaves_decode_timing_to_the_next(tmp_path, single_thread_runs, capsys):
    """--minutes: a piece that ends with models' decode timing left writes no table and says so; the next piece times
    only those models (the timed ones are kept) and writes the table."""
    (tmp_path / "c.txt").write_text(CORPUS)
    sweep = replace(MICRO, corpus=str(tmp_path / "c.txt"))
    root = run_sweep(sweep, out=tmp_path / "sweep")
    left = models(sweep)[0].name
    for name in ("table.md", "table.csv", "decode.jsonl", "context.png"):
        (root / name).unlink()
    (root / "decode" / left / "result.json").unlink()
    stamps = {p: p.stat().st_mtime_ns for p in root.glob("*/*/result.json")}
    capsys.readouterr()
    run_sweep(sweep, out=root, minutes=1e-9)
    said = capsys.readouterr().out
    n = len(models(sweep))
    assert f"every run trained, {n - 1} of {n} models' decode timed" in said and f"--out {root}" in said
    assert not (root / "table.md").exists() and not (root / "decode" / left / "result.json").exists()
    run_sweep(sweep, out=root)
    assert (root / "table.md").exists() and (root / "decode" / left / "result.json").exists()
    assert stamps == {p: p.stat().st_mtime_ns for p in stamps}  # nothing else trained or timed again


BAD = [
    ["--ratios", "2:2"], ["--ratios", "5:1"], ["--kinds", "rnn"], ["--scales", "12"], ["--scales", "0"],
    ["--contexts", "16", "64"], ["--contexts", "64", "32"], ["--train-len", "0"], ["--decode-contexts", "0"],
    ["--corpus", "/no/such.txt"], ["--steps", "0"], ["--quick", "--full"], ["--gate-dt", "1e-2", "1e-3"],
    ["--contexts", "32", "1000000"],
]


@pytest.mark.parametrize("flags", BAD, ids=[" ".join(b) for b in BAD])
def test_bad_flags_one_line_exit_2_nothing_written(flags, tmp_path, monkeypatch, capsys):
    code, err = _cli(["lab", "context", *flags, "--out", str(tmp_path / "new")], tmp_path, monkeypatch, capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("evict") and "error:" in err[0], err
    assert not (tmp_path / "new").exists()


def test_flags_reach_the_sweep(monkeypatch):
    seen = []
    monkeypatch.setattr("evict.lab.context.run_sweep", lambda sweep, out=None, minutes=None: seen.append(sweep))
    assert main(["lab", "context", "--scales", "32", "--kinds", "mla", "attention", "--contexts", "32", "512",
                 "--decode-contexts"]) == 0
    assert main(["lab", "context", "--full", "--no-compile"]) == 0
    assert (seen[0].scales, seen[0].kinds, seen[0].contexts, seen[0].decode_contexts) == (
        (32,), ("mla", "attention"), (32, 512), ())
    assert seen[1].n_layers == 8 and seen[1].compile is False and seen[1].ratios == FULL.ratios


@pytest.mark.slow
def test_the_full_sweep_validates():
    """The GPU sweep's 18 models build, tile 8 layers and fit 64 windows of 4,096 in the validation text (~13 s)."""
    context.validate(FULL)
    assert len(models(FULL)) == 18 and FULL.seeds * len(models(FULL)) == 54
