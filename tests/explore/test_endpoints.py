"""`evict explore`'s endpoints, through FastAPI's TestClient: every figure's numbers pinned to the lesson's."""

import shlex
import time

import pytest
import torch

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from evict.cli import build_parser  # noqa: E402
from evict.explore import depth, dial  # noqa: E402
from evict.explore.app import STATIC, create_app  # noqa: E402
from evict.explore.concepts import FIGURES  # noqa: E402
from evict.models import LM, presets  # noqa: E402
from evict.stories import K_CAT, K_DOG, K_TAX, V_BISCUIT, V_MOCHI, V_REX, V_TAX  # noqa: E402

SMALL = dial.Dial(T=64, H=1, D=16, repeats=1)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    return TestClient(create_app(SMALL, cache_dir=tmp_path_factory.mktemp("dial"), warm=False))


def close(a, b, tol=1e-9):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), atol=tol, rtol=0)


def outer(k, v):
    return torch.outer(torch.tensor(k, dtype=torch.float64), torch.tensor(v, dtype=torch.float64))


def test_page_and_assets_are_served(client):
    page = client.get("/")
    assert page.status_code == 200 and "explore.js" in page.text
    assert "cdn" not in page.text.lower() and "http" not in page.text.replace("http://www.w3.org", "")
    for fig in FIGURES:
        assert f'id="fig-{fig}"' in page.text
    assert client.get("/static/explore.js").status_code == 200 and client.get("/static/explore.css").status_code == 200


def test_whiteboard_interference(client):
    d = client.get("/api/whiteboard", params={"writes": "cat,dog", "read": "cat"}).json()
    assert close(d["o"], [2, 2.8, 0.6, 2.2])
    assert close(d["error"], [0.6 * x for x in V_REX])  # the interference law: (k_cat · k_dog) v_Rex
    assert close(d["steps"][-1]["S"], outer(K_CAT, V_MOCHI) + outer(K_DOG, V_REX))
    assert close(d["steps"][1]["S"], outer(K_CAT, V_MOCHI))
    alone = client.get("/api/whiteboard", params={"writes": "cat", "read": "cat"}).json()
    assert close(alone["o"], V_MOCHI) and close(alone["error"], [0] * 4)
    dog = client.get("/api/whiteboard", params={"writes": "cat,dog", "read": "dog"}).json()
    assert close(dog["o"], [0.6 * m + r for m, r in zip(V_MOCHI, V_REX)])
    empty = client.get("/api/whiteboard", params={"writes": "", "read": "cat"}).json()
    assert close(empty["o"], [0] * 4) and len(empty["steps"]) == 1


def test_delta_stamp_every_cell(client):
    d = client.get("/api/delta-stamp").json()
    before, read, sub, after = d["steps"]
    assert close(read["v_old"], V_MOCHI) and close(sub["u"], [-1, -1, 2, 1])
    assert close(after["S"][0], V_BISCUIT) and close(after["S"][0], [1, 0, 2, 2])
    for s in d["steps"]:  # the orthogonal fact is untouched at every step
        assert close(s["S"][1], V_TAX)
    assert close(torch.tensor(after["S"]) - torch.tensor(before["S"]), outer(K_CAT, sub["u"]))
    assert close(d["read_after"]["tax"], V_TAX)
    half = client.get("/api/delta-stamp", params={"beta": 0.5}).json()
    assert close(half["steps"][3]["S"][0], [m + 0.5 * u for m, u in zip(V_MOCHI, [-1, -1, 2, 1])])
    assert client.get("/api/delta-stamp", params={"beta": 2.5}).status_code == 422


