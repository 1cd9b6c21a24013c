"""The capacity task and lab: the generator's pairs, a hand-computed memory, and the sweep end to end (micro)."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from evict.cli import main
from evict.lab.capacity import (LAW, QUICK, CapacityModel, breaks, floor, jobs_for, law, regression_loss, report,
                                 run_sweep, sizes_at, write_then_read)
from evict.tasks.capacity import make_batch

MICRO = replace(QUICK, sizes=(4, 6), steps=3, batch_size=4, eval_batches=1, d_keys=(8,), workers=1)


@pytest.mark.parametrize("overwrite", [False, True])
def test_batches_are_deterministic_and_hold_the_latest_value(overwrite):
    S, B = 13, 7
    b = make_batch(S, B, overwrite=overwrite, seed=3, step=5)
    again = make_batch(S, B, overwrite=overwrite, seed=3, step=5)
    other = make_batch(S, B, overwrite=overwrite, seed=3, step=6)
    assert all(torch.equal(x, y) for x, y in zip(vars(b).values(), vars(again).values()))
    assert not torch.equal(b.write_keys, other.write_keys)
    assert b.write_keys.shape == b.write_values.shape == (B, 2 * S if overwrite else S)
    for row in range(B):
        keys, values = b.write_keys[row].tolist(), b.write_values[row].tolist()
        assert sorted(b.query_keys[row].tolist()) == list(range(S))  # every key queried once
        assert sorted(keys) == sorted(list(range(S)) * (2 if overwrite else 1))  # unique, or each key exactly twice
        latest = {}
        for key, value in zip(keys, values):  # the slow reading: the last write of a key wins
            if overwrite and key in latest:
                assert value != latest[key]  # an overwrite changes the value
            latest[key] = value
        assert b.targets[row].tolist() == [latest[q] for q in b.query_keys[row].tolist()]
        if not overwrite:
            assert sorted(values) == list(range(S))  # S distinct values


@pytest.mark.parametrize("S", [2, 13, 300])
def test_overwrite_batches_equal_the_one_hot_count_of_writes(S):
    """The second write of a key found from the positions of the two copies equals the first form (a running
    one-hot count of each key's writes, 118 ms a batch at S 300 on one core): same rows, so the committed runs of
    `evict lab capacity --full` stay reproducible."""
    import evict.tasks.capacity as task

    b = make_batch(S, 5, overwrite=True, seed=1, step=2)
    g = task._generator(1, 2)
    first = task._perms(5, S, g)
    second = (first + torch.randint(1, S, (5, S), generator=g)) % S
    keys = task._perms(5, 2 * S, g) % S
    seen = F.one_hot(keys, S).cumsum(dim=1)
    later = seen.gather(2, keys[..., None])[..., 0] == 2
    assert torch.equal(b.write_keys, keys)
    assert torch.equal(b.write_values, torch.where(later, second.gather(1, keys), first.gather(1, keys)))


def _one_hot_memory(keys, values, queries, d, V):
    """q, k, v for write_then_read with keys and queries as one-hot vectors in R^d (orthogonal by construction)."""
    k = F.one_hot(torch.tensor([keys + queries]), d).double()  # [1, T, d]
    v = F.one_hot(torch.tensor([values + [0] * len(queries)]), V).double()  # [1, T, V]
    return k, k, v


def test_orthogonal_keys_by_hand():
    # three orthogonal keys, unique writes: both rules read every value back exactly (β = 1, nothing learnt)
    keys, values, queries = [0, 2, 1], [1, 0, 2], [2, 0, 1]
    q, k, v = _one_hot_memory(keys, values, queries, d=4, V=3)
    for delta in (False, True):
        o = write_then_read(q, k, v, torch.ones(1, 3, dtype=torch.float64), delta=delta, n_queries=3)
        assert torch.equal(o[0], F.one_hot(torch.tensor([0, 1, 2]), 3).double())  # values of keys 2, 0, 1
        assert regression_loss(o, torch.tensor([[0, 1, 2]])).item() == 0
    # key 0 written twice (value 1, then 2): delta with β = 1 returns the later value exactly; additive reads the sum,
    # v1 + v2, whose loss is ½‖v1‖² = 0.5; scaled by the best constant ½ it would be ½(¼ + ¼) = 0.25 (its floor)
    q, k, v = _one_hot_memory([0, 1, 0], [1, 0, 2], [0, 1], d=4, V=3)
    target = torch.tensor([[2, 0]])
    delta = write_then_read(q, k, v, torch.ones(1, 3, dtype=torch.float64), delta=True, n_queries=2)
    assert torch.equal(delta[0], torch.tensor([[0.0, 0, 1], [1, 0, 0]], dtype=torch.float64))
    assert regression_loss(delta, target).item() == 0
    add = write_then_read(q, k, v, torch.ones(1, 3, dtype=torch.float64), delta=False, n_queries=2)
    assert torch.equal(add[0], torch.tensor([[0.0, 1, 1], [1, 0, 0]], dtype=torch.float64))
    assert regression_loss(add, target).item() == 0.25  # (½ · 1 for the first query + 0) / 2 queries
    half = write_then_read(q, k, v, torch.full((1, 3), 0.5, dtype=torch.float64), delta=False, n_queries=2)
    assert regression_loss(half[:, :1], target[:, :1]).item() == 0.25


def test_model_shapes_and_zero_output_loss():
    b = make_batch(6, 3, overwrite=True, seed=0, step=0)
    for rule in ("additive", "delta"):
        pred = CapacityModel(6, rule, d_key=8)(b)
        assert pred.shape == (3, 6, 6) and torch.isfinite(pred).all()
    assert regression_loss(torch.zeros(3, 6, 6), b.targets).item() == 0.5


def test_sweep_runs_resumes_and_writes_outputs(tmp_path):
    root = run_sweep(MICRO, out=tmp_path / "sweep")
    for name in ("config.json", "results.jsonl", "table.md", "capacity.png"):
        assert (root / name).stat().st_size > 0, name
    rows = [json.loads(line) for line in (root / "results.jsonl").read_text().splitlines()]
    assert {(r["rule"], r["overwrite"], r["S"]) for r in rows} == {
        (r, ow, S) for r in MICRO.rules for ow in MICRO.overwrite for S in MICRO.sizes}
    assert all(r["steps"] == 3 and 0 <= r["loss"] < 100 for r in rows)
    table = (root / "table.md").read_text()
    assert "| S | floor | additive | delta | additive + overwrites | delta + overwrites |" in table
    stamps = {p: p.stat().st_mtime_ns for p in (root / "runs").glob("*/result.json")}
    run_sweep(MICRO, out=root)  # resuming a finished sweep trains nothing
    assert stamps == {p: p.stat().st_mtime_ns for p in (root / "runs").glob("*/result.json")}
    with pytest.raises(ValueError, match=r"^out: .* holds a sweep with another config"):
        run_sweep(replace(MICRO, steps=4), out=root)
    assert len(jobs_for(replace(MICRO, seeds=2), tmp_path)) == 2 * 2 * 2 * 2


@pytest.mark.parametrize("rule, overwrite", [("delta", True), ("additive", False)])
def test_a_run_stopped_by_its_piece_resumes_to_the_same_result(rule, overwrite, tmp_path, monkeypatch):
    """Session 15: a --full run (10,000 steps) outlasts its piece; it used to train on past the piece's end (and be
    killed with the machine). Now it saves checkpoint.pt and returns None, and the next piece finishes it to the
    uninterrupted run's numbers, bit for bit on the CPU."""
    import evict.lab.capacity as cap

    sweep = replace(MICRO, rules=(rule,), sizes=(6,), overwrite=(overwrite,), steps=20)
    whole, = jobs_for(sweep, tmp_path / "whole")
    split, = jobs_for(sweep, tmp_path / "split")
    expected = cap.run_one(whole)
    calls = []

    def piece_over_at_step_7(job):  # calls: the start check, then one before each step after the first
        calls.append(1)
        return len(calls) > 7

    monkeypatch.setattr(cap, "out_of_time", piece_over_at_step_7)
    assert cap.run_one(split) is None
    ckpt = Path(split["dir"]) / "checkpoint.pt"
    saved = torch.load(ckpt, weights_only=True)
    assert saved["step"] == 7
    torch.save({**saved, "seconds": 100.0}, ckpt)  # as if the first piece had trained for 100 s
    monkeypatch.setattr(cap, "out_of_time", lambda job: False)
    made = []
    monkeypatch.setattr(cap, "make_batch", lambda *a, **kw: made.append(kw["step"]) or make_batch(*a, **kw))
    got = cap.run_one(split)
    assert made[:13] == list(range(7, 20)) and len(made) == 13 + sweep.eval_batches  # steps 7… only, then the eval
    assert not ckpt.exists()  # finished: the result replaces it
    assert got["loss"] == expected["loss"] and got["train_curve"] == expected["train_curve"]
    assert got["steps"] == 20 and 100 <= got["seconds"] < 160  # both pieces' seconds


