"""The pairs-vs-dimension lab: the ladder's rule (first failing rung ends it, best over lr), the fit, and the sweep
end to end on a micro grid (real training through the recall lab's cell)."""

import functools
import json
from dataclasses import replace

import pytest

from evict.cli import main
from evict.lab import pairs
from evict.lab.pairs import QUICK, fit, jobs_for, run_sweep

from .pieces import finished_piece, stopped_piece

MICRO = replace(QUICK, rules=("deltanet", "attention"), dims=(4, 8), d_model=8, pairs=(1, 2), steps=2, eval_every=1,
                eval_batches=1, batch_size=4, workers=1)


def test_fit_recovers_linear_and_square_laws():
    lin = fit([(8, 16), (16, 32), (32, 64)])
    assert lin["c"] == pytest.approx(2) and lin["p"] == pytest.approx(1) and lin["points"] == 3
    sq = fit([(2, 4), (4, 16), (8, 64)])
    assert sq["p"] == pytest.approx(2)
    assert fit([(8, 16), (16, 0)]) is None  # K* = 0 carries no power law; one point is no fit


def test_ladder_stops_at_the_first_failing_rung_and_a_rung_at_its_first_passing_lr(tmp_path, monkeypatch):
    acc = {(1, 0.1): 0.95, (1, 0.2): 0.5, (2, 0.1): 0.3, (2, 0.2): 0.92, (4, 0.1): 0.1, (4, 0.2): 0.93,
           (8, 0.1): 0.6, (8, 0.2): 0.5, (16, 0.1): 1.0}
    trained = []

    def fake(job):
        trained.append((job["pairs"], job["lr"]))
        return {"accuracy": acc[(job["pairs"], job["lr"])], "lr": job["lr"], "steps": 1, "seconds": 0.5,
                "state_size": 1, "params": 1}

    monkeypatch.setattr(pairs.recall, "run_one", fake)
    sweep = replace(MICRO, pairs=(8, 1, 16, 4, 2), lrs=(0.1, 0.2))
    job = {**jobs_for(sweep, tmp_path)[0], "dir": str(tmp_path / "ladder")}
    res = pairs.run_one(job)
    assert res["max_pairs"] == 4 and not res["ladder_top"]  # K = 8 fails at both lrs: K = 16 never runs
    assert [r["pairs"] for r in res["rungs"]] == [1, 2, 4, 8] and [r["lr"] for r in res["rungs"]] == [0.1, 0.2, 0.2, 0.1]
    # up to the first lr that passes, the rung below's passing lr first: K = 1 passes at 0.1 (0.2 never runs), K = 2
    # at 0.2 after 0.1 fails, K = 4 at 0.2 (0.1 never runs), K = 8 fails at 0.2, then at 0.1
    assert trained == [(1, 0.1), (2, 0.1), (2, 0.2), (4, 0.2), (8, 0.2), (8, 0.1)]
    trained.clear()
    assert pairs.run_one(job) == res and trained == []  # finished rungs are read back, not retrained
    # resumed under the other lr order, the finished runs still settle every rung: K = 1 reads its passing 0.1 run
    # instead of training 0.2 first; the same ladder, nothing trained (K* never depends on the order)
    assert pairs.run_one({**job, "sweep": {**job["sweep"], "lrs": [0.2, 0.1]}}) == res and trained == []
    top = pairs.run_one({**job, "dir": str(tmp_path / "top"), "sweep": {**job["sweep"], "pairs": [1, 2]}})
    assert top["max_pairs"] == 2 and top["ladder_top"]


def test_sweep_runs_resumes_and_writes_outputs(tmp_path):
    root = run_sweep(MICRO, out=tmp_path / "sweep")
    for name in ("config.json", "results.jsonl", "table.md", "pairs.png"):
        assert (root / name).stat().st_size > 0, name
    rows = [json.loads(line) for line in (root / "results.jsonl").read_text().splitlines()]
    assert {(r["rule"], r["d"]) for r in rows} == {(r, d) for r in MICRO.rules for d in MICRO.dims}
    for r in rows:
        assert r["rungs"] and r["rungs"][0]["pairs"] == 1 and all(u["steps"] <= 2 for u in r["rungs"])
        for u in r["rungs"]:  # each rung's reported run's curve: its evaluations, the best one its accuracy
            assert u["curve"][-1][0] == u["steps"]
            assert max(v for _, v in u["curve"]) == pytest.approx(u["accuracy"], abs=5e-5)
        passed = [u["pairs"] for u in r["rungs"] if u["accuracy"] >= MICRO.threshold]
        assert r["max_pairs"] == (max(passed) if passed else 0)
    table = (root / "table.md").read_text()
    assert "| rule | d=4 | d=8 | K* ≈ c·d | K* ∝ d^p |" in table
    _stopped_sweep_shows_the_cells_known(root, table)
    stamps = {p: p.stat().st_mtime_ns for p in (root / "runs").glob("*/result.json")}
    run_sweep(MICRO, out=root)  # resuming a finished sweep trains nothing
    assert stamps == {p: p.stat().st_mtime_ns for p in (root / "runs").glob("*/result.json")}


