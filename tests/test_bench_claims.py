"""`evict bench claims` on a CPU: the exact parts (KDA over GDN parameters, hybrid vs all-MLA ratios from decode JSON)
against independent derivations, KDA written as a DPLR transition against the float64 reference, and the timed claims'
code at tiny sizes (a smoke test: its times are never quoted)."""

import json

import pytest
import torch

from evict.bench import claims as c
from evict.bench import claims_timed as ct
from evict.bench.ops import rule_inputs
from evict.cli import main
from evict.ops import memory
from tests.conftest import cli_error


@pytest.mark.parametrize("name", c.RELEASED_KDA)
def test_kda_over_gdn_is_the_decay_projection_and_the_per_channel_bias(name):
    from evict.models import presets

    r = c.param_overhead(name)
    cfg = presets.get(name)
    differ = {t["tensor"]: t["difference"] for t in r["terms"] if t["difference"]}
    d, H, D = cfg.d_model, cfg.n_heads, cfg.head_size
    assert differ == {"f_gate": d * D + D * H * D - d * H, "dt_bias": H * D - H}
    assert r["difference"] == c.overhead_formula(d, H, D) == sum(differ.values())
    assert r["kda_mixer"] - r["gdn_mixer"] == r["difference"]
    assert r["of_gdn_mixer"] == r["difference"] / r["gdn_mixer"]
    assert r["of_model_total"] < r["of_model_active"] < r["of_layer_active"] < r["of_gdn_mixer"]


def test_the_overhead_falls_with_width_and_the_formula_matches_the_modules():
    rows = c.one_percent_widths(D=64, heads_per_width=1.0)
    assert all(r["difference"] == r["formula"] for r in rows)
    fractions = [r["of_gdn_mixer"] for r in rows]
    assert fractions == sorted(fractions, reverse=True)


def _decode_json(path, rows, gpu="NVIDIA H100"):
    path.write_text(json.dumps({"card": {"gpu": gpu, "date": "2026-12-06 08:00 UTC"}, "rows": rows}))


def test_decode_ratios_from_a_run(tmp_path):
    def r(model, ms, batch_mode="1", batch=1, variant="graph", ctx=1024):
        return {"model": model, "context": ctx, "batch": batch, "batch_mode": batch_mode, "variant": variant,
                "ms_per_token": ms}
    _decode_json(tmp_path / "a.json", [r("hybrid", 2.0), r("mla", 5.0), r("attention", 3.0), r("kda", 1.0),
                                       r("hybrid", 0.5, "max", 64), r("mla", 1.0, "max", 32)])
    rows = c.decode_ratios(["a.json", "missing.json"], root=tmp_path)
    assert [(x["batch"], x["MLA / hybrid"], x["attention / hybrid"]) for x in rows] == [("1", 2.5, 1.5),
                                                                                      ("max (64 / 32)", 2.0, None)]


def test_the_committed_1m_run_gives_the_hybrid_against_mla():
    for name in ("decode_cuda_fast_1m.json", "decode_cuda_1m_batched_h100.json"):
        rows = [r for r in c.decode_ratios() if r["context"] == 1048576 and r["path"] == "compiled" and r["run"] == name]
        raw = json.loads((c.REPO / "results/bench/decode" / name).read_text())["rows"]
        ms = {(x["model"], x["batch"]): x["ms_per_token"] for x in raw if x["variant"] == "compiled"}
        hybrid1, mla1 = ms[("hybrid", 1)], ms[("mla", 1)]
        one = [r for r in rows if r["batch"] == "1"]
        assert len(one) == 1 and one[0]["MLA / hybrid"] == round(mla1 / hybrid1, 2)
    most = {m: max((b, t) for (mm, b), t in ms.items() if mm == m) for m in ("hybrid", "mla")}  # the largest batch
    batched = [r for r in rows if r["batch"] == f"max ({most['hybrid'][0]} / {most['mla'][0]})"]
    assert len(batched) == 1 and batched[0]["MLA / hybrid"] == round(most["mla"][1] / most["hybrid"][1], 2) > 3


@pytest.mark.parametrize("B, T, H, D, seed", [(1, 1, 1, 4, 0), (2, 37, 3, 8, 1), (1, 70, 2, 5, 2)])
def test_kda_as_dplr_is_kda(B, T, H, D, seed):
    x = rule_inputs("kda", B, T, H, D, dtype=torch.float64, seed=seed)
    x["beta"] = x["beta"] * 2  # the negative-eigenvalue range too
    want, _ = memory(x["q"], x["k"], x["v"], log_alpha=x["log_alpha"], beta=x["beta"], delta=True, impl="reference")
    got = ct.dplr_reference(*ct.kda_as_dplr(x["q"], x["k"], x["v"], x["log_alpha"], x["beta"]))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    wrong = ct.dplr_reference(*ct.kda_as_dplr(x["q"], x["k"], x["v"], torch.zeros_like(x["log_alpha"]), x["beta"]))
    assert T == 1 or not torch.allclose(wrong, want)  # the decay enters: the check can fail


def test_the_timed_claims_run_on_a_cpu_as_a_smoke_test():
    rows = ct.time_dplr("cpu")
    assert rows[0]["form"] == "evict kda (chunked)" and rows[0]["rel err vs evict"] == "0.0e+00" and rows[0]["fwd ms"] > 0
    assert rows[-1]["note"] == "not run: fla runs on CUDA only"
    situ = ct.time_situ("cpu", compile=False)
    assert [r["activation"] for r in situ] == ["situ", "swiglu"] and all(r["eager fwd+bwd ms"] > 0 for r in situ)


@pytest.mark.slow
def test_attn_res_and_compiled_situ_on_a_cpu():
    rows = ct.time_attn_res("cpu")
    assert rows[0]["with ms"] > 0 and rows[0]["without ms"] > 0
    situ = ct.time_situ("cpu", compile=True)
    assert all(r["compiled fwd ms"] > 0 and r["compiled fwd+bwd ms"] > 0 and "eager / compiled fwd" in r for r in situ)


def test_the_command_writes_json_and_markdown(tmp_path, capsys):
    out = tmp_path / "claims.json"
    main(["bench", "claims", "--claims", "params", "decode", "--out", str(out), "-q"])
    data = json.loads(out.read_text())
    assert [r["model"] for r in data["params"]] == list(c.RELEASED_KDA) and data["decode"]
    md = out.with_suffix(".md").read_text()
    assert "f_gate" in md and "MLA / hybrid" in md and "smoke test" not in md


@pytest.mark.parametrize("argv, says", [(["--claims", "speed"], "argument --claims: invalid choice"),
                                        (["--modes", "fast"], "argument --modes: invalid choice")])
def test_bad_flags_are_one_line(argv, says, capsys, tmp_path):
    assert says in cli_error(["bench", "claims", "--out", str(tmp_path / "x.json"), *argv], capsys)
    assert not (tmp_path / "x.json").exists()


def test_a_failing_timed_claim_is_its_row_and_the_rest_runs(monkeypatch, tmp_path):
    def broken(device):
        raise RuntimeError("fla refused\nsecond line")
    monkeypatch.setattr(ct, "time_dplr", broken)
    result = c.run_claims(("dplr", "params"), device="cpu", out=tmp_path / "x.json")
    assert result["dplr"] == [{"claim": "dplr", "device": "cpu", "error": "RuntimeError: fla refused"}]
    assert len(result["params"]) == 2 and "fla refused" in (tmp_path / "x.md").read_text()