def test_published_numbers_appear_beside_ours(tmp_path):
    pub = replace(MICRO, sizes=(20,), rules=("additive",), overwrite=(True,), batch_size=2, d_keys=(64,))
    assert "[published 0.105]" in (run_sweep(pub, out=tmp_path / "a") / "table.md").read_text()
    # published at d_key 64 only: another key dim's cell at the same S gets no bracket
    assert "published" not in (run_sweep(replace(pub, d_keys=(8,)), out=tmp_path / "b") / "table.md").read_text()


def test_cli_runs_with_flags(tmp_path, monkeypatch):
    monkeypatch.setattr("evict.lab.capacity.QUICK", MICRO)  # the flags on top of a micro sweep, not the quick one
    assert main(["lab", "capacity", "--rules", "delta", "--sizes", "3", "--overwrite", "yes", "--steps", "2",
                 "--workers", "1", "--out", str(tmp_path / "y")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "y" / "results.jsonl").read_text().splitlines()]
    assert [(r["rule"], r["overwrite"], r["S"], r["steps"]) for r in rows] == [("delta", True, 3, 2)]


def test_the_first_seed_is_a_flag_of_every_lab(tmp_path, monkeypatch):
    """`--seed S --seeds N` (add_sweep_flags, every lab): the runs use seeds S … S+N-1, the header names them."""
    monkeypatch.setattr("evict.lab.capacity.QUICK", MICRO)
    assert main(["lab", "capacity", "--rules", "delta", "--sizes", "3", "--overwrite", "no", "--steps", "1",
                 "--seed", "5", "--seeds", "2", "--workers", "1", "--out", str(tmp_path / "y")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "y" / "results.jsonl").read_text().splitlines()]
    assert sorted(r["seed"] for r in rows) == [5, 6] and json.loads((tmp_path / "y" / "config.json").read_text())["seed"] == 5
    assert "seeds 5, 6" in (tmp_path / "y" / "table.md").read_text()


