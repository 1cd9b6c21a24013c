"""The hybrid lab: layer patterns per ratio and placement, equal parameters, the accountant's cache numbers, the
ordering against Kimi Linear's Table 1, the sweep end to end (micro) and its flags."""

import functools
import json
from dataclasses import replace

import pytest
import torch

from evict.cli import main
from evict.lab import hybrid
from evict.lab.hybrid import (FULL, KINDS, PARAM_TOLERANCE, PUBLISHED, QUICK, accountant, layer_pattern, model_config,
                              ordering, run_sweep, variants)
from evict.layers.attention import Attention
from evict.layers.memory_mixer import MemoryMixer
from evict.layers.mla import MLA
from evict.models import LM, ModelConfig
from tests.test_bad_input import _cli

from .pieces import finished_piece, stopped_piece

CORPUS = "ROMEO: But soft, what light through yonder window breaks?\nJULIET: Ay me!\n" * 40
MICRO = replace(QUICK, ratios=("1:0", "3:1", "0:1"), placement_ratios=("3:1",), n_layers=4, d_model=16,
                head_dim=8, d_ff=32, seq_len=16, pairs=2, vocab_size=16, text_seq_len=16, steps=2, batch_size=4,
                eval_every=2, eval_batches=1, contexts=(64, 1024), workers=1)


def _expected_positions(ratio: str, n: int, placement: str) -> list[int]:
    """Where the attention layers go, written out per placement (spread: 1-based layers g, 2g, … for b = 1)."""
    a, b = (int(x) for x in ratio.split(":"))
    n_attn = n * b // (a + b)
    if placement == "early":
        return list(range(n_attn))
    if placement == "late":
        return list(range(n - n_attn, n))
    return [i for i in range(n) if i % (a + b) >= a]


@pytest.mark.parametrize("n", [8, 16])
@pytest.mark.parametrize("placement", ["spread", "early", "late"])
@pytest.mark.parametrize("ratio", ["1:0", "15:1", "7:1", "3:1", "1:1", "0:1"])
def test_pattern_counts_and_positions(ratio, placement, n):
    a, b = (int(x) for x in ratio.split(":"))
    if n % (a + b):
        with pytest.raises(ValueError, match=rf"^n_layers: ratio {ratio} needs a multiple of {a + b} layers"):
            layer_pattern(ratio, n, placement, "M")
        return
    for letter in "MA":
        pat = layer_pattern(ratio, n, placement, letter)
        assert len(pat) == n and set(pat) <= {"K", letter}
        assert pat.count(letter) == n * b // (a + b) and pat.count("K") == n * a // (a + b)
        assert [i for i, c in enumerate(pat) if c == letter] == _expected_positions(ratio, n, placement)


def test_spread_is_kimi_linear_tiling_and_the_lm_builds_it():
    for ratio, tile in (("3:1", "KKKM"), ("7:1", "KKKKKKKM"), ("15:1", "K" * 15 + "M"), ("1:1", "KM")):
        tiled = ModelConfig(pattern=tile, n_layers=16).layer_mixers()  # the config's own tiling of a short pattern
        assert list(layer_pattern(ratio, 16, "spread", "M")) == tiled
    for pat in ("KKKMKKKM", "AAKKKKKK", "KMKMKMKM", "MMMMMMMM"):
        with torch.device("meta"):
            lm = LM(model_config(replace(QUICK, n_layers=len(pat)), pat, 64))
        want = {"K": MemoryMixer, "M": MLA, "A": Attention}
        assert [type(b.mixer) for b in lm.blocks] == [want[c] for c in pat]
        assert all(b.mixer.kind == "kda" for b, c in zip(lm.blocks, pat) if c == "K")


def test_variants_fold_placements_with_the_same_pattern():
    vs = {v.name: v for v in variants(replace(FULL, placement_ratios=("15:1", "3:1")))}
    assert vs["mla_15to1_spread"].same_as == ("late",) and "mla_15to1_late" not in vs  # one attention layer: last
    assert vs["mla_15to1_early"].pattern == "M" + "K" * 15
    assert {v.placement for v in vs.values() if v.ratio == "7:1"} == {"spread"}  # not a placement ratio
    assert {v.placement for v in vs.values() if v.ratio == "3:1" and v.kind == "attention"} == {"spread", "early", "late"}
    assert [v.name for v in vs.values() if v.kind == "kda"] == ["kda_1to0"]
    assert len({v.pattern for v in vs.values()}) == len(vs)


