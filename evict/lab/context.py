"""The ratio-against-context lab (`evict lab context`): each KDA : attention ratio's text quality at contexts longer
than it was trained on, beside its measured decode cost at each context, at matched training FLOPs, two scales, seeds.

The hybrid lab (evict/lab/hybrid.py) ranks ratios at one context length and equal parameters. Here every ratio is
trained on next-character text at one short length (`train_len`) and then read at several longer ones (`contexts`):
length generalisation. Beside each ratio's quality, the same model's decode ms per token and cache bytes, measured
(evict.models.decode_cost: `evict bench decode`'s timing and cache count) at each context.

Models. The hybrid lab's model (`hybrid.shape_config`: heads of `head_dim`, the kernel-4 short conv on every mixer,
dense SwiGLU of width 2 × d_model) at each width of `scales`, `n_layers` deep, the attention layers spread as in Kimi
Linear (`hybrid.layer_pattern`: KKKKKKKM for 7:1, KKKM… for 3:1, KM… for 1:1), MLA (`M`, NoPE, latent cache) or plain
attention (`A`, RoPE, KV cache) by `kinds`. One shape per scale: the models differ in parameters (a KDA layer has
more than an MLA layer); what is matched is training compute.

Matched training FLOPs. F(model) = evict.models.accounting.train_flops_per_token(cfg, train_len)["total"]: 6 × the
matmul parameters (the head included) + 3 × the forward work without parameters, which for attention grows with T
(2 · H · (d_qk + d_v) · T/2 a layer, causal) and for the memory op is fixed (MEMORY_D2 · H · D², KDA's 7: write,
read, retrieve, fade). The first ratio of `ratios` (all-KDA by default) trains `steps` steps; the budget is
steps × batch × train_len × F(first), and every model trains round(budget / (batch × train_len × F)) steps
(`matched_steps`), so the FLOPs differ by less than half a step's worth (the table shows each model's FLOPs).

Quality: the next-character loss (nats/char) over the last `train_len` positions of a window of T tokens (`tail
loss`), for T in `contexts`: every window of every T ends at the same `windows` points of the validation text, so at
each T the same characters are scored, with T − train_len more characters before them than training ever showed.
A model that uses a longer context gets lower as T grows; one that breaks past its training length gets higher.

Decode: evict.models.decode_cost (`evict bench decode`'s timing) at batch 1 on an untrained model of the same
config (cost depends on shape, not weights): a cache filled to the context, the median of `decode_steps` one-token
steps (CUDA: replayed from a CUDA graph, bf16; CPU: eager, float32, one thread), and the bytes the cache holds per
sequence, as allocated. Timed one model at a time, after the training runs (never beside them), at `contexts` and
the longer `decode_contexts`.

Outputs under runs/context/<timestamp>/: config.json, results.jsonl (one training run a row), decode.jsonl (one
model a row), table.md, table.csv (one row per model, scale and context), context.png; runs/<name>/result.json.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from evict.lab import hybrid
from evict.lab.sweep import (diverged, fresh_compile, from_json, lab_train_config, out_of_time, run_grid, run_jobs,
                              seeds_of, seeds_phrase, sweep_folder)
from evict.models import LM, accounting
from evict.report import markdown_table
from evict.tasks.text import TextTask, corpus_files
from evict.train import train


@dataclass
class ContextSweep:
    ratios: tuple = ("1:0", "3:1", "1:1", "0:1")  # KDA : attention; the first one's steps set the FLOPs budget
    kinds: tuple = ("mla",)  # the attention layers: hybrid.KINDS keys
    scales: tuple = (16, 32)  # d_model of each scale
    n_layers: int = 4
    head_dim: int = 8
    chunk_size: int | None = 16  # None: the memory op picks by shape
    gate_dt: tuple = hybrid.recall.DEFAULT_GATE_DT
    corpus: str | None = None  # None = Shakespeare
    train_len: int = 32
    contexts: tuple = (32, 64, 128, 256)  # quality read at these (increasing, each >= train_len); decode timed too
    decode_contexts: tuple = (1024, 8192, 65_536)  # decode also timed here
    windows: int = 64  # validation windows per context
    steps: int = 250  # the first ratio's; every other model gets the same training FLOPs
    batch_size: int = 16
    lr: float = 1e-2
    eval_every: int = 100_000  # training's own validation: once, at the end (the lab reads its own)
    eval_batches: int = 1
    decode_steps: int = 10
    decode_warmup: int = 2
    seed: int = 0
    seeds: int = 2
    workers: int = 2
    device: str = "cpu"
    compile: bool = False  # CUDA: each block through torch.compile (sweep.compiles)


QUICK = ContextSweep()  # 4 layers (no 7:1), d 16 and 32, 250 steps at T 32: ~200 CPU-seconds (docs/labs/hybrid.md)
FULL = ContextSweep(  # one GPU, ~90 min; not run yet (docs/labs/hybrid.md)
    ratios=("1:0", "7:1", "3:1", "1:1", "0:1"), kinds=("mla", "attention"), n_layers=8, scales=(128, 256), head_dim=32,
    chunk_size=None,
    gate_dt=(1e-4, 1e-3), train_len=256, contexts=(256, 512, 1024, 2048, 4096), decode_contexts=(16_384, 131_072),
    steps=2000, batch_size=32, lr=3e-3, decode_steps=30, decode_warmup=5, seeds=3, workers=4, device="auto",
    compile=True,
)
WHICH_FIELDS = ("seed", "seeds")


@dataclass(frozen=True)
class Model:
    kind: str  # "kda" (all-KDA) or a hybrid.KINDS key
    ratio: str
    pattern: str
    d_model: int

    @property
    def name(self) -> str:
        return f"{self.kind}_{self.ratio.replace(':', 'to')}_d{self.d_model}"

    @property
    def label(self) -> str:
        return f"{'KDA only' if self.kind == 'kda' else self.kind} {self.ratio}"


def models(sweep: ContextSweep) -> list[Model]:
    """Every model: per scale, all-KDA once and every (kind, ratio) with attention layers spread."""
    out = []
    for d in sweep.scales:
        for ratio in sweep.ratios:
            a, b = hybrid.parse_ratio(ratio)
            for kind in (("kda",) if b == 0 else sweep.kinds):
                letter = hybrid.LINEAR if b == 0 else hybrid.KINDS[kind]
                m = Model(kind, ratio, hybrid.layer_pattern(ratio, sweep.n_layers, "spread", letter), d)
                out.append(m)
    return out


def model_config(sweep: ContextSweep, m: Model, vocab_size: int):
    """`m`'s config: the hybrid lab's model at width m.d_model, SwiGLU 2 × d_model."""
    shape = hybrid.HybridSweep(n_layers=sweep.n_layers, d_model=m.d_model, head_dim=sweep.head_dim, d_ff=2 * m.d_model,
                               chunk_size=sweep.chunk_size, gate_dt=tuple(sweep.gate_dt), seq_len=sweep.train_len,
                               text_seq_len=sweep.train_len, vocab_size=vocab_size)
    return hybrid.shape_config(shape, m.pattern, shape.d_ff, vocab_size)


# -- matched training FLOPs ----------------------------------------------------------------------------------------


def steps_for_budget(budget: float, flops_per_token: float, tokens_per_step: int) -> int:
    """The whole steps that spend `budget` FLOPs nearest (at least one)."""
    return max(1, round(budget / (flops_per_token * tokens_per_step)))


def matched_steps(sweep: ContextSweep, vocab_size: int) -> dict[str, dict]:
    """model name -> {"flops_per_token", "steps", "train_flops"}: at each scale the first ratio's model trains
    sweep.steps steps, and that budget (steps × batch × train_len × its F) sets every other model's steps."""
    tokens = sweep.batch_size * sweep.train_len
    out: dict[str, dict] = {}
    for d in sweep.scales:
        ms = [m for m in models(sweep) if m.d_model == d]
        f = {m.name: accounting.train_flops_per_token(model_config(sweep, m, vocab_size), sweep.train_len)["total"]
             for m in ms}
        budget = sweep.steps * tokens * f[ms[0].name]
        for m in ms:
            steps = steps_for_budget(budget, f[m.name], tokens)
            out[m.name] = {"flops_per_token": f[m.name], "steps": steps, "train_flops": steps * tokens * f[m.name],
                           "budget": budget}
    return out


