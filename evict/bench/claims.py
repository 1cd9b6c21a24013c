"""`evict bench claims`: the lesson's numeric claims (issue 79, item 6) beside what evict computes or measures.

Exact on any machine (no timing):
    params          KDA's parameters over Gated DeltaNet's, term by term, from our MemoryMixer at the released shapes
                    (on the meta device), against four denominators, and the widths at which the overhead is 1 %
    decode          the committed decode runs (results/bench/decode/*.json): the 3:1 hybrid against all-MLA and against
                    attention, per context, path and batch
Timed (CUDA for the numbers; a CPU run is a smoke test of the same code at tiny sizes, never quoted), in
evict/bench/claims_timed.py:
    attn_res        one training step with AttnRes against the same LM without it (< 2 % of step time claimed)
    situ            SiTU's activation unfused (eager: one kernel per elementwise op) against fused (torch.compile)
                    (≈ 3× claimed), with SwiGLU beside it
    dplr            KDA's chunked kernel against the general DPLR form of the same recurrence (fla's
                    chunk_dplr_delta_rule, optional oracle) (≈ 2× claimed)
Trained (named explicitly: minutes), in evict/bench/claims_train.py:
    attn_res_train  the same small LM with and without AttnRes at counted compute, seeds (Kimi: a 1.25× compute
                    advantage); --full is the GPU scale
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from evict.models import presets

CLAIMS = ("params", "decode", "attn_res", "situ", "dplr", "attn_res_train")
DEFAULT = CLAIMS[:5]  # attn_res_train trains for minutes: only when named
EXACT = ("params", "decode")
RELEASED_KDA = ("kimi_linear_48b", "kimi_k3")
DECODE_RUNS = ("results/bench/decode/decode_cuda_fast.json", "results/bench/decode/decode_cuda_fast_1m.json",
               "results/bench/decode/decode_cuda_paths_batched.json", "results/bench/decode/decode_cuda_1m_batched_h100.json")


# -- params: KDA over Gated DeltaNet ---------------------------------------------------------------------------------

def _mixer_params(cfg, kind: str) -> dict[str, int]:
    """{parameter name: count} of one MemoryMixer of `kind` at cfg's width, built on the meta device."""
    from evict.layers.memory_mixer import MemoryMixer

    with torch.device("meta"):
        m = MemoryMixer(cfg, kind)
    return {n: p.numel() for n, p in m.named_parameters()}


def _kda_layers(cfg) -> int:
    return sum(1 for letter in cfg.layer_mixers() if letter == "K")


def param_overhead(name: str) -> dict:
    """KDA's mixer against Gated DeltaNet's at the released shape `name`: every parameter tensor of both, the
    difference, and the difference as a fraction of the GDN mixer, of one layer's active parameters (mixer + the
    FFN a token visits), of the model's active and of its total parameters."""
    from evict.models.accounting import param_report

    cfg = presets.get(name)
    kda, gdn = _mixer_params(cfg, "kda"), _mixer_params(cfg, "gated_deltanet")
    groups: dict[str, dict] = {}
    for n in sorted(set(kda) | set(gdn)):  # f_gate.0.weight / f_gate.1.weight -> f_gate
        top = n.split(".")[0]
        g = groups.setdefault(top, {"tensor": top, "kda": 0, "gdn": 0, "difference": 0})
        g["kda"] += kda.get(n, 0)
        g["gdn"] += gdn.get(n, 0)
        g["difference"] += kda.get(n, 0) - gdn.get(n, 0)
    per_layer = sum(kda.values()) - sum(gdn.values())
    report = param_report(cfg)
    n_kda = _kda_layers(cfg)
    ffn_active = _active_ffn(cfg)
    return {
        "model": name, "d_model": cfg.d_model, "heads": cfg.n_heads, "head_dim": cfg.head_size,
        "out_gate_rank": "full" if cfg.out_gate_rank is None else cfg.out_gate_rank or cfg.head_size,
        "kda_layers": n_kda, "terms": list(groups.values()),
        "kda_mixer": sum(kda.values()), "gdn_mixer": sum(gdn.values()), "difference": per_layer,
        "of_gdn_mixer": per_layer / sum(gdn.values()),
        "of_layer_active": per_layer / (sum(gdn.values()) + ffn_active),
        "of_model_active": per_layer * n_kda / (report["active"] - per_layer * n_kda),
        "of_model_total": per_layer * n_kda / (report["total"] - per_layer * n_kda),
    }


