"""dev/grid_restore.py: the finished runs of earlier GPU pieces (committed JSONL) go back into a sweep folder with
their cells' solved markers, so the next piece on a bare machine trains only what is left."""

import dataclasses
import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from evict.lab import hybrid, pairs, recall, state

SPEC = importlib.util.spec_from_file_location("grid_restore", Path(__file__).parents[2] / "dev" / "grid_restore.py")
grid_restore = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(grid_restore)


def _piece(tmp_path, config: dict, rows: list[dict]) -> list[str]:
    cfg, res = tmp_path / "piece_config.json", tmp_path / "piece_results.jsonl"
    cfg.write_text(json.dumps(config))
    res.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [str(cfg), str(res)]


def test_recall_rows_and_solved_markers_are_restored(tmp_path):
    full = json.loads(json.dumps(dataclasses.asdict(recall.FULL)))
    solved = dict(arch="kda", seq_len=128, pairs=8, d_model=64, lr=2.2e-3, seed=0, accuracy=0.995, steps=900,
                  dir="kda_L128_K8_d64_lr0.0022")
    open_cell = dict(arch="linear", seq_len=128, pairs=8, d_model=64, lr=2.2e-3, seed=0, accuracy=0.4, steps=8000,
                     dir="linear_L128_K8_d64_lr0.0022")
    files = _piece(tmp_path, {**full, "archs": ["kda", "linear"]}, [solved, open_cell])  # `archs` may differ
    root = tmp_path / "sweep"
    grid_restore.main(str(root), files)
    assert json.loads((root / "runs" / solved["dir"] / "result.json").read_text())["accuracy"] == 0.995
    marker = recall.solved_marker({**solved, "solved_dir": str(root / "solved")})
    assert marker.exists() and len(list((root / "solved").iterdir())) == 1  # only the solved cell
    # the solved cell's other lr is then skipped, as in the piece that solved it
    job = {**solved, "lr": 1e-2, "dir": str(root / "runs" / "kda_L128_K8_d64_lr0.01"), "solved_dir": str(root / "solved"),
           "sweep": dataclasses.asdict(recall.FULL)}
    assert recall.run_one(job)["skipped"].startswith("cell solved first by lr=0.0022")


def test_another_config_is_refused_and_labs_compare_every_field(tmp_path):
    full = json.loads(json.dumps(dataclasses.asdict(recall.FULL)))
    with pytest.raises(SystemExit, match="steps differ"):
        grid_restore.main(str(tmp_path / "a"), _piece(tmp_path, {**full, "steps": 100}, []))
    lab = json.loads(json.dumps(dataclasses.asdict(state.FULL)))
    row = dict(task="parity", model="kda", seed=0, accuracy=1.0, dir="parity_kda_s0")
    grid_restore.main(str(tmp_path / "s"), _piece(tmp_path, {**lab, "workers": 1}, [row]), lab="state")
    assert (tmp_path / "s" / "runs" / "parity_kda_s0" / "result.json").exists() and not (tmp_path / "s" / "solved").exists()
    with pytest.raises(SystemExit, match="lr differ"):
        grid_restore.main(str(tmp_path / "t"), _piece(tmp_path, {**lab, "lr": 3e-3}, [row]), lab="state")
    # the fields that choose which runs exist (state.WHICH_FIELDS) may differ: a sweep that adds a task (here: the
    # committed pieces' four tasks, before mod_arith_prec) keeps every run of the others; each row names its own
    older = {**lab, "tasks": ["parity", "mod_arith", "s3", "s5"], "models": ["kda"], "seeds": 2}
    grid_restore.main(str(tmp_path / "u"), _piece(tmp_path, older, [row]), lab="state")
    assert (tmp_path / "u" / "runs" / "parity_kda_s0" / "result.json").exists()
    # hybrid's which-runs fields (seed, seeds, text_seeds): piece 1 (session 26) predates text_seeds and is kept by a
    # sweep that adds the text runs' seeds 1 and 2; a field that changes what a run trains is still refused
    hyb = json.loads(json.dumps(dataclasses.asdict(hybrid.FULL)))
    piece1 = {k: v for k, v in hyb.items() if k != "text_seeds"}
    run = dict(variant="kda_1to0", task="text", seed=0, val_loss=1.4, dir="kda_1to0_text_s0")
    grid_restore.main(str(tmp_path / "h"), _piece(tmp_path, piece1, [run]), lab="hybrid")
    assert (tmp_path / "h" / "runs" / "kda_1to0_text_s0" / "result.json").exists()
    with pytest.raises(SystemExit, match="mqar_steps differ"):
        grid_restore.main(str(tmp_path / "i"), _piece(tmp_path, {**piece1, "mqar_steps": 4000}, [run]), lab="hybrid")
    # pairs' lrs compare as a set (pairs.UNORDERED_FIELDS): the committed pieces 1-7, climbed in the order (2.2e-3,
    # 1e-2, 4.6e-4), restore into FULL's; a rung row keeps its LADDER/RUNG folder; another set of lrs is refused
    full = json.loads(json.dumps(dataclasses.asdict(pairs.FULL)))
    old = {**full, "lrs": [2.2e-3, 1e-2, 4.6e-4]}
    assert old["lrs"] != full["lrs"]
    rung = dict(arch="kda", seq_len=256, pairs=32, lr=4.6e-4, seed=0, accuracy=0.913, dir="kda_d32_s0/K32_lr0.00046")
    grid_restore.main(str(tmp_path / "p"), _piece(tmp_path, old, [rung]), lab="pairs")
    assert (tmp_path / "p" / "runs" / "kda_d32_s0" / "K32_lr0.00046" / "result.json").exists()
    with pytest.raises(SystemExit, match="lrs differ"):
        grid_restore.main(str(tmp_path / "q"), _piece(tmp_path, {**full, "lrs": [2.2e-3, 1e-2]}, [rung]), lab="pairs")