# -- quality at longer contexts ------------------------------------------------------------------------------------


def window_ends(n_tokens: int, longest: int, windows: int) -> np.ndarray:
    """Where the `windows` validation windows end (the index of the last input token + 1): evenly spaced over a text
    of n_tokens so that a window of `longest` tokens and its targets fit before every end."""
    stride = (n_tokens - 1 - longest) // windows
    if stride < 1:
        raise ValueError(f"contexts: the validation text ({n_tokens} tokens) is too short for {windows} windows of "
                         f"{longest}; lower --contexts or windows")
    return longest + stride * np.arange(windows)


def window_rows(val: np.ndarray, ends: np.ndarray, T: int) -> np.ndarray:
    """[W, T + 1]: the windows of T inputs (and their targets, one further) that end at `ends`."""
    return val[ends[:, None] - T + np.arange(T + 1)]


@torch.no_grad()
def context_losses(model: LM, val: np.ndarray, sweep: ContextSweep, device: torch.device) -> dict[str, dict]:
    """str(T) -> {"loss": mean over every position of the T-token windows, "tail_loss": mean over their last
    train_len positions} (nats per token), for T in sweep.contexts; every T's windows end at the same places."""
    ends = window_ends(len(val), max(sweep.contexts), sweep.windows)
    was = model.training
    model.eval()
    out = {}
    for T in sweep.contexts:
        rows = torch.from_numpy(window_rows(val, ends, T).astype(np.int64))  # [W, T+1]
        total = torch.zeros(2, dtype=torch.float64)  # every position, the tail
        for chunk in rows.split(16):
            x, y = chunk[:, :-1].to(device), chunk[:, 1:].to(device)  # [b, T]
            with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
                logits = model(x)  # [b, T, V]
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> float32; float64 stays
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), y, reduction="none")  # [b, T]
            total += torch.stack([nll.sum(), nll[:, -sweep.train_len:].sum()]).double().cpu()
        n = rows.shape[0]
        out[str(T)] = {"loss": float(total[0]) / (n * T), "tail_loss": float(total[1]) / (n * sweep.train_len)}
    model.train(was)
    return out