def _active_ffn(cfg) -> int:
    """Parameters of one MoE FFN a token visits (shared + top_k routed experts + router + latent projections)."""
    from evict.layers.moe import MoE
    from evict.models.lm import LM

    with torch.device("meta"):
        for m in LM(cfg).modules():
            if isinstance(m, MoE):
                return int(m.param_counts()["active"])
    raise ValueError(f"{cfg}: expected a model with an MoE FFN")


def overhead_formula(d: int, H: int, D: int) -> int:
    """KDA's extra parameters per layer over Gated DeltaNet's, in closed form: the decay's low-rank projection
    d·D + D·(H·D) instead of GDN's d·H, and a dt_bias per channel (H·D) instead of per head (H)."""
    return d * D + D * H * D - d * H + H * D - H


def one_percent_widths(D: int = 128, heads_per_width: float = 4096 / 2304, out_gate_rank: int | None = 0) -> list[dict]:
    """The overhead as a fraction of the GDN mixer at widths d = 1024 … 16384 with H·D = heads_per_width · d (Kimi
    Linear's ratio by default) and head dim D, counted from the module: where it falls to 1 %."""
    rows = []
    for d in (1024, 2048, 2304, 4096, 7168, 8192, 16384):
        H = max(1, round(heads_per_width * d / D))
        cfg = presets.get("kda", d_model=d, n_heads=H, head_dim=D, out_gate_rank=out_gate_rank)
        kda, gdn = sum(_mixer_params(cfg, "kda").values()), sum(_mixer_params(cfg, "gated_deltanet").values())
        rows.append({"d_model": d, "heads": H, "head_dim": D, "difference": kda - gdn,
                     "formula": overhead_formula(d, H, D), "of_gdn_mixer": (kda - gdn) / gdn})
    return rows


# -- decode: the hybrid against all-MLA, from the committed runs -------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]  # the checkout evict runs from (results/ is not in the package)


def decode_ratios(paths=DECODE_RUNS, root: str | Path = REPO) -> list[dict]:
    """From each committed decode JSON: per (context, batch mode, variant), ms per token of attention, MLA and the 3:1
    hybrid, and the ratios MLA / hybrid and attention / hybrid (> 1: the hybrid is faster; at the largest batch each
    model has its own batch, shown hybrid / MLA / attention). A missing file is skipped."""
    out = []
    for p in paths:
        path = Path(root) / p
        if not path.exists():
            continue
        d = json.loads(path.read_text())
        by = {(r["model"], r["context"], r["batch_mode"], r["variant"]): r for r in d["rows"] if "ms_per_token" in r}
        for (model, ctx, bm, var), r in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][3])):
            if model != "hybrid":
                continue
            mla, att = by.get(("mla", ctx, bm, var)), by.get(("attention", ctx, bm, var))
            out.append({"run": path.name, "gpu": d["card"].get("gpu"), "date": d["card"]["date"], "context": ctx,
                        "batch": bm if bm == "1" else "max (" + " / ".join(str(x["batch"]) for x in (r, mla, att) if x) + ")",
                        "path": var,
                        "hybrid ms": round(r["ms_per_token"], 3),
                        "MLA ms": None if mla is None else round(mla["ms_per_token"], 3),
                        "attention ms": None if att is None else round(att["ms_per_token"], 3),
                        "MLA / hybrid": None if mla is None else round(mla["ms_per_token"] / r["ms_per_token"], 2),
                        "attention / hybrid": None if att is None else round(att["ms_per_token"] / r["ms_per_token"], 2)})
    return out