@pytest.mark.parametrize("sweep", [QUICK, pytest.param(FULL, marks=pytest.mark.slow), MICRO], ids=["quick", "full", "micro"])
def test_equal_parameters_within_tolerance(sweep):
    """Counted here from the built model's parameters (meta device), not from the accountant the lab used."""
    def body(pattern):
        with torch.device("meta"):
            lm = LM(model_config(sweep, pattern, sweep.vocab_size))
        return sum(p.numel() for p in lm.parameters()) - lm.embed.weight.numel()  # tied head: counted once

    target = body("K" * sweep.n_layers)
    widths = {}
    for v in variants(sweep):
        got = body(v.pattern)
        assert abs(got / target - 1) <= PARAM_TOLERANCE, (v.label, got, target)
        assert accountant(sweep, v.pattern)["params"] == got
        widths[v.pattern] = model_config(sweep, v.pattern, 10).d_ff
    assert widths["K" * sweep.n_layers] == sweep.d_ff
    assert len(set(widths.values())) > 1  # the widths really were adjusted (attention mixers are smaller than KDA)


def test_validate_rejects_what_cannot_be_matched(monkeypatch):
    monkeypatch.setattr(hybrid, "PARAM_TOLERANCE", 0.0)
    with pytest.raises(ValueError, match=r"^d_ff: .* cannot match the all-KDA model's parameters within 0%"):
        hybrid.validate(QUICK)


def test_accountant_cache_numbers_by_hand():
    s = MICRO  # d 16, heads of 8 (2 heads), MLA latent kv_lora max(16, d/2) = 16 + rope max(2, hd/2) = 4
    H, D, conv = 2, 8, 3  # kernel 4 keeps 3 tokens of q, k, v (3 H D channels) per conv layer
    tail = 3 * H * D * conv * 2  # bytes of one layer's conv tail (2 B per number)
    kda = accountant(s, "KKKK")
    assert kda["cache_bytes_per_token"] == 0 and kda["fixed_bytes"] == 4 * (H * D * D * 4 + tail)
    mla = accountant(s, "KKKM")
    assert mla["cache_bytes_per_token"] == 1 * (16 + 4) * 2
    attn = accountant(s, "KAKA")
    assert attn["cache_bytes_per_token"] == 2 * (2 * H * D) * 2  # two layers of K and V
    assert attn["decode_bytes"]["1024"] == attn["fixed_bytes"] + 1024 * attn["cache_bytes_per_token"]


def test_ordering_ranks_our_scores_beside_the_published_ones():
    sweep = replace(MICRO, ratios=("3:1", "1:1", "0:1"), placement_ratios=(), kinds=("mla",))
    loss = {"3:1": 2.0, "1:1": 1.5, "0:1": 3.0}  # ours: 1:1 best, then 3:1, then 0:1
    acc = {"3:1": 0.5, "1:1": 0.9, "0:1": 0.7}
    rows = [{"variant": v.name, "task": t, "seed": 0, "val_loss": loss[v.ratio], "accuracy": acc[v.ratio]}
            for v in variants(sweep) for t in ("mqar", "text")]
    text = ordering(sweep, rows)
    assert f"| 3:1 | {PUBLISHED['3:1']:.2f} (1) | 2.000 (2) | 0.500 (3) |" in text
    assert f"| 1:1 | {PUBLISHED['1:1']:.2f} (2) | 1.500 (1) | 0.900 (1) |" in text
    assert f"| 0:1 | {PUBLISHED['0:1']:.2f} (3) | 3.000 (3) | 0.700 (2) |" in text
    assert "- val loss: one seed a cell, so no range says whether neighbouring ranks differ." in text
    # two seeds: 1:1 (1.4–1.6) and 3:1 (1.55–2.45) overlap, 3:1 and 0:1 (2.9–3.1) do not; MQAR's ranges are all apart
    two = [{**r, "seed": s, "val_loss": r["val_loss"] + d * (0.45 if r["variant"].endswith("3to1_spread") else 0.1),
            "accuracy": r["accuracy"] + d * 0.01} for r in rows for s, d in ((0, -1), (1, 1))]
    text = ordering(replace(sweep, seeds=2), two)
    assert "| 1:1 | 5.66 (2) | 1.500 (1) | 0.900 (1) |" in text
    assert ("- val loss: the ranges over 2 seeds overlap for 1:1 and 3:1 (their order is not separated by the seeds). "
            "Seed by seed (the same batches at a seed): 1:1 ahead of 3:1 at 2 of 2 (mean difference -0.5000).") in text
    assert "- MQAR acc: every two neighbouring ranks' ranges over 2 seeds are apart." in text