# -- runs ------------------------------------------------------------------------------------------------------------


def run_one(job: dict) -> dict | None:
    """Train one (model, seed) run at its matched steps, then read it at every context; module-level for workers."""
    logging.getLogger("evict").setLevel(logging.WARNING)
    if out_of_time(job):
        return None
    sweep = from_json(ContextSweep, job["sweep"])
    m = from_json(Model, job["model"])
    seed = job["seed"]
    task = TextTask(corpus=sweep.corpus, tokenizer="char", seq_len=sweep.train_len, seed=seed)
    flops = matched_steps(sweep, task.vocab_size)[m.name]
    fresh_compile(sweep)
    torch.manual_seed(seed)
    model = LM(model_config(sweep, m, task.vocab_size))
    res = train(model, task, lab_train_config(sweep, seed, job, steps=flops["steps"]))
    if res.interrupted:
        return None
    device = next(model.parameters()).device
    by_ctx = context_losses(model, task.val, sweep, device)
    tail = {t: round(v["tail_loss"], 4) for t, v in by_ctx.items()}
    return {"model": m.name, "kind": m.kind, "ratio": m.ratio, "pattern": m.pattern, "d_model": m.d_model,
            "seed": seed, "contexts": by_ctx, "train_val_loss": res.final_val_loss, **flops,
            "params": sum(p.numel() for p in model.parameters()), "seconds": round(res.total_seconds, 1),
            **diverged(res), "label": f"{m.label} d{m.d_model} tail {tail}"}