PIECE_SPEC = importlib.util.spec_from_file_location("grid_piece", Path(__file__).parents[2] / "dev" / "grid_piece.py")
grid_piece = importlib.util.module_from_spec(PIECE_SPEC)
PIECE_SPEC.loader.exec_module(grid_piece)


def test_a_piece_commits_only_its_new_runs_and_the_lab_writes_the_table(tmp_path):
    """dev/grid_piece.py: a device call's rows that no committed piece holds become the next piece (config beside
    them); a call with nothing new writes nothing; the partial table is the lab's own, from every piece."""
    committed = Path(__file__).parents[2] / "results" / "recall" / "full"  # the first GPU piece: real rows and config
    config = (committed / "piece1_config.json").read_text()
    old, new = [json.loads(line) for line in (committed / "piece1_results.jsonl").read_text().splitlines()[:2]]
    docs, at = tmp_path / "docs", tmp_path / "files_at"
    docs.mkdir(), at.mkdir()
    (docs / "piece1_config.json").write_text(config)
    (docs / "piece1_results.jsonl").write_text(json.dumps(old) + "\n")
    (at / "grid_config.json").write_text(config)
    (at / "grid_results.jsonl").write_text(json.dumps(old) + "\n" + json.dumps(new) + "\n")
    out = grid_piece.main(str(at), docs=str(docs))
    assert out == docs / "piece2_results.jsonl" and (docs / "piece2_config.json").exists()
    assert [json.loads(line)["dir"] for line in out.read_text().splitlines()] == [new["dir"]]
    table = (docs / "partial_table.md").read_text()
    assert table.startswith("Partial: 2 of 336 runs finished")
    assert grid_piece.main(str(at), docs=str(docs)) is None and not (docs / "piece3_results.jsonl").exists()
    (at / "grid_results.jsonl").write_text("{not json\n")
    with pytest.raises(SystemExit, match="grid_results.jsonl: line 1 is not JSON"):
        grid_piece.main(str(at), docs=str(docs))
    with pytest.raises(SystemExit, match="grid_config.json: not found"):
        grid_piece.main(str(tmp_path / "nowhere"), docs=str(docs))