def test_text_losses_are_compared_seed_by_seed():
    """A seed gives every model the same batches, so the table pairs each model's text loss with KDA only's at the same
    seed, and the ordering pairs neighbouring ratios whose ranges overlap: a model ahead at every seed shows it even
    when its range overlaps."""
    sweep = replace(MICRO, ratios=("1:0", "3:1", "1:1"), placement_ratios=(), kinds=("mla",), tasks=("text",), seeds=3)
    seed_loss = {0: 1.50, 1: 1.60, 2: 1.40}  # the seeds' own spread, shared by every model
    gap = {"1:0": [0.0, 0.0, 0.0], "3:1": [-0.02, -0.01, -0.03], "1:1": [0.01, -0.005, 0.04]}
    rows = [{"variant": v.name, "task": "text", "seed": s, "val_loss": seed_loss[s] + gap[v.ratio][s]}
            for v in variants(sweep) for s in range(3)]
    table = hybrid.report(sweep, [{**r, "d_ff": 1, "params": 1, "params_gap": 0.0, "cache_bytes_per_token": 0,
                                   "decode_bytes": {str(c): 1 for c in sweep.contexts}} for r in rows])
    assert "Δ val loss vs KDA only" in table.splitlines()[2]
    line = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]] for r in table.splitlines() if r.startswith("| ")}
    col = line["model"].index("Δ val loss vs KDA only")
    assert line["KDA only 1:0"][col] == "" and line["mla 3:1 spread"][col] == "-0.0200 (3 of 3 lower)"
    assert line["mla 1:1 spread"][col] == "+0.0150 (1 of 3 lower)"
    # 3:1 (1.37–1.59) and 1:1 (1.44–1.60) overlap; seed by seed 3:1 is ahead at all three
    assert ("the ranges over 3 seeds overlap for 3:1 and 1:1 (their order is not separated by the seeds). Seed by "
            "seed (the same batches at a seed): 3:1 ahead of 1:1 at 3 of 3 (mean difference -0.0350).") in table


@pytest.fixture
def single_thread_runs(one_thread, monkeypatch):
    """run_jobs gives each run cpu_count // workers threads: one here (tiny shapes; a busy machine's spinning
    threads made a micro run 10× slower); one_thread restores the thread count afterwards."""
    monkeypatch.setattr("evict.lab.sweep.os.cpu_count", lambda: 1)