def _stopped_sweep_shows_the_cells_known(root, table: str) -> None:
    """A piece that stops with ladders left (out of time before any starts, over a folder holding 2 of the finished
    sweep's 4 ladders: DeltaNet's) writes partial_table.md — DeltaNet's row as in the whole table, attention's all —, no
    table, rows or plot; the piece that finishes the sweep writes those and drops the partial table."""
    run = functools.partial(run_sweep, MICRO)
    kept = [f"deltanet_d{d}_s0" for d in MICRO.dims]
    part, partial = stopped_piece(root, run, kept, total=4, png="pairs.png")
    rows = {text: {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| ")}
            for text in (table, partial)}
    assert rows[partial]["| DeltaNet"] == rows[table]["| DeltaNet"]
    assert rows[partial]["| attention"] == "| attention | — | — | — | — |"
    finished_piece(root, part, run, table)


def test_a_sweep_resumes_over_another_lr_order_but_not_other_lrs(tmp_path):
    """UNORDERED_FIELDS: the lrs' order only says which run of a rung goes first, so a folder resumes under another
    order (config.json then says it) and trains nothing already settled; another set of lrs is refused, naming it."""
    sweep = replace(MICRO, rules=("deltanet",), dims=(4,), lrs=(1e-2, 2e-2))
    root = run_sweep(sweep, out=tmp_path / "s")
    stamps = {p: p.stat().st_mtime_ns for p in (root / "runs").rglob("result.json")}
    table = (root / "table.md").read_text()
    run_sweep(replace(sweep, lrs=(2e-2, 1e-2)), out=root)
    assert stamps == {p: p.stat().st_mtime_ns for p in (root / "runs").rglob("result.json")}
    assert json.loads((root / "config.json").read_text())["lrs"] == [2e-2, 1e-2]
    assert (root / "table.md").read_text().replace("[0.02, 0.01]", "[0.01, 0.02]") == table
    with pytest.raises(ValueError, match=r"^out: .* holds a sweep with another config \(lrs differ\)"):
        run_sweep(replace(sweep, lrs=(1e-2, 3e-2)), out=root)
    assert pairs.UNORDERED_FIELDS == ("lrs",) and sorted(pairs.FULL.lrs) == [4.6e-4, 2.2e-3, 1e-2]


def test_one_head_of_dim_d_at_a_fixed_width(tmp_path):
    """Only the memory grows with d: the width stays d_model, one head per layer, state d × d per memory layer."""
    from evict.models import LM

    sizes = {}
    for d in (4, 8):
        cfg = pairs.recall.model_config("deltanet", MICRO.d_model, pairs.recall_sweep(MICRO, d), 16)
        assert (cfg.d_model, cfg.n_heads, cfg.head_dim) == (8, 1, d)
        sizes[d] = LM(cfg).blocks[0].mixer.state_size(16) - 3 * d * 3  # minus the conv tails
    assert sizes == {4: 16, 8: 64}


@pytest.mark.parametrize("kw, name", [(dict(dims=(16,)), "dims"), (dict(pairs=(200,)), "pairs"),
                                      (dict(rules=("gla",)), "rules"), (dict(threshold=0), "threshold"),
                                      (dict(len_per_pair=3), "len_per_pair"), (dict(lrs=()), "lrs"),
                                      (dict(tokens_per_step=15), "tokens_per_step"),
                                      (dict(tokens_per_step=64.0), "tokens_per_step")])
def test_bad_sweeps_name_the_field(kw, name, tmp_path):
    with pytest.raises(ValueError, match=rf"^{name}: "):
        run_sweep(replace(MICRO, **kw), out=tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_each_rung_trains_at_its_own_batch_under_tokens_per_step(tmp_path, monkeypatch):
    """`tokens_per_step`: a rung's batch is batch_size, or fewer where L x batch would pass it — what each rung's run
    is given, what its row records, and what the table says; --full's: 256 up to L 512, then 128 / 64 / 32."""
    batches = []

    def fake(job):
        batches.append((job["seq_len"], job["sweep"]["batch_size"]))
        return {"accuracy": 1.0, "lr": job["lr"], "steps": 1, "seconds": 0.5, "state_size": 1, "params": 1}

    monkeypatch.setattr(pairs.recall, "run_one", fake)
    sweep = replace(MICRO, pairs=(1, 2, 4, 8), batch_size=4, tokens_per_step=64)  # L 16, 16, 16, 32
    res = pairs.run_one({**jobs_for(sweep, tmp_path)[0], "dir": str(tmp_path / "ladder")})
    assert batches == [(16, 4), (16, 4), (16, 4), (32, 2)]
    assert [u["batch"] for u in res["rungs"]] == [4, 4, 4, 2]
    assert "batch 4 up to 64 tokens (2 at L 32)" in pairs.report(sweep, [res])
    assert "batch 4 (" in pairs.report(MICRO, [res])  # no tokens_per_step: one batch for every rung
    full = {pairs.seq_len(pairs.FULL, K): pairs.rung_batch(pairs.FULL, pairs.seq_len(pairs.FULL, K)) for K in pairs.FULL.pairs}
    assert full == {32: 256, 64: 256, 128: 256, 256: 256, 512: 256, 1024: 128, 2048: 64, 4096: 32}


def test_cli_runs_with_flags(tmp_path, monkeypatch):
    monkeypatch.setattr("evict.lab.pairs.QUICK", MICRO)  # the flags on top of a micro sweep, not the quick one
    assert main(["lab", "pairs", "--rules", "kda", "--dims", "4", "--pairs", "1", "--lr", "0.02", "--threshold", "0.5",
                 "--steps", "1", "--d-model", "12", "--tokens-per-step", "64", "--out", str(tmp_path / "y")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "y" / "results.jsonl").read_text().splitlines()]
    assert [(r["rule"], r["d"], [u["lr"] for u in r["rungs"]]) for r in rows] == [("kda", 4, [0.02])]
    config = json.loads((tmp_path / "y" / "config.json").read_text())
    assert (config["threshold"], config["d_model"], config["tokens_per_step"]) == (0.5, 12, 64)


@pytest.mark.gpu
def test_micro_sweep_on_cuda(tmp_path):
    """The GPU path of a rung (recall's cell with whole-step CUDA graphs) end to end."""
    root = run_sweep(replace(MICRO, device="cuda", steps=4, eval_every=2), out=tmp_path / "gpu")
    rows = [json.loads(line) for line in (root / "results.jsonl").read_text().splitlines()]
    assert len(rows) == len(MICRO.rules) * len(MICRO.dims) and all(r["rungs"] for r in rows)


def test_gate_dt_reaches_the_models_and_is_validated(tmp_path, capsys):
    """--gate-dt: the decay gates' initial dt range goes through the recall sweep into every model's config; a range
    that is not 0 < MIN <= MAX is one line and nothing written."""
    from evict.lab import recall

    rs = pairs.recall_sweep(replace(MICRO, gate_dt=(1e-4, 2e-4)), 4)
    cfg = recall.model_config("kda", MICRO.d_model, rs, 16)
    assert (cfg.gate_dt_min, cfg.gate_dt_max) == (1e-4, 2e-4)
    with pytest.raises(SystemExit) as e:
        main(["lab", "pairs", "--gate-dt", "1e-2", "1e-3", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "gate_dt: expected MIN MAX with 0 < MIN <= MAX" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


def test_a_rung_runs_with_its_pieces_deadline_and_length(tmp_path, monkeypatch):
    """A rung is the recall lab's cell: it gets the piece's stop_at and length (piece_seconds), so a rung longer than
    a whole piece starts in a piece's first half like any recall run (recall.starts_now) instead of never."""
    seen = []
    monkeypatch.setattr(pairs.recall, "run_one", lambda job: seen.append(job) or None)
    job = {**jobs_for(MICRO, tmp_path)[0], "stop_at": 123.0, "piece_seconds": 540.0}
    assert pairs._rung(job, {"d_models": [8]}, 2, 1e-2, 16) is None  # stopped: no result.json
    assert seen[0]["stop_at"] == 123.0 and seen[0]["piece_seconds"] == 540.0
    # and a rung's run stops once it passes: the recall lab's target accuracy is the ladder's threshold
    assert pairs.recall_sweep(replace(MICRO, threshold=0.75), 4).target_accuracy == 0.75


def test_workers_take_ladders_in_flight_first_then_the_shortest_rung(tmp_path, monkeypatch):
    """next_rung: a ladder whose rung has a run in flight (checkpoint.pt without result.json) goes to a worker first,
    then the ladder climbing the shortest rung (session 43: a short piece on a fresh machine spent its 8 workers on
    the first 8 ladders' 8-11 minute rungs while others waited on 1-minute ones); run_sweep hands them out so."""
    acc = {(1, 0.1): 0.95, (2, 0.1): 0.3}

    def fake(job):
        if (job["pairs"], job["lr"]) not in acc:
            return None
        return {"accuracy": acc[(job["pairs"], job["lr"])], "lr": job["lr"], "steps": 1, "seconds": 1.0,
                "state_size": 1, "params": 1}

    monkeypatch.setattr(pairs.recall, "run_one", fake)
    sweep = replace(MICRO, rules=("deltanet",), dims=(4, 8), pairs=(1, 2, 4), lrs=(0.1, 0.2), min_len=16,
                    len_per_pair=16)
    root = tmp_path / "sweep"
    d4, d8 = jobs_for(sweep, root)
    assert pairs.run_one(d4) is None  # d 4: K 1 passed, K 2 failed at 0.1 and its run at 0.2 stopped
    assert pairs.next_rung(d4) == (1, 32) and pairs.next_rung(d8) == (1, 16)  # d 8 climbs a shorter rung: first
    k2 = pairs._rung_dir(d4, 2, 0.1)
    (k2 / "checkpoint.pt").write_bytes(b"")  # a finished run keeps its checkpoint: not in flight
    assert pairs.next_rung(d4) == (1, 32)
    (pairs._rung_dir(d4, 2, 0.2) / "checkpoint.pt").write_bytes(b"")  # 0.2 stopped mid-run: resume it first
    assert pairs.next_rung(d4) == (0, 32)
    acc[(2, 0.2)], acc[(4, 0.2)], acc[(4, 0.1)] = 0.2, 0.2, 0.2
    assert pairs.run_one(d4)["max_pairs"] == 1 and pairs.next_rung(d4) == (0, 0)  # every rung in: read back
    order = []
    monkeypatch.setattr(pairs, "run_one", lambda job: order.append(job["d"]) or None)
    (pairs._rung_dir(d4, 2, 0.2) / "result.json").unlink()  # d 4 in flight again
    run_sweep(sweep, out=root, minutes=1)
    assert order == [4, 8]
    (pairs._rung_dir(d4, 2, 0.2) / "checkpoint.pt").unlink()  # d 4's run lost (a fresh machine): L 32 after L 16
    order.clear()
    run_sweep(sweep, out=root, minutes=1)
    assert order == [8, 4]


def test_partial_table_lists_the_ladders_still_climbing(tmp_path, monkeypatch):
    """A piece that stops mid-ladder: partial_table.md's second part gives each unfinished ladder's K passed so far,
    the rung it stopped on and that rung's finished runs, read back from its folders (nothing trains)."""
    acc = {(1, 0.1): 0.95, (2, 0.1): 0.3}

    def fake(job):  # K = 1 passes at 0.1; K = 2 fails at 0.1, then its run at 0.2 stops with the piece
        if (job["pairs"], job["lr"]) not in acc:
            return None
        return {"accuracy": acc[(job["pairs"], job["lr"])], "lr": job["lr"], "steps": 1, "seconds": 90.0,
                "state_size": 1, "params": 1}

    monkeypatch.setattr(pairs.recall, "run_one", fake)
    sweep = replace(MICRO, rules=("deltanet",), dims=(4, 8), pairs=(1, 2, 4), lrs=(0.1, 0.2))
    jobs = jobs_for(sweep, tmp_path)
    assert [j["d"] for j in jobs] == [4, 8]  # smallest d first: its runs are the shortest
    assert pairs.run_one(jobs[0]) is None  # d 4 climbs: K 1 passes, K 2 stops at its second lr
    text = pairs.climbing(sweep, jobs)
    assert "(1; 1 more not started)" in text
    row = [line for line in text.splitlines() if line.startswith("| DeltaNet")]
    assert row == ["| DeltaNet | 4 | 0 | K ≤ 1 | K 2 (L 16) | 0.300 at lr 0.1 | 3 min |"]
    assert not (tmp_path / "runs" / "deltanet_d8_s0").exists()  # reading a ladder makes no folders
    assert pairs.climbing(sweep, jobs[1:]) == "No ladder has a finished rung yet (1 not started)."
    # through run_grid: a timed piece that leaves the ladder writes it under the cells
    root = run_sweep(sweep, out=tmp_path / "sweep", minutes=1)
    table = (root / "partial_table.md").read_text()
    assert "Partial: 0 of 2 runs finished" in table and "| DeltaNet | 8 | 0 | K ≤ 1 | K 2 (L 16) |" in table
    # a ladder that has every rung in by the time it is read (run_jobs' None came first) is left out, not shown
    acc[(2, 0.2)], acc[(4, 0.2)], acc[(4, 0.1)] = 0.91, 0.2, 0.3
    assert pairs.run_one(jobs[0])["max_pairs"] == 2
    assert pairs.climbing(sweep, jobs) == "No ladder has a finished rung yet (1 not started)."