def _rows(losses: dict) -> list[dict]:
    """Hand-made results: (rule, d, S) -> loss, unique keys, one seed."""
    return [{"rule": r, "overwrite": False, "d_key": d, "S": S, "seed": 0, "loss": x} for (r, d, S), x in losses.items()]


def test_breaks_and_the_law_from_hand_made_losses():
    sweep = replace(LAW, d_keys=(16, 32, 64), rules=("additive", "delta"))
    assert sizes_at(sweep, 16) == [8, 12, 14, 16, 18, 20, 24] and sizes_at(sweep, 64)[0] == 32
    losses = {}
    for d in sweep.d_keys:
        for S in sizes_at(sweep, d):
            losses[("additive", d, S)] = 0.01 if S <= d else 0.2  # breaks just past S = d at every d
            losses[("delta", d, S)] = 0.2 if S > d // 2 or d == 16 else 0.0  # d/2 at 32 and 64, nothing at 16
    bs = breaks(sweep, _rows(losses))
    assert [bs[("additive", False, d)] for d in (16, 32, 64)] == [(16, False), (32, False), (64, False)]
    assert [bs[("delta", False, d)] for d in (16, 32, 64)] == [(0, False), (16, False), (32, False)]
    fits = law(sweep, _rows(losses))
    assert fits[("additive", False)]["c"] == pytest.approx(1.0) and fits[("additive", False)]["p"] == pytest.approx(1.0)
    assert fits[("delta", False)]["points"] == 2  # S* = 0 at d 16 has no logarithm: fitted over 32 and 64
    losses[("additive", 64, 96)] = 0.0  # a loss back under the threshold past the break does not move S*
    assert breaks(sweep, _rows(losses))[("additive", False, 64)] == (64, False)
    never = {k: 0.0 for k in losses}  # nothing broke: S* is the ladder's top, marked, and not fitted
    assert breaks(sweep, _rows(never))[("additive", False, 32)] == (48, True)
    assert law(sweep, _rows(never))[("additive", False)] is None
    table = report(sweep, _rows(losses))
    assert "| d_key | S | S / d | floor | additive | delta |" in table and "| 64 | 80 | 1.25 | 0.100 |" in table
    assert "S* ≈ 1.00·d, p = 1.00 (3 dims)" in table