def test_memory_wall_gpt2_and_lines(client):
    d = client.get("/api/memory-wall", params={"context": 1024}).json()
    lines = {l["id"]: l for l in d["lines"]}
    g = lines["gpt2_124m"]
    assert g["bytes_per_token"] == 36_864 == 2 * 12 * 12 * 64 * 2
    assert g["at_context"] == 36_864 * 1024 and g["at_context_text"] == "37.7 MB"
    assert lines["llama70b_gqa"]["bytes_per_token"] == 2 * 80 * 8 * 128 * 2
    assert lines["k3_mla"]["bytes_per_token"] == 24 * 576 * 2
    assert len(set(lines["k3_kda"]["bytes"])) == 1 and lines["k3_kda"]["bytes_per_token"] == 0  # flat
    assert d["ceiling"]["bytes"] == 141e9 and len(g["bytes"]) == len(d["grid"]) == 81
    assert d["grid"][0] == 1_000 and d["grid"][-1] == 10_000_000
    big = {l["id"]: l for l in client.get("/api/memory-wall", params={"context": 128_000}).json()["lines"]}
    assert big["gpt2_124m"]["at_context_text"] == "4.72 GB"  # the lesson's 4.7 GB at 128K
    m = {l["id"]: l for l in client.get("/api/memory-wall", params={"context": 1_000_000}).json()["lines"]}
    assert m["gpt2_124m"]["at_context_text"] == "36.9 GB"  # the lesson's 37 GB at 1M
    assert m["dense_mha_k3"]["at_context"] > 1e12  # terabytes
    assert m["gpt2_124m"]["hits_ceiling_at"] == -(-141_000_000_000 // 36_864)
    for bad in (999, 10_000_001, "x"):
        r = client.get("/api/memory-wall", params={"context": bad})
        assert r.status_code == 422 and r.json()["detail"].startswith("context: ") and "\n" not in r.json()["detail"]


def test_history_fold_bytes_and_reads(client):
    d = client.get("/api/history-fold", params={"step": 10}).json()
    assert d["kv_bytes_read"] == 2 * 10 * 8 * 2 and d["state_bytes_read"] == 8 * 8 * 4
    k, v = torch.tensor(d["keys"], dtype=torch.float64), torch.tensor(d["values"], dtype=torch.float64)
    assert k.shape == (10, 8) and close(d["S"], k.T @ v, tol=1e-3)  # S = Σ kᵀv (keys and values shown in fp16)
    assert [p["kv_bytes"] for p in d["per_step"]] == [32 * t for t in range(1, 17)]
    assert client.get("/api/history-fold", params={"step": 17}).status_code == 422


def test_chunk_dial_law_and_measurement(client):
    d = client.get("/api/chunk-dial", params={"C": 16}).json()
    T, D = SMALL.T, SMALL.D
    assert d["sizes"] == [1, 2, 4, 8, 16, 32, 64]
    assert d["at"]["flops_per_head"] == 2 * T * D * D + 2 * T * 16 * D
    flops = [row["flops"] for row in d["law"]]
    assert flops == sorted(flops) and flops[0] < flops[-1]  # the law falls as C shrinks
    assert d["at"]["intra_pairs"] + d["at"]["folded_pairs"] == T * (T + 1) // 2
    assert client.get("/api/chunk-dial", params={"C": 3}).status_code == 422
    assert d["gpu"] == dial.gpu_numbers()
    client.post("/api/chunk-dial/measure")
    deadline = time.monotonic() + 60
    while client.get("/api/chunk-dial/progress").json()["status"] == "running" and time.monotonic() < deadline:
        time.sleep(0.1)
    done = client.get("/api/chunk-dial", params={"C": 16}).json()
    assert done["progress"]["status"] == "done" and done["progress"]["done"] == 7
    assert len(done["cpu"]["seconds"]) == 7 and all(s > 0 for s in done["cpu"]["seconds"])


def test_chunk_dial_cache_is_reused_and_damage_remeasured(tmp_path):
    m = dial.Measurer(SMALL, tmp_path)
    m.path.parent.mkdir(parents=True, exist_ok=True)
    m.path.write_text('{"sizes": [1, 2], "seconds": [1')
    assert m.result() is None and m.state()["status"] == "idle"  # a damaged cache is measured again
    m.start()
    m._thread.join(60)
    first = m.result()
    assert first is not None and first["sizes"] == SMALL.sizes()
    again = dial.Measurer(SMALL, tmp_path)
    assert again.state()["status"] == "done" and again.result() == first and again.start()["status"] == "done"


def test_fade_curve_and_twin_boards(client):
    d = client.get("/api/fade-curve", params={"slam": 0.2}).json()
    base = client.get("/api/fade-curve", params={"slam": 1.0}).json()
    q = d["query"]
    assert d["example"]["survival"] == pytest.approx(0.405, abs=1e-12)  # 0.9 · 0.5 · 0.9
    for fact in ("mochi", "junk"):  # one scalar gate: both at 20 % × the baseline decay
        assert d["survival"][fact][q] == pytest.approx(0.2 * base["survival"][fact][q], rel=1e-12)
    assert d["survival"]["tax"][q] == pytest.approx(base["survival"]["tax"][q])  # written after the switch
    assert client.get("/api/fade-curve", params={"slam": 1.5}).status_code == 422
    t = client.get("/api/twin-boards").json()
    assert t["scalar"]["survival"]["mochi"][q] == pytest.approx(0.1)
    assert t["scalar"]["survival"]["junk"][q] == pytest.approx(0.1)
    assert t["per_channel"]["survival"]["mochi"][q] == pytest.approx(0.95)
    assert t["per_channel"]["survival"]["junk"][q] == pytest.approx(0.1)


def test_params_views(client):
    stored = client.get("/api/params", params={"view": "stored"}).json()
    assert 2.7e12 < stored["total"] < 2.9e12 and stored["value"] == stored["total"]
    assert 0.95 <= stored["experts_share"] <= 0.99
    assert stored["ratio_lesson"] == pytest.approx(22_580, abs=1)  # 2.8T / 124M
    assert stored["ratio_total"] == pytest.approx(stored["total"] / stored["gpt2_total"])
    assert stored["gpt2_total"] == 124_439_808  # GPT-2 small exactly (vocab 50,257, LayerNorm with biases)
    assert stored["mla_numbers_per_token"] == 576 and stored["mha_numbers_per_token"] == 16_384
    assert stored["mla_saving"] == pytest.approx(28.44, abs=0.01)
    active = client.get("/api/params", params={"view": "active"}).json()
    assert sum(b["params"] for b in active["bars"]) == active["active"] == active["value"]
    assert 1e10 < active["active"] < 2e11 and 100 < active["ratio_active"] < 1000  # hundreds × GPT-2
    ratio = client.get("/api/params", params={"view": "ratio"}).json()
    assert ratio["value"] == pytest.approx(stored["ratio_total"]) and ratio["headline"].startswith(f"{ratio['value']:,.0f}×")
    assert client.get("/api/params", params={"view": "total"}).status_code == 422


def test_layer_map(client):
    d = client.get("/api/layers").json()
    layers = d["layers"]
    assert len(layers) == 93 and d["dense_ffn_layers"] == [1]
    assert [l["layer"] for l in layers if l["mixer"] == "mla"] == list(range(4, 93, 4)) + [93]
    assert d["snapshots"] == [12, 24, 36, 48, 60, 72, 84, 93]  # 8 snapshots: every 12 layers, plus the top
    assert all(l["cache_bytes_per_token"] == (1152 if l["mixer"] == "mla" else 0) for l in layers)
    assert all(l["active"] < l["params"] for l in layers[1:]) and layers[0]["active"] == layers[0]["params"]


def test_depth_lens_committed_file(client):
    d = client.get("/api/depth-lens").json()
    a, p = d["attn_res"], d["plain"]
    S = len(a["sources"])
    assert S == 9 and a["sources"][0] == "embedding"
    assert all(len(row) == S and abs(sum(row) - 1) < 1e-5 for row in a["final_weights"])
    assert len(a["final_weights"]) == len(d["tokens"]) == len(d["text"])
    assert len(p["layer_rms"]) == 8 and p["layer_rms"][-1]["rms"] > p["layer_rms"][0]["rms"]  # norms grow with depth
    for run in d["training"].values():
        assert run["val_loss"] < run["unigram_loss"]  # trained, not invented


def test_depth_lens_at_init_is_uniform():
    """At initialisation every AttnRes query is zero, so every read weighs its sources equally."""
    torch.manual_seed(0)
    kw = dict(n_layers=4, attn_res_block=1, vocab_size=32)
    a = LM(presets.get("k3_mini", **kw))
    p = LM(presets.get("k3_mini", **kw, attn_res=False))
    tokens = torch.randint(0, 32, (1, 12))
    out = depth.lens(a, p, tokens)
    w = torch.tensor(out["attn_res"]["final_weights"])
    assert w.shape == (12, 5) and torch.allclose(w, torch.full_like(w, 0.2))
    with torch.no_grad():
        h = p.embed(tokens)
        for blk in p.blocks:  # the plain residual stream recomputed by hand
            h = h + blk.mixer(blk.norm1(h), None, 0)
            h = h + blk.ffn(blk.norm2(h))
    assert out["plain"]["layer_rms"][-1]["rms"] == pytest.approx(float(h.double().pow(2).mean(-1).sqrt().mean()), rel=1e-5)
    with pytest.raises(ValueError, match="^models:"):
        depth.lens(p, a, tokens)


def test_concept_map_links_every_idea():
    from evict.explore.concepts import concept_map

    d = concept_map()
    html = (STATIC / "index.html").read_text()
    ids = {n["id"] for n in d["nodes"]}
    assert len(d["nodes"]) == 18 and {n["group"] for n in d["nodes"]} == set(d["groups"])
    for n in d["nodes"]:
        assert n["figure"] is None or f'id="fig-{n["figure"]}"' in html
        argv = shlex.split(n["command"])
        assert argv[0] == "evict"
        build_parser().parse_args(argv[1:])  # every command is a real one
    assert set(FIGURES) - {"concept-map"} <= {n["figure"] for n in d["nodes"]}  # every figure has an idea
    assert all(l["from"] in ids and l["to"] in ids for l in d["links"])


def test_cli_port_errors(capsys):
    import socket

    from evict.cli import main

    with pytest.raises(SystemExit) as e:
        main(["explore", "--port", "70000"])
    assert e.value.code == 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(SystemExit) as e:
            main(["explore", "--port", str(s.getsockname()[1])])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("evict explore: error: --port: cannot listen on 127.0.0.1:")


def test_gpu_numbers_file_is_checked(tmp_path, monkeypatch):
    bad = tmp_path / "chunk_dial_gpu.json"
    bad.write_text('{"sizes": [1, 2], "seconds": [0.1]}')
    monkeypatch.setattr(dial.resources, "files", lambda pkg: tmp_path)
    monkeypatch.setattr(dial, "GPU_DATA", "chunk_dial_gpu.json")
    with pytest.raises(ValueError, match="^chunk dial GPU numbers: .* lacks matching"):
        dial.gpu_numbers()


def test_memory_wall_point_only_and_the_lesson_numbers(client):
    full = client.get("/api/memory-wall", params={"context": 128_000}).json()
    point = client.get("/api/memory-wall", params={"context": 128_000, "curves": "false"}).json()
    assert point["grid"] is None and all(l["bytes"] is None for l in point["lines"])
    assert [l["at_context"] for l in point["lines"]] == [l["at_context"] for l in full["lines"]]
    assert full["k128"] == 128_000
    params = client.get("/api/params").json()
    assert params["mha"] == {"heads": 64, "head_dim": 128} and params["mha_numbers_per_token"] == 2 * 64 * 128
    layers = client.get("/api/layers").json()
    assert len(layers["layers"]) == 93 and layers["counts"]["mla"] == 24
    assert layers["why_93"].startswith("93 layers, 24 MLA: 23 KKKM cycles (92 layers, 23 MLA) plus 1 final MLA layer")


def test_replays_are_computed_by_the_ops(client):
    import math

    one = client.get("/api/replay/1", params={"shelf": 16}).json()
    assert one["ratio"] == pytest.approx(math.exp(4), rel=1e-12) and one["bytes_read"] == 16 * 2 * 4 * 2
    keys, values = (torch.tensor(x, dtype=torch.float64) for x in (K_CAT, V_MOCHI))
    from evict.explore.lesson import _shelf

    K, V = _shelf(16)
    w = torch.softmax(K @ (4 * keys), 0)  # the float64 reference of the op's read
    assert one["w_mochi"] == pytest.approx(float(w[0]), rel=1e-12) and close(one["read"], w @ V, 1e-12)
    assert close(V[0], values)
    assert client.get("/api/replay/1", params={"shelf": 3}).status_code == 422
    assert close(client.get("/api/replay/2").json()["read"], [2, 2.8, 0.6, 2.2])
    three = client.get("/api/replay/3").json()
    assert close(three["delta_read"], V_BISCUIT) and close(three["additive_read"], [m + b for m, b in zip(V_MOCHI, V_BISCUIT)])
    assert close(three["tax_read"], V_TAX)
    dirty = three["contaminated"]  # cat fixed exactly; dog's read moves by (k_dog · k_cat) u
    u = [b - c for b, c in zip(V_BISCUIT, dirty["cat_before"])]
    assert close(dirty["cat_after"], V_BISCUIT) and close(dirty["dog_after"], [d + 0.6 * x for d, x in zip(dirty["dog_before"], u)])
    assert close(dirty["dog_before"], [0.6 * m + r for m, r in zip(V_MOCHI, V_REX)])
    four = client.get("/api/replay/4").json()
    assert four["mochi"] == pytest.approx(0.2 * four["mochi_no_slam"]) and four["junk"] == pytest.approx(0.2 * four["junk_no_slam"])
    five = client.get("/api/replay/5").json()
    assert five["kda_mochi"] == pytest.approx(0.95) and five["kda_junk"] == pytest.approx(0.1)
    assert close(five["shelf_row"], V_MOCHI) and close(five["mla_read"], V_MOCHI, 1e-4)
    r = client.get("/api/replay/6")
    assert r.status_code == 422 and r.json()["detail"] == "n: expected a replay from 1 to 5, got 6"


def test_scorecard_matches_the_committed_lab_results(client):
    from pathlib import Path

    from evict.explore import lesson

    docs = Path(__file__).resolve().parents[2] / "results" / "recall"
    card = client.get("/api/scorecard").json()
    assert len(card["rows"]) == 8 and card["setting"] == lesson.SETTING
    again = lesson.measured(docs)  # the committed data/scorecard.json is what the lab's JSONL files say
    for row in card["rows"]:
        assert row["measured"] == (again["best"][row["arch"]] if row["arch"] else None)
    acc = {r["arch"]: r["measured"]["accuracy"] for r in card["rows"] if r["arch"]}
    assert acc["attention"] > 0.99 and acc["linear"] < 0.5 < acc["deltanet"]  # the rows differ at this setting
    link = client.get("/results/results.jsonl")
    assert link.status_code == 200 and '"arch": "attention"' in link.text
    for row in card["rows"]:
        if row["measured"]:
            m = row["measured"]
            run = client.get("/results/" + m["source"].removeprefix("results/recall/full/"), params={"line": m["line"]}).json()
            assert run["arch"] == row["arch"] and run["accuracy"] == m["accuracy"] and run["seq_len"] == 512
    assert client.get("/results/results.jsonl", params={"line": 0}).status_code == 422
    assert client.get("/results/../../pyproject.toml").status_code == 404
    with pytest.raises(ValueError, match="^docs: "):
        lesson.measured(docs / "nowhere")


def test_twin_board_knobs_and_favicon(client):
    t = client.get("/api/twin-boards", params={"keep": 0.6, "clear": 0.3}).json()
    assert t["per_channel"]["survival"]["mochi"][24] == pytest.approx(0.6) and t["scalar"]["survival"]["junk"][24] == pytest.approx(0.3)
    assert client.get("/api/twin-boards", params={"keep": 2}).status_code == 422
    fav = client.get("/favicon.ico")
    assert fav.status_code == 200 and fav.text.startswith("<svg")


def test_whiteboard_capacity_four_facts_fit_a_fifth_blurs(client):
    four = client.get("/api/whiteboard", params={"writes": "cat,tax,owl,bee", "read": "owl"}).json()
    assert all(r["error_norm"] < 1e-12 for r in four["reads"].values()) and close(four["o"], [0, 2, 1, 0])
    five = client.get("/api/whiteboard", params={"writes": "cat,tax,owl,bee,fox", "read": "cat"}).json()
    assert all(r["error_norm"] > 0.5 for r in five["reads"].values())  # every read blurs once a fifth key is in
    assert close(five["error"], [0.5 * x for x in (2.0, 0.0, 1.0, 1.0)])  # cat's read gains (k_cat · k_fox) v_Rusty
    twice = client.get("/api/whiteboard", params={"writes": "cat,cat", "read": "cat"}).json()
    assert close(twice["o"], [2 * x for x in V_MOCHI])  # additive: a second write of the same fact doubles it
