"""`evict bench claims --claims attn_res_train`: the AttnRes training-efficiency comparison (evict/bench/claims_train.py)."""

from __future__ import annotations

import json

import pytest
import torch

from evict.bench import claims as c
from evict.bench import claims_train as ct
from evict.layers.attn_res import AttnResRead
from evict.models import LM
from tests.conftest import cli_error

TINY = dict(d_model=16, n_heads=1, head_dim=16, d_ff=32, n_layers=2, seq_len=16, batch=4, steps=4, warmup=1,
            eval_every=2, eval_batches=1, seeds=(0,))


@pytest.mark.parametrize("n_layers, block", [(1, 1), (3, 1), (4, 2), (5, 2), (6, 3), (7, 12)])
def test_read_sources_count_what_the_lm_mixes(n_layers, block):
    """Each AttnResRead's input, recorded by a hook on a real forward, has the source count read_sources predicts."""
    cfg = ct.model_config(dict(ct.QUICK, n_layers=n_layers, attn_res_block=block, d_model=16, n_heads=1, head_dim=16,
                               d_ff=32, seq_len=8), vocab_size=11, attn_res=True)
    model = LM(cfg)
    seen: list[int] = []
    for m in model.modules():
        if isinstance(m, AttnResRead):
            m.register_forward_pre_hook(lambda mod, args: seen.append(len(args[0])))
    model(torch.randint(0, 11, (2, 8)))
    assert seen == ct.read_sources(n_layers, block)


def test_attn_res_flops_are_counted_and_small():
    s = dict(ct.QUICK)
    plain, ar = (ct.model_config(s, 85, on) for on in (False, True))
    assert ct.attn_res_flops_per_token(plain) == 0
    expect = 3 * 8 * s["d_model"] * sum(ct.read_sources(s["n_layers"], s["attn_res_block"]))
    assert ct.attn_res_flops_per_token(ar) == expect
    ratio = ct.flops_per_token(ar, s["seq_len"]) / ct.flops_per_token(plain, s["seq_len"])
    assert 1 < ratio < 1.1  # AttnRes adds a few % of FLOPs at this width


@pytest.mark.parametrize("p1, p2, ar, flops, m, note", [
    (3.0, 2.8, 3.0, 1.0, 1.0, ""),            # AttnRes = plain 1x: no advantage
    (3.0, 2.8, 2.8, 1.0, 1.25, ""),           # AttnRes = plain 1.25x: the report's advantage
    (3.0, 2.8, 2.9, 1.0, 1.25 ** 0.5, ""),    # halfway in loss = sqrt(1.25) in compute
    (3.0, 2.8, 2.8, 1.25, 1.0, ""),           # the same loss bought with 1.25x the FLOPs: no advantage
    (3.0, 2.8, 3.2, 1.0, 0.8, "behind"),      # worse than plain 1x: extrapolated below 1
    (3.0, 2.8, 2.6, 1.0, 1.5625, "ahead"),    # better than plain 1.25x: extrapolated above
])
def test_the_multiplier_interpolates_in_log_compute(p1, p2, ar, flops, m, note):
    got, why = ct.multiplier(p1, p2, ar, flops)
    assert got == pytest.approx(m, abs=1e-3) and (note in why if note else why == "")


def test_no_slope_is_none():
    assert ct.multiplier(3.0, 3.1, 2.9)[0] is None


def test_a_tiny_comparison_through_the_command(tmp_path, monkeypatch):
    """Three runs per seed at the same data, a table, a plot and the JSON; the seeds' batches are the arms' batches."""
    monkeypatch.setattr(ct, "QUICK", ct.with_overrides(ct.QUICK, **TINY))
    out = tmp_path / "art.json"
    c.run_claims(("attn_res_train",), device="cpu", out=out)
    data = json.loads(out.read_text())["attn_res_train"]
    assert [(r["arm"], r["steps"]) for r in data["runs"]] == [("plain", 4), ("plain x1.25", 5), ("AttnRes", 4)]
    assert data["runs"][2]["params"] > data["runs"][0]["params"]  # the queries and key norms
    row = data["table"][0]
    assert row["AttnRes - plain"] == pytest.approx(row["AttnRes"] - row["plain"], abs=1e-4)
    assert all(r["curve"][-1][0] == r["steps"] and all(loss > 0 for _, loss in r["curve"]) for r in data["runs"])
    assert (tmp_path / "art_attn_res_train.png").stat().st_size > 0
    assert "AttnRes training efficiency" in out.with_suffix(".md").read_text()


def test_unknown_settings_are_refused():
    with pytest.raises(ValueError, match="unknown settings"):
        ct.with_overrides(ct.QUICK, depth=3)


@pytest.mark.parametrize("argv", [["--claims", "attn_res_train", "--full"], ["--claims", "params", "--full", "--device", "cpu"]])
def test_full_needs_a_gpu_and_the_trained_claim(argv, capsys, tmp_path):
    says = cli_error(["bench", "claims", "--out", str(tmp_path / "x.json"), *argv], capsys)
    assert "--full: expected --device cuda and --claims attn_res_train" in says
    assert not (tmp_path / "x.json").exists()


