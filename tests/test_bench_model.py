"""The model-level training bench: FLOP counting against hand counts, a CPU run of its loop, bad input."""

import pytest
import torch

from evict.bench.model import NAMED, attention_flops_per_token, bench_model, matmul_params, model_config
from evict.models import LM


def test_gpt2_124m_flops_by_hand():
    cfg = model_config("gpt2_124m")
    with torch.device("meta"):
        model = LM(cfg)
    d, L, V, T = 768, 12, 50257, 1024
    per_layer = 4 * d * d + 4 * d + 2 * 4 * d * d + 4 * d + d + 4 * d  # qkv+o (+biases), MLP (+biases), two LayerNorms
    assert matmul_params(model, model.head) == V * d + L * per_layer + 2 * d  # tied head once, final LayerNorm; no wpe
    assert attention_flops_per_token(cfg, T) == L * 12 * T * d


def test_named_shapes():
    with torch.device("meta"):
        kda = LM(NAMED["kda_226m"]())
    n = sum(p.numel() for p in kda.parameters())
    assert 220e6 < n < 232e6  # issue 74's "226M"
    assert attention_flops_per_token(NAMED["kda_226m"](), 4096) == 0
    assert attention_flops_per_token(NAMED["kkka_226m"](), 4096) == 3 * 12 * 4096 * 1024
    assert attention_flops_per_token(NAMED["kkkm_226m"](), 4096) == 3 * 6 * 4096 * 8 * (128 + 64 + 128)


@pytest.mark.slow
def test_cpu_run_beside_transformers(tmp_path):
    pytest.importorskip("transformers")
    rows = bench_model(models=("gpt2",), size="tiny", batch=2, seq_len=16, warmup=1, steps=1, device="cpu",
                       out=tmp_path / "b.json")
    assert [(r["impl"], r["mode"]) for r in rows] == [("evict", "eager"), ("transformers", "eager")]
    assert all(r["tok/s"] > 0 and r["peak GiB"] is None for r in rows)
    assert rows[0]["vs"] == "transformers" and rows[0]["tok/s ratio"] > 0
    # same shapes, same FLOP count: the two models are the same architecture
    assert rows[0]["GFLOP/token"] == rows[1]["GFLOP/token"] and rows[0]["params M"] == rows[1]["params M"]
    assert (tmp_path / "b.json").exists()


def test_profile_writes_each_rows_kernel_table(tmp_path):
    """profile=N: one more step under torch.profiler per row, its top-N table in the JSON row and in the .kernels.txt."""
    rows = bench_model(models=("gpt2",), size="tiny", batch=1, seq_len=8, warmup=1, steps=1, device="cpu",
                       references=False, profile=4, out=tmp_path / "b.json")
    table = rows[0]["kernels"]
    assert "Self CPU" in table and "aten::" in table
    text = (tmp_path / "b.kernels.txt").read_text()
    assert text.startswith("## gpt2 evict eager B1 T8:") and table in text


def test_reference_only_that_runs_nothing_is_refused(tmp_path):
    """impls=("reference",) for a model no reference maps to (a hybrid), or with references=False, would write a JSON
    of no rows: refused in one line before anything runs or is written."""
    for kw, why in ((dict(models=("kimi_linear",)), "no reference model"), (dict(models=("gpt2",), references=False),
                                                                            "references=False")):
        with pytest.raises(ValueError, match=rf"^impls: \('reference',\) runs nothing for .*{why}"):
            bench_model(**{"device": "cpu", "size": "tiny", "seq_len": 8, "impls": ("reference",), "out": tmp_path / "x.json", **kw})
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("kw,name", [(dict(models=("nope",)), "model"), (dict(modes=("fast",)), "modes"),
                                     (dict(impls=("fla",)), "impls"), (dict(impls=()), "impls"),
                                     (dict(batch=0), "batch"), (dict(profile=-1), "profile"), (dict(models=("gpt2",), seq_len=4096), "seq_len")])
def test_bad_input_one_line(kw, name, tmp_path):
    with pytest.raises(ValueError, match=f"^{name}: expected|^{name}: gpt2 has"):
        bench_model(**{"device": "cpu", "out": tmp_path / "x.json", **kw})
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("argv", [["--lm", "nope"], ["--lm", "gpt2", "--batch-size", "0"],
                                  ["--lm", "gpt2", "--modes", "fast"], ["--lm", "gpt2", "--seq-len", "5000"],
                                  ["--lm", "gpt2", "--profile", "0"]])
def test_cli_bad_flags_one_line_exit_2(argv, tmp_path, monkeypatch, capsys):
    from evict.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["bench", "train", "--device", "cpu", "--out", str(tmp_path / "b.json"), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) <= 2 and "Traceback" not in "\n".join(err), err
    assert not (tmp_path / "b.json").exists()


