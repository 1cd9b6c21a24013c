"""Decode cost vs context: time per output token of equal-width, equal-depth models of each memory kind.

Models (one preset base, the same d_model / n_layers / heads / FFN for the first four):
    attention  "A"     KV cache, O(N) per token
    mla        "M"     latent cache, O(N) per token, smaller
    kda        "K"     fixed-size state, O(1) per token
    hybrid     "KKKM"  Kimi Linear's 3:1 (last layer MLA), dense FFN like the others
    k3_mini    the k3_mini preset with its features (gated MLA, latent MoE, AttnRes, bounded gates)

Method (the timing itself: evict/models/decode_cost.py). Decode cost does not depend on what the memory holds, only on its shape, so no prompt is prefilled:
one token is run through a fresh cache (this creates the recurrent states and conv tails), every cache tensor
is then filled with random numbers, and `cache.pos` is set to the context length. Each timed step resets
`cache.pos` to the context, runs the one-token forward and samples greedily, so every step attends over exactly
`context` past tokens. Reported: median seconds per step over `steps` steps (after `warmup`), divided by the
batch for time per token. On CUDA each step is bracketed by torch.cuda.synchronize().

Variants (CUDA; side by side in one run):
    graph     the fast path: split-K decode kernels for attention / MLA, graph-safe MoE dispatch, one CUDA graph
    before    the previous path: SDPA / einsum decode and sort-dispatched MoE, one CUDA graph where it captures
    compiled  the fast path with each layer compiled by torch.compile (elementwise chains fused), one CUDA graph
    eager     the fast path without a graph (the only variant on a CPU)
The weights floor: parameter bytes / the card's copy bandwidth (one 1 GiB device-to-device copy, read + write bytes
over its time, measured in the same run): the time to read every weight once per step.

Batches: 1, and the largest batch whose cache fits --max-batch-bytes (cache bytes per sequence at this context,
as allocated), capped at --max-batch. Memory per sequence is reported beside the time.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from evict.models import LM, presets
from evict.models.decode_cost import VARIANTS, cache_bytes, filled_cache, sync, time_variant
from evict.report import card, markdown_table, write_json

KINDS = ("attention", "mla", "kda", "hybrid", "k3_mini")
CPU_CONTEXTS = (256, 512, 1024, 2048, 4096, 8192)
CUDA_CONTEXTS = tuple(1024 * 2**i for i in range(8))  # 1K … 128K
GPU_WIDTH = dict(d_model=1024, n_layers=8, n_heads=8, head_dim=128, d_ff=2816, kv_lora_rank=512, qk_nope_dim=128,
                 qk_rope_dim=64, v_head_dim=128)


def model_configs(kinds=KINDS, size: str = "tiny", width: dict | None = None) -> dict:
    """{kind: ModelConfig} of equal width and depth. `width` overrides the size's shared settings."""
    width = dict(width or {})
    cfgs = {}
    for kind in kinds:
        if kind not in KINDS:
            raise ValueError(f"models: unknown kind {kind!r}; expected some of {', '.join(KINDS)}")
        if kind == "hybrid":
            cfg = presets.hybrid(size=size, **width)
        elif kind == "k3_mini":
            cfg = presets.get("k3_mini", size=size, **width)
            if "d_model" in width:  # the preset derives these from d_model
                half = width["d_model"] // 2
                cfg = replace(cfg, q_lora_rank=half, moe=None if cfg.moe is None else replace(cfg.moe, latent_dim=half))
        else:
            cfg = presets.get(kind, size=size, **width)
        cfgs[kind] = cfg
    return cfgs


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes per second of a device-to-device copy (read + write bytes over the time), median of 5."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    times = []
    for _ in range(6):
        sync(device)
        t0 = time.perf_counter()
        b.copy_(a)
        sync(device)
        times.append(time.perf_counter() - t0)
    del a, b
    return 2 * nbytes / statistics.median(times[1:])


