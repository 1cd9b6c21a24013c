"""The figures of scale, computed by the accountant (evict.models.accounting) on the meta device:

    memory_wall(context)   bytes per sequence vs context for the lesson's lines, and one GPU's HBM ceiling
    params(view)           the parameter accountant of the K3-style preset: stored / active per token / ratio to GPT-2
    layer_map()            the K3-style stack layer by layer (mixer, FFN, parameters, cache, AttnRes taps)

Each model is built once per process (K3 takes seconds even on meta) and then asked at any context.
"""

from __future__ import annotations

import functools
import math
import threading

from evict.models import accounting, presets
from evict.models.config import MIXERS, ModelConfig

CONTEXT_MIN, CONTEXT_MAX = 1_000, 10_000_000
GRID = [round(CONTEXT_MIN * 10 ** (i / 20)) for i in range(81)]  # the slider's stops: 20 per decade, 1K … 10M
BYTES = 2  # KV / latent numbers in 16-bit; recurrent states float32 (the accountant's convention)

MODELS = {  # name -> (label, config builder); the K3 model gives two lines (its growing and its fixed caches)
    "gpt2_124m": ("GPT-2 small, MHA (12 layers × 12 heads × 64)", lambda: presets.get("gpt2_124m")),
    "llama70b_gqa": ("Llama-70B-style GQA (80 layers × 8 KV heads × 128)", lambda: ModelConfig(
        vocab_size=128256, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128, pattern="A",
        d_ff=28672, tie_embeddings=False)),
    "dense_mha_k3": ("hypothetical dense MHA at K3 scale (93 layers × 96 heads × 128)", lambda: ModelConfig(
        vocab_size=163840, d_model=7168, n_layers=93, n_heads=96, head_dim=128, pattern="A", d_ff=18432,
        tie_embeddings=False)),
    "kimi_k3": ("K3-style hybrid", lambda: presets.get("kimi_k3")),
}


_BUILDING = threading.Lock()  # the warm-up thread and the first requests ask at once: build each model once


@functools.cache
def _meta_model(name: str):
    return accounting.build_meta(MODELS[name][1]())


def meta_model(name: str):
    with _BUILDING:
        return _meta_model(name)


def _check_context(context) -> int:
    if type(context) is not int or not CONTEXT_MIN <= context <= CONTEXT_MAX:
        raise ValueError(f"context: expected an integer from {CONTEXT_MIN:,} to {CONTEXT_MAX:,}, got {context!r}")
    return context


def _lines(name: str, rows: list[dict]) -> list[dict]:
    """One or two lines of bytes per sequence (each row: one context)."""
    label = MODELS[name][0]
    if name != "kimi_k3":
        return [{"id": name, "label": label, "bytes": [r["total_bytes"] for r in rows], "grows": True}]
    m = meta_model(name)
    n_mla = sum(1 for b in m.blocks if MIXERS[b.letter] == "mla")
    n_fixed = len(m.blocks) - n_mla
    return [{"id": "k3_mla", "label": f"K3-style: its only growing cache, {n_mla} MLA layers (latent 576 / token)",
             "bytes": [r["latent_bytes"] for r in rows], "grows": True},
            {"id": "k3_kda", "label": f"K3-style: {n_fixed} KDA layers' fixed states (S in float32 + conv tails)",
             "bytes": [r["recurrent_bytes"] + r["conv_bytes"] for r in rows], "grows": False}]


LESSON_128K = 128_000  # the lesson's "128K" is decimal (4.7 GB for GPT-2); 2**17 = 131,072 tokens would be 4.83 GB
MHA_HEADS, MHA_HEAD_DIM = 64, 128  # the lesson's MHA comparison for MLA: 2 · 64 heads · 128 = 16,384 numbers per token


def memory_wall(context: int, curves: bool = True) -> dict:
    """Every line at `context`, with bytes per token and where it meets the HBM ceiling; with `curves`, also each
    line over the slider's grid (the page asks for the curves once, then only the point as the slider moves)."""
    context = _check_context(context)
    contexts = (GRID if curves else []) + [context]
    lines = []
    for name in MODELS:
        model = meta_model(name)
        rows = accounting.model_memory(model, contexts, BYTES)
        per_token = accounting.model_memory(model, [2], BYTES)[0]["total_bytes"] - accounting.model_memory(model, [1], BYTES)[0]["total_bytes"]
        for line in _lines(name, rows):
            at = line["bytes"][-1]
            growth = per_token if line["grows"] else 0
            wall = math.ceil((accounting.H200_BYTES - (at - growth * context)) / growth) if growth else None
            lines.append({**line, "bytes": line["bytes"][:-1] if curves else None, "at_context": at, "at_context_text": accounting.fmt_bytes(at),
                          "bytes_per_token": growth, "hits_ceiling_at": wall})
    return {"context": context, "grid": GRID if curves else None, "bytes_per_number": BYTES, "lines": lines,
            "k128": LESSON_128K,
            "ceiling": {"label": "one H200's HBM: 141 GB", "bytes": accounting.H200_BYTES}}