def _device_calls(tmp_path, ran: Path, stem: str, lab: str, first: int) -> Path:
    """Commit a sweep that ran in `ran` as two device calls' worth of pieces (grid_piece): `first` runs, then all. The
    pieces say they ran with 3 workers (the device's count, not the scratch run's one)."""
    config = {**json.loads((ran / "config.json").read_text()), "workers": 3}
    rows = [{**json.loads(f.read_text()), "dir": f.parent.name} for f in sorted((ran / "runs").glob("*/result.json"))]
    docs, at = tmp_path / "docs", tmp_path / "files_at"
    at.mkdir()
    (at / f"{stem}_config.json").write_text(json.dumps(config))
    for n in (first, len(rows)):
        (at / f"{stem}_results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:n]))
        grid_piece.main(str(at), lab=lab, docs=str(docs), target=config)
        if n == first:
            assert not (docs / "table.md").exists()
            if lab in ("recall", "state", "hybrid", "pairs"):  # the labs whose report shows a partial sweep
                assert (docs / "partial_table.md").read_text().startswith(f"Partial: {first} of {len(rows)} runs")
    return docs


def test_the_last_piece_writes_the_finished_grid(tmp_path):
    """dev/grid_piece.py: while runs are left it writes the partial table; once every run of the grid is committed, the
    finished sweep's own outputs (table, scorecard, every run's row, both plots) replace it — the same table the sweep
    wrote where it ran."""
    micro = dataclasses.replace(recall.QUICK, archs=("attention", "deltanet"), settings=((16, 2), (24, 4)),
                                d_models=(32,), lrs=(1e-3, 3e-3), steps=4, batch_size=4, eval_every=2, eval_batches=1,
                                workers=1, vocab_size=32, seeds=1)
    ran = recall.run_sweep(micro, out=tmp_path / "device")  # where the pieces ran, all at once here
    docs = _device_calls(tmp_path, ran, "grid", "recall", first=3)
    assert not (docs / "partial_table.md").exists()
    assert (docs / "table.md").read_text() == (ran / "table.md").read_text()
    assert (docs / "scorecard.md").read_text() == (ran / "scorecard.md").read_text()
    assert len((docs / "results.jsonl").read_text().splitlines()) == 8
    assert json.loads((docs / "config.json").read_text())["workers"] == 3  # as the pieces ran, not as the table's run
    assert all((docs / png).stat().st_size > 0 for png in ("recall_vs_pairs.png", "recall_vs_state.png"))


@pytest.mark.parametrize("stem", ["lab_capacity", "lab"])
def test_a_labs_last_piece_writes_its_finished_sweep(tmp_path, stem):
    """The same for a research lab (`--lab`): nothing but the pieces while runs are left, then the lab's own table,
    rows and plot. A call names its files by lab (lab_capacity_config.json: two labs can share a call); the older
    lab_config.json is still read."""
    from evict.lab import capacity

    micro = dataclasses.replace(capacity.QUICK, sizes=(4, 6), steps=3, batch_size=4, eval_batches=1, workers=1)
    ran = capacity.run_sweep(micro, out=tmp_path / "device")
    docs = _device_calls(tmp_path, ran, stem, "capacity", first=2)
    assert (docs / "table.md").read_text() == (ran / "table.md").read_text()
    assert (docs / "results.jsonl").read_text() == (ran / "results.jsonl").read_text()
    assert (docs / "capacity.png").stat().st_size > 0 and json.loads((docs / "config.json").read_text())["sizes"] == [4, 6]
    assert json.loads((docs / "config.json").read_text())["workers"] == 3


def test_the_heads_lab_is_committed_as_the_capacity_labs_heads_full_mode(tmp_path):
    """--lab heads: `evict lab capacity --heads-full` in pieces (dev/gpu.sh LAB=heads): its mode, its folder
    (results/capacity/heads_full/), its preset as the default target (a piece of another step count is refused), and
    the finished table is capacity_heads' own, the same as where the sweep ran."""
    from evict.lab import capacity_heads

    mode = subprocess.run([sys.executable, str(Path(__file__).parents[2] / "dev" / "grid_restore.py"), "--mode", "heads"],
                          capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert mode.stdout.split() == ["capacity", "heads_full"]
    assert grid_restore.preset("heads") is capacity_heads.HEADS_FULL
    full = json.loads(json.dumps(dataclasses.asdict(capacity_heads.HEADS_FULL)))
    with pytest.raises(SystemExit, match="steps differ"):
        grid_restore.main(str(tmp_path / "a"), _piece(tmp_path, {**full, "steps": 100}, []), lab="heads")
    micro = dataclasses.replace(capacity_heads.HEADS, sizes=(4, 8), layouts=("1x4", "4x2"), rules=("delta",), steps=3,
                                batch_size=4, eval_batches=1, workers=1)
    ran = capacity_heads.run_sweep(micro, out=tmp_path / "device")
    docs = _device_calls(tmp_path, ran, "lab_heads", "heads", first=2)
    assert (docs / "table.md").read_text() == (ran / "table.md").read_text()
    assert (docs / "results.jsonl").read_text() == (ran / "results.jsonl").read_text()
    assert json.loads((docs / "config.json").read_text())["layouts"] == ["1x4", "4x2"]


def test_the_context_labs_decode_timings_travel_with_its_pieces(tmp_path, monkeypatch):
    """--lab context: a piece's rows include its timed models (dir "@decode/MODEL", from ROOT/decode/MODEL); they are
    restored there, so the last piece's table is written here from the device's timings — the same table as where the
    sweep ran — and nothing is timed on this machine (a piece without them writes no table)."""
    from evict.lab import context

    (tmp_path / "c.txt").write_text("ROMEO: But soft, what light through yonder window breaks?\n" * 300)
    micro = dataclasses.replace(context.QUICK, ratios=("1:0", "0:1"), n_layers=2, scales=(8,), head_dim=8,
                                train_len=8, contexts=(8, 16), decode_contexts=(32,), windows=4, steps=2, batch_size=2,
                                decode_steps=1, decode_warmup=0, seeds=1, workers=1, corpus=str(tmp_path / "c.txt"))
    ran = context.run_sweep(micro, out=tmp_path / "device")
    rows = grid_restore.finished_rows(ran)
    timed = [r for r in rows if r["dir"].startswith("@decode/")]
    assert sorted(r["dir"] for r in timed) == sorted(f"@decode/{m.name}" for m in context.models(micro))
    config = json.loads((ran / "config.json").read_text())
    docs, at = tmp_path / "docs", tmp_path / "files_at"
    at.mkdir()
    (at / "lab_context_config.json").write_text(json.dumps(config))
    real = context.time_one  # here only ever asked past the scratch piece's end, so it times nothing
    monkeypatch.setattr(context, "time_one", lambda job: real(job) if context.out_of_time(job) else pytest.fail("timed here"))
    runs = [r for r in rows if r not in timed]
    (at / "lab_context_results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runs))
    grid_piece.main(str(at), lab="context", docs=str(docs), target=config)  # every run, no timing: no table
    assert not (docs / "table.md").exists()
    (at / "lab_context_results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    grid_piece.main(str(at), lab="context", docs=str(docs), target=config)
    assert [json.loads(line)["dir"] for line in (docs / "piece2_results.jsonl").read_text().splitlines()] == \
        [r["dir"] for r in timed]
    assert (docs / "table.md").read_text() == (ran / "table.md").read_text()
    restored = tmp_path / "restored"
    restored.mkdir()
    (restored / "config.json").write_text(json.dumps(config))  # the sweep the pieces belong to (else FULL's)
    grid_restore.main(str(restored), [str(docs / "piece2_config.json"), str(docs / "piece2_results.jsonl")], lab="context")
    assert (restored / "decode" / context.models(micro)[0].name / "result.json").exists()
    with pytest.raises(SystemExit, match="names no folder after @decode/"):
        grid_restore.main(str(restored), _piece(tmp_path, config, [{"dir": "@decode"}]), lab="context")


def test_a_side_experiment_is_committed_beside_the_grid_against_its_own_config(tmp_path):
    """--side NAME: a side experiment's rows (NAME_config.json + NAME_results.jsonl) go to side_NAME/ and its table is
    written against its own config (here a fixed training set), not `--full`'s; a bad name is one line."""
    micro = dataclasses.replace(recall.QUICK, archs=("deltanet",), settings=((16, 2),), d_models=(32,), lrs=(1e-3, 3e-3),
                                steps=4, batch_size=4, eval_every=2, eval_batches=1, workers=1, vocab_size=32, seeds=1,
                                train_examples=8)
    ran = recall.run_sweep(micro, out=tmp_path / "device")
    rows = [{**json.loads(f.read_text()), "dir": f.parent.name} for f in sorted((ran / "runs").glob("*/result.json"))]
    at, docs = tmp_path / "at", tmp_path / "docs"
    at.mkdir()
    (at / "finite_config.json").write_text((ran / "config.json").read_text())
    (at / "finite_results.jsonl").write_text(json.dumps(rows[0]) + "\n")
    grid_piece.main(str(at), docs=str(docs), side="finite")
    assert (docs / "side_finite" / "partial_table.md").read_text().startswith("Partial: 1 of 2 runs finished")
    (at / "finite_results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    grid_piece.main(str(at), docs=str(docs), side="finite")
    assert (docs / "side_finite" / "table.md").read_text() == (ran / "table.md").read_text()
    assert not (docs / "piece1_results.jsonl").exists()  # nothing lands among the grid's own pieces
    with pytest.raises(SystemExit, match="--side"):
        grid_piece.main(str(at), docs=str(docs), side="../x")


def test_a_packed_call_is_read_from_its_archive(tmp_path):
    """A call with more than 8 files in $OUT comes back as out.tar.gz (dev/gpu.sh packs it): grid_piece reads the
    piece from inside, as from the folder."""
    import tarfile

    committed = Path(__file__).parents[2] / "results" / "recall" / "full"
    src = tmp_path / "out"
    src.mkdir()
    (src / "grid_config.json").write_text((committed / "piece1_config.json").read_text())
    (src / "grid_results.jsonl").write_text((committed / "piece1_results.jsonl").read_text().splitlines()[0] + "\n")
    at = tmp_path / "files_at"
    at.mkdir()
    with tarfile.open(at / "out.tar.gz", "w:gz") as tar:
        for f in src.iterdir():
            tar.add(f, arcname=f"./{f.name}")  # as `tar czf out.tar.gz .` names them
    docs = tmp_path / "docs"
    out = grid_piece.main(str(at), docs=str(docs))
    assert out == docs / "piece1_results.jsonl" and len(out.read_text().splitlines()) == 1


def test_a_state_piece_commits_the_cells_known_so_far(tmp_path):
    """The state lab writes a partial table while runs are left (the cells whose every seed is in), and its finished
    table, rows and plot once the last piece is committed; the partial table then goes."""
    from evict.lab import state

    micro = dataclasses.replace(state.QUICK, models=("deltanet", "deltanet_neg"), d_model=16, n_heads=2, steps=2,
                                batch_size=4, eval_every=2, eval_batches=1, train_lengths=(3, 8), test_lengths=(8, 16),
                                workers=1)
    ran = state.run_sweep(micro, out=tmp_path / "device")
    docs = _device_calls(tmp_path, ran, "lab_state", "state", first=1)
    assert not (docs / "partial_table.md").exists() and (docs / "state.png").stat().st_size > 0
    assert (docs / "table.md").read_text() == (ran / "table.md").read_text()


def test_a_half_climbed_ladder_climbs_on_from_its_committed_rungs(tmp_path, monkeypatch):
    """A pairs ladder that a device session leaves half-climbed: its finished rungs come back (finished_rows: rows
    LADDER/RUNG), are committed (grid_piece) and restored (grid_restore), so the next bare machine trains only the
    rungs above them; once the ladder is finished its rungs are not committed again (the ladder's row holds them)."""
    from evict.lab import pairs
    from evict.lab.sweep import out_of_time

    trained = []

    def fake(job):  # the recall lab's run of one rung: every rung passes; none starts after its piece's end
        if out_of_time(job):
            return None
        trained.append(job["pairs"])
        return {"accuracy": 0.5 + job["pairs"] / 10, "lr": job["lr"], "steps": 3, "seconds": 1.0, "state_size": 16,
                "params": 99}

    monkeypatch.setattr(pairs.recall, "run_one", fake)
    micro = dataclasses.replace(pairs.QUICK, rules=("deltanet",), dims=(4,), d_model=8, pairs=(1, 2, 4), threshold=0.5,
                                lrs=(1e-2,), workers=1)
    ran = pairs.run_sweep(micro, out=tmp_path / "device")
    whole = (ran / "results.jsonl").read_text()
    ladder = ran / "runs" / "deltanet_d4_s0"
    (ladder / "result.json").unlink()  # the session ended while the third rung trained
    (ladder / "K4_lr0.01" / "result.json").unlink()
    rows = grid_restore.finished_rows(ran)
    assert [r["dir"] for r in rows] == ["deltanet_d4_s0/K1_lr0.01", "deltanet_d4_s0/K2_lr0.01"]
    config = json.loads((ran / "config.json").read_text())
    at, docs = tmp_path / "at", tmp_path / "docs"
    at.mkdir()
    (at / "lab_pairs_config.json").write_text(json.dumps(config))
    (at / "lab_pairs_results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    first = grid_piece.main(str(at), lab="pairs", docs=str(docs), target=config)
    assert len(first.read_text().splitlines()) == 2 and not (docs / "table.md").exists()
    # the next bare machine
    nxt = tmp_path / "next"
    nxt.mkdir()
    (nxt / "config.json").write_text(json.dumps(config))
    grid_restore.main(str(nxt), [str(docs / "piece1_config.json"), str(first)], lab="pairs")
    trained.clear()
    pairs.run_sweep(micro, out=nxt)
    assert trained == [4] and (nxt / "results.jsonl").read_text() == whole
    (at / "lab_pairs_results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in grid_restore.finished_rows(nxt)))
    second = grid_piece.main(str(at), lab="pairs", docs=str(docs), target=config)
    assert [json.loads(line)["dir"] for line in second.read_text().splitlines()] == ["deltanet_d4_s0"]
    assert (docs / "results.jsonl").read_text() == whole
    for bad in ("../x", "a/b/c", "", "a//b"):
        with pytest.raises(SystemExit, match="must be a run folder"):
            grid_restore.main(str(nxt), _piece(tmp_path, config, [{"dir": bad, "accuracy": 1.0}]), lab="pairs")


def test_the_committed_pairs_pieces_restore_into_full(tmp_path):
    """What the next bare device machine does first (`LAB=pairs bash dev/gpu.sh lab`): every committed pairs piece's
    rows go back into a folder for pairs.FULL, whatever lr order the piece climbed in; none is refused or lost."""
    docs = Path(__file__).parents[2] / "results" / "pairs" / "full"
    configs = sorted(docs.glob("piece*_config.json"), key=grid_piece._number)
    files = [str(f) for c in configs for f in (c, c.with_name(c.name.replace("_config.json", "_results.jsonl")))]
    rows = sum(len(Path(f).read_text().splitlines()) for f in files[1::2])
    assert len(configs) >= 7 and rows > 100
    grid_restore.main(str(tmp_path / "r"), files, lab="pairs")
    assert len(list((tmp_path / "r" / "runs").rglob("result.json"))) == rows


def _one_piece(tmp_path, monkeypatch, lab: str, cli: list[str], png: str) -> Path:
    """A lab's sweep (its preset patched to a micro one) finished by one device piece (`evict lab … --minutes`),
    committed by grid_piece under the repository's results folder (here tmp_path's) for `lab`, then restored on the
    next bare machine (a folder not yet started: the preset is the target) where the same command trains nothing and
    writes the same table. Returns the committed folder."""
    from evict.cli import main

    device, at, fresh = tmp_path / "device", tmp_path / "at", tmp_path / "fresh"
    assert main([*cli, "--minutes", "5", "--out", str(device)]) == 0
    at.mkdir()
    (at / f"lab_{lab}_config.json").write_text((device / "config.json").read_text())
    rows = grid_restore.finished_rows(device)
    (at / f"lab_{lab}_results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(grid_piece, "ROOT", tmp_path)
    out = grid_piece.main(str(at), lab=lab)
    docs = out.parent
    assert out.name == "piece1_results.jsonl" and len(out.read_text().splitlines()) == len(rows)
    assert len(rows) == len(list((device / "runs").iterdir()))  # every run finished in the one piece
    assert (docs / "table.md").read_text() == (device / "table.md").read_text() and (docs / png).stat().st_size > 0
    grid_restore.main(str(fresh), [str(docs / "piece1_config.json"), str(out)], lab=lab)
    module = importlib.import_module(f"evict.lab.{grid_restore.LABS[lab]}")

    def trains(job):
        raise AssertionError(f"{job['dir']}: a restored run trained again")

    monkeypatch.setattr(module, "run_one", trains)
    assert main([*cli, "--minutes", "5", "--out", str(fresh)]) == 0
    assert (fresh / "table.md").read_text() == (device / "table.md").read_text()
    return docs


def test_a_ttt_piece_is_committed_restored_and_not_trained_again(tmp_path, monkeypatch):
    """`LAB=ttt bash dev/gpu.sh lab`'s round trip: `evict lab ttt --full` pieces land in results/ttt/full/."""
    from evict.lab import ttt

    micro = dataclasses.replace(ttt.QUICK, rules=("delta", "adagrad"), sizes=(3, 4), pairs=(1,), d_key=4, d_model=8,
                                seq_len=8, vocab_size=8, steps=2, eval_every=1, batch_size=3, eval_batches=1, workers=1)
    monkeypatch.setattr(ttt, "FULL", micro)
    docs = _one_piece(tmp_path, monkeypatch, "ttt", ["lab", "ttt", "--full"], "ttt.png")
    assert docs == tmp_path / "results" / "ttt" / "full"


def test_a_counters_piece_lands_beside_the_state_labs_full_sweep(tmp_path, monkeypatch):
    """`LAB=counters bash dev/gpu.sh lab` runs `evict lab state --counters-full`: its pieces land in
    results/state/counters_full/, against COUNTERS_FULL, and leave results/state/full/ alone."""
    from evict.lab import state

    micro = dataclasses.replace(state.COUNTERS, tasks=("count_mod3",), models=("deltanet", "deltanet_neg"), d_model=16,
                                n_heads=2, steps=2, batch_size=4, eval_every=2, eval_batches=1, train_lengths=(3, 8),
                                test_lengths=(8, 16), workers=1)
    monkeypatch.setattr(state, "COUNTERS_FULL", micro)
    docs = _one_piece(tmp_path, monkeypatch, "counters", ["lab", "state", "--counters-full"], "state.png")
    assert docs == tmp_path / "results" / "state" / "counters_full"
    assert not (tmp_path / "results" / "state" / "full").exists()


def test_the_new_pieces_restore_against_their_own_presets(tmp_path):
    """A bare machine's folder not yet started: ttt's pieces are restored against ttt.FULL, counters' against
    state.COUNTERS_FULL, and a piece of `lab state --full` is refused there (half the steps); `--mode` tells dev/gpu.sh
    which `evict lab` command and pieces folder a name means."""
    from evict.lab import state, ttt

    full = json.loads(json.dumps(dataclasses.asdict(ttt.FULL)))
    row = dict(task="mqar", rule="delta", size=32, seed=0, final=0.5, dir="mqar_delta_32_s0")
    grid_restore.main(str(tmp_path / "t"), _piece(tmp_path, {**full, "workers": 8}, [row]), lab="ttt")
    assert (tmp_path / "t" / "runs" / "mqar_delta_32_s0" / "result.json").exists()
    counters = json.loads(json.dumps(dataclasses.asdict(state.COUNTERS_FULL)))
    row = dict(task="count_mod5", model="kda_neg", seed=2, scaled_accuracy=1.0, dir="count_mod5_kda_neg_s2")
    grid_restore.main(str(tmp_path / "c"), _piece(tmp_path, counters, [row]), lab="counters")
    assert (tmp_path / "c" / "runs" / "count_mod5_kda_neg_s2" / "result.json").exists()
    with pytest.raises(SystemExit, match="steps differ"):
        grid_restore.main(str(tmp_path / "s"), _piece(tmp_path, json.loads(json.dumps(dataclasses.asdict(state.FULL))),
                                                      [row]), lab="counters")
    assert grid_restore.mode_of("counters") == ("state", "counters_full")
    assert grid_restore.mode_of("ttt") == ("ttt", "full")
    tool = [sys.executable, str(Path(__file__).parents[2] / "dev" / "grid_restore.py"), "--mode"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    said = subprocess.run([*tool, "counters"], capture_output=True, text=True, env=env)
    assert said.stdout == "state counters_full\n"
    bad = subprocess.run([*tool, "recall"], capture_output=True, text=True, env=env)
    assert bad.returncode == 1 and "--mode: expected one of" in bad.stderr