def time_one(job: dict) -> dict | None:
    """Decode ms per token and cache bytes of one model at every context (batch 1, weights untrained); None when the
    piece is over before it starts (out_of_time: left for the next piece)."""
    from evict.distributed import resolve_device
    from evict.models import decode_cost

    if out_of_time(job):
        return None
    sweep = from_json(ContextSweep, job["sweep"])
    m = from_json(Model, job["model"])
    dev = resolve_device(sweep.device)
    torch.manual_seed(0)
    model = LM(model_config(sweep, m, job["vocab_size"])).to(
        device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32).eval()
    rows = {}
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(1)  # tiny models: one thread is faster, and steadier on a shared machine
    try:
        for ctx in decode_grid(sweep):
            secs, how = decode_cost.time_variant(model, "graph" if dev.type == "cuda" else "eager", 1, ctx,
                                             sweep.decode_steps, sweep.decode_warmup)
            with torch.inference_mode():
                nbytes = decode_cost.cache_bytes(decode_cost.filled_cache(model, 1, ctx, extra=1), ctx)
            rows[str(ctx)] = {"ms_per_token": 1e3 * secs, "cache_bytes": nbytes, "timing": how}
    finally:
        torch.set_num_threads(threads)
    return {"model": m.name, "kind": m.kind, "ratio": m.ratio, "pattern": m.pattern, "d_model": m.d_model,
            "device": str(dev), "dtype": str(next(model.parameters()).dtype).replace("torch.", ""), "decode": rows,
            "label": f"{m.label} d{m.d_model} decoded"}


def decode_grid(sweep: ContextSweep) -> list[int]:
    return sorted(set(sweep.contexts) | set(sweep.decode_contexts))


def jobs_for(sweep: ContextSweep, root: Path) -> list[dict]:
    """Every training run, seed-major, the widest and most KDA-heavy first (the slowest on a CPU)."""
    sw = dataclasses.asdict(sweep)
    ms = sorted(models(sweep), key=lambda m: (-m.d_model, -m.pattern.count(hybrid.LINEAR)))
    return [{"model": dataclasses.asdict(m), "seed": s, "dir": str(root / "runs" / f"{m.name}_s{s}"), "sweep": sw}
            for s in seeds_of(sweep) for m in ms]


# -- report ----------------------------------------------------------------------------------------------------------


def _tails(results: list[dict]) -> dict:
    """(model name, T) -> the tail losses over seeds, seed order."""
    cells: dict = {}
    for r in sorted(results, key=lambda r: r["seed"]):
        for t, v in r["contexts"].items():
            cells.setdefault((r["model"], int(t)), []).append(v["tail_loss"])
    return cells


def _fmt(xs: list | None) -> str:
    if not xs:
        return "—"
    return f"{statistics.fmean(xs):.3f}" + (f" ({min(xs):.3f}–{max(xs):.3f})" if len(xs) > 1 else "")


def table_rows(sweep: ContextSweep, results: list[dict], decoded: list[dict]) -> list[dict]:
    """One row per (model, scale, context): the CSV's (quality over seeds, decode cost, training compute)."""
    tails, dec = _tails(results), {r["model"]: r["decode"] for r in decoded}
    runs: dict = {}
    for one in results:
        runs.setdefault(one["model"], one)
    rows = []
    for m in models(sweep):
        r, d = runs.get(m.name), dec.get(m.name, {})
        for T in decode_grid(sweep):
            xs = tails.get((m.name, T), [])
            rows.append({"model": m.label, "kind": m.kind, "ratio": m.ratio, "pattern": m.pattern, "d_model": m.d_model,
                         "context": T, "tail_loss_mean": round(statistics.fmean(xs), 4) if xs else "",
                         "tail_loss_min": round(min(xs), 4) if xs else "", "tail_loss_max": round(max(xs), 4) if xs else "",
                         "seeds": len(xs), "decode_ms_per_token": round(d[str(T)]["ms_per_token"], 4) if str(T) in d else "",
                         "cache_bytes": d[str(T)]["cache_bytes"] if str(T) in d else "",
                         "params": r["params"] if r else "", "steps": r["steps"] if r else "",
                         "train_flops": f"{r['train_flops']:.4g}" if r else ""})
    return rows