def test_sweep_runs_resumes_and_writes_outputs(tmp_path, single_thread_runs):
    (tmp_path / "c.txt").write_text(CORPUS)
    sweep = replace(MICRO, corpus=str(tmp_path / "c.txt"))
    root = run_sweep(sweep, out=tmp_path / "sweep")
    for name in ("config.json", "results.jsonl", "table.md", "hybrid.png"):
        assert (root / name).stat().st_size > 0, name
    rows = [json.loads(line) for line in (root / "results.jsonl").read_text().splitlines()]
    vs = variants(sweep)
    assert len(vs) == 1 + 2 * 3  # 1:0; per kind 3:1 spread (= late) and early, 0:1
    assert {(r["variant"], r["task"]) for r in rows} == {(v.name, t) for v in vs for t in ("mqar", "text")}
    for r in rows:
        assert r["steps"] == 2 and abs(r["params_gap"]) <= PARAM_TOLERANCE
        assert (0 <= r["accuracy"] <= 1) if r["task"] == "mqar" else r["val_loss"] > 0
        # the learning curve: every evaluation (eval_every = steps here: one), ending at the row's final score
        assert [step for step, _ in r["curve"]] == [2]
        final = r["final_accuracy"] if r["task"] == "mqar" else r["val_loss"]
        assert r["curve"][-1][1] == pytest.approx(final, abs=5e-5)
        if r["task"] == "mqar":
            assert max(v for _, v in r["curve"]) == pytest.approx(r["accuracy"], abs=5e-5)
        assert (root / "runs" / f"{r['variant']}_{r['task']}_s0" / "result.json").exists()
    table = (root / "table.md").read_text()
    assert "| mla 3:1 spread = late | KKKM |" in table and "| attention 3:1 early | AKKK |" in table
    assert "published ppl (rank)" in table and "5.65 (1)" in table
    _stopped_sweep_shows_the_cells_known(sweep, root, table)
    stamps = {p: p.stat().st_mtime_ns for p in (root / "runs").glob("*/result.json")}
    run_sweep(sweep, out=root)  # resuming a finished sweep trains nothing
    assert stamps == {p: p.stat().st_mtime_ns for p in (root / "runs").glob("*/result.json")}
    with pytest.raises(ValueError, match=r"^out: .* holds a sweep with another config"):
        run_sweep(replace(sweep, steps=3), out=root)
    # more text seeds over the same folder (a warm machine's resume, session 27): accepted, the 7 new text runs are
    # left (out of time before any starts), the 14 finished ones kept
    run_sweep(replace(sweep, text_seeds=2), out=root, minutes=1e-9)
    assert (root / "partial_table.md").read_text().startswith("Partial: 14 of 21 runs finished;")
    assert not any((root / name).exists() for name in ("table.md", "results.jsonl", "hybrid.png"))  # the old sweep's
    assert stamps == {p: p.stat().st_mtime_ns for p in (root / "runs").glob("*/result.json")}


def _stopped_sweep_shows_the_cells_known(sweep, root, table: str) -> None:
    """A piece that stops with runs left (out of time before any starts, over a folder holding 3 of the finished
    sweep's 14 runs) writes partial_table.md: a model whose runs are in has its row as in the whole table, one with
    only its MQAR run has — for val loss, one with none — everywhere but its name and pattern, and the ranking waits;
    no table, rows or plot. Once every run is in, the finished sweep's table, and no partial one."""
    run = functools.partial(run_sweep, sweep)
    first, second, third = (v.name for v in variants(sweep)[:3])
    kept = [f"{first}_mqar_s0", f"{first}_text_s0", f"{second}_mqar_s0"]
    part, partial = stopped_piece(root, run, kept, total=14, png="hybrid.png")
    # of the MLA ratios' 4 cells (3:1 and 0:1, MQAR and text) only 3:1's MQAR is in
    assert "Ordering beside Kimi Linear's Table 1: once every MLA ratio's runs are in (1 of 4 cells so far)." in partial
    rows = {text: {line.split(" | ")[0]: line.split(" | ") for line in text.splitlines() if line.startswith("| ")}
            for text in (table, partial)}
    label = {v.name: f"| {v.label}" for v in variants(sweep)}
    head = rows[table]["| model"]
    assert rows[partial][label[first]] == rows[table][label[first]]
    got, want = rows[partial][label[second]], rows[table][label[second]]
    assert got[head.index("val loss")] == "—" and got[head.index("MQAR acc")] == want[head.index("MQAR acc")]
    assert {c for c in rows[partial][label[third]][2:-1] if c} == {"—"}  # the published ppl column may be blank
    finished_piece(root, part, run, table)


