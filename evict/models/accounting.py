"""The accountant: parameters and per-sequence memory of a config, counted on the meta device (nothing allocated).

    param_report(cfg)                          -> {"total", "active", "active_excl_embeddings", "by_kind", ...}
    memory_report(cfg, contexts, bytes_per_number=2) -> [{"context", "kv_bytes", "latent_bytes", "recurrent_bytes", ...}]
    model_params(model), model_memory(model, contexts, bytes_per_number=2) -> the same for an LM already built
    comparisons(name, cfg)                     -> rows {"figure", "computed", "expected", "note"} (the seeds' figures)
    plot_memory({name: cfg}, contexts, png)    -> the "memory wall": bytes per sequence vs context, log-log

Conventions
- Parameters are counted once each (a tied head shares the token table and is not counted again).
- Active per token: every parameter except the routed experts a token does not visit, i.e. per MoE layer
  shared experts + router + top_k routed experts + the latent projections/norm (`MoE.param_counts()["active"]`).
  `active` counts the embedding tables and the head in full (the convention of the released "A3B" / "~104B
  active" figures); `active_excl_embeddings` drops the token table, the position table and an untied head
  (a token reads one row of the input table; the head is a d x vocab matmul, compute but not "model" width).
- Memory per sequence, from each mixer's `state_size(context_len)` (numbers held):
  KV (softmax attention, A) and latent (MLA, M) in the activation dtype (`bytes_per_number`);
  recurrent state S of the linear/delta family (L/D/G/K/C) always float32 (4 bytes), their short-conv tails
  in the activation dtype. Weights are not included: this is what each extra sequence costs.

The MLA comparison. Per token per MLA layer the cache holds c (kv_lora_rank 512) + k_rope (64) = 576 numbers.
The lesson sets this against 16,384 numbers for "full MHA K+V" (16,384 / 576 = 28.4x). 16,384 = 2 (K and V)
x 128 heads x 64 dims — equivalently 128 heads x 128 dims for K alone. The DeepSeek-V3 MHA that MLA replaces
(128 heads, K dim 128 + 64 = 192, V dim 128) would cache 128 x (192 + 128) = 40,960 numbers (71x); with 128-dim
K and V, 2 x 128 x 128 = 32,768 (57x). `comparisons` prints the lesson's 16,384 with that reading and, for
each MLA preset, the MHA that the same config would need (heads x (qk_nope + qk_rope + v_head)).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from .config import MIXERS, ModelConfig

ATTENTION_LETTERS = ("A", "M")
MEMORY_LETTERS = ("L", "D", "G", "K", "C")
KINDS = ("embeddings", "attention_mixers", "memory_mixers", "dense_ffn", "experts", "attn_res", "norms")
STATE_BYTES = 4  # the linear/delta family keeps S in float32 whatever the activation dtype
GPT2_REPORTED = 124e6  # the lesson's GPT-2 small parameter count
H200_BYTES = 141e9
# forward FLOPs per token per head of each memory op, in units of D² (train_flops_per_token): write 2 + read 2,
# + retrieval 2 for the delta rule, + fade 1 for a decay
MEMORY_D2 = {"linear": 4, "gla": 5, "deltanet": 6, "gated_deltanet": 7, "kda": 7}


def _check_cfg(cfg) -> None:
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg: expected a ModelConfig, got {type(cfg).__name__}")


def build_meta(cfg: ModelConfig):
    """The LM on the meta device: shapes only, no storage (K3's ~2.8T parameters cost nothing)."""
    from .lm import LM

    _check_cfg(cfg)
    lm_log = logging.getLogger(LM.__module__)
    level = lm_log.level
    lm_log.setLevel(logging.WARNING)  # the report prints the layer list itself, once
    try:
        with torch.device("meta"):
            return LM(cfg)
    finally:
        lm_log.setLevel(level)


def _kind(name: str, letters: list[str], ffn_kinds: list[str]) -> str:
    """The accounting kind of one parameter name of LM."""
    parts = name.split(".")
    if parts[0] in ("embed", "wpe", "head"):
        return "embeddings"
    if parts[0] == "final_read":
        return "attn_res"
    if parts[0] == "norm":
        return "norms"
    if parts[0] == "blocks":
        i, sub = int(parts[1]), parts[2]
        if sub == "mixer":
            return "attention_mixers" if letters[i] in ATTENTION_LETTERS else "memory_mixers"
        if sub == "ffn":
            return "experts" if ffn_kinds[i] == "moe" else "dense_ffn"
        if sub in ("read_mixer", "read_ffn"):
            return "attn_res"
        if sub in ("norm1", "norm2"):
            return "norms"
    raise ValueError(f"name: no accounting kind for parameter {name!r}")


def param_report(cfg: ModelConfig) -> dict:
    """Parameter counts of `cfg` (built on the meta device). See the module docstring for the conventions.

    Returns {"total", "active", "active_excl_embeddings", "embeddings": {"token", "position", "head"},
    "by_kind": {kind: count}, "moe": {"layers", "total", "active"}, "tied": bool}.
    """
    return model_params(build_meta(cfg))


def model_params(model) -> dict:
    """`param_report` of an LM already built (e.g. once, on the meta device)."""
    cfg = model.cfg
    letters, ffn_kinds = cfg.layer_mixers(), cfg.layer_ffns()
    by_kind = dict.fromkeys(KINDS, 0)
    for name, p in model.named_parameters():  # shared (tied) parameters are yielded once
        by_kind[_kind(name, letters, ffn_kinds)] += p.numel()
    total = sum(by_kind.values())
    moe = [m.param_counts() for m in model.moe_layers()]
    moe_total, moe_active = sum(c["total"] for c in moe), sum(c["active"] for c in moe)
    emb = {"token": model.embed.weight.numel(),
           "position": 0 if model.wpe is None else model.wpe.weight.numel(),
           "head": 0 if cfg.tie_embeddings else model.head.weight.numel()}
    active = total - (moe_total - moe_active)
    return {"total": total, "active": active, "active_excl_embeddings": active - sum(emb.values()),
            "embeddings": emb, "by_kind": by_kind, "tied": cfg.tie_embeddings,
            "moe": {"layers": len(moe), "total": moe_total, "active": moe_active}}


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> dict:
    """Model FLOPs of one trained token at `seq_len` (forward + backward = 3 × forward; the MFU convention):
    - params: 6 × the active parameters that multiply (embeddings excluded: a lookup; an untied head included)
    - mixing: the sequence work that has no parameters, 3 × forward per layer: softmax / MLA attention
      2 × H × (d_qk + d_v) × T/2 (causal: a query sees T/2 keys on average); a memory op MEMORY_D2[kind] × H × D²,
      the recurrent form's per-token work on the D × D state per head (the chunked form does it in another order):
      write k vᵀ (2 D²) and read qᵀS (2 D²), plus for the delta rule the retrieval Sᵀk before the write (2 D²), plus
      for a decay the fade of S (D²: a scalar or per-channel gate times every entry); O(D) terms (β, the normaliser)
      are left out. Returns {"params", "mixing", "total"}."""
    _check_cfg(cfg)
    r = param_report(cfg)
    matmul = r["active"] - r["embeddings"]["token"] - r["embeddings"]["position"]
    if cfg.tie_embeddings:  # the tied head is a matmul too
        matmul += r["embeddings"]["token"]
    H, D = cfg.n_heads, cfg.head_size
    mixing: float = 0
    for letter in cfg.layer_mixers():
        kind = MIXERS[letter]
        if kind == "mla":
            mixing += 2 * H * (cfg.qk_nope_dim + cfg.qk_rope_dim + cfg.v_head_dim) * seq_len / 2
        elif kind == "attention":
            mixing += 2 * H * 2 * D * seq_len / 2
        else:
            mixing += MEMORY_D2[kind] * H * D * D
    return {"params": 6 * matmul, "mixing": 3 * mixing, "total": 6 * matmul + 3 * mixing}


def _check_contexts(contexts) -> list[int]:
    contexts = list(contexts)
    if not contexts or not all(isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in contexts):
        raise ValueError(f"contexts: expected a non-empty list of positive ints, got {contexts!r}")
    return contexts


def memory_report(cfg: ModelConfig, contexts, bytes_per_number: int = 2) -> list[dict]:
    """Bytes held per sequence at each context length, split by kind of state.

    One row per context: {"context", "kv_bytes", "latent_bytes", "recurrent_bytes" (S, float32),
    "conv_bytes" (short-conv tails), "total_bytes", "numbers"}. KV/latent/conv use `bytes_per_number`.
    """
    contexts = _check_contexts(contexts)
    if not isinstance(bytes_per_number, int) or isinstance(bytes_per_number, bool) or bytes_per_number < 1:
        raise ValueError(f"bytes_per_number: expected a positive int, got {bytes_per_number!r}")
    return model_memory(build_meta(cfg), contexts, bytes_per_number)


def model_memory(model, contexts, bytes_per_number: int = 2) -> list[dict]:
    """`memory_report` of an LM already built (e.g. once, on the meta device, then asked at many contexts)."""
    return _memory(model, _check_contexts(contexts), bytes_per_number)


def _memory(model, contexts: list[int], bytes_per_number: int) -> list[dict]:
    rows = []
    for n in contexts:
        kv = latent = rec = conv = numbers = 0
        for blk in model.blocks:
            m, size = blk.mixer, blk.mixer.state_size(n)
            numbers += size
            kind = MIXERS[blk.letter]
            if kind == "attention":
                kv += size * bytes_per_number
            elif kind == "mla":
                latent += size * bytes_per_number
            else:
                s = m.H * m.D * (m.D + (1 if m.normalizer else 0))  # S [H, D, D(+1)]
                rec += s * STATE_BYTES
                conv += (size - s) * bytes_per_number
        rows.append({"context": n, "kv_bytes": kv, "latent_bytes": latent, "recurrent_bytes": rec, "conv_bytes": conv,
                     "total_bytes": kv + latent + rec + conv, "numbers": numbers})
    return rows


# -- the seeds' comparisons ------------------------------------------------------------------------------------


def kv_bytes_per_token(cfg: ModelConfig, bytes_per_number: int = 2) -> int:
    """KV-cache bytes per token of the softmax-attention layers: 2 x layers x kv_heads x d_head x bytes."""
    n_attn = sum(1 for c in cfg.layer_mixers() if c == "A")
    return 2 * n_attn * cfg.kv_heads * cfg.head_size * bytes_per_number


def mla_numbers_per_token(cfg: ModelConfig) -> int:
    """Latent-cache numbers per token per MLA layer: kv_lora_rank + qk_rope_dim (512 + 64 = 576 released)."""
    return cfg.kv_lora_rank + cfg.qk_rope_dim


def fmt_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:g}"