def test_law_sweep_runs_end_to_end(tmp_path):
    micro = replace(LAW, d_keys=(4, 8), per_d=(0.5, 1.0), steps=2, batch_size=2, eval_batches=1, workers=1)
    root = run_sweep(micro, out=tmp_path / "law")
    rows = [json.loads(line) for line in (root / "results.jsonl").read_text().splitlines()]
    assert {(r["rule"], r["d_key"], r["S"]) for r in rows} == {(r, d, S) for r in micro.rules for d, S in
                                                                [(4, 2), (4, 4), (8, 4), (8, 8)]}
    assert "The break S*" in (root / "table.md").read_text() and (root / "capacity.png").stat().st_size > 0


@pytest.mark.parametrize("change, message", [
    ({"per_d": (0.5,)}, r"^sizes / per_d: expected exactly one"),
    ({"sizes": (), "per_d": (0.5, -1.0)}, r"^per_d: expected distinct fractions"),
    ({"sizes": (), "per_d": (0.5, 0.51)}, r"^per_d: .* rounds two fractions to one S at d_key 8"),
    ({"d_keys": (8, 8)}, r"^d_keys: expected distinct key dims"),
    ({"threshold": 0.5}, r"^threshold: expected a loss in \(0, 0.5\)"),
])
def test_bad_law_settings_get_one_line(tmp_path, change, message):
    with pytest.raises(ValueError, match=message):
        run_sweep(replace(MICRO, **change), out=tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_cli_law_mode_with_flags(tmp_path, monkeypatch):
    monkeypatch.setattr("evict.lab.capacity.LAW", replace(LAW, d_keys=(4,), per_d=(1.0,), batch_size=2, eval_batches=1))
    assert main(["lab", "capacity", "--law", "--rules", "additive", "--d-keys", "4", "6", "--steps", "1",
                 "--workers", "1", "--out", str(tmp_path / "l")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "l" / "results.jsonl").read_text().splitlines()]
    assert sorted((r["d_key"], r["S"], r["overwrite"]) for r in rows) == [(4, 4, False), (6, 6, False)]
    monkeypatch.setattr("evict.lab.capacity.QUICK", MICRO)
    assert main(["lab", "capacity", "--rules", "delta", "--per-d", "0.5", "--d-keys", "4", "--overwrite", "no",
                 "--steps", "1", "--workers", "1", "--out", str(tmp_path / "p")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "p" / "results.jsonl").read_text().splitlines()]
    assert [(r["d_key"], r["S"]) for r in rows] == [(4, 2)]


def test_no_memory_beats_the_rank_floor():
    # the floor ½(1 − d/S): the best rank-d read-out of S one-hot targets (SVD of the identity's projection) meets it,
    # and a memory with orthogonal one-hot keys for the first d of S keys (the rest read nothing) meets it too
    S, d = 10, 4
    assert floor(S, d) == pytest.approx(0.3) and floor(d, d) == 0 == floor(3, d)
    keys = list(range(S))
    q, k, v = _one_hot_memory(keys, keys, keys, d=S, V=S)  # one-hot in R^S: keys ≥ d are cut to zero below
    q, k = q.clone(), k.clone()
    q[..., d:], k[..., d:] = 0, 0
    o = write_then_read(q, k, v, torch.ones(1, S, dtype=torch.float64), delta=True, n_queries=S)
    assert regression_loss(o, torch.tensor([keys])).item() == pytest.approx(floor(S, d))
    torch.manual_seed(0)  # random d-dim keys and the least-squares state: never below the floor
    Q = torch.randn(S, d, dtype=torch.float64)
    M = torch.linalg.lstsq(Q, torch.eye(S, dtype=torch.float64)).solution  # [d, S]
    assert regression_loss((Q @ M)[None], torch.tensor([keys])).item() >= floor(S, d) - 1e-12