def test_cli_runs_a_micro_sweep(tmp_path, monkeypatch, single_thread_runs):
    (tmp_path / "c.txt").write_text(CORPUS)
    monkeypatch.setattr("evict.lab.hybrid.QUICK", MICRO)  # the flags on top of a micro sweep, not the 5-minute one
    trained, train = [], hybrid.train
    monkeypatch.setattr("evict.lab.hybrid.train",
                        lambda model, task, tc: trained.append((tc.batch_size, model.cfg.gate_dt_min, model.cfg.gate_dt_max))
                        or train(model, task, tc))
    argv = ["lab", "hybrid", "--ratios", "3:1", "0:1", "--kinds", "attention", "--tasks", "text", "--corpus",
            str(tmp_path / "c.txt"), "--steps", "1", "--batch-size", "3", "--gate-dt", "1e-4", "1e-3",
            "--out", str(tmp_path / "y")]
    assert main(argv) == 0
    rows = [json.loads(line) for line in (tmp_path / "y" / "results.jsonl").read_text().splitlines()]
    assert sorted(r["pattern"] for r in rows) == ["AAAA", "AKKK", "KKKA"]  # 3:1 keeps the micro sweep's placements
    config = json.loads((tmp_path / "y" / "config.json").read_text())
    assert config["batch_size"] == 3 and config["gate_dt"] == [1e-4, 1e-3]  # MICRO's: 4 and the default gates
    assert config["compile"] is False  # QUICK's; --full's is True, --no-compile turns it off (next test)
    assert trained == [(3, 1e-4, 1e-3)] * 3  # what each run trained with, not only the config
    assert "KDA gates at init dt 0.0001..0.001" in (tmp_path / "y" / "table.md").read_text()


def test_no_compile_reaches_the_full_sweep(monkeypatch):
    """--full compiles the blocks on CUDA (hybrid.FULL.compile); --no-compile lays compile=False over it."""
    seen = []
    monkeypatch.setattr("evict.lab.hybrid.run_sweep", lambda sweep, out=None, minutes=None: seen.append(sweep))
    assert main(["lab", "hybrid", "--full", "--no-compile"]) == 0 and main(["lab", "hybrid", "--full"]) == 0
    assert [s.compile for s in seen] == [False, True] and seen[1] == FULL


def test_mqar_runs_take_their_own_schedule_and_steps_sets_both(tmp_path, monkeypatch, single_thread_runs):
    (tmp_path / "c.txt").write_text(CORPUS)
    monkeypatch.setattr("evict.lab.hybrid.QUICK", MICRO)
    trained, train = [], hybrid.train
    monkeypatch.setattr("evict.lab.hybrid.train", lambda model, task, tc: trained.append((type(task).__name__, tc.steps))
                        or train(model, task, tc))
    base = ["lab", "hybrid", "--ratios", "0:1", "--kinds", "attention", "--corpus", str(tmp_path / "c.txt")]
    assert main([*base, "--steps", "2", "--mqar-steps", "3", "--out", str(tmp_path / "a")]) == 0
    assert sorted(trained) == [("MQARTask", 3), ("TextTask", 2)]
    rows = {json.loads(line)["task"]: json.loads(line) for line in (tmp_path / "a" / "results.jsonl").read_text().splitlines()}
    assert rows["text"]["steps"] == 2 and rows["mqar"]["steps"] <= 3  # MQAR may stop early at 0.99
    assert json.loads((tmp_path / "a" / "config.json").read_text())["mqar_steps"] == 3
    assert "3 steps for MQAR (it stops at 0.99), 2 for text" in (tmp_path / "a" / "table.md").read_text()
    trained.clear()
    assert main([*base, "--steps", "1", "--out", str(tmp_path / "b")]) == 0  # --steps alone: both schedules
    assert sorted(trained) == [("MQARTask", 1), ("TextTask", 1)]
    assert hybrid.task_steps(FULL, "mqar") == 8000 and hybrid.task_steps(FULL, "text") == FULL.steps == 2000
    assert hybrid.task_steps(QUICK, "mqar") == QUICK.steps  # QUICK has no MQAR schedule of its own
    with pytest.raises(ValueError, match=r"^mqar_steps: expected a positive integer or None, got 0$"):
        hybrid.validate(replace(MICRO, mqar_steps=0))