# -- the report -----------------------------------------------------------------------------------------------------------

def _pct(x: float) -> str:
    return f"{100 * x:.2f} %" if 100 * x >= 0.1 else f"{100 * x:.4f} %"


def params_markdown(rows: list[dict], widths: list[dict]) -> str:
    from evict.report import markdown_table

    out = []
    for r in rows:
        out.append(f"**{r['model']}** (d {r['d_model']}, {r['heads']} heads × {r['head_dim']}, output gate rank "
                   f"{r['out_gate_rank']}, {r['kda_layers']} KDA layers), parameters per mixer:")
        out.append(markdown_table([{**t, "difference": f"{t['difference']:+,}", "kda": f"{t['kda']:,}", "gdn": f"{t['gdn']:,}"}
                                   for t in r["terms"]], ["tensor", "kda", "gdn", "difference"]))
    summary = [{"model": r["model"], "KDA mixer": f"{r['kda_mixer']:,}", "GDN mixer": f"{r['gdn_mixer']:,}",
                "difference": f"{r['difference']:,}", "of the GDN mixer": _pct(r["of_gdn_mixer"]),
                "of a layer's active": _pct(r["of_layer_active"]), "of the model's active": _pct(r["of_model_active"]),
                "of the model's total": _pct(r["of_model_total"])} for r in rows]
    out.append("The difference against four denominators:")
    out.append(markdown_table(summary, list(summary[0])))
    out.append("Of the GDN mixer at other widths (H·D = 4096/2304 · d, head dim 128, low-rank output gate):")
    out.append(markdown_table([{**w, "difference": f"{w['difference']:,}", "formula": f"{w['formula']:,}",
                                "of_gdn_mixer": _pct(w["of_gdn_mixer"])} for w in widths],
                              ["d_model", "heads", "head_dim", "difference", "formula", "of_gdn_mixer"]))
    out.append("Whole language models, every KDA layer against a Gated DeltaNet one (evict's presets and the 226M LM):")
    out.append(markdown_table([{**p, "kda": f"{p['kda']:,}", "gdn": f"{p['gdn']:,}", "difference": f"{p['difference']:,}",
                                "of the GDN model": _pct(p["of_gdn_model"])} for p in preset_overheads()],
                              ["model", "kda", "gdn", "difference", "of the GDN model"]))
    return "\n\n".join(out)


def preset_overheads() -> list[dict]:
    """Whole-LM parameters with KDA layers against the same LM with Gated DeltaNet layers (meta device)."""
    from dataclasses import replace

    from evict.bench.model import NAMED
    from evict.models import LM

    cfgs = {"kda tiny": presets.get("kda", size="tiny"), "kda small": presets.get("kda", size="small"),
            "kda_226m": NAMED["kda_226m"]()}
    rows = []
    for name, cfg in cfgs.items():
        with torch.device("meta"):
            n_kda = sum(p.numel() for p in LM(cfg).parameters())
            n_gdn = sum(p.numel() for p in LM(replace(cfg, pattern=cfg.pattern.replace("K", "G"))).parameters())
        rows.append({"model": name, "kda": n_kda, "gdn": n_gdn, "difference": n_kda - n_gdn,
                     "of_gdn_model": (n_kda - n_gdn) / n_gdn})
    return rows