VIEWS = ("stored", "active", "ratio")


@functools.cache
def _k3_params() -> tuple[dict, dict]:
    k3, gpt2 = (accounting.model_params(meta_model(n)) for n in ("kimi_k3", "gpt2_124m"))
    return k3, gpt2


def params(view: str) -> dict:
    """The K3-style preset's parameters by kind in one view: stored (all), active per token, or ratio to GPT-2 small."""
    if view not in VIEWS:
        raise ValueError(f"view: expected one of {VIEWS}, got {view!r}")
    k3, gpt2 = _k3_params()
    cfg = meta_model("kimi_k3").cfg
    total, active, g = k3["total"], k3["active"], gpt2["total"]
    routed_idle = k3["moe"]["total"] - k3["moe"]["active"]  # the routed experts a token does not visit
    kinds = dict(k3["by_kind"])
    if view == "active":
        kinds["experts"] -= routed_idle
    shown = sum(kinds.values())
    bars = [{"kind": k, "params": v, "share": v / shown,
             "text": f"{v / g:,.1f}× GPT-2" if view == "ratio" else accounting.fmt_count(v)} for k, v in kinds.items()]
    headline = {"stored": (total, f"{accounting.fmt_count(total)} parameters stored"),
                "active": (active, f"{accounting.fmt_count(active)} active per token"),
                "ratio": (total / g, f"{total / g:,.0f}× GPT-2 small stored, {active / g:,.0f}× active")}[view]
    lat = accounting.mla_numbers_per_token(cfg)
    return {"view": view, "bars": bars, "headline": headline[1], "value": headline[0],
            "total": total, "active": active, "active_excl_embeddings": k3["active_excl_embeddings"],
            "gpt2_total": g, "ratio_total": total / g, "ratio_active": active / g,
            "ratio_lesson": 2.8e12 / accounting.GPT2_REPORTED, "experts_share": k3["by_kind"]["experts"] / total,
            "mla_numbers_per_token": lat, "mha_numbers_per_token": 2 * MHA_HEADS * MHA_HEAD_DIM,
            "mha": {"heads": MHA_HEADS, "head_dim": MHA_HEAD_DIM}, "mla_saving": 2 * MHA_HEADS * MHA_HEAD_DIM / lat,
            "moe": {"routed": cfg.moe.n_routed, "shared": cfg.moe.n_shared, "top_k": cfg.moe.top_k}}


@functools.cache
def layer_map() -> dict:
    """The K3-style stack, layer by layer: mixer, FFN, stored and active parameters, cache bytes per token, and where
    AttnRes closes a block (its depth snapshots: every `attn_res_block` layers, plus the top)."""
    model = meta_model("kimi_k3")
    cfg = model.cfg
    rows = []
    for i, blk in enumerate(model.blocks):
        stored = sum(p.numel() for p in blk.parameters())
        idle = blk.ffn.param_counts()["total"] - blk.ffn.param_counts()["active"] if blk.ffn_kind == "moe" else 0
        per_token = blk.mixer.state_size(2) - blk.mixer.state_size(1)
        rows.append({"layer": i + 1, "mixer": MIXERS[blk.letter], "letter": blk.letter, "ffn": blk.ffn_kind,
                     "params": stored, "params_text": accounting.fmt_count(stored), "active": stored - idle,
                     "cache_bytes_per_token": per_token * BYTES, "fixed_state_numbers": blk.mixer.state_size(1) - per_token,
                     "snapshot": (i + 1) % cfg.attn_res_block == 0 or i + 1 == cfg.n_layers})
    return {"layers": rows, "pattern": cfg.pattern, "final_mixer": cfg.final_mixer, "attn_res_block": cfg.attn_res_block,
            "snapshots": [r["layer"] for r in rows if r["snapshot"]],
            "counts": {MIXERS[c]: cfg.layer_mixers().count(c) for c in sorted(set(cfg.layer_mixers()))},
            "dense_ffn_layers": [r["layer"] for r in rows if r["ffn"] != "moe"], "why_93": _why_93(cfg)}


def _why_93(cfg: ModelConfig) -> str:
    """Why evict's K3-style stack has one layer and one MLA more than the lesson's 92 and 23 (MODELS.md)."""
    cycles, tail = divmod(cfg.n_layers, len(cfg.pattern))
    n_mla = cfg.layer_mixers().count("M")
    final = MIXERS[cfg.final_mixer].upper() if cfg.final_mixer else "extra"
    return (f"{cfg.n_layers} layers, {n_mla} MLA: {cycles} {cfg.pattern} cycles ({cycles * len(cfg.pattern)} layers, "
            f"{cycles} MLA) plus {tail} final {final} layer on top. The lesson's 92 and 23 count the cycles alone "
            f"({cycles * len(cfg.pattern)} layers, {cycles} MLA); evict keeps the final MLA layer of its K3 spec (MODELS.md), "
            f"so its cache counts {n_mla} latent shelves, not {cycles}.")
