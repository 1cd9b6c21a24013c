"""Heads against head dim at fixed total state: the multi-head write/read against one head at a time, the rank
floor met by a hand-built split memory, and the sweep end to end (micro)."""

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from evict.cli import main
from evict.lab import capacity
from evict.lab.capacity import check_layouts, parse_layout, regression_loss, write_then_read
from evict.lab.capacity_heads import HEADS, HEADS_FULL, HeadsCapacityModel, embed_width, heads_floor, run_sweep
from evict.tasks.capacity import make_batch

MICRO = replace(HEADS, sizes=(4, 8), layouts=("1x8", "4x4"), steps=2, batch_size=2, eval_batches=1, workers=1)


@pytest.mark.parametrize("delta", [False, True])
def test_heads_are_independent_memories(delta):
    # H heads in one call read what H one-head calls read, head by head (float64, odd sizes, fresh random inputs)
    g = torch.Generator().manual_seed(5)
    B, W, n, H, K, V = 2, 7, 5, 3, 4, 6
    q, k = (F.normalize(torch.randn(B, W + n, H, K, generator=g, dtype=torch.float64), dim=-1) for _ in range(2))
    v = torch.randn(B, W + n, H, V, generator=g, dtype=torch.float64)
    beta = torch.rand(B, W, H, generator=g, dtype=torch.float64)
    both = write_then_read(q, k, v, beta, delta=delta, n_queries=n)  # [B, n, H, V]
    assert both.shape == (B, n, H, V)
    for h in range(H):
        one = write_then_read(q[:, :, h], k[:, :, h], v[:, :, h], beta[:, :, h], delta=delta, n_queries=n)
        torch.testing.assert_close(both[:, :, h], one, rtol=1e-10, atol=1e-10)


def test_a_split_memory_meets_its_rank_floor_where_one_head_cannot():
    # S = 8 keys in 16 numbers of state: 4 heads of 2 (H·D = 8) hold all 8 exactly — key i lives in head i // 2 as the
    # one-hot e_(i mod 2), with its value read back at output i — while one head of 4 (16 numbers) is held to its
    # floor ½(1 − 4/8) = 0.25 whatever it does
    S, H, D = 8, 4, 2
    keys = list(range(S))
    k = torch.zeros(1, 2 * S, H, D, dtype=torch.float64)
    for t, i in enumerate(keys + keys):  # writes, then queries in the same order
        k[0, t, i // D, i % D] = 1.0
    v = k.clone()  # value of key i: e_(i mod 2) in head i // 2; the queries' values are never written
    o = write_then_read(k, k, v, torch.ones(1, S, H, dtype=torch.float64), delta=True, n_queries=S)  # [1, S, H, D]
    assert regression_loss(o.flatten(-2), torch.tensor([keys])).item() == 0 == heads_floor(S, H, D)
    assert heads_floor(S, 1, 4) == pytest.approx(0.25) and heads_floor(S, 16, 1) == 0


def test_layouts_parse_and_hold_one_total_state():
    assert parse_layout("16x32") == (16, 32) and embed_width(16, 32) == 128 == embed_width(1, 128)
    check_layouts(HEADS.layouts)
    check_layouts(HEADS_FULL.layouts)
    for bad, message in (("4x", "HxD"), ("0x8", "HxD"), ("x8", "HxD"), ("4x1", "HxD"), ("2x٣", "HxD")):
        with pytest.raises(ValueError, match=rf"^layouts: expected {message}"):
            parse_layout(bad)
    with pytest.raises(ValueError, match=r"^layouts: expected one total state .* 4x30: 3600"):
        check_layouts(("1x64", "4x30"))
    with pytest.raises(ValueError, match=r"^layouts: expected layouts of distinct head dims"):
        check_layouts(("4x32", "4x32"))


def test_model_shapes_and_params_per_layout():
    batch = make_batch(6, 3, overwrite=False, seed=0, step=0)
    for h, d in ((1, 8), (4, 4)):
        for rule in ("additive", "delta"):
            model = HeadsCapacityModel(6, rule, h, d)
            assert model(batch).shape == (3, 6, 6)
            assert model.k_proj.out_features == h * d and model.embed.embedding_dim == 8


def test_heads_sweep_runs_end_to_end(tmp_path):
    micro = replace(MICRO, rules=("delta",))
    root = run_sweep(micro, out=tmp_path / "heads")
    rows = [json.loads(line) for line in (root / "results.jsonl").read_text().splitlines()]
    assert sorted((r["d_key"], r["S"]) for r in rows) == [(4, 4), (4, 8), (8, 4), (8, 8)]
    assert {p.name for p in (root / "runs").iterdir()} == {f"delta_unique_h{t}_S{S}_s0" for t in MICRO.layouts for S in (4, 8)}
    table = (root / "table.md").read_text()
    assert "one total state H·D² = 64" in table and "| 4×4² | 16 | 8 | 0.000 |" in table and "| 1×8² | 8 | 8 | 0.000 |" in table
    assert "The break S*" in table and (root / "capacity.png").stat().st_size > 0


@pytest.mark.parametrize("change, message", [
    ({"layouts": ("1x8", "2x8")}, r"^layouts: expected layouts of distinct head dims"),
    ({"d_keys": (16,)}, r"^d_keys: the heads sweep takes its head dims from layouts"),
    ({"sizes": (), "per_d": (0.5,)}, r"^per_d: the heads sweep takes sizes"),
    ({"layouts": ()}, r"^layouts: expected a heads sweep's layouts"),
])
def test_bad_heads_settings_get_one_line(tmp_path, change, message):
    with pytest.raises(ValueError, match=message):
        run_sweep(replace(MICRO, **change), out=tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
    with pytest.raises(ValueError, match=r"^layouts: a heads sweep runs through"):  # not capacity's one-head model
        capacity.run_sweep(MICRO, out=tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_cli_heads_mode_with_flags(tmp_path, monkeypatch):
    monkeypatch.setattr("evict.lab.capacity_heads.HEADS", MICRO)
    assert main(["lab", "capacity", "--heads", "--layouts", "1x4", "4x2", "--sizes", "3", "--rules", "delta",
                 "--steps", "1", "--workers", "1", "--out", str(tmp_path / "h")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "h" / "results.jsonl").read_text().splitlines()]
    assert sorted((r["d_key"], r["S"], r["rule"]) for r in rows) == [(2, 3, "delta"), (4, 3, "delta")]
    with pytest.raises(SystemExit) as e:
        main(["lab", "capacity", "--heads", "--layouts", "1x4", "2x4", "--out", str(tmp_path / "bad")])
    assert e.value.code == 2 and not (tmp_path / "bad").exists()