def run(*, device: str = "cpu", kinds=KINDS, contexts=None, size: str | None = None, width: dict | None = None,
        steps: int = 20, warmup: int = 3, max_batch_bytes: int | None = None, max_batch: int | None = None,
        threads: int | None = None, out: str | Path | None = None, progress: bool = True, graphs: bool = False,
        variants=None, batched: bool = True) -> dict:
    """Time every (model, context, batch, variant); print a table; write JSON to `out` and a PNG beside it.

    `variants` (see the module docstring) default to ("graph",) on CUDA and ("eager",) on a CPU; `graphs=True` is the
    older spelling of ("graph",). Variants other than "eager" need CUDA. `batched=False` times batch 1 only."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: CUDA requested but torch.cuda.is_available() is False")
    if threads is not None:
        torch.set_num_threads(threads)
    cuda = dev.type == "cuda"
    variants = tuple(variants or (("graph",) if cuda else ("eager",)))  # `graphs` is the same default, kept for callers
    for v in variants:
        if v not in VARIANTS:
            raise ValueError(f"variants: expected some of {', '.join(VARIANTS)}, got {v!r}")
        if v != "eager" and not cuda:
            raise ValueError(f"variants: {v!r} needs --device cuda (CUDA graphs); use eager on a CPU")
    contexts = tuple(contexts or (CUDA_CONTEXTS if cuda else CPU_CONTEXTS))
    size = size or ("small" if cuda else "tiny")
    width = GPU_WIDTH if (width is None and cuda) else (width or {})
    max_batch_bytes = max_batch_bytes or (64 << 30 if cuda else 256 << 20)
    max_batch = max_batch or (256 if cuda else 32)
    dtype = torch.bfloat16 if cuda else torch.float32
    out = Path(out or f"runs/bench/decode_{dev.type}.json")
    for name, v in (("steps", steps), ("max_batch", max_batch), ("max_batch_bytes", max_batch_bytes)):
        if v < 1:
            raise ValueError(f"{name}: expected >= 1, got {v}")
    if min(contexts) < 1:
        raise ValueError(f"contexts: expected positive lengths, got {list(contexts)}")
    if warmup < 0:
        raise ValueError(f"warmup: expected >= 0, got {warmup}")

    torch.manual_seed(0)
    models = {k: LM(c).to(device=dev, dtype=dtype).eval() for k, c in model_configs(kinds, size, width).items()}
    bandwidth = copy_bandwidth(dev) if cuda else None
    weight_bytes = {k: sum(p.numel() * p.element_size() for p in m.parameters()) for k, m in models.items()}
    rows = []
    jobs = [(k, ctx) for ctx in contexts for k in models]
    bar = tqdm(jobs, desc="decode", disable=not progress, dynamic_ncols=True)
    for kind, ctx in bar:
        model = models[kind]
        with torch.inference_mode():
            per_seq = cache_bytes(filled_cache(model, 1, ctx, extra=1), ctx)
        big = max(1, min(max_batch, max_batch_bytes // max(per_seq, 1)))
        timed: dict = {}
        for mode, batch in (("1", 1), ("max", big)) if batched else (("1", 1),):
            for variant in variants:
                bar.set_postfix(model=kind, context=ctx, batch=batch, variant=variant)
                if (batch, variant) not in timed:
                    timed[batch, variant] = time_variant(model, variant, batch, ctx, steps, warmup)
                step_s, how = timed[batch, variant]
                floor = weight_bytes[kind] / bandwidth if bandwidth else None
                rows.append({"model": kind, "context": ctx, "batch": batch, "batch_mode": mode, "variant": variant,
                             "ms_per_token": 1e3 * step_s / batch, "ms_per_step": 1e3 * step_s,
                             "tokens_per_s": batch / step_s, "cache_MiB_per_seq": per_seq / 2**20, "timing": how,
                             "x_weights_floor": None if floor is None else step_s / floor})
        if cuda:
            torch.cuda.empty_cache()
    bar.close()
    _ratios(rows)
    payload = {"card": card(), "device": str(dev), "dtype": str(dtype).replace("torch.", ""), "size": size,
               "width": width, "layers": {k: m.cfg.pattern + (f"/{m.cfg.final_mixer}" if m.cfg.final_mixer else "")
                                          for k, m in models.items()},
               "params": {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()},
               "weight_bytes": weight_bytes, "copy_bandwidth_GBps": None if bandwidth is None else bandwidth / 1e9,
               "weights_floor_ms": {k: None if bandwidth is None else 1e3 * b / bandwidth for k, b in weight_bytes.items()},
               "steps": steps, "warmup": warmup, "max_batch_bytes": max_batch_bytes, "max_batch": max_batch,
               "variants": list(variants), "graphs": any(v != "eager" for v in variants), "rows": rows}
    print(render(payload))
    print(f"\njson: {write_json(out, payload)}")
    print(f"plot: {plot(payload, out.with_suffix('.png'))}")
    return payload


def _ratios(rows: list[dict]) -> None:
    """speedup_vs_attention = attention's ms/token / this model's (same context, batch mode and variant);
    speedup_vs_before = this model's "before" ms/token / this variant's (same context and batch mode)."""
    key = lambda r: (r["context"], r["batch_mode"], r["variant"])
    att = {key(r): r["ms_per_token"] for r in rows if r["model"] == "attention"}
    before = {(r["model"], r["context"], r["batch_mode"]): r["ms_per_token"] for r in rows if r["variant"] == "before"}
    for r in rows:
        a = att.get(key(r))
        r["speedup_vs_attention"] = a / r["ms_per_token"] if a else None
        b = before.get((r["model"], r["context"], r["batch_mode"]))
        r["speedup_vs_before"] = b / r["ms_per_token"] if b and r["variant"] != "before" else None


def render(payload: dict) -> str:
    cols = ["model", "context", "batch", "variant", "ms_per_token", "tokens_per_s", "cache_MiB_per_seq",
            "speedup_vs_attention", "speedup_vs_before", "x_weights_floor", "timing"]
    x = lambda v, f: "" if v is None else f.format(v)
    fmt = []
    for r in payload["rows"]:
        fmt.append({**r, "ms_per_token": f"{r['ms_per_token']:.3f}", "tokens_per_s": f"{r['tokens_per_s']:.0f}",
                    "cache_MiB_per_seq": f"{r['cache_MiB_per_seq']:.3f}",
                    "speedup_vs_attention": x(r["speedup_vs_attention"], "{:.2f}×"),
                    "speedup_vs_before": x(r.get("speedup_vs_before"), "{:.2f}×"),
                    "x_weights_floor": x(r.get("x_weights_floor") if r["batch_mode"] == "1" else None, "{:.1f}×")})
    floors = payload.get("weights_floor_ms") or {}
    head = (f"decode on {payload['device']} ({payload['dtype']}, size {payload['size']}, width {payload['width'] or 'preset'}); "
            f"median of {payload['steps']} steps; layers {payload['layers']}")
    if payload.get("copy_bandwidth_GBps"):
        head += (f"\ncopy bandwidth {payload['copy_bandwidth_GBps']:.0f} GB/s; weights floor (ms/step): "
                 + ", ".join(f"{k} {v:.3f}" for k, v in floors.items()))
    return head + "\n\n" + markdown_table(fmt, cols)


def plot(payload: dict, png: str | Path) -> Path:
    """Log-log ms/token vs context, one line per model; batch 1 and max batch side by side."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter

    fig = Figure(figsize=(11, 4.2), constrained_layout=True)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    for ax, mode, title in zip(axes, ("1", "max"), ("batch 1", "largest batch within the memory budget")):
        variants = list(dict.fromkeys(r.get("variant", "eager") for r in payload["rows"]))
        for kind in dict.fromkeys(r["model"] for r in payload["rows"]):
            for variant, style in zip(variants, ("o-", "x--", "s:", "^-.")):
                pts = [(r["context"], r["ms_per_token"]) for r in payload["rows"]
                       if r["model"] == kind and r["batch_mode"] == mode and r.get("variant", "eager") == variant]
                if pts:
                    ax.plot(*zip(*pts), style, ms=3, label=kind if len(variants) == 1 else f"{kind} ({variant})")
        ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="ms per output token", title=title)
        ctxs = sorted({r["context"] for r in payload["rows"]})
        ax.set_xticks(ctxs, [f"{c // 1024}K" if c >= 1024 else str(c) for c in ctxs])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle(f"decode cost vs context — {payload['device']}, {payload['dtype']}")
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    return png


