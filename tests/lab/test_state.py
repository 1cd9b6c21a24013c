"""The state-tracking lab end to end on a micro configuration: runs, resumes, writes the table, plot and JSON."""

import functools
import json
from dataclasses import replace

import pytest
import torch

from evict.cli import main
from evict.lab.state import (QUICK, _task, best_of_seeds, jobs_for, model_config, position_accuracy, position_spans,
                             report, run_sweep)
from evict.models import LM

from .pieces import finished_piece, stopped_piece

MICRO = replace(QUICK, tasks=("parity", "mod_arith"), models=("deltanet", "deltanet_neg", "attention"), d_model=16,
                n_heads=2, steps=3, batch_size=4, eval_every=2, eval_batches=1, train_lengths=(3, 8),
                test_lengths=(8, 24), workers=1)


def test_sweep_runs_resumes_and_writes_outputs(tmp_path, capsys):
    root = run_sweep(MICRO, out=tmp_path / "sweep")
    for name in ("config.json", "results.jsonl", "table.md", "state.png"):
        assert (root / name).stat().st_size > 0, name
    rows = [json.loads(line) for line in (root / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 3 and {(r["task"], r["model"]) for r in rows} == {(t, m) for t in MICRO.tasks for m in MICRO.models}
    for r in rows:
        chance = 1 / r["classes"]
        assert r["classes"] == (2 if r["task"] == "parity" else 5) and r["steps"] == 3
        assert abs(r["scaled_accuracy"] - (r["accuracy"] - chance) / (1 - chance)) < 1e-12
        assert 0 <= r["beyond_accuracy"] <= 1
        assert abs(r["beyond_scaled_accuracy"] - (r["beyond_accuracy"] - chance) / (1 - chance)) < 1e-12
        assert set(r["beyond_scaled_by_position"]) <= {"8-15", "16-23"} and r["beyond_scaled_by_position"]
    table = (root / "table.md").read_text()
    assert "| DeltaNet β∈[0,2] |" in table and "parity (published)" in table and "parity past 8" in table and "| 1.000 |" in table
    assert "Past 8, by test position" in table and "| parity 8-15 | parity 16-23 | mod_arith 8-15 |" in table
    _stopped_sweep_shows_the_cells_known(root, table)
    stamps = {p: p.stat().st_mtime_ns for p in (root / "runs").glob("*/result.json")}
    run_sweep(MICRO, out=root)  # resuming a finished sweep trains nothing
    assert stamps == {p: p.stat().st_mtime_ns for p in (root / "runs").glob("*/result.json")}
    with pytest.raises(ValueError, match=r"^out: .* holds a sweep with another config"):
        run_sweep(replace(MICRO, steps=4), out=root)


def _stopped_sweep_shows_the_cells_known(root, table: str) -> None:
    """A piece that stops with runs left (here: out of time before any starts, over a folder holding 3 of the finished
    sweep's 6 runs) writes partial_table.md — the finished runs' cells as in the whole table, — elsewhere — and no
    table, rows or plot; the piece that finishes the sweep writes those and drops the partial table."""
    run = functools.partial(run_sweep, MICRO)
    kept = ["parity_deltanet_s0", "parity_deltanet_neg_s0", "mod_arith_attention_s0"]
    part, partial = stopped_piece(root, run, kept, total=6, png="state.png")
    whole_rows, part_rows = {}, {}  # model -> its row of the first table (best of seeds)
    for text, rows in ((table, whole_rows), (partial, part_rows)):
        for line in text.splitlines():
            if line.startswith("| "):
                rows.setdefault(line.split(" |")[0], line)
    row = whole_rows["| DeltaNet β∈[0,2]"].split(" | ")  # model | parity | published | past 8 | mod_arith | …
    assert part_rows["| DeltaNet β∈[0,2]"].split(" | ")[:4] == row[:4]  # its parity cell is known, as in the table
    assert part_rows["| DeltaNet β∈[0,2]"].split(" | ")[4] == "—"  # its mod_arith run is not in
    assert part_rows["| attention (RoPE)"].split(" | ")[1] == "—" and part_rows["| attention (RoPE)"].split(" | ")[4] != "—"
    finished_piece(root, part, run, table)


def test_neg_eigval_reaches_the_model_and_best_of_seeds():
    by = {m: LM(model_config(m, MICRO, 3)) for m in ("deltanet", "deltanet_neg")}
    assert [layer.mixer.neg_eigval for layer in by["deltanet_neg"].blocks] == [True, True]
    assert [layer.mixer.neg_eigval for layer in by["deltanet"].blocks] == [False, False]
    rows = [dict(task="parity", model="deltanet", seed=s, scaled_accuracy=a) for s, a in ((0, 0.1), (1, 0.7), (2, 0.3))]
    assert best_of_seeds(rows)[("parity", "deltanet")]["seed"] == 1
    assert best_of_seeds(rows, seeds=3)[("parity", "deltanet")]["seed"] == 1 and best_of_seeds(rows[:2], seeds=3) == {}
    sweep = replace(MICRO, tasks=("parity",), models=("deltanet",), seeds=3)
    full = [{**r, "beyond_scaled_accuracy": 0.0} for r in rows]
    assert "| DeltaNet β∈[0,1] | 0.100 / 0.700 / 0.300 (mean 0.367) |" in report(sweep, full)
    assert "| DeltaNet β∈[0,1] | 0.100 / 0.700 / — |" in report(sweep, full[:2])  # no mean until every seed is in
    assert len(jobs_for(replace(MICRO, seeds=3), __import__("pathlib").Path("/x"))) == 2 * 3 * 3


def test_cli_runs_and_rejects_bad_names(tmp_path, monkeypatch):
    with pytest.raises(SystemExit):
        main(["lab", "state", "--models", "transformerxl", "--out", str(tmp_path / "x")])
    monkeypatch.setattr("evict.lab.state.QUICK", MICRO)  # the flags on top of a micro sweep, not the 4-minute one
    assert main(["lab", "state", "--models", "deltanet_neg", "--steps", "1", "--workers", "1", "--out", str(tmp_path / "y")]) == 0
    assert (tmp_path / "y" / "table.md").exists()


class _ParityOracle(torch.nn.Module):
    """Running parity, right before position `until` and wrong from there on: logits [B, T, 3]."""

    def __init__(self, until: int):
        super().__init__()
        self.until, self.w = until, torch.nn.Parameter(torch.zeros(()))

    def forward(self, x):
        parity = (x * (x < 2)).cumsum(-1) % 2  # PAD (2) counts as no bit
        wrong = torch.arange(x.shape[1])[None, :] >= self.until
        return torch.nn.functional.one_hot(torch.where(wrong, 1 - parity, parity), 3).float()


def test_position_accuracy_scores_each_span_past_training():
    sweep = replace(MICRO, train_lengths=(3, 8), test_lengths=(8, 40), batch_size=64, eval_batches=2)
    assert position_spans(sweep) == [(8, 16), (16, 32), (32, 40)]
    assert position_spans(QUICK) == [(40, 80), (80, 160), (160, 256)]
    task = _task("parity", sweep, 0)
    beyond, spans = position_accuracy(_ParityOracle(10**9), task, sweep)
    assert beyond == 1.0 and spans == {"8-15": 1.0, "16-31": 1.0, "32-39": 1.0}  # the oracle is the task's labels
    beyond, spans = position_accuracy(_ParityOracle(16), task, sweep)
    assert spans == {"8-15": 1.0, "16-31": 0.0, "32-39": 0.0}
    labelled = [(y != -100) for y in (task.get_batch("val", i, 64)[1] for i in range(2))]
    pos = torch.arange(labelled[0].shape[1])
    right = sum((m & (pos >= 8) & (pos < 16)).sum().item() for m in labelled)
    assert beyond == right / sum((m & (pos >= 8)).sum().item() for m in labelled)  # label-weighted, not span-averaged


def test_counters_mode_runs_the_counter_tasks(tmp_path, monkeypatch):
    from evict.lab.state import COUNTERS, COUNTERS_FULL

    assert COUNTERS.tasks == ("count_mod3", "dyck4") and {"deltanet", "deltanet_neg"} <= set(COUNTERS.models)
    assert set(COUNTERS_FULL.tasks) == {"count_mod3", "count_mod5", "dyck4"} and COUNTERS_FULL.device == "auto"
    micro = replace(MICRO, tasks=("count_mod3", "dyck2"), models=("deltanet_neg",), steps=1)
    monkeypatch.setattr("evict.lab.state.COUNTERS", micro)
    assert main(["lab", "state", "--counters", "--workers", "1", "--out", str(tmp_path / "c")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "c" / "results.jsonl").read_text().splitlines()]
    assert sorted((r["task"], r["classes"]) for r in rows) == [("count_mod3", 3), ("dyck2", 3)]
    assert "| count_mod3 | count_mod3 (published) |" in (tmp_path / "c" / "table.md").read_text()
    for bad in (["--tasks", "dyck0"], ["--tasks", "count_mod3", "count_mod3"]):
        with pytest.raises(SystemExit) as e:
            main(["lab", "state", *bad, "--out", str(tmp_path / "bad")])
        assert e.value.code == 2 and not (tmp_path / "bad").exists()
