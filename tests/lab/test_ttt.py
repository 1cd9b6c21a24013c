"""The TTT lab (`evict lab ttt`): its models read what the op reads, the queries read one state, the sweep end to end
(micro), a stopped run resumes to the same result, the CLI and its bad flags."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from evict.cli import main
from evict.lab.capacity import write_then_read
from evict.lab.ttt import QUICK, RULES, MQARMemory, TTTCapacityModel, jobs_for, run_sweep, state_numbers
from evict.tasks.capacity import make_batch

MICRO = replace(QUICK, sizes=(3, 4), pairs=(1,), d_key=4, d_model=8, seq_len=8, vocab_size=8, steps=2, eval_every=1,
                batch_size=3, eval_batches=1, workers=1, rules=("delta", "momentum", "adagrad"))


def test_the_delta_rule_model_reads_what_the_op_reads():
    """TTTCapacityModel with the delta rule = the capacity model's own read (the op, chunked) on L2-normalised
    features: the TTT path adds nothing at its neutral setting."""
    torch.manual_seed(0)
    model = TTTCapacityModel(5, "delta", 6)
    batch = make_batch(5, 3, overwrite=True, seed=0, step=0)
    got = model(batch)
    tokens = torch.cat([batch.write_keys, batch.query_keys], dim=1)
    e = model.embed(tokens)
    k, q = F.normalize(model.k_proj(e), dim=-1), F.normalize(model.q_proj(e), dim=-1)
    v = F.one_hot(torch.cat([batch.write_values, torch.zeros_like(batch.query_keys)], dim=1), 5).float()
    beta = torch.sigmoid(model.beta_proj(e[:, :10]))[..., 0]
    assert torch.allclose(got, write_then_read(q, k, v, beta, delta=True, n_queries=5), rtol=0, atol=1e-6)


@pytest.mark.parametrize("rule", list(RULES))
def test_every_query_reads_the_state_the_writes_left(rule):
    """Queries write nothing and carry no momentum (β = μ = 0 there): a query read twice, early and late among the
    queries, reads the same."""
    torch.manual_seed(1)
    model = TTTCapacityModel(4, rule, 5)
    b = make_batch(4, 2, overwrite=False, seed=0, step=0)
    twice = type(b)(b.write_keys, b.write_values, torch.cat([b.query_keys, b.query_keys], 1),
                    torch.cat([b.targets, b.targets], 1))
    out = model(twice)  # [B, 8, 4]
    assert torch.allclose(out[:, :4], out[:, 4:], rtol=0, atol=1e-6)


def test_mqar_model_shapes():
    model = MQARMemory(16, 8, 4, "momentum")
    assert model(torch.randint(0, 16, (2, 12))).shape == (2, 12, 16)


def test_state_numbers():
    assert state_numbers("delta", 8, 8) == 64 and state_numbers("momentum", 8, 8) == 128
    assert state_numbers("adagrad", 8, 8) == 72 and state_numbers("newton", 8, 8) == 72


def test_sweep_runs_resumes_and_writes_outputs(tmp_path):
    root = run_sweep(MICRO, out=tmp_path / "sweep")
    assert all((root / name).stat().st_size > 0 for name in ("config.json", "results.jsonl", "table.md", "ttt.png"))
    rows = [json.loads(line) for line in (root / "results.jsonl").read_text().splitlines()]
    assert {(r["task"], r["rule"], r["size"]) for r in rows} == {
        *(("capacity", r, S) for r in MICRO.rules for S in MICRO.sizes), *(("mqar", r, 1) for r in MICRO.rules)}
    assert all(len(r["curve"]) == 2 and r["early"] == r["curve"][0][1] and r["final"] == r["curve"][1][1] for r in rows)
    assert all(0 <= r["final"] <= (1 if r["task"] == "mqar" else 100) for r in rows)
    table = (root / "table.md").read_text()
    assert "| rule | state | S 3 | S 4 |" in table and "| rule | state | K 1 |" in table and "| floor |" in table
    stamps = {p: p.stat().st_mtime_ns for p in (root / "runs").glob("*/result.json")}
    run_sweep(MICRO, out=root)  # resuming a finished sweep trains nothing
    assert stamps == {p: p.stat().st_mtime_ns for p in (root / "runs").glob("*/result.json")}


def test_a_run_stopped_by_its_piece_resumes_to_the_same_result(tmp_path, monkeypatch):
    import evict.lab.ttt as lab

    sweep = replace(MICRO, rules=("momentum",), tasks=("mqar",), steps=6, eval_every=2)
    whole, = jobs_for(sweep, tmp_path / "whole")
    split, = jobs_for(sweep, tmp_path / "split")
    expected = lab.run_one(whole)
    calls = []
    monkeypatch.setattr(lab, "out_of_time", lambda job: calls.append(1) or len(calls) > 4)
    assert lab.run_one(split) is None
    assert torch.load(Path(split["dir"]) / "checkpoint.pt", weights_only=True)["step"] == 4
    monkeypatch.setattr(lab, "out_of_time", lambda job: False)
    got = lab.run_one(split)
    assert not (Path(split["dir"]) / "checkpoint.pt").exists()
    assert got["curve"] == expected["curve"] and got["final"] == expected["final"]


def test_cli_runs_with_flags(tmp_path, monkeypatch):
    monkeypatch.setattr("evict.lab.ttt.QUICK", MICRO)
    assert main(["lab", "ttt", "--rules", "steps3", "--tasks", "capacity", "--sizes", "3", "--d-key", "4",
                 "--steps", "1", "--workers", "1", "--out", str(tmp_path / "y")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "y" / "results.jsonl").read_text().splitlines()]
    assert [(r["task"], r["rule"], r["size"], r["steps"]) for r in rows] == [("capacity", "steps3", 3, 1)]


@pytest.mark.parametrize("flags,message", [
    (["--pairs", "9"], "pairs: vocab_size=8 holds only 3 distinct keys"),
    (["--sizes", "1"], "expected distinct S >= 2"),
    (["--rules", "adam"], "invalid choice"),
])
def test_bad_flags_exit_2_with_one_line(flags, message, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("evict.lab.ttt.QUICK", MICRO)
    with pytest.raises(SystemExit) as e:
        main(["lab", "ttt", *flags, "--out", str(tmp_path / "z")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) <= 3 and "Traceback" not in err
    assert not (tmp_path / "z" / "results.jsonl").exists()