def _attn_res_train(result: dict, device: str, full: bool, out, seeds=None, earlier: dict | None = None) -> str:
    """Train the comparison (claims_train), put it in result, plot it beside `out`; the report's section. seeds: the
    mode's seeds instead; earlier: a result of the same setting whose whole seeds are kept (compare_attn_res)."""
    from evict.report import markdown_table

    from . import claims_train as ct

    r = ct.compare_attn_res(ct.setting(full, device, seeds), earlier=earlier)
    result["attn_res_train"] = r
    if out:  # drawn by run_claims with the JSON, once every claim has run (nothing written before a failure)
        from pathlib import Path

        r["plot"] = str(Path(out).with_name(Path(out).stem + "_attn_res_train.png"))
    st = r["setting"]
    head = (f"## AttnRes training efficiency ({'full' if full else 'quick'}, {device}): {st['preset']} d {st['d_model']}, "
            f"{st['n_layers']} layers, AttnRes block {st['attn_res_block']}, T {st['seq_len']} × B {st['batch']}, "
            f"{st['steps']} steps (plain also {ct.FACTOR:g}×), lr {st['lr']}, seeds {st['seeds']}; val loss in nats / char\n\n")
    return head + markdown_table(r["table"], list(r["table"][0])) + "\n\nSummary: " + \
        ", ".join(f"{k} {v}" for k, v in r["summary"].items())


def run_claims(claims=DEFAULT, *, device: str = "cpu", compile: bool = True, modes=("eager",), out=None,
               full: bool = False, seeds=None, earlier: dict | None = None) -> dict:
    """Compute / time / train each of `claims`, print one section per claim, write JSON (and .md beside it, and
    attn_res_train's plot as STEM_attn_res_train.png) to `out`. full: attn_res_train at its GPU scale; seeds: its
    seeds instead of the mode's; earlier: an attn_res_train result whose whole seeds are kept, not trained again."""
    from evict.cli_args import first_line, out_of_memory
    from evict.report import card, markdown_table, write_json

    from . import claims_timed as timed

    result: dict = {"card": card(), "device": device, "claims": list(claims)}
    text = [f"# The lesson's claims: `evict bench claims --device {device}` ({result['card']['date']})\n"]
    if device == "cpu" and set(claims) - set(EXACT):
        text.append("The timed rows below ran on a CPU at tiny sizes: a smoke test of the code, not a measurement.\n")
    for claim in claims:
        if claim == "params":
            rows, widths = [param_overhead(n) for n in RELEASED_KDA], one_percent_widths()
            result["params"], result["params_widths"], result["params_presets"] = rows, widths, preset_overheads()
            text.append("## KDA's parameters over Gated DeltaNet's (exact, from the modules)\n\n" + params_markdown(rows, widths))
        elif claim == "attn_res_train":
            text.append(_attn_res_train(result, device, full, out, seeds, earlier))
        elif claim == "decode":
            rows = decode_ratios()
            if not rows:
                raise FileNotFoundError(f"decode: none of {', '.join(DECODE_RUNS)} under {REPO}")
            result["decode"] = rows
            text.append("## Decode: the 3:1 hybrid against all-MLA and attention (the committed GPU runs)\n\n"
                        + markdown_table(rows, list(rows[0]) if rows else ["run"]))
        else:
            run = {"attn_res": lambda: timed.time_attn_res(device, modes), "situ": lambda: timed.time_situ(device, compile),
                   "dplr": lambda: timed.time_dplr(device)}[claim]
            try:
                rows = run()
            except Exception as e:  # one claim's failure is its row; the call goes on to the next claim
                if out_of_memory(e) and device == "cuda":
                    torch.cuda.empty_cache()
                rows = [{"claim": claim, "device": device, "error": f"{type(e).__name__}: {first_line(e)}"}]
            result[claim] = rows
            cols = list(dict.fromkeys(k for r in rows for k in r))
            text.append(f"## {claim} (timed, {device})\n\n" + markdown_table(rows, cols))
        print(text[-1] + "\n", flush=True)
    if out:
        if "plot" in result.get("attn_res_train", {}):
            from . import claims_train as ct

            ct.plot(result["attn_res_train"], result["attn_res_train"]["plot"])
        path = write_json(out, result)
        md = path.with_suffix(".md")
        md.write_text("\n\n".join(text) + "\n")
        print(f"wrote {path}, {md}")
    return result