def fmt_bytes(b: float) -> str:
    """Decimal units (1 GB = 1e9 B), as the lesson quotes them."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(b) >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{b:g} B"


def comparisons(name: str, cfg: ModelConfig, bytes_per_number: int = 2, params: dict | None = None) -> list[dict]:
    """The lesson's figures for this preset, computed from the config, beside the figures the seeds quote.

    `params`: this config's `param_report` when the caller already has it (K3 takes seconds to build on meta).
    """
    rows = []
    params = param_report(cfg) if params is None else params
    gpt2_total = param_report(_gpt2())["total"] if name != "gpt2_124m" else params["total"]
    if "A" in cfg.layer_mixers():
        per_tok = kv_bytes_per_token(cfg, bytes_per_number)
        rows.append({"figure": "KV bytes / token", "computed": f"{per_tok:,} B",
                     "expected": "36,864 B (GPT-2 fp16)" if name == "gpt2_124m" else "",
                     "note": f"2 x {cfg.layer_mixers().count('A')} layers x {cfg.kv_heads} kv heads x {cfg.head_size} x {bytes_per_number} B"})
        if name == "gpt2_124m":
            for n, expected, note in ((1024, "37.7 MB", ""),
                                      (131_072, "4.7 GB", "at 128K = 131,072; the seeds' 4.7 GB is 128,000 tokens"),
                                      (128_000, "4.7 GB", "128K read as 128,000 tokens"),
                                      (1_048_576, "37 GB", "at 1M = 1,048,576; the seeds' 37 GB is 1,000,000 tokens"),
                                      (1_000_000, "37 GB", "1M read as 1,000,000 tokens")):
                rows.append({"figure": f"KV at {n:,} tokens", "computed": fmt_bytes(per_tok * n), "expected": expected,
                             "note": note or "decimal MB"})
    if "M" in cfg.layer_mixers():
        lat = mla_numbers_per_token(cfg)
        mha = cfg.n_heads * (cfg.qk_nope_dim + cfg.qk_rope_dim + cfg.v_head_dim)
        rows.append({"figure": "MLA cache numbers / token / MLA layer", "computed": f"{lat:,}",
                     "expected": "576 (512 + 64)", "note": f"kv_lora {cfg.kv_lora_rank} + rope {cfg.qk_rope_dim}"})
        rows.append({"figure": "lesson's full MHA K+V / token / layer", "computed": f"{2 * 128 * 64:,} ({2 * 128 * 64 / lat:.1f}x)",
                     "expected": "16,384 (~28x)", "note": "2 x 128 heads x 64 dims (= 128 heads x 128 dims, K only)"})
        rows.append({"figure": "same-config MHA K+V / token / layer", "computed": f"{mha:,} ({mha / lat:.1f}x)", "expected": "",
                     "note": f"{cfg.n_heads} heads x (K {cfg.qk_nope_dim}+{cfg.qk_rope_dim} + V {cfg.v_head_dim})"})
    extra = cfg.extra or {}
    for key, label in (("reported_params", "total params"), ("reported_total", "total params"), ("reported_active", "active params")):
        if key in extra:
            got = params["active"] if key == "reported_active" else params["total"]
            rows.append({"figure": label, "computed": fmt_count(got), "expected": f"{fmt_count(extra[key])} (reported)",
                         "note": f"config gives {got:,} ({got / extra[key]:.2f}x reported)"})
    if name == "kimi_linear_48b":
        rows.append({"figure": "why not 48B / 3B", "computed": f"experts {fmt_count(params['by_kind']['experts'])}",
                     "expected": "48B / 3B", "note": "the name's 48B/A3B are rounded labels: MoE layers alone hold "
                     f"{fmt_count(params['by_kind']['experts'])}; active without embeddings + head is "
                     f"{fmt_count(params['active_excl_embeddings'])} (~3B), with them {fmt_count(params['active'])}"})
    if name != "gpt2_124m":
        rows.append({"figure": "total / GPT-2 small", "computed": f"{params['total'] / gpt2_total:,.0f}",
                     "expected": "22,580 (2.8T / 124M)" if name == "kimi_k3" else "",
                     "note": f"our GPT-2 124M counts {gpt2_total:,}"})
        rows.append({"figure": "active / GPT-2 small", "computed": f"{params['active'] / gpt2_total:,.0f}", "expected": "",
                     "note": f"excl. embeddings: {params['active_excl_embeddings'] / gpt2_total:,.0f}"})
    if name == "kimi_k3" and cfg.moe is not None:
        rows.append({"figure": "routed experts / MoE layer", "computed": f"{cfg.moe.n_routed} (+{cfg.moe.n_shared} shared)",
                     "expected": "898 (seeds)", "note": "896 routed + 2 shared = 898 experts per layer"})
        rows.append({"figure": "layers", "computed": f"{cfg.n_layers}", "expected": "92 (seeds)",
                     "note": f"{cfg.layer_mixers().count('M')} MLA + {cfg.layer_mixers().count('K')} KDA; the 93rd is the final MLA"})
        rows.append({"figure": "seeds' 2.8T / 124M", "computed": f"{2.8e12 / GPT2_REPORTED:,.0f}", "expected": "22,580",
                     "note": "the lesson's ratio from its rounded figures"})
    return rows


def _gpt2() -> ModelConfig:
    from . import presets

    return presets.get("gpt2_124m")


# -- tables and the memory wall --------------------------------------------------------------------------------


def param_rows(report: dict) -> list[dict]:
    t = report["total"]
    rows = [{"kind": k, "params": f"{v:,}", "human": fmt_count(v), "share": f"{100 * v / t:.1f}%"} for k, v in report["by_kind"].items()]
    tied = " (tied head counted once)" if report["tied"] else ""
    rows += [{"kind": "**total**" + tied, "params": f"{t:,}", "human": fmt_count(t), "share": "100%"},
             {"kind": "**active / token** (incl. embedding table + head)", "params": f"{report['active']:,}",
              "human": fmt_count(report["active"]), "share": f"{100 * report['active'] / t:.1f}%"},
             {"kind": "**active / token** (excl. embeddings + head)", "params": f"{report['active_excl_embeddings']:,}",
              "human": fmt_count(report["active_excl_embeddings"]), "share": f"{100 * report['active_excl_embeddings'] / t:.1f}%"}]
    return rows


def memory_rows(rows: list[dict]) -> list[dict]:
    return [{"context": f"{r['context']:,}", "KV": fmt_bytes(r["kv_bytes"]), "latent (MLA)": fmt_bytes(r["latent_bytes"]),
             "recurrent S (fp32)": fmt_bytes(r["recurrent_bytes"]), "conv tails": fmt_bytes(r["conv_bytes"]),
             "total / sequence": fmt_bytes(r["total_bytes"])} for r in rows]


def plot_memory(cfgs: dict, contexts, png, bytes_per_number: int = 2) -> Path:
    """Log-log memory per sequence vs context, one line per preset, with the H200's 141 GB as a wall."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = _check_contexts(contexts)
    if not isinstance(cfgs, dict) or not cfgs:
        raise ValueError(f"cfgs: expected a non-empty dict of name -> ModelConfig, got {cfgs!r}")
    lo, hi = min(contexts), max(contexts)
    grid = sorted({max(1, round(math.exp(math.log(lo) + (math.log(hi) - math.log(lo)) * i / 48))) for i in range(49)} | set(contexts))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, cfg in cfgs.items():
        ys = [r["total_bytes"] for r in memory_report(cfg, grid, bytes_per_number)]
        ax.plot(grid, ys, label=name)
        ax.scatter(contexts, [ys[grid.index(c)] for c in contexts], s=12)
    ax.axhline(H200_BYTES, color="red", linestyle="--", linewidth=1)
    ax.text(grid[0], H200_BYTES * 1.15, "H200: 141 GB", color="red", fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel(f"bytes per sequence ({bytes_per_number}-byte KV/latent, fp32 S)")
    ax.set_title("Memory per sequence vs context (the memory wall)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def size_report(name: str, cfg: ModelConfig, contexts, bytes_per_number: int = 2) -> dict:
    """Everything `evict size` prints, as data: params, memory rows, comparisons."""
    contexts = _check_contexts(contexts)
    model = build_meta(cfg)
    params = model_params(model)
    return {"preset": name, "layers": "".join(cfg.layer_mixers()), "params": params,
            "memory": _memory(model, contexts, bytes_per_number), "bytes_per_number": bytes_per_number,
            "comparisons": comparisons(name, cfg, bytes_per_number, params=params)}


def render(report: dict) -> str:
    """The markdown `evict size` prints."""
    from evict.report import markdown_table

    letters = report["layers"]
    counts = ", ".join(f"{letters.count(c)} {MIXERS[c]}" for c in sorted(set(letters), key=letters.index))
    out = [f"## {report['preset']}: {len(letters)} layers ({counts}); mixers {letters}", "",
           "### Parameters (counted once; active = shared + router + top_k routed experts per MoE layer, all else in full)", "",
           markdown_table(param_rows(report["params"]), ["kind", "params", "human", "share"]), "",
           f"### Memory per sequence ({report['bytes_per_number']} B per KV/latent/conv number; S in float32)", "",
           markdown_table(memory_rows(report["memory"]), ["context", "KV", "latent (MLA)", "recurrent S (fp32)", "conv tails", "total / sequence"])]
    if report["comparisons"]:
        out += ["", "### The lesson's figures, computed", "",
                markdown_table(report["comparisons"], ["figure", "computed", "expected", "note"])]
    return "\n".join(out)
