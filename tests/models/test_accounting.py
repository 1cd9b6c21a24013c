"""The accountant: parameter counts and per-sequence memory of the released shapes, built on the meta device."""

import json
import resource

import pytest

from evict.cli import main
from evict.models import accounting, presets
from evict.models.accounting import build_meta, kv_bytes_per_token, memory_report, mla_numbers_per_token, param_report


@pytest.fixture(scope="module")
def k3():
    """K3 built once on meta, with the growth of the peak RSS it caused (bytes)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model = build_meta(presets.get("kimi_k3"))
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return model, grown


def test_gpt2_small_is_124m():
    r = param_report(presets.get("gpt2_124m"))
    assert r["total"] == 124_439_808  # GPT-2 small exactly (vocab 50,257, LayerNorm with bias)
    assert r["active"] == r["total"]  # dense: everything is active
    assert r["embeddings"]["head"] == 0  # tied: the head is the token table, counted once
    assert r["embeddings"]["token"] == 50257 * 768 and r["embeddings"]["position"] == 1024 * 768
    assert r["active_excl_embeddings"] == r["total"] - 50257 * 768 - 1024 * 768
    assert sum(r["by_kind"].values()) == r["total"]


def test_gpt2_kv_cache_figures():
    cfg = presets.get("gpt2_124m")
    assert kv_bytes_per_token(cfg, 2) == 2 * 12 * 12 * 64 * 2 == 36_864
    rows = {r["context"]: r for r in memory_report(cfg, [1024, 128_000, 131_072, 1_000_000, 1_048_576], bytes_per_number=2)}
    assert all(r["kv_bytes"] == 36_864 * n and r["total_bytes"] == r["kv_bytes"] for n, r in rows.items())
    assert round(rows[1024]["kv_bytes"] / 1e6, 1) == 37.7  # 37.7 MB (decimal)
    # the seeds' 4.7 GB and 37 GB read 128K and 1M as 128,000 and 1,000,000 tokens;
    # at 131,072 and 1,048,576 tokens the same cache is 4.83 GB and 38.7 GB
    assert round(rows[128_000]["kv_bytes"] / 1e9, 1) == 4.7
    assert round(rows[1_000_000]["kv_bytes"] / 1e9) == 37
    assert round(rows[131_072]["kv_bytes"] / 1e9, 2) == 4.83
    assert round(rows[1_048_576]["kv_bytes"] / 1e9, 1) == 38.7
    assert accounting.fmt_bytes(rows[1024]["kv_bytes"]) == "37.7 MB"


def test_mla_latent_is_576_numbers_per_token_per_mla_layer():
    cfg = presets.get("kimi_linear_48b")
    assert mla_numbers_per_token(cfg) == 576
    n_mla = cfg.layer_mixers().count("M")
    assert n_mla == 7
    a, b = memory_report(cfg, [1000, 2000], bytes_per_number=2)
    assert b["latent_bytes"] - a["latent_bytes"] == 1000 * n_mla * 576 * 2
    assert a["kv_bytes"] == 0
    # the recurrent state does not grow with context: 20 KDA layers x 32 heads x 128 x 128 in float32
    assert a["recurrent_bytes"] == b["recurrent_bytes"] == 20 * 32 * 128 * 128 * 4
    assert a["conv_bytes"] == b["conv_bytes"] == 20 * 3 * 32 * 128 * 3 * 2
    assert 2 * 128 * 64 == 16_384 and round(16_384 / 576) == 28  # the lesson's MHA figure and ratio


def test_kimi_linear_48b_counts():
    r = param_report(presets.get("kimi_linear_48b"))
    # The published name says 48B / A3B. Counting the released shapes gives 49.12B total: the routed + shared
    # experts of the 26 MoE layers alone are 47.3B, and embeddings (2 x 163840 x 2304 untied = 0.75B) plus the
    # mixers (~1B) come on top; "48B" is a rounded label. Active: 3.48B with the embedding table and head,
    # 2.73B without them (the "A3B" figure is the latter, rounded).
    assert abs(r["total"] - 49.12e9) < 0.01e9
    assert abs(r["total"] - 48e9) / 48e9 < 0.03  # within 3% of the reported 48B
    assert abs(r["active"] - 3.48e9) < 0.01e9
    assert abs(r["active_excl_embeddings"] - 2.73e9) < 0.01e9
    assert r["moe"]["layers"] == 26


def test_kimi_k3_counts(k3):
    model, _ = k3
    r = accounting.model_params(model)
    assert 1e12 < r["total"] < 1e13
    assert abs(r["total"] - 2.78e12) / 2.78e12 < 0.01  # reported 2.78T
    assert 5e10 < r["active"] < 2e11
    assert abs(r["active"] - 104e9) / 104e9 < 0.02  # reported ~104B
    assert r["by_kind"]["attn_res"] > 0
    rows = accounting.comparisons("kimi_k3", model.cfg, params=r)
    seeds = {row["figure"]: row for row in rows}
    assert seeds["seeds' 2.8T / 124M"]["computed"] == "22,581"  # the lesson's 22,580, rounded the other way
    assert seeds["layers"]["computed"] == "93" and seeds["layers"]["expected"] == "92 (seeds)"


def test_meta_build_allocates_nothing(k3):
    model, grown = k3
    assert all(p.is_meta for p in model.parameters()) and all(b.is_meta for b in model.buffers())
    assert sum(p.numel() for p in model.parameters()) > 2e12
    assert grown < 500e6  # K3's weights would be > 5 TB in bf16


def test_cli_size_gpt2_end_to_end(tmp_path, capsys):
    png, js = tmp_path / "gpt2.png", tmp_path / "gpt2.json"
    assert main(["size", "gpt2_124m", "--plot", str(png), "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "36,864 B" in out and "37.7 MB" in out and "124,439,808" in out
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads(js.read_text())["reports"][0]
    assert [r["context"] for r in report["memory"]] == [1024, 8192, 131072, 1048576]


def test_unknown_preset_is_a_clear_error():
    with pytest.raises(SystemExit, match="preset: .*unknown preset 'gpt5'"):
        main(["size", "gpt5"])
    with pytest.raises(ValueError, match="contexts"):
        memory_report(presets.get("gpt2_124m"), [0])
    with pytest.raises(ValueError, match="bytes_per_number"):
        memory_report(presets.get("gpt2_124m"), [1024], bytes_per_number=0)
    with pytest.raises(ValueError, match="cfg"):
        param_report("gpt2_124m")


def test_train_flops_per_token_gpt2_is_the_textbook_count():
    """GPT-2 124M: 6 N (N without the embeddings; the tied head counted) + 6 L d T (PaLM's 12 L d T, halved for causal)."""
    from evict.models.accounting import train_flops_per_token

    cfg = presets.get("gpt2_124m")
    T, L, d, V = 1024, 12, 768, 50304
    n = 12 * L * d * d + V * d  # the blocks' matrices and the head (biases and norms add ~0.1 %)
    f = train_flops_per_token(cfg, T)
    assert f["mixing"] == 6 * L * d * T
    assert f["params"] == pytest.approx(6 * n, rel=2e-3)
    assert f["total"] == f["params"] + f["mixing"]
    kimi = presets.get("kimi_linear", size="small")
    assert train_flops_per_token(kimi, 2 * T)["mixing"] > train_flops_per_token(kimi, T)["mixing"]  # the MLA layers