def report(sweep: ContextSweep, results: list[dict], decoded: list[dict]) -> str:
    """Per scale: the tail loss at each context (mean, seeds' range) and its change from train_len to the longest;
    then the decode cost at each context; then the compute each model trained with."""
    tails, dec = _tails(results), {r["model"]: r for r in decoded}
    runs: dict = {}
    for one in results:
        runs.setdefault(one["model"], one)
    t0, t1 = sweep.train_len, max(sweep.contexts)
    parts = []
    for d in sweep.scales:
        q, c = [], []
        for m in (m for m in models(sweep) if m.d_model == d):
            r = runs.get(m.name)
            row = {"model": m.label, "pattern": m.pattern,
                   "params": "—" if r is None else f"{r['params']:,}", "steps": "—" if r is None else str(r["steps"]),
                   "train FLOPs": "—" if r is None else f"{r['train_flops']:.3g}"}
            for T in sweep.contexts:
                row[f"tail loss @{T}"] = _fmt(tails.get((m.name, T)))
            a, b = tails.get((m.name, t0)), tails.get((m.name, t1))
            if a and b and t0 in sweep.contexts:
                diffs = [y - x for x, y in zip(a, b)]
                row[f"Δ {t0}→{t1}"] = f"{statistics.fmean(diffs):+.3f} ({sum(x < 0 for x in diffs)} of {len(diffs)} lower)"
            q.append(row)
            got = dec.get(m.name, {}).get("decode", {})
            cost = {"model": m.label}
            for T in decode_grid(sweep):
                v = got.get(str(T))
                cost[f"ms/token @{T}"] = "—" if v is None else f"{v['ms_per_token']:.3f}"
            for T in (t1, max(decode_grid(sweep))):
                v = got.get(str(T))
                cost[f"cache @{T}"] = "—" if v is None else accounting.fmt_bytes(v["cache_bytes"])
            c.append(cost)
        parts.append(f"### d_model {d}\n\nQuality (tail loss, nats/char; {seeds_phrase(seeds_of(sweep))}):\n\n"
                     f"{markdown_table(q, list(q[0]))}\n\nDecode, batch 1:\n\n{markdown_table(c, list(c[0]))}")
    where = next(iter(decoded), {})
    head = (f"Ratio against context: {sweep.n_layers} layers, heads of {sweep.head_dim}, SwiGLU 2 × d_model, attention "
            f"layers spread ({', '.join(sweep.kinds)}); next-character "
            f"{'Shakespeare' if sweep.corpus is None else Path(sweep.corpus).name}, trained at T {t0}, batch "
            f"{sweep.batch_size}, lr {sweep.lr:g}; matched training FLOPs: {sweep.ratios[0]} trains {sweep.steps} steps "
            f"and every model of a scale spends its FLOPs (accounting.train_flops_per_token at T {t0}). Tail loss: "
            f"the last {t0} positions of windows of T tokens, {sweep.windows} windows ending at the same validation "
            f"characters at every T. Δ: tail loss at {t1} minus at {t0}, seed by seed. Decode: "
            f"{where.get('device', '?')}, {where.get('dtype', '?')}, median of {sweep.decode_steps} steps at batch 1, "
            "an untrained model of the same config; cache = bytes the cache holds per sequence, as allocated.")
    return head + "\n\n" + "\n\n".join(parts)