def test_each_row_is_written_as_it_finishes(tmp_path, monkeypatch):
    """A run cut after its first row (here: the second row raises) leaves that row in the JSON."""
    import json

    import evict.bench.model as bm

    real, calls = bm._measure, []

    def measure(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("cut")
        return real(*a, **k)

    monkeypatch.setattr(bm, "_measure", measure)
    with pytest.raises(RuntimeError, match="cut"):
        bench_model(models=("gpt2", "kda"), size="tiny", batch=1, seq_len=8, warmup=1, steps=1, device="cpu",
                    references=False, out=tmp_path / "b.json")
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert [(r["model"], r["impl"]) for r in rows] == [("gpt2", "evict")] and rows[0]["tok/s"] > 0


def test_impls_and_merge_across_runs(tmp_path):
    """impls=("evict",) runs evict's rows only; merge puts runs side by side and computes the ratios across them
    (a hybrid against the KDA-only model of another file; evict against a reference row of another file)."""
    import json

    from evict.bench.model import merge

    rows = bench_model(models=("gpt2",), size="tiny", batch=1, seq_len=8, warmup=1, steps=1, device="cpu",
                       impls=("evict",), out=tmp_path / "a.json")
    assert [(r["model"], r["impl"]) for r in rows] == [("gpt2", "evict")] and "vs" not in rows[0]

    def run(name, model, impl, tps, gib):
        row = {"model": model, "impl": impl, "mode": "eager", "shape": "B4 T4096", "tok/s": tps, "peak GiB": gib}
        (tmp_path / name).write_text(json.dumps({"card": {"device": "x"}, "batch": 4, "rows": [row]}))
        return tmp_path / name

    paths = [run("k.json", "kda_226m", "evict", 100, 20.0), run("h.json", "kkka_226m", "evict", 95, 21.0),
             run("f.json", "kda_226m", "fla", 125, 19.0)]
    comp = json.loads(paths[0].read_text())
    comp["rows"][0].update(mode="compiled", **{"tok/s": 150, "peak GiB": 17.0})
    (tmp_path / "c.json").write_text(json.dumps(comp))
    merged = merge([*paths, tmp_path / "c.json"], out=tmp_path / "m.json")
    compiled = next(r for r in merged if r["mode"] == "compiled")  # no compiled fla row: beside fla's eager one
    assert compiled["vs"] == "fla (eager)" and compiled["tok/s ratio"] == 1.2 and compiled["memory ratio"] == 0.89
    merged = merge(paths, out=tmp_path / "m.json")
    by = {(r["model"], r["impl"]): r for r in merged}
    assert by[("kda_226m", "evict")]["vs"] == "fla" and by[("kda_226m", "evict")]["tok/s ratio"] == 0.8
    assert by[("kda_226m", "evict")]["memory ratio"] == round(20 / 19, 2)
    assert by[("kkka_226m", "evict")]["vs"] == "evict kda_226m" and by[("kkka_226m", "evict")]["tok/s ratio"] == 0.95
    data = json.loads((tmp_path / "m.json").read_text())
    assert [r["file"] for r in data["runs"]] == ["k.json", "h.json", "f.json"] and len(data["rows"]) == 3
    with pytest.raises(ValueError, match="^paths: expected"):
        merge([tmp_path / "a.json", _not_bench(tmp_path)])



def test_merge_compares_rows_of_the_same_shape_only(tmp_path):
    """Runs of other shapes side by side: no ratio across them (a B4 T2048 fla row is no base for a B4 T4096 row)."""
    import json

    from evict.bench.model import merge

    paths = []
    for name, model, impl, shape in (("k.json", "kda_226m", "evict", "B4 T4096"), ("h.json", "kkka_226m", "evict", "B4 T2048"),
                                     ("f.json", "kda_226m", "fla", "B4 T2048")):
        row = {"model": model, "impl": impl, "mode": "eager", "shape": shape, "tok/s": 100, "peak GiB": 20.0}
        (tmp_path / name).write_text(json.dumps({"card": {"device": "x"}, "rows": [row]}))
        paths.append(tmp_path / name)
    by = {(r["model"], r["impl"]): r for r in merge(paths)}
    assert "vs" not in by[("kda_226m", "evict")] and "vs" not in by[("kkka_226m", "evict")]


def _not_bench(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("[1, 2]")
    return p


@pytest.mark.parametrize("parallel", [True, False])
def test_fla_rows_run_inside_the_parallel_compile_unless_told_not(parallel, tmp_path, monkeypatch):
    """The reference row named fla measures inside parallel_autotune_compile (its counts in the row's note);
    parallel_compile=False (autotune results restored from disk) measures it plainly. A stand-in plays fla's model."""
    from contextlib import contextmanager

    import evict.bench.model as bm

    entered = []

    @contextmanager
    def fake_parallel():
        entered.append(1)
        yield {"kernels": 2, "configs": 7, "compile s": 1.5}

    def fake_fla(cfg, seq_len, device):
        s = bm._evict(cfg, seq_len, device, False)
        return bm._Subject("fla", s.model, s.loss, s.flops_per_token)

    monkeypatch.setattr(bm, "parallel_autotune_compile", fake_parallel)
    monkeypatch.setattr(bm, "_reference", lambda cfg: ("fla", fake_fla))
    rows = bench_model(models=("gpt2",), size="tiny", batch=1, seq_len=8, warmup=1, steps=1, device="cpu",
                       impls=("reference",), parallel_compile=parallel, out=tmp_path / "b.json")
    assert [r["impl"] for r in rows] == ["fla"] and rows[0]["tok/s"] > 0
    assert len(entered) == int(parallel)
    assert (rows[0].get("note") == "2 autotuned kernels, 7 configs compiled in parallel first (1.5 s)") == parallel


def test_compiled_lean_mode_compiles_blocks_lean(monkeypatch):
    """Mode compiled-lean: compile_blocks(lean=True); compiled-keep: lean=False (the keep-all form); compiled:
    compile_blocks' default form (lean=None); a row each, labelled by its mode."""
    import evict.bench.model as bm

    seen = []
    monkeypatch.setattr(bm, "compile_blocks", lambda model, lean=None: seen.append(lean))  # eager steps, no compile
    rows = bench_model(models=("kda",), size="tiny", batch=1, seq_len=8, warmup=1, steps=1, device="cpu",
                       references=False, modes=("compiled", "compiled-lean", "compiled-keep"))
    assert seen == [None, True, False] and [r["mode"] for r in rows] == ["compiled", "compiled-lean", "compiled-keep"]
