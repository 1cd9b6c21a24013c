"""`evict bench grid` on a CPU: a tiny grid gives one well-formed row per cell (the torch path; fla and cuDNN refuse and
say so), reruns resume, cells that cannot fit or run out of memory are recorded, the crossover is right on synthetic
rows, and bad flags are one line. The GPU table itself is docs/benchmarks.md's owed command, never a test."""

import json
import math
import time

import pytest
import torch

from evict.bench import grid as g
from evict.bench.grid_report import best_chunk, crossover_table, crossovers, grid_table, plot_grid
from evict.cli import main
from tests.conftest import cli_error

TINY = dict(lengths=(16, 32), head_dims=(8,), chunks=(8, 16), tokens=64, heads=2,
            kernels=("evict_kda", "evict_gdn", "fla_kda", "sdpa_flash", "sdpa_cudnn", "sdpa_math"))


def once(fn) -> float:
    """One timed call (ms): the grid's own timer repeats, which a test of its plumbing does not need."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def test_a_tiny_grid_gives_one_well_formed_row_per_cell_and_resumes(tmp_path):
    out = tmp_path / "grid.jsonl"
    rows = g.run_grid(out, progress=False, timer=once, **TINY)
    cells = g.cells(**TINY)
    assert len(rows) == len(cells) == len(out.read_text().splitlines())
    assert [g.key(r) for r in rows] == [g.key(c) for c in cells]
    for r in rows:
        assert r["B"] * r["N"] == 64 and r["status"] in ("ok", "unsupported", "skipped", "oom", "error"), r
        if r["kernel"].startswith("evict_"):
            assert r["status"] == "ok" and r["ran"] == "chunked" and r["ms"] > 0 and r["C"] in (8, 16), r
        elif r["kernel"] == "sdpa_flash":
            assert r["status"] == "ok" and "flash" in r["ran"] and r["C"] is None, r
        elif r["kernel"] == "sdpa_math":
            assert r["status"] == "ok" and "flash" not in r["ran"], r
        else:  # fla needs CUDA, cuDNN's attention has no CPU kernel
            assert r["status"] == "unsupported" and r["note"] and "ms" not in r, r
    assert {r["pass"] for r in rows} == {"fwd", "fwd+bwd"}
    again = g.run_grid(out, progress=False, timer=once, **TINY)
    assert len(again) == len(rows) and len(out.read_text().splitlines()) == len(rows)
    more = g.run_grid(out, progress=False, timer=once, **{**TINY, "lengths": (16, 32, 64)})  # only the new N runs
    assert len(more) == len(g.cells(**{**TINY, "lengths": (16, 32, 64)}))
    assert {r["N"] for r in more[len(rows):]} == {64}


def test_cells_that_cannot_fit_are_skipped_and_an_oom_is_recorded(tmp_path, monkeypatch):
    monkeypatch.setattr(g, "free_bytes", lambda device: 1)
    rows = g.run_grid(tmp_path / "a.jsonl", progress=False, **{**TINY, "kernels": ("evict_gdn", "sdpa_flash")})
    assert rows and all(r["status"] == "skipped" and "GiB" in r["note"] for r in rows)

    monkeypatch.setattr(g, "free_bytes", lambda device: 2**40)

    def boom(*a, **k):
        def fn():
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8 GiB")
        return fn, "triton"
    monkeypatch.setattr(g, "_memory_fn", boom)
    rows = g.run_grid(tmp_path / "b.jsonl", progress=False, timer=once, **{**TINY, "kernels": ("evict_gdn", "sdpa_flash")})
    mem = [r for r in rows if r["kernel"] == "evict_gdn"]
    assert mem and all(r["status"] == "oom" and "out of memory" in r["note"] for r in mem)
    assert all(r["status"] == "ok" for r in rows if r["kernel"] == "sdpa_flash")  # the grid went on


def test_the_math_backend_is_skipped_past_its_limit():
    cell = g.cells(lengths=(64,), head_dims=(8,), kernels=("sdpa_math",), tokens=64, heads=1)[0]
    assert g.run_cell(cell, "cpu", max_math_tokens=32)["status"] == "skipped"
    assert g.estimate_bytes({**cell, "N": 65536, "B": 1, "H": 16}) > 16 * 65536**2 * 4  # N x N float32 scores


def _row(kernel, N, ms, C=None, D=128, p="fwd"):
    return {"kernel": kernel, "N": N, "D": D, "C": C, "pass": p, "B": 65536 // N, "H": 16, "dtype": "bfloat16",
            "device": "cuda", "status": "ok", "ms": ms}


def test_crossover_on_synthetic_rows():
    Ns = (1024, 4096, 16384, 65536)
    rows = [_row("sdpa_flash", N, 1e-6 * N * N / 64) for N in Ns]  # attention ~ N^2 / B-constant tokens: ~ N
    rows += [_row("evict_kda", N, 0.5, C=64) for N in Ns] + [_row("evict_kda", N, 0.25, C=32) for N in Ns[2:]]
    rows += [_row("evict_gdn", N, 1e9) for N in Ns]  # never faster
    rows += [_row("sdpa_cudnn", N, 1e-9) for N in Ns]  # never beaten
    rows += [{**_row("evict_kda", 1024, 0.01, C=16), "status": "oom"}]  # not ok: never counted
    best = best_chunk(rows)
    assert best[("evict_kda", 16384, 128, "fwd")] == (0.25, 32) and best[("evict_kda", 1024, 128, "fwd")] == (0.5, 64)
    by = {(c["memory"], c["attention"]): c for c in crossovers(rows)}
    c = by[("evict_kda", "sdpa_flash")]
    # attention ms = N / 64e3 ... 1024 -> 0.016, 4096 -> 0.262, 16384 -> 4.19, 65536 -> 67.1; KDA 0.5, 0.5, 0.25, 0.25
    assert c["crossover_N"] == 16384 and c["Ns"] == list(Ns)
    y0, y1 = math.log(0.262144 / 0.5), math.log(4.194304 / 0.25)  # log(attention / memory) either side
    expected = 4096 * 4 ** (-y0 / (y1 - y0))  # linear in log N between 4096 and 16384
    assert c["estimate_N"] == pytest.approx(expected, rel=1e-3)
    assert by[("evict_gdn", "sdpa_flash")]["crossover_N"] is None
    assert by[("evict_kda", "sdpa_cudnn")]["crossover_N"] is None
    flipped = [_row("sdpa_flash", N, 10.0) for N in Ns] + [_row("evict_kda", N, ms, C=64) for N, ms in zip(Ns, (1, 20, 1, 1))]
    c = crossovers(flipped)[0]  # faster, slower, then faster for good: the crossover is the last switch
    assert c["crossover_N"] == 16384 and c["estimate_N"] is not None
    allwin = crossovers([_row("sdpa_flash", N, 10.0) for N in Ns] + [_row("evict_kda", N, 1.0, C=64) for N in Ns])[0]
    assert allwin["crossover_N"] == 1024 and allwin["estimate_N"] is None
    table = crossover_table(rows)
    assert "16K (~" in table and "not by 64K" in table


def test_the_table_and_plot_render(tmp_path):
    rows = [_row(k, N, ms, C=C, D=D, p=p) for k, C in (("evict_kda", 64), ("sdpa_flash", None)) for N, ms in ((1024, 1.0), (4096, 2.0))
            for D in (64, 128) for p in ("fwd", "fwd+bwd")]
    rows.append({**_row("sdpa_cudnn", 1024, 0), "status": "unsupported", "note": "head dim 256"})
    text = grid_table(rows)
    assert "1.000 (C64)" in text and "sdpa_cudnn: unsupported: head dim 256" in text
    png = plot_grid(rows, tmp_path / "g.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_the_command_writes_rows_table_and_plot(tmp_path, capsys):
    out = tmp_path / "grid.jsonl"
    argv = ["bench", "grid", "--lengths", "16", "32", "--head-dims", "8", "--chunks", "16", "--tokens", "32", "--heads", "1",
            "--kernels", "evict_gdn", "sdpa_flash", "--passes", "fwd", "--out", str(out), "-q"]
    main(argv)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4 and all(r["status"] == "ok" for r in rows)
    assert "Crossover" in out.with_suffix(".md").read_text() and out.with_suffix(".png").exists()
    main(["bench", "grid", "--report", "--out", str(out), "-q"])  # rebuilds without timing
    assert len(out.read_text().splitlines()) == 4


@pytest.mark.parametrize("argv, says", [
    (["--lengths", "64", "--tokens", "100"], "--tokens: expected a multiple of every --lengths value"),
    (["--lengths", "64", "--tokens", "64", "--chunks", "48"], "--chunks: expected powers of two"),
    (["--kernels", "flash3"], "argument --kernels: invalid choice"),
    (["--passes", "bwd"], "argument --passes: invalid choice"),
    (["--head-dims", "0"], "argument --head-dims"),
])
def test_bad_flags_are_one_line(argv, says, capsys, tmp_path):
    assert says in cli_error(["bench", "grid", "--out", str(tmp_path / "x.jsonl"), *argv], capsys)
    assert not (tmp_path / "x.jsonl").exists()


def _fails(argv, capsys) -> str:
    return cli_error(["bench", "grid", *argv], capsys)


def test_a_corrupt_or_empty_file_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"kernel": "evict_kda"}\n')
    assert "line 1 is not a grid row" in _fails(["--report", "--out", str(bad)], capsys)
    assert "--report: " in _fails(["--report", "--out", str(tmp_path / "none.jsonl")], capsys)
    bad.write_text("{not json\n")
    assert "line 1 is not JSON" in _fails(["--lengths", "16", "--tokens", "16", "--out", str(bad)], capsys)
    assert bad.read_text() == "{not json\n" and not bad.with_suffix(".md").exists()