def plot(sweep: ContextSweep, results: list[dict], decoded: list[dict], path: Path) -> Path:
    """Per scale (columns): tail loss vs context, one line per model (bars: the seeds' range); decode ms/token vs
    context (every timed context); tail loss at the longest read context vs decode ms/token at the longest timed one."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter

    tails, dec = _tails(results), {r["model"]: r["decode"] for r in decoded}
    n, t1, far = len(sweep.scales), max(sweep.contexts), max(decode_grid(sweep))
    fig = Figure(figsize=(5.2 * n, 11.5), constrained_layout=True)
    FigureCanvasAgg(fig)
    axes = fig.subplots(3, n, squeeze=False)
    for j, d in enumerate(sweep.scales):
        top, mid, low = axes[0][j], axes[1][j], axes[2][j]
        group = [m for m in models(sweep) if m.d_model == d]
        for i, m in enumerate(group):
            style, color = ("o-" if m.kind in ("kda", "mla") else "s--"), f"C{i}"
            cells = [tails.get((m.name, T), []) for T in sweep.contexts]
            if all(cells):
                means = [statistics.fmean(c) for c in cells]
                yerr = [[mu - min(c) for mu, c in zip(means, cells)], [max(c) - mu for mu, c in zip(means, cells)]]
                nudge = 1 + 0.03 * (i - (len(group) - 1) / 2)  # side by side on the log axis
                top.errorbar([T * nudge for T in sweep.contexts], means, yerr=yerr, fmt=style, capsize=3, color=color,
                             label=m.label)
            got = dec.get(m.name, {})
            grid = [T for T in decode_grid(sweep) if str(T) in got]
            mid.plot(grid, [got[str(T)]["ms_per_token"] for T in grid], style, color=color, label=m.label)
            if cells[-1] and str(far) in got:
                mu = statistics.fmean(cells[-1])
                low.errorbar([got[str(far)]["ms_per_token"]], [mu], yerr=[[mu - min(cells[-1])], [max(cells[-1]) - mu]],
                             fmt=style[0], ms=8, capsize=3, color=color, label=m.label)
        top.axvline(sweep.train_len, color="grey", lw=0.8, ls=":")
        top.set(xscale="log", xlabel="context T (tokens; dotted: the training length)",
                ylabel=f"tail loss (last {sweep.train_len} positions, nats/char)", title=f"d_model {d}: quality vs context")
        top.set_xticks(list(sweep.contexts), [str(T) for T in sweep.contexts])
        mid.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="decode ms per token (batch 1, measured)",
                title=f"d_model {d}: decode cost vs context")
        low.set(xlabel=f"decode ms per token at {far:,} (measured)", ylabel=f"tail loss at T {t1} (bars: seeds)",
                title=f"d_model {d}: quality vs decode cost")
        for ax in (top, mid, low):
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7)
    fig.savefig(path, dpi=120)
    return path


# -- validation and the sweep ----------------------------------------------------------------------------------------


def validate(sweep: ContextSweep) -> None:
    """Reject a bad sweep before any folder is written."""
    if not sweep.ratios or len(set(sweep.ratios)) != len(sweep.ratios):
        raise ValueError(f"ratios: expected distinct ratios, got {list(sweep.ratios)}")
    for r in sweep.ratios:
        hybrid.parse_ratio(r)
    bad = [k for k in sweep.kinds if k not in hybrid.KINDS]
    if bad or not sweep.kinds or len(set(sweep.kinds)) != len(sweep.kinds):
        raise ValueError(f"kinds: expected distinct names from {list(hybrid.KINDS)}, got {list(sweep.kinds)}")
    for name in ("n_layers", "head_dim", "train_len", "windows", "steps", "batch_size", "eval_every", "eval_batches",
                 "decode_steps", "seeds", "workers"):
        if type(getattr(sweep, name)) is not int or getattr(sweep, name) < 1:
            raise ValueError(f"{name}: expected a positive integer, got {getattr(sweep, name)!r}")
    if type(sweep.decode_warmup) is not int or sweep.decode_warmup < 0:
        raise ValueError(f"decode_warmup: expected an integer >= 0, got {sweep.decode_warmup!r}")
    if not sweep.scales or len(set(sweep.scales)) != len(sweep.scales) or any(
            type(d) is not int or d < 1 or d % min(sweep.head_dim, d) for d in sweep.scales):
        raise ValueError(f"scales: expected distinct widths, each a multiple of head_dim={sweep.head_dim}, "
                         f"got {list(sweep.scales)}")
    if not sweep.contexts or any(type(c) is not int or c < sweep.train_len for c in sweep.contexts) \
            or list(sweep.contexts) != sorted(set(sweep.contexts)):
        raise ValueError(f"contexts: expected increasing lengths, each >= train_len={sweep.train_len}, "
                         f"got {list(sweep.contexts)}")
    if any(type(c) is not int or c < 1 for c in sweep.decode_contexts):
        raise ValueError(f"decode_contexts: expected positive integers, got {list(sweep.decode_contexts)}")
    hybrid.recall.gate_dt_fields(sweep.gate_dt)
    corpus_files(sweep.corpus)
    task = TextTask(corpus=sweep.corpus, tokenizer="char", seq_len=sweep.train_len, seed=sweep.seed)
    window_ends(len(task.val), max(sweep.contexts), sweep.windows)
    matched_steps(sweep, task.vocab_size)  # every ratio tiles n_layers, every config builds


def run_sweep(sweep: ContextSweep, out: str | Path | None = None, minutes: float | None = None) -> Path:
    """Train (or resume) every run; once all are in, time every model's decode (one at a time, in this process,
    resumable like the runs) and write the table, table.csv and the plot."""
    validate(sweep)
    root = sweep_folder("context", sweep, out, which=WHICH_FIELDS)
    stop_at = None if minutes is None else time.time() + 60 * minutes  # the piece's end, for the decode timing too
    timed: list[dict] = []

    def decoded() -> list[dict]:
        if not timed:
            rows = decode_all(sweep, root, stop_at)
            if rows is None:
                raise _DecodeLeft
            timed.extend(rows)
        return timed

    try:
        run_grid("context", sweep, root, jobs_for=jobs_for, run_one=run_one, minutes=minutes, which=WHICH_FIELDS,
                 report=lambda sw, res: report(sw, res, decoded()), plot=lambda sw, res, path: plot(sw, res, decoded(), path))
    except _DecodeLeft:
        done = sum(1 for m in models(sweep) if (root / "decode" / m.name / "result.json").exists())
        print(f"context: stopped after {minutes:g} min: every run trained, {done} of {len(models(sweep))} models' decode "
              f"timed; run the same command with --out {root} to continue (the table comes with the last model's timing)")
        return root
    if timed:  # every run finished (run_grid wrote the table)
        results = [json.loads(line) for line in (root / "results.jsonl").read_text().splitlines()]
        rows = table_rows(sweep, results, timed)
        with (root / "table.csv").open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {root / 'table.csv'}")
    return root


class _DecodeLeft(Exception):
    """A timed piece ended with models' decode timing left (run_sweep: no table yet; the next piece times them)."""


def decode_all(sweep: ContextSweep, root: Path, stop_at: float | None = None) -> list[dict] | None:
    """Every model's decode row, one model at a time (run_jobs with one worker: <root>/decode/<model>/result.json),
    also written to <root>/decode.jsonl; None when the piece ends (`stop_at`, wall-clock) with models left, whose
    timing the next piece does (the finished ones are kept: a timed model is not timed again)."""
    vocab = TextTask(corpus=sweep.corpus, tokenizer="char", seq_len=sweep.train_len).vocab_size
    jobs = [{"model": dataclasses.asdict(m), "sweep": dataclasses.asdict(sweep), "vocab_size": vocab,
             "dir": str(root / "decode" / m.name), "stop_at": stop_at} for m in models(sweep)]
    outs = run_jobs(time_one, jobs, workers=1, desc="decode")
    if any(r is None for r in outs):
        return None
    rows = [r for r in outs if r is not None]
    (root / "decode.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows
