"""The recall lab end to end on a micro configuration: runs, resumes, writes the table, plots and scorecard."""

import json
from dataclasses import replace

import pytest
import torch

from evict.cli import main
from evict.lab.recall import (FULL, QUICK, Cell, best_over_lr, jobs_for, known_rows, lr_rounds, model_config, over_seeds,
                               report, run_sweep)

MICRO = replace(QUICK, archs=("attention", "deltanet", "kimi_linear"), settings=((16, 2), (24, 4)), d_models=(32,),
                lrs=(1e-3, 3e-3), steps=4, batch_size=4, eval_every=2, eval_batches=1, workers=1, vocab_size=32, seeds=1)


def test_sweep_runs_resumes_and_writes_outputs(tmp_path, capsys):
    root = run_sweep(MICRO, out=tmp_path / "sweep")
    for name in ("config.json", "results.jsonl", "table.md", "scorecard.md", "recall_vs_pairs.png", "recall_vs_state.png"):
        assert (root / name).stat().st_size > 0, name
    rows = [json.loads(line) for line in (root / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * 2 * 2
    assert {r["arch"] for r in rows} == set(MICRO.archs)
    assert all(r["final_loss"] > 0 for r in rows)  # the last evaluation's loss (a plateau at ln(V/2) shows there)
    for r in rows:  # the learning curve: every evaluation up to the run's last step, its best the row's accuracy
        steps = [step for step, _ in r["curve"]]
        assert steps == sorted(steps) and steps[-1] == r["steps"]
        assert max(v for _, v in r["curve"]) == pytest.approx(r["accuracy"], abs=5e-5)
        assert r["curve"][-1][1] == pytest.approx(r["final_accuracy"], abs=5e-5)
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
    # the worker count says how the sweep runs, not what it trains: a resume may use another (and records it)
    run_sweep(replace(MICRO, workers=MICRO.workers + 1), out=root)
    assert json.loads((root / "config.json").read_text())["workers"] == MICRO.workers + 1
    assert stamps == {p: p.stat().st_mtime_ns for p in (root / "runs").glob("*/result.json")}


def test_a_sweep_on_a_fixed_training_set(tmp_path, capsys, monkeypatch):
    """--train-examples N: every run trains on one fixed set of N examples in epochs (Zoology's regime), the table's
    title says so, and a bad N is refused before the sweep folder exists."""
    from evict.tasks.mqar import MQARTask

    made = []
    fixed_set = MQARTask.fixed_set
    monkeypatch.setattr(MQARTask, "fixed_set", lambda self: made.append(self.cfg.train_examples) or fixed_set(self))
    sweep = replace(MICRO, archs=("deltanet",), settings=((16, 2),), lrs=(1e-3,), train_examples=6)
    root = run_sweep(sweep, out=tmp_path / "fixed")
    assert made and set(made) == {6}  # 4 steps of batch 4: 16 stream positions, past two epochs of 6
    assert json.loads((root / "config.json").read_text())["train_examples"] == 6
    assert "trained on one fixed set of 6 examples (epochs of 1.5 steps)" in capsys.readouterr().out
    with pytest.raises(ValueError, match="train_examples"):
        run_sweep(replace(sweep, train_examples=0), out=tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_best_over_lr_and_state_sizes():
    jobs = jobs_for(MICRO, __import__("pathlib").Path("/nonexistent"))
    assert len(jobs) == 12
    rows = [dict(arch="a", seq_len=16, pairs=2, d_model=32, lr=lr, seed=seed, accuracy=acc, state_size=7)
            for lr, seed, acc in ((1e-3, 0, 0.4), (3e-3, 0, 0.7), (1e-3, 1, 0.9), (3e-3, 1, 0.2))]
    best = best_over_lr(rows)
    assert best[("a", 16, 2, 32, 0)]["lr"] == 3e-3 and best[("a", 16, 2, 32, 1)]["lr"] == 1e-3
    cell = over_seeds(best)[("a", 16, 2, 32)]
    assert cell.accuracies == [0.7, 0.9] and cell.seeds == [0, 1] and cell.spread == (0.7, 0.9)
    assert abs(cell.mean - 0.8) < 1e-12 and str(cell) == "0.800 (0.700–0.900)" and str(Cell([0.25], [3], 7)) == "0.250"
    # the fixed memories hold the same numbers at any length; attention's grows with it
    from evict import LM

    att, dn = LM(model_config("attention", 32, MICRO, 64)), LM(model_config("deltanet", 32, MICRO, 64))
    kv_per_token = 2 * 2 * 32  # 2 layers x (K + V) x d_model (heads x head_dim)
    assert att.state_size(128) - att.state_size(64) == kv_per_token * 64
    assert dn.state_size(128) == dn.state_size(64)


def test_cli_rejects_unknown_arch(tmp_path):
    with pytest.raises(SystemExit, match="archs: unknown architecture"):
        main(["recall", "--archs", "transformerxl", "--out", str(tmp_path / "x")])


def test_seeds_mean_and_range_per_cell_and_every_seed_kept(tmp_path):
    sweep = replace(MICRO, archs=("deltanet",), settings=((16, 2),), lrs=(3e-3,), seed=5, seeds=2)
    jobs = jobs_for(sweep, tmp_path)
    assert [j["seed"] for j in jobs] == [5, 6] and jobs[1]["dir"].endswith("deltanet_L16_K2_d32_lr0.003_s6")
    root = run_sweep(sweep, out=tmp_path / "sweep")
    rows = [json.loads(line) for line in (root / "results.jsonl").read_text().splitlines()]
    assert [r["seed"] for r in rows] == [5, 6]
    table = (root / "table.md").read_text()
    assert "seeds 5, 6" in table and "mean (min–max)" in table
    lo, hi = sorted(r["accuracy"] for r in rows)
    assert f"| deltanet | {(lo + hi) / 2:.3f} ({lo:.3f}–{hi:.3f}) |" in table
    assert f"| deltanet | {rows[0]['accuracy']:.3f} / {rows[1]['accuracy']:.3f} |" in table  # every seed, in order


def test_one_seed_sweep_written_before_seeds_existed_resumes(tmp_path):
    sweep = replace(MICRO, archs=("attention",), settings=((16, 2),), lrs=(3e-3,))
    root = run_sweep(sweep, out=tmp_path / "sweep")
    cfg = json.loads((root / "config.json").read_text())
    del cfg["seeds"]
    (root / "config.json").write_text(json.dumps(cfg))
    (done,) = (root / "runs").glob("*/result.json")
    assert done.parent.name == "attention_L16_K2_d32_lr0.003"  # one seed: the old run names
    old = json.loads(done.read_text())
    del old["seed"]
    done.write_text(json.dumps(old))
    stamp = done.stat().st_mtime_ns
    run_sweep(sweep, out=root)
    assert done.stat().st_mtime_ns == stamp
    assert json.loads((root / "results.jsonl").read_text())["seed"] == 0


def test_cli_rejects_zero_seeds(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["recall", "--seeds", "0", "--out", str(tmp_path / "x")])
    assert e.value.code != 0 and "--seeds: expected a positive integer" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_cli_rejects_a_negative_first_seed(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["recall", "--seed", "-1", "--out", str(tmp_path / "x")])
    assert e.value.code != 0 and "--seed: expected an integer in [0, 2**32)" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_the_recall_command_starts_its_seeds_at_seed(tmp_path):
    """`--seed 1 --seeds 2`: seeds 1 and 2 (a side experiment's other seeds of a cell the grid ran at seed 0)."""
    out = tmp_path / "s"
    main(["recall", "--archs", "deltanet", "--setting", "16", "2", "--d-model", "32", "--lr", "1e-2", "--steps", "2",
          "--vocab", "32", "--seed", "1", "--seeds", "2", "--workers", "1", "--out", str(out)])
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted(r["seed"] for r in rows) == [1, 2] and json.loads((out / "config.json").read_text())["seed"] == 1
    assert "seeds 1, 2" in (out / "table.md").read_text()


def test_sweep_in_pieces_equals_one_piece(tmp_path, capsys, monkeypatch):
    """`--minutes`: runs in flight checkpoint and stop, the rest wait; rerunning continues to the same results."""
    import time

    from evict.lab import recall
    from evict.lab import sweep as sweep_mod

    sweep = replace(MICRO, archs=("deltanet",), settings=((16, 2),), lrs=(3e-3,), steps=8, eval_every=2)
    whole = run_sweep(sweep, out=tmp_path / "whole")
    late = run_sweep(sweep, out=tmp_path / "late", minutes=1e-9)  # out of time before the run starts: nothing runs
    assert "0 of 1 runs finished, 1 left" in capsys.readouterr().out and not list(late.glob("runs/*"))
    assert "| deltanet | — | — |" in (late / "partial_table.md").read_text()
    # the lab's clock says "start", the training loop's real clock says "stop": one step, a checkpoint, no result
    clock = type("Clock", (), {"time": staticmethod(lambda: 0.0)})
    monkeypatch.setattr(recall, "time", clock)
    monkeypatch.setattr(sweep_mod, "time", clock)
    piece = run_sweep(sweep, out=tmp_path / "pieces", minutes=1e-9)
    monkeypatch.setattr(recall, "time", time)
    monkeypatch.setattr(sweep_mod, "time", time)
    assert "0 of 1 runs finished, 1 left" in capsys.readouterr().out
    assert not (piece / "table.md").exists() and not list(piece.glob("runs/*/result.json"))
    assert (next(piece.glob("runs/*")) / "checkpoint.pt").exists()
    run_sweep(sweep, out=piece)
    a, b = ([json.loads(x) for x in (r / "results.jsonl").read_text().splitlines()] for r in (whole, piece))
    assert [(r["accuracy"], r["steps"], r["curve"]) for r in a] == [(r["accuracy"], r["steps"], r["curve"]) for r in b]
    assert [step for step, _ in a[0]["curve"]] == [2, 4, 6, 8]
    with pytest.raises(ValueError, match="minutes"):
        run_sweep(sweep, out=tmp_path / "x", minutes=0)


def test_a_piece_does_not_start_a_run_it_cannot_finish(tmp_path):
    """expected_seconds: the median seconds per step of the cell's finished runs (same architecture first, runs of
    >= 1,000 steps) times the steps; a piece (stop_at) leaves a run that would not end in time for the next piece,
    and starts it when it would (or when nothing is known)."""
    import time

    from evict.lab.recall import expected_seconds, run_one

    jobs = jobs_for(replace(MICRO, steps=2000), tmp_path)
    job = next(j for j in jobs if j["arch"] == "deltanet" and j["pairs"] == 2 and j["lr"] == 1e-3)
    assert expected_seconds(job, 2000) is None

    def finished(arch, lr, steps, seconds, pairs=2):
        f = tmp_path / "runs" / f"{arch}_L{8 * pairs}_K{pairs}_d32_lr{lr:g}" / "result.json"
        f.parent.mkdir(parents=True)
        f.write_text(json.dumps(dict(arch=arch, seq_len=8 * pairs, pairs=pairs, d_model=32, steps=steps, seconds=seconds)))

    finished("attention", 1e-3, 1000, 500.0)  # another architecture: used while the same one has no run
    finished("deltanet", 5e-3, 500, 1.0)  # too short to say (compilation, evaluation)
    finished("kimi_linear", 1e-3, 1000, 9e9, pairs=4)  # another cell
    assert expected_seconds(job, 2000) == pytest.approx(1000.0)
    finished("deltanet", 3e-3, 2000, 100.0)
    assert expected_seconds(job, 2000) == pytest.approx(100.0)
    assert run_one({**job, "stop_at": time.time() + 50}) is None and not (tmp_path / "runs" / job["dir"]).exists()
    row = run_one({**job, "sweep": {**job["sweep"], "steps": 4}, "stop_at": time.time() + 600})
    assert row is not None and row["steps"] == 4


def test_a_run_longer_than_a_whole_piece_starts_in_the_pieces_first_half(tmp_path):
    """starts_now: a run expected to outlast a whole piece would never start under "finish in this piece", so it
    starts while at least half the piece is left (and resumes in the next piece); one that fits a fresh piece waits."""
    import time

    from evict.lab.recall import longer_than_a_piece, starts_now

    jobs = jobs_for(replace(MICRO, steps=2000), tmp_path)
    job = next(j for j in jobs if j["arch"] == "deltanet" and j["pairs"] == 2)
    f = tmp_path / "runs" / "done" / "result.json"  # 0.5 s per step: a 2,000-step run takes 1,000 s
    f.parent.mkdir(parents=True)
    f.write_text(json.dumps(dict(arch="deltanet", seq_len=job["seq_len"], pairs=2, d_model=job["d_model"], steps=1000,
                                 seconds=500.0)))
    now = time.time()
    piece = lambda length, left: {**job, "stop_at": now + left, "piece_seconds": length}
    assert longer_than_a_piece(piece(600, 600), 2000) and not longer_than_a_piece(piece(1200, 600), 2000)
    assert not longer_than_a_piece(job, 2000)  # not a timed piece
    assert starts_now(piece(600, 590), 2000) and starts_now(piece(600, 310), 2000)  # outlasts any piece: first half
    assert not starts_now(piece(600, 290), 2000)  # second half: the next piece starts it
    assert not starts_now(piece(1200, 900), 2000)  # fits a fresh piece, not this one's rest: waits
    assert starts_now(piece(1200, 1100), 2000)  # fits what is left


def test_left_estimate_counts_unfinished_runs_of_unsolved_cells(tmp_path):
    """left_estimate: expected_seconds summed over the unfinished runs (full steps), runs of solved cells skipped, runs
    of cells without a timed run counted apart."""
    from evict.lab.recall import left_estimate, solved_marker

    jobs = jobs_for(replace(MICRO, steps=2000), tmp_path)
    timed = next(j for j in jobs if j["arch"] == "deltanet" and j["pairs"] == 2)
    f = tmp_path / "runs" / "done" / "result.json"  # a finished run of that cell: 0.05 s per step
    f.parent.mkdir(parents=True)
    f.write_text(json.dumps(dict(arch="deltanet", seq_len=timed["seq_len"], pairs=2, d_model=timed["d_model"],
                                 steps=1000, seconds=50.0)))
    results = [None] * len(jobs)
    same_cell = [i for i, j in enumerate(jobs) if (j["seq_len"], j["pairs"], j["d_model"]) == (timed["seq_len"], 2, timed["d_model"])]
    seconds, known, unknown = left_estimate(jobs, results, 2000)
    assert known == len(same_cell) and unknown == len(jobs) - known and seconds == pytest.approx(100.0 * known)
    results[same_cell[0]] = {"accuracy": 0.5}  # finished
    marker = solved_marker(jobs[same_cell[1]])  # its cell solved: its other lrs will be skipped
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text("lr=1e-3")
    cell = lambda j: (j["arch"], j["seq_len"], j["pairs"], j["d_model"])
    solved = sum(cell(jobs[i]) == cell(jobs[same_cell[1]]) for i in same_cell[1:])
    _, known2, _ = left_estimate(jobs, results, 2000)
    assert known2 == known - 1 - solved


def test_a_solved_cell_stops_its_other_learning_rates(tmp_path):
    """Zoology's early stop at the target, per cell: once one lr reaches it, the cell's best over lr is known to be at
    least the target, so a later lr of that cell is not trained (accuracy None, skipped) and the table uses the winner."""
    sweep = replace(MICRO, archs=("attention",), settings=((16, 2),), lrs=(1e-2, 1e-3), target_accuracy=1e-9, steps=40,
                    eval_every=10, batch_size=16, eval_batches=2)
    root = run_sweep(sweep, out=tmp_path / "s")
    rows = {r["lr"]: r for r in map(json.loads, (root / "results.jsonl").read_text().splitlines())}
    first, second = rows[1e-2], rows[1e-3]  # jobs run in lr order with one worker
    assert first["accuracy"] > 0 and first["steps"] < 40  # seeded: above the tiny target before the last step
    assert (root / "solved" / "attention_L16_K2_d32_s0").read_text() == f"lr=0.01 at step {first['steps']}\n"
    assert second["accuracy"] is None and second["steps"] == 0 and "solved first by lr=0.01" in second["skipped"]
    assert f"| {first['accuracy']:.3f} |" in (root / "table.md").read_text()


def test_lr_order_runs_the_grid_in_rounds(tmp_path):
    """lr_order: every cell's first lr before any cell's second (costliest setting first, as without it); lrs it does
    not list follow in lrs order, and listed lrs that the sweep lacks (a --lr override) are ignored."""
    sweep = replace(MICRO, archs=("attention", "deltanet"), lrs=(1e-3, 3e-3, 1e-2), lr_order=(3e-3, 5e-2))
    assert lr_rounds(sweep) == [3e-3, 1e-3, 1e-2] and lr_rounds(replace(sweep, lr_order=())) == [1e-3, 3e-3, 1e-2]
    jobs = jobs_for(sweep, tmp_path)
    assert [(j["seq_len"], j["lr"], j["arch"]) for j in jobs[:6]] == [
        (24, 3e-3, "attention"), (24, 3e-3, "deltanet"), (24, 1e-3, "attention"), (24, 1e-3, "deltanet"),
        (24, 1e-2, "attention"), (24, 1e-2, "deltanet")]
    side_by_side = jobs_for(replace(sweep, lr_order=()), tmp_path)  # without: a cell's lrs adjacent, in lrs order
    assert [(j["arch"], j["lr"]) for j in side_by_side[:3]] == [("attention", 1e-3), ("attention", 3e-3), ("attention", 1e-2)]
    assert sorted(j["dir"] for j in jobs) == sorted(j["dir"] for j in side_by_side)  # the same runs, reordered
    assert lr_rounds(FULL)[0] == 2.2e-3 and sorted(lr_rounds(FULL)) == sorted(FULL.lrs)


def test_a_cell_solved_in_the_first_round_skips_its_later_lrs(tmp_path):
    """Two cells, two rounds, one worker: each cell's round-one lr (1e-2) reaches the (tiny) target, so neither cell
    trains its round-two lr, and the table holds the round-one accuracies."""
    sweep = replace(MICRO, archs=("attention", "deltanet"), settings=((16, 2),), lrs=(1e-3, 1e-2), lr_order=(1e-2,),
                    target_accuracy=1e-9, steps=40, eval_every=10, batch_size=16, eval_batches=2)
    root = run_sweep(sweep, out=tmp_path / "r")
    rows = [json.loads(x) for x in (root / "results.jsonl").read_text().splitlines()]
    assert [(r["arch"], r["lr"]) for r in rows] == [("attention", 1e-2), ("deltanet", 1e-2), ("attention", 1e-3),
                                                    ("deltanet", 1e-3)]
    assert all(r["accuracy"] > 0 for r in rows[:2]) and all(r["accuracy"] is None and r["steps"] == 0 for r in rows[2:])


def test_partial_report_shows_only_cells_whose_best_is_known(tmp_path):
    """A stopped sweep's table: a cell shows once every lr has finished or one reached the target; else —."""
    sweep = replace(MICRO, archs=("attention", "deltanet", "linear"), settings=((16, 2),), lrs=(1e-3, 3e-3))
    jobs = jobs_for(sweep, tmp_path)
    acc = {("attention", 1e-3): 0.5, ("attention", 3e-3): 0.7, ("deltanet", 1e-3): 0.995, ("deltanet", 3e-3): None,
           ("linear", 1e-3): 0.4, ("linear", 3e-3): None}  # None: not finished (deltanet's is known: 0.995 >= 0.99)
    results = [None if acc[(j["arch"], j["lr"])] is None else
               dict(arch=j["arch"], seq_len=16, pairs=2, d_model=32, lr=j["lr"], accuracy=acc[(j["arch"], j["lr"])],
                    state_size=11) for j in jobs]
    rows = known_rows(sweep, jobs, results)
    assert sorted((r["arch"], r["lr"]) for r in rows) == [("attention", 1e-3), ("attention", 3e-3), ("deltanet", 1e-3)]
    assert all(r["seed"] == 0 for r in rows)
    tables, _ = report(sweep, rows)
    assert "| attention | 0.700 | 11 |" in tables and "| deltanet | 0.995 | 11 |" in tables
    assert "| linear | — | — |" in tables


def test_a_run_whose_loss_stops_being_finite_is_marked_diverged(tmp_path, monkeypatch):
    """A run whose weights turn NaN (injected after step 3) stops at its next logged loss; its row keeps the best
    accuracy it reached before and says where it diverged (an unmarked 0.000 after thousands of steps otherwise)."""
    from evict.lab import recall

    real = recall.train

    def breaking(model, task, cfg, *args, **kw):
        seen = []

        def after_step():
            seen.append(1)
            if len(seen) == 3:
                with torch.no_grad():
                    next(model.parameters()).fill_(float("nan"))

        model.after_step = after_step
        return real(model, task, cfg, *args, **kw)

    monkeypatch.setattr(recall, "train", breaking)
    sweep = replace(MICRO, archs=("attention",), settings=((16, 2),), lrs=(1e-3,), steps=8, eval_every=2)
    root = run_sweep(sweep, out=tmp_path / "s")
    (row,) = map(json.loads, (root / "results.jsonl").read_text().splitlines())
    assert row["steps"] == 8 and row["diverged"] == "training loss not finite by step 8"
    assert row["accuracy"] is not None and "diverged at step 8" in row["label"]


def test_the_recall_command_takes_the_gate_init_and_a_fixed_training_set(tmp_path):
    """`evict recall --gate-dt MIN MAX --train-examples N` reach the sweep (its config.json) and every run."""
    out = tmp_path / "s"
    main(["recall", "--archs", "gated_deltanet", "--setting", "16", "2", "--d-model", "32", "--lr", "1e-2", "--steps", "2",
          "--vocab", "32", "--seeds", "1", "--workers", "1", "--gate-dt", "1e-3", "1e-2", "--train-examples", "8",
          "--out", str(out)])
    config = json.loads((out / "config.json").read_text())
    assert config["gate_dt"] == [1e-3, 1e-2] and config["train_examples"] == 8
    assert len((out / "results.jsonl").read_text().splitlines()) == 1


def test_the_recall_command_sets_model_fields_over_the_labs_models(tmp_path):
    """`evict recall --set KEY=VALUE` (a side experiment's ablation, e.g. Kimi Linear with tied embeddings) reaches the
    sweep's config.json, every model it builds, and the table's title."""
    out = tmp_path / "s"
    main(["recall", "--archs", "kimi_linear", "--setting", "16", "2", "--d-model", "32", "--lr", "1e-2", "--steps", "2",
          "--vocab", "32", "--seeds", "1", "--workers", "1", "--set", "tie_embeddings=true", "--set", "pattern=MMMM",
          "--out", str(out)])
    config = json.loads((out / "config.json").read_text())
    assert config["model_set"] == {"tie_embeddings": True, "pattern": "MMMM"}
    sweep = replace(QUICK, model_set=config["model_set"])
    cfg = model_config("kimi_linear", 32, sweep, 16)
    assert cfg.tie_embeddings is True and cfg.pattern == "MMMM" and cfg.moe is None  # the lab's own choices stay
    assert model_config("kimi_linear", 32, QUICK, 16).tie_embeddings is False  # the preset's, without --set
    assert "tie_embeddings=true, pattern=\"MMMM\"" in (out / "table.md").read_text().splitlines()[0]


@pytest.mark.parametrize("flag, message", [
    ("no_such_field=1", "'no_such_field' is not a ModelConfig field"),
    ("d_model=64", "d_model is the sweep's own (--vocab / --d-model)"),
    ("tie_embeddings", "--set: expected KEY=VALUE"),
])
def test_a_bad_set_flag_is_one_line_and_writes_nothing(flag, message, tmp_path, capsys):
    out = tmp_path / "s"
    with pytest.raises(SystemExit) as e:
        main(["recall", "--archs", "kimi_linear", "--setting", "16", "2", "--d-model", "32", "--steps", "2",
              "--vocab", "32", "--workers", "1", "--set", flag, "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and message in err[0], err
    assert not out.exists()