def add_arguments(g) -> None:
    """`evict bench decode`'s own flags (--device and --out are added by evict/commands/bench.py)."""
    from evict.cli_args import positive_int

    g.add_argument("--contexts", type=int, nargs="+", help="context lengths (default CPU 256 … 8K, CUDA 1K … 128K)")
    g.add_argument("--models", nargs="+", choices=KINDS, help=f"default all: {' '.join(KINDS)}")
    g.add_argument("--size", choices=sorted(presets.SIZES), help="preset size (default tiny on CPU, small on CUDA)")
    g.add_argument("--d-model", type=positive_int, help="width override (CUDA default 1024, with 8 layers, 8 heads of 128)")
    g.add_argument("--n-layers", type=positive_int)
    g.add_argument("--n-heads", type=positive_int)
    g.add_argument("--steps", type=int, default=20, help="timed decode steps per point (median)")
    g.add_argument("--warmup", type=int, default=3)
    g.add_argument("--max-batch-bytes", type=int, help="cache budget for the batched point (default 256 MiB CPU, 64 GiB CUDA)")
    g.add_argument("--max-batch", type=int, help="cap on the batched point (default 32 CPU, 256 CUDA)")
    g.add_argument("--threads", type=positive_int, help="torch CPU threads")
    g.add_argument("--graphs", action="store_true", help="CUDA: time each step replayed from a CUDA graph (= --paths graph)")
    g.add_argument("--paths", nargs="+", choices=VARIANTS,
                   help="CUDA: graph (fast path), before (previous path), compiled (+ torch.compile), eager; default graph")
    g.add_argument("--batch1-only", action="store_true", help="time batch 1 only (skip the largest-batch point)")


def cli_run(args) -> dict:
    width = None
    overrides = {k: v for k, v in (("d_model", args.d_model), ("n_layers", args.n_layers), ("n_heads", args.n_heads))
                 if v is not None}
    if overrides:
        width = {**(GPU_WIDTH if args.device.startswith("cuda") else {}), **overrides}
    try:
        return run(device=args.device, kinds=tuple(args.models or KINDS), contexts=args.contexts, size=args.size,
                   width=width, steps=args.steps, warmup=args.warmup, max_batch_bytes=args.max_batch_bytes,
                   max_batch=args.max_batch, threads=args.threads, out=args.out, graphs=args.graphs,
                   variants=args.paths, batched=not args.batch1_only)
    except ValueError as e:
        raise SystemExit(f"bench decode: {e}") from None