def test_text_runs_take_more_seeds_and_cells_wait_for_every_one(tmp_path, monkeypatch, single_thread_runs):
    """`text_seeds` (--text-seeds; --full: 3): the text runs' seeds when more than `seeds`; the MQAR runs keep
    `seeds`. Each text cell is the mean and range of its seeds, and waits (—) until every one is in."""
    (tmp_path / "c.txt").write_text(CORPUS)
    sweep = replace(MICRO, ratios=("1:0", "0:1"), placement_ratios=(), kinds=("attention",), corpus=str(tmp_path / "c.txt"),
                    text_seeds=2)
    jobs = hybrid.jobs_for(sweep, tmp_path)
    assert [(j["variant"]["ratio"], j["task"], j["seed"]) for j in jobs] == [  # seed-major: every first seed first
        ("1:0", "mqar", 0), ("1:0", "text", 0), ("0:1", "mqar", 0), ("0:1", "text", 0), ("1:0", "text", 1), ("0:1", "text", 1)]
    assert hybrid.task_seeds(replace(sweep, seeds=3), "text") == [0, 1, 2]  # never fewer than `seeds`
    assert hybrid.task_seeds(FULL, "text") == [0, 1, 2] and hybrid.task_seeds(FULL, "mqar") == [0]
    root = run_sweep(sweep, out=tmp_path / "s")
    rows = [json.loads(line) for line in (root / "results.jsonl").read_text().splitlines()]
    assert sorted((r["task"], r["seed"]) for r in rows) == [("mqar", 0)] * 2 + [("text", 0)] * 2 + [("text", 1)] * 2
    table = (root / "table.md").read_text()
    assert "MQAR seed 0, text seeds 0, 1 (mean, min–max)" in table
    kda = [r for r in rows if r["variant"] == "kda_1to0"]
    losses = sorted(r["val_loss"] for r in kda if r["task"] == "text")
    acc = next(r["accuracy"] for r in kda if r["task"] == "mqar")
    line = next(x for x in table.splitlines() if x.startswith("| KDA only"))
    assert f"| {acc:.3f} |" in line and f"| {sum(losses) / 2:.3f} ({losses[0]:.3f}–{losses[1]:.3f}) |" in line
    # a partial sweep whose text runs of seed 1 are not in: the text cells wait, the MQAR cells show
    partial = hybrid.report(sweep, [r for r in rows if r["seed"] == 0])
    line = next(x for x in partial.splitlines() if x.startswith("| KDA only"))
    assert f"| {acc:.3f} | — |" in line
    with pytest.raises(ValueError, match=r"^text_seeds: expected a positive integer or None, got 0$"):
        hybrid.validate(replace(MICRO, text_seeds=0))


def test_text_seeds_flag_reaches_the_sweep(monkeypatch):
    seen = []
    monkeypatch.setattr("evict.lab.hybrid.run_sweep", lambda sweep, out=None, minutes=None: seen.append(sweep))
    assert main(["lab", "hybrid", "--full", "--text-seeds", "5"]) == 0 and main(["lab", "hybrid"]) == 0
    assert [s.text_seeds for s in seen] == [5, None] and FULL.text_seeds == 3


BAD = [
    ["--mqar-steps", "0"], ["--mqar-steps", "x"], ["--text-seeds", "0"],
    ["--ratios", "2:2"], ["--ratios", "x"], ["--ratios", "5:1"], ["--ratios", "3:1", "3:1"], ["--kinds", "rnn"],
    ["--tasks", "wiki"], ["--placement-ratios", "1:0"], ["--placement-ratios", "7:1", "--ratios", "3:1"],
    ["--layers", "0"], ["--layers", "6"], ["--d-model", "24"], ["--setting", "10", "8"], ["--steps", "0"],
    ["--corpus", "/no/such.txt"], ["--out", "{file}"], ["--quick", "--full"], ["--workers", "-1"],
    ["--batch-size", "0"], ["--batch-size", "two"], ["--gate-dt", "1e-2", "1e-3"], ["--gate-dt", "0", "1e-3"],
]


@pytest.mark.parametrize("flags", BAD, ids=[" ".join(b) for b in BAD])
def test_bad_flags_one_line_exit_2_nothing_written(flags, tmp_path, monkeypatch, capsys):
    (tmp_path / "a_file").write_text("x")
    argv = ["lab", "hybrid", *[str(tmp_path / "a_file") if f == "{file}" else f for f in flags]]
    if "--out" not in flags:
        argv += ["--out", str(tmp_path / "new")]
    code, err = _cli(argv, tmp_path, monkeypatch, capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("evict") and "error:" in err[0], err
    assert not (tmp_path / "new").exists()