def test_a_run_cut_short_counts_its_own_steps_and_gives_no_multiplier(monkeypatch):
    """A run that stops before its steps (the training loop stops a diverged loss) is counted at the steps it ran, and
    its seed gives no multiplier and stays out of the summary: no ratio from work that did not run."""
    import dataclasses

    import evict.train

    real = evict.train.train

    def train(model, task, cfg, *a, **k):  # the AttnRes arm of seed 0 "diverges" after 2 of its 4 steps
        if model.cfg.attn_res and cfg.seed == 0:
            return dataclasses.replace(real(model, task, dataclasses.replace(cfg, steps=2), *a, **k), diverged_at=2)
        return real(model, task, cfg, *a, **k)

    monkeypatch.setattr(evict.train, "train", train)
    r = ct.compare_attn_res(ct.with_overrides(ct.QUICK, **dict(TINY, seeds=(0, 1))), progress=False)
    by = {(x["seed"], x["arm"]): x for x in r["runs"]}
    cut, whole = by[(0, "AttnRes")], by[(1, "AttnRes")]
    assert cut["steps"] == 2 and cut["stopped"] == "at step 2 of 4 (training loss not finite)" and "stopped" not in whole
    assert cut["train FLOPs"] * 2 == whole["train FLOPs"]  # counted as run
    rows = {x["seed"]: x for x in r["table"]}
    assert rows[0]["compute multiplier"] is None and "the AttnRes run stopped at step 2 of 4" in rows[0]["note"]
    assert r["summary"]["seeds"] == 1 and r["summary"]["seeds cut short"] == 1
    assert r["summary"]["mean AttnRes - plain"] == rows[1]["AttnRes - plain"]


def test_a_later_claim_failing_leaves_no_plot(tmp_path, monkeypatch):
    """attn_res_train's plot is written with the JSON, after every claim has run: a claim failing after it leaves
    nothing behind (no plot without its JSON)."""
    monkeypatch.setattr(ct, "QUICK", ct.with_overrides(ct.QUICK, **TINY))
    monkeypatch.setattr(c, "decode_ratios", lambda: [])  # no committed decode runs: the decode claim raises
    with pytest.raises(FileNotFoundError, match="^decode: none of"):
        c.run_claims(("attn_res_train", "decode"), device="cpu", out=tmp_path / "art.json")
    assert list(tmp_path.iterdir()) == []


def test_resume_keeps_whole_seeds_and_trains_only_the_others(tmp_path, monkeypatch, capsys):
    """`--seeds 1 --resume` over a result of seed 0 (the same setting): seed 0's three runs are kept as they were (not
    trained again: three new runs, not six), seed 1's are trained, and the JSON, table and summary hold both seeds —
    how a --full run is trained a seed per device call."""
    import evict.train
    from evict.cli import main

    monkeypatch.setattr(ct, "QUICK", ct.with_overrides(ct.QUICK, **TINY))
    out = tmp_path / "art.json"
    main(["bench", "claims", "--claims", "attn_res_train", "--seeds", "0", "--out", str(out)])
    first = json.loads(out.read_text())["attn_res_train"]
    assert first["setting"]["seeds"] == [0] and len(first["runs"]) == 3
    real, trained = evict.train.train, []
    monkeypatch.setattr(evict.train, "train", lambda model, task, cfg, *a, **k: trained.append(cfg.seed) or real(model, task, cfg, *a, **k))
    main(["bench", "claims", "--claims", "attn_res_train", "--seeds", "1", "--resume", "--out", str(out)])
    assert trained == [1, 1, 1] and "seeds 0 kept from" in capsys.readouterr().out
    both = json.loads(out.read_text())["attn_res_train"]
    assert both["setting"]["seeds"] == [0, 1] and both["runs"][:3] == first["runs"]
    assert [r["seed"] for r in both["table"]] == [0, 1] and both["summary"]["seeds"] == 2
    # again with both seeds named: nothing left to train, the same result
    trained.clear()
    main(["bench", "claims", "--claims", "attn_res_train", "--seeds", "0", "1", "--resume", "--out", str(out)])
    assert trained == [] and json.loads(out.read_text())["attn_res_train"]["runs"] == both["runs"]


def test_resume_refuses_another_setting_or_file_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ct, "QUICK", ct.with_overrides(ct.QUICK, **TINY))
    out = tmp_path / "art.json"
    other = {"attn_res_train": {"setting": {**json.loads(json.dumps(ct.QUICK)), "steps": 9, "device": "cpu"}, "runs": []}}
    out.write_text(json.dumps(other))
    says = cli_error(["bench", "claims", "--claims", "attn_res_train", "--resume", "--out", str(out)], capsys)
    assert f"--resume: {out}: trained at another setting (steps differ)" in says
    assert json.loads(out.read_text()) == other  # untouched
    out.write_text("{not json")
    assert "is not an `evict bench claims` JSON with attn_res_train runs" in cli_error(
        ["bench", "claims", "--claims", "attn_res_train", "--resume", "--out", str(out)], capsys)
    for argv, want in ((["--claims", "params", "--seeds", "1"], "--seeds: expected --claims attn_res_train"),
                       (["--claims", "params", "--resume", "--out", str(out)], "--resume: expected --claims attn_res_train"),
                       (["--claims", "attn_res_train", "--resume"], "--resume: expected --out"),
                       (["--claims", "attn_res_train", "--seeds", "1", "1"], "--seeds: expected distinct seeds")):
        assert want in cli_error(["bench", "claims", *argv], capsys)
