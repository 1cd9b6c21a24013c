"""The hybrid lab (`evict lab hybrid`): how many full-attention layers does a KDA stack need, and where?

Kimi Linear (Table 1, LAB.md) trains KDA : MLA stacks at 15:1, 7:1, 3:1, 1:1 and all-MLA and finds 3:1 best by
validation perplexity (3:1 5.65, 1:1 5.66, 7:1 5.70, all-MLA 5.77, 15:1 5.82). Here the same question at lab scale:
KDA : attention ratios from pure KDA (1:0) to pure attention (0:1), with the attention layers MLA (`M`, latent cache,
NoPE) and, separately, plain softmax attention (`A`, KV cache, RoPE); and, at chosen ratios, where the attention
layers sit (spread, early, late). Every model is the one LM built from a full-depth layer pattern string
(`layer_pattern`), the recall lab's model otherwise (`evict.lab.recall.model_config`: heads of `head_dim`, the
kernel-4 short conv on every mixer, dense SwiGLU), and every model has the all-KDA model's parameter count: its
SwiGLU width `d_ff` is solved for with the accountant (`equal_params_d_ff`; within PARAM_TOLERANCE, the table shows
the gap). Two tasks: MQAR (accuracy, best evaluation) and next-character Shakespeare (validation loss, nats/char);
from the accountant, the cache bytes per token of context and the cache a decode step reads at a given context.

Placements for n attention layers of N (ratio a:b, group g = a + b, N a multiple of g):
    spread  the last b layers of every group of g (Kimi Linear's tiling, KKKM KKKM …)
    early   layers 0 … n−1            late   layers N−n … N−1
A placement whose pattern equals an earlier one (one attention layer: spread = late) is run once.

Outputs under runs/hybrid/<timestamp>/: config.json, results.jsonl (one row per run), table.md, hybrid.png,
runs/<name>/result.json (resumable with evict.lab.sweep.run_jobs); a timed piece (`--minutes`) that leaves runs
writes partial_table.md instead (the cells whose every seed is in).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from evict.lab import recall
from evict.lab.sweep import (curve, diverged, fresh_compile, from_json, lab_train_config, out_of_time, run_grid,
                              seeds_phrase)
from evict.models import LM, ModelConfig, accounting
from evict.report import markdown_table
from evict.tasks.mqar import MQARConfig, MQARTask
from evict.tasks.text import TextTask, corpus_files
from evict.train import TrainConfig, train

KINDS = {"mla": "M", "attention": "A"}  # the attention layers' kind -> pattern letter
LINEAR = "K"
RATIOS = ("1:0", "15:1", "7:1", "3:1", "1:1", "0:1")
PLACEMENTS = ("spread", "early", "late")
TASKS = ("mqar", "text")
PUBLISHED = {"3:1": 5.65, "1:1": 5.66, "7:1": 5.70, "15:1": 5.82, "0:1": 5.77}  # Kimi Linear Table 1, val ppl, KDA:MLA
PARAM_TOLERANCE = 0.01  # every model's parameters (excl. embeddings) within 1 % of the all-KDA model's
CACHE_BYTES = 2  # bytes per KV / latent / conv number (bf16); KDA's S is float32 (the accountant's rule)


@dataclass
class HybridSweep:
    ratios: tuple = RATIOS
    kinds: tuple = tuple(KINDS)
    placement_ratios: tuple = ("3:1",)  # ratios that also run early and late (every hybrid ratio runs spread)
    tasks: tuple = TASKS
    n_layers: int = 16
    d_model: int = 32
    head_dim: int = 16
    d_ff: int = 64  # the all-KDA model's SwiGLU width; every other model's is solved for equal parameters
    chunk_size: int | None = 16  # None: the memory op picks by shape (CUDA: auto_chunk; CPU: 64)
    seq_len: int = 64  # MQAR
    pairs: int = 8
    vocab_size: int = 256  # MQAR
    text_seq_len: int = 64
    corpus: str | None = None  # None = Shakespeare (shipped inside evict), else a text file or folder
    steps: int = 300
    mqar_steps: int | None = None  # MQAR's schedule (it stops at 0.99 accuracy); None: `steps`, as the text runs
    batch_size: int = 32
    lr: float = 3e-3
    gate_dt: tuple = recall.DEFAULT_GATE_DT  # KDA's decay gates' initial dt range (ModelConfig.gate_dt_min / gate_dt_max)
    eval_every: int = 100
    eval_batches: int = 4
    contexts: tuple = (131_072, 1_048_576)  # decode cost reported at these contexts (the last in the table)
    seed: int = 0
    seeds: int = 1
    text_seeds: int | None = None  # the text runs' seeds when more than `seeds` (None: `seeds`): cheap runs whose
    # losses differ by about the seed spread, so `--full` runs 3 of them where each costly MQAR run has one
    workers: int = 2
    device: str = "cpu"
    compile: bool = False  # CUDA: each block through torch.compile inside the step's CUDA graph (sweep.compiles)


QUICK = HybridSweep(  # 4 layers: every CPU second goes to depth (see docs/labs/hybrid.md; timing in dev/LOG.md)
    ratios=("1:0", "3:1", "1:1", "0:1"), placement_ratios=("1:1",), n_layers=4, seq_len=32, pairs=8,
    vocab_size=128, text_seq_len=32, steps=300, lr=1e-2,
)
FULL = HybridSweep(  # the paper's hardest MQAR setting (L 512, K 64, vocab 8192); 16 layers for 15:1
    d_model=128, head_dim=32, d_ff=256, chunk_size=None, seq_len=512, pairs=64, vocab_size=8192, text_seq_len=256,
    steps=2000, batch_size=64, lr=3e-3, eval_every=250, eval_batches=16, workers=4, device="auto",
    # on the card every MQAR run of 16 layers with the default gates stayed at chance in 2,000 steps; with slow gates
    # (and, for the hybrids, an 8,000-step schedule) all-KDA, MLA 3:1 and attention 3:1 left it by step 1,750 (results/full_runs.md)
    gate_dt=(1e-4, 1e-3), mqar_steps=8000,
    # a compiled step alone on the H200: 64 ms for 3:1 MLA (graphed 87, eager 117), 41 ms for all-MLA (67, 130)
    compile=True,
    # the text losses of piece 1 (one seed) spanned 0.019 nats, about a seed's spread: 3 seeds for the ordering
    text_seeds=3,
)
WHICH_FIELDS = ("seed", "seeds", "text_seeds")  # they choose which runs exist; each row names its seed (dev/grid_restore.py)


def task_seeds(sweep: HybridSweep, task: str) -> list[int]:
    """The seeds `task`'s runs use: `seeds` of them from `seed`; for text, `text_seeds` when that is more."""
    n = max(sweep.seeds, sweep.text_seeds or 0) if task == "text" else sweep.seeds
    return list(range(sweep.seed, sweep.seed + n))


# -- patterns ----------------------------------------------------------------------------------------------------


def parse_ratio(text: str) -> tuple[int, int]:
    """'a:b' (KDA layers : attention layers, lowest terms, not both 0) -> (a, b)."""
    parts = text.split(":") if isinstance(text, str) else []
    ok = len(parts) == 2 and all(p.isdigit() for p in parts)
    a, b = (int(parts[0]), int(parts[1])) if ok else (0, 0)
    if not ok or a + b == 0 or math.gcd(a, b) != 1:
        raise ValueError(f"ratios: expected KDA:attention in lowest terms like 3:1, 1:0 or 0:1, got {text!r}")
    return a, b


def layer_pattern(ratio: str, n_layers: int, placement: str, letter: str) -> str:
    """The full-depth pattern string (one letter per layer) of `ratio` with its attention layers (`letter`) placed."""
    a, b = parse_ratio(ratio)
    g = a + b
    if n_layers % g:
        raise ValueError(f"n_layers: ratio {ratio} needs a multiple of {g} layers, got {n_layers}")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement: expected one of {PLACEMENTS}, got {placement!r}")
    n_attn = n_layers // g * b
    if placement == "spread":
        attn = {i for i in range(n_layers) if i % g >= a}
    elif placement == "early":
        attn = set(range(n_attn))
    else:
        attn = set(range(n_layers - n_attn, n_layers))
    return "".join(letter if i in attn else LINEAR for i in range(n_layers))


@dataclass(frozen=True)
class Variant:
    kind: str  # "kda" (pure KDA) or a KINDS key
    ratio: str
    placement: str  # "—" for the pure models
    pattern: str
    same_as: tuple = ()  # other placements that give this same pattern

    @property
    def name(self) -> str:
        return "_".join([self.kind, self.ratio.replace(":", "to")] + ([self.placement] if self.placement != "—" else []))

    @property
    def label(self) -> str:
        place = "" if self.placement == "—" else f" {self.placement}" + "".join(f" = {s}" for s in self.same_as)
        return f"{'KDA only' if self.kind == 'kda' else self.kind} {self.ratio}{place}"


def variants(sweep: HybridSweep) -> list[Variant]:
    """Every distinct model of the sweep: pure KDA once, every (kind, ratio, placement) with placements other than
    spread only at `placement_ratios`; placements that give an earlier pattern are folded into it (`same_as`)."""
    out: list[Variant] = []
    for ratio in sweep.ratios:
        a, b = parse_ratio(ratio)
        if b == 0:
            out.append(Variant("kda", ratio, "—", layer_pattern(ratio, sweep.n_layers, "spread", LINEAR)))
            continue
        for kind in sweep.kinds:
            if a == 0:
                out.append(Variant(kind, ratio, "—", layer_pattern(ratio, sweep.n_layers, "spread", KINDS[kind])))
                continue
            places = PLACEMENTS if ratio in sweep.placement_ratios else ("spread",)
            seen: dict[str, int] = {}
            for p in places:
                pat = layer_pattern(ratio, sweep.n_layers, p, KINDS[kind])
                if pat in seen:
                    v = out[seen[pat]]
                    out[seen[pat]] = replace(v, same_as=v.same_as + (p,))
                else:
                    seen[pat] = len(out)
                    out.append(Variant(kind, ratio, p, pat))
    return out


# -- models at equal parameters ----------------------------------------------------------------------------------


def shape_config(sweep: HybridSweep, pattern: str, d_ff: int, vocab_size: int):
    """The recall lab's model of `pattern` at the sweep's sizes (heads of head_dim) with SwiGLU width `d_ff`."""
    shape = recall.RecallSweep(head_dim=sweep.head_dim, n_layers=sweep.n_layers, vocab_size=sweep.vocab_size,
                               chunk_size=sweep.chunk_size, gate_dt=tuple(sweep.gate_dt))
    base = recall.model_config("kda", sweep.d_model, shape, max(sweep.seq_len, sweep.text_seq_len))
    return replace(base, pattern=pattern, d_ff=d_ff, vocab_size=vocab_size)


def body_params(cfg) -> int:
    """Parameters without the token table and head (the same in every model of one task)."""
    return _body_params(cfg.to_json())


@functools.lru_cache(maxsize=1024)
def _body_params(cfg_json: str) -> int:  # counted on the meta device once per config and process
    r = accounting.param_report(ModelConfig.from_dict(json.loads(cfg_json)))
    return r["total"] - sum(r["embeddings"].values())


def equal_params_d_ff(sweep: HybridSweep, pattern: str) -> int:
    """The SwiGLU width that brings `pattern`'s model closest to the all-KDA model's parameter count (the FFN is
    linear in d_ff, so one step from two counts lands on the best integer)."""
    target = body_params(shape_config(sweep, LINEAR * sweep.n_layers, sweep.d_ff, sweep.vocab_size))
    p0 = body_params(shape_config(sweep, pattern, sweep.d_ff, sweep.vocab_size))
    slope = body_params(shape_config(sweep, pattern, sweep.d_ff + 1, sweep.vocab_size)) - p0
    return max(1, sweep.d_ff + round((target - p0) / slope))


def model_config(sweep: HybridSweep, pattern: str, vocab_size: int):
    """The model of `pattern` for a task of `vocab_size` tokens, at the all-KDA model's parameter count."""
    return shape_config(sweep, pattern, equal_params_d_ff(sweep, pattern), vocab_size)


def accountant(sweep: HybridSweep, pattern: str) -> dict:
    """Parameters and decode memory of `pattern`'s model (MQAR vocabulary) from evict.models.accounting.

    cache_bytes_per_token: what one more token of context adds (KV or latent, CACHE_BYTES per number); fixed_bytes:
    what a sequence holds whatever its length (KDA's float32 S and every conv tail); decode_bytes: the cache a
    decode step reads at each of sweep.contexts (all of it: the memory-bound cost of one token)."""
    cfg = model_config(sweep, pattern, sweep.vocab_size)
    target = body_params(shape_config(sweep, LINEAR * sweep.n_layers, sweep.d_ff, sweep.vocab_size))
    params = body_params(cfg)
    one, two, *rows = accounting.memory_report(cfg, [1, 2, *sweep.contexts], CACHE_BYTES)
    per_token = two["total_bytes"] - one["total_bytes"]
    return {"params": params, "params_gap": params / target - 1, "d_ff": cfg.d_ff, "cache_bytes_per_token": per_token,
            "fixed_bytes": one["total_bytes"] - per_token,
            "decode_bytes": {str(r["context"]): r["total_bytes"] for r in rows}}


# -- runs --------------------------------------------------------------------------------------------------------


def make_task(sweep: HybridSweep, task: str, seed: int):
    if task == "mqar":
        return MQARTask(MQARConfig(vocab_size=sweep.vocab_size, seq_len=sweep.seq_len, num_pairs=sweep.pairs,
                                   train_seed=seed))
    return TextTask(corpus=sweep.corpus, tokenizer="char", seq_len=sweep.text_seq_len, seed=seed)


def task_steps(sweep: HybridSweep, task: str) -> int:
    """The schedule length of `task`'s runs: MQAR's own when the sweep sets one, else `steps`."""
    return sweep.mqar_steps if task == "mqar" and sweep.mqar_steps is not None else sweep.steps


def train_config(sweep: HybridSweep, task: str, seed: int, job: dict | None = None, **fields) -> TrainConfig:
    """The training knobs every run of the sweep shares for `task` (every lab's, with `task`'s schedule; MQAR stops at
    0.99), a job's folder and piece; `fields` (TrainConfig fields) are laid over them: dev/hybrid_depth.py's lr /
    schedule / batch."""
    own = {"steps": task_steps(sweep, task), "target_accuracy": 0.99 if task == "mqar" else None}
    return lab_train_config(sweep, seed, job, **{**own, **fields})


def run_one(job: dict) -> dict | None:
    """Train one (variant, task, seed) run; module-level so worker processes can run it."""
    logging.getLogger("evict").setLevel(logging.WARNING)
    if out_of_time(job):
        return None  # a timed piece is over: left for the next one
    sweep = from_json(HybridSweep, job["sweep"])
    v = from_json(Variant, job["variant"])
    seed = job["seed"]
    task = make_task(sweep, job["task"], seed)
    fresh_compile(sweep)
    torch.manual_seed(seed)
    model = LM(model_config(sweep, v.pattern, task.vocab_size))
    res = train(model, task, train_config(sweep, job["task"], seed, job))
    if res.interrupted:
        return None  # stopped at the piece's end: its checkpoint resumes it
    score = ({"accuracy": res.best_val_accuracy, "final_accuracy": res.final_val_accuracy, "curve": curve(res)}
             if job["task"] == "mqar" else
             {"val_loss": res.final_val_loss, "val_ppl": math.exp(res.final_val_loss), "curve": curve(res, "loss")})
    shown = f"acc {score['accuracy']:.3f}" if job["task"] == "mqar" else f"loss {score['val_loss']:.3f}"
    return {"variant": v.name, "kind": v.kind, "ratio": v.ratio, "placement": v.placement, "pattern": v.pattern,
            "task": job["task"], "seed": seed, **score, "steps": res.steps_done, "seconds": round(res.total_seconds, 1),
            "total_params": sum(p.numel() for p in model.parameters()), **accountant(sweep, v.pattern),
            **diverged(res), "label": f"{v.label} {job['task']} {shown}"}


def jobs_for(sweep: HybridSweep, root: Path) -> list[dict]:
    """Every run; the KDA-heaviest models first (the slowest on a CPU), so the last to finish are short ones."""
    sw = dataclasses.asdict(sweep)
    vs = sorted(variants(sweep), key=lambda v: -v.pattern.count(LINEAR))
    seeds = {t: task_seeds(sweep, t) for t in sweep.tasks}
    every = sorted({s for ss in seeds.values() for s in ss})  # seed-major: every model's first seed first
    return [{"variant": dataclasses.asdict(v), "task": t, "seed": s, "dir": str(root / "runs" / f"{v.name}_{t}_s{s}"),
             "sweep": sw} for s in every for v in vs for t in sweep.tasks if s in seeds[t]]


# -- report ------------------------------------------------------------------------------------------------------


def _cells(results: list[dict], sweep: HybridSweep | None = None) -> dict:
    """(variant name, task) -> the runs' scores over seeds (accuracy for MQAR, val loss for text). `sweep`: only the
    cells with every seed of their task in (a partial sweep's cell short of a seed's run is not known yet)."""
    cells: dict = {}
    for r in sorted(results, key=lambda r: r["seed"]):
        cells.setdefault((r["variant"], r["task"]), []).append(r["accuracy"] if r["task"] == "mqar" else r["val_loss"])
    return {k: xs for k, xs in cells.items() if sweep is None or len(xs) == len(task_seeds(sweep, k[1]))}


def _fmt(xs: list | None) -> str:
    if xs is None:
        return "—"
    return f"{statistics.fmean(xs):.3f}" + (f" ({min(xs):.3f}–{max(xs):.3f})" if len(xs) > 1 else "")


def _by_seed(xs: list, ys: list, lower: bool = True) -> tuple[float, int]:
    """xs − ys seed by seed (both sorted by seed, the same seeds; a seed gives every model the same batches): the mean
    difference and at how many seeds xs is ahead (lower, or higher with `lower` off)."""
    d = [x - y for x, y in zip(xs, ys)]
    return statistics.fmean(d), sum((x < 0) if lower else (x > 0) for x in d)


def _paired(xs: list | None, ys: list) -> str:
    """The table's Δ vs KDA only: xs − ys seed by seed, the mean and at how many seeds xs is lower."""
    if xs is None:
        return "—"
    mean, lower = _by_seed(xs, ys)
    return f"{mean:+.4f} ({lower} of {len(xs)} lower)"


def _rank(values: dict, reverse: bool) -> dict:
    order = sorted(values, key=lambda k: values[k], reverse=reverse)
    return {k: order.index(k) + 1 for k in values}


def report(sweep: HybridSweep, results: list[dict]) -> str:
    """One row per model (scores, parameters, cache), then the MLA ratios ranked beside Kimi Linear's Table 1. A
    partial sweep's (run_grid's partial_table.md) cells short of a seed's run show —, as do a model's parameters and
    cache until one of its runs is in; the ranking waits for every ratio's runs."""
    cells, by, vs = _cells(results, sweep), {r["variant"]: r for r in results}, variants(sweep)
    ctx = str(sweep.contexts[-1])
    full = {k: by[v.name]["decode_bytes"][ctx] for v in vs for k in KINDS
            if v.kind == k and v.ratio == "0:1" and v.name in by}
    kda = [v.name for v in vs if v.kind == "kda"]
    base = cells.get((kda[0], "text")) if kda else None  # the text losses every model is paired with, seed by seed
    rows = []
    for v in vs:
        r = by.get(v.name)
        row = {"model": v.label, "pattern": v.pattern, "d_ff": "—" if r is None else str(r["d_ff"]),
               "params (Δ vs KDA only)": "—" if r is None else f"{r['params']:,} ({100 * r['params_gap']:+.2f}%)"}
        if "mqar" in sweep.tasks:
            row["MQAR acc"] = _fmt(cells.get((v.name, "mqar")))
        if "text" in sweep.tasks:
            row["val loss"] = _fmt(cells.get((v.name, "text")))
            if base is not None:
                row["Δ val loss vs KDA only"] = "" if v.kind == "kda" else _paired(cells.get((v.name, "text")), base)
        row["cache B/token"] = "—" if r is None else f"{r['cache_bytes_per_token']:,}"
        ref = full.get(v.kind)
        row[f"decode read @{int(ctx):,}"] = "—" if r is None else accounting.fmt_bytes(r["decode_bytes"][ctx]) + (
            f" ({r['decode_bytes'][ctx] / ref:.2f}×)" if ref else "")
        row["published ppl"] = f"{PUBLISHED[v.ratio]:.2f}" if v.kind == "mla" and v.placement in ("spread", "—") and v.ratio in PUBLISHED else ""
        rows.append(row)
    head = (f"{sweep.n_layers} layers, d {sweep.d_model}, heads of {sweep.head_dim}, equal parameters (SwiGLU width solved"
            f" per model); {_steps_phrase(sweep)}, batch {sweep.batch_size}, lr {sweep.lr:g}"
            f"{'' if tuple(sweep.gate_dt) == recall.DEFAULT_GATE_DT else ', KDA gates at init dt %g..%g' % tuple(sweep.gate_dt)}; "
            f"{_seeds_phrase(sweep)}. MQAR: L {sweep.seq_len}, K {sweep.pairs}, vocab "
            f"{sweep.vocab_size}, best evaluation. val loss: next-character "
            f"{'Shakespeare' if sweep.corpus is None else Path(sweep.corpus).name}, nats/char after the last step, "
            f"T {sweep.text_seq_len}. Cache: {CACHE_BYTES} B per KV/latent number (KDA's S float32, fixed); decode read = "
            f"the cache one decode step reads at {int(ctx):,} tokens (× = vs all-attention of the same kind). Published: "
            "Kimi Linear Table 1 (KDA:MLA, validation perplexity at 1.4T tokens)."
            + (" Δ val loss vs KDA only: a model's val loss minus KDA only's at the same seed (a seed gives every "
               "model the same text batches), the mean over seeds and at how many seeds it is lower." if base is not None else ""))
    cols = list(rows[0])
    return f"{head}\n\n{markdown_table(rows, cols)}\n\n{ordering(sweep, results)}"


def _seeds_phrase(sweep: HybridSweep) -> str:
    mqar, text = task_seeds(sweep, "mqar"), task_seeds(sweep, "text")
    if mqar == text or "text" not in sweep.tasks or "mqar" not in sweep.tasks:
        return seeds_phrase(mqar if "mqar" in sweep.tasks else text)
    return f"MQAR {seeds_phrase(mqar)}, text {seeds_phrase(text)}"


def _steps_phrase(sweep: HybridSweep) -> str:
    mqar, text = task_steps(sweep, "mqar"), task_steps(sweep, "text")
    if mqar == text or "text" not in sweep.tasks or "mqar" not in sweep.tasks:
        return f"{mqar if 'mqar' in sweep.tasks else text} steps"
    return f"{mqar} steps for MQAR (it stops at 0.99), {text} for text"


def ordering(sweep: HybridSweep, results: list[dict]) -> str:
    """The spread MLA models ranked by our scores beside Kimi Linear's ranking by perplexity."""
    cells = _cells(results, sweep)
    names = {v.ratio: v.name for v in variants(sweep) if v.kind == "mla" and v.placement in ("spread", "—")
             and v.ratio in PUBLISHED}
    if not names:
        return "No MLA ratio of Kimi Linear's Table 1 in this sweep."
    tasks = [t for t in ("text", "mqar") if t in sweep.tasks]
    known = sum((n, t) in cells for n in names.values() for t in tasks)
    if known < len(names) * len(tasks):
        return (f"Ordering beside Kimi Linear's Table 1: once every MLA ratio's runs are in ({known} of "
                f"{len(names) * len(tasks)} cells so far).")
    pub = _rank({k: PUBLISHED[k] for k in names}, reverse=False)
    cols = ["KDA:MLA", "published ppl (rank)"]
    ranks, notes = {}, []
    for task, col, best_low in (("text", "val loss", True), ("mqar", "MQAR acc", False)):
        if task not in sweep.tasks:
            continue
        scores = {k: cells[(n, task)] for k, n in names.items()}
        vals = {k: statistics.fmean(xs) for k, xs in scores.items()}
        ranks[col] = (vals, _rank(vals, reverse=not best_low))
        notes.append(_separation(col, scores, ranks[col][1], best_low))
    rows = []
    for k in sorted(names, key=lambda k: pub[k]):
        row = {"KDA:MLA": k, "published ppl (rank)": f"{PUBLISHED[k]:.2f} ({pub[k]})"}
        for col, (vals, rk) in ranks.items():
            row[f"ours: {col} (rank)"] = f"{vals[k]:.3f} ({rk[k]})"
        rows.append(row)
    cols += [f"ours: {c} (rank)" for c in ranks]
    return (f"Ordering (rank 1 = best) of the MLA ratios this sweep shares with Kimi Linear's Table 1:\n\n"
            f"{markdown_table(rows, cols)}\n\n" + "\n".join(f"- {n}" for n in notes))


def _separation(col: str, scores: dict, rank: dict, best_low: bool = True) -> str:
    """Whether the seeds separate our neighbouring ranks: the pairs of ratios next in rank whose ranges (min–max over
    seeds) overlap, so that the order between them is not known at this many seeds; for those, the same pair seed by
    seed (a seed gives every model the same batches): at how many seeds the better-ranked one is ahead."""
    n = min(len(xs) for xs in scores.values())
    if n < 2:
        return f"{col}: one seed a cell, so no range says whether neighbouring ranks differ."
    order = sorted(scores, key=lambda k: rank[k])
    tied = [(a, b) for a, b in zip(order, order[1:])
            if max(min(scores[a]), min(scores[b])) <= min(max(scores[a]), max(scores[b]))]
    if not tied:
        return f"{col}: every two neighbouring ranks' ranges over {n} seeds are apart."

    def ahead(a: str, b: str) -> str:
        mean, wins = _by_seed(scores[a], scores[b], best_low)
        return f"{a} ahead of {b} at {wins} of {len(scores[a])} (mean difference {mean:+.4f})"

    return (f"{col}: the ranges over {n} seeds overlap for " + ", ".join(f"{a} and {b}" for a, b in tied)
            + " (their order is not separated by the seeds). Seed by seed (the same batches at a seed): "
            + "; ".join(ahead(a, b) for a, b in tied) + ".")


def plot(sweep: HybridSweep, results: list[dict], path: Path) -> Path:
    """Scores vs ratio (one line per kind, placements as extra markers; bars: the seeds' min–max) and decode cache
    read vs context."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cells = _cells(results)
    vs = variants(sweep)
    panels = [t for t in ("mqar", "text") if t in sweep.tasks]
    fig = Figure(figsize=(4.6 * (len(panels) + 1), 4.2), constrained_layout=True)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels) + 1)
    xs = {r: i for i, r in enumerate(sweep.ratios)}
    marks, shift = {"early": "v", "late": "^"}, {"early": -0.18, "late": 0.18}

    def spread(names: list[str], task: str) -> tuple[list[float], list[list[float]]]:
        """The cells' means and their seeds' ranges as errorbar's yerr (zero for a one-seed cell)."""
        got = [cells[(n, task)] for n in names]
        means = [statistics.fmean(c) for c in got]
        return means, [[m - min(c) for m, c in zip(means, got)], [max(c) - m for m, c in zip(means, got)]]

    for ax, task in zip(axes, panels):
        for i, kind in enumerate(sweep.kinds):
            line = [v for v in vs if (v.kind in (kind, "kda")) and v.placement in ("spread", "—")]
            nudge = 0.06 * (i - (len(sweep.kinds) - 1) / 2)  # the kinds' bars side by side, not on top of each other
            means, yerr = spread([v.name for v in line], task)
            ax.errorbar([xs[v.ratio] + nudge for v in line], means, yerr=yerr, fmt="o-", capsize=3, color=f"C{i}",
                        label=f"{kind} (spread)")
            shown = set()
            for v in (v for v in vs if v.kind == kind and v.placement in marks):
                means, yerr = spread([v.name], task)
                ax.errorbar([xs[v.ratio] + nudge + shift[v.placement]], means, yerr=yerr, fmt=marks[v.placement], ms=7,
                            capsize=3, color=f"C{i}", label=None if v.placement in shown else f"{kind} {v.placement}")
                shown.add(v.placement)
        ax.set_xticks(range(len(sweep.ratios)), list(sweep.ratios))
        if task == "mqar":
            ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("KDA : attention layers")
        ax.set_ylabel("MQAR accuracy (best eval)" if task == "mqar"
                      else "validation loss (nats/char; bars: seeds' range)")
        ax.set_title(f"MQAR L {sweep.seq_len}, K {sweep.pairs}" if task == "mqar" else "Shakespeare, next character",
                     fontsize=10)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    ax = axes[-1]
    grid = sorted({2 ** i for i in range(10, 21)} | set(sweep.contexts))
    styles = {"kda": "-", **dict(zip(sweep.kinds, ("-", "--")))}
    for v in (v for v in vs if v.placement in ("spread", "—")):
        ys = [r["total_bytes"] for r in accounting.memory_report(model_config(sweep, v.pattern, sweep.vocab_size), grid, CACHE_BYTES)]
        ax.plot(grid, ys, color=f"C{xs[v.ratio]}", ls=styles[v.kind], label=v.label)
    ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="cache read per decode step (bytes)")
    ax.set_title("Decode memory traffic, from the accountant", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    fig.savefig(path, dpi=120)
    return path


# -- validation --------------------------------------------------------------------------------------------------


def validate(sweep: HybridSweep) -> None:
    """Reject a bad sweep before any folder is written: names, ratios that do not tile the depth, sizes, and a model
    whose parameters cannot be brought within PARAM_TOLERANCE of the all-KDA model's."""
    for name, allowed, got in (("kinds", tuple(KINDS), sweep.kinds), ("tasks", TASKS, sweep.tasks)):
        bad = [x for x in got if x not in allowed]
        if bad or not got or len(set(got)) != len(got):
            raise ValueError(f"{name}: expected distinct names from {list(allowed)}, got {list(got)}")
    if not sweep.ratios or len(set(sweep.ratios)) != len(sweep.ratios):
        raise ValueError(f"ratios: expected distinct ratios, got {list(sweep.ratios)}")
    for r in (*sweep.ratios, *sweep.placement_ratios):
        parse_ratio(r)
    stray = [r for r in sweep.placement_ratios if r not in sweep.ratios or 0 in parse_ratio(r)]
    if stray:
        raise ValueError(f"placement_ratios: expected hybrid ratios from ratios {list(sweep.ratios)}, got {stray}")
    for name in ("n_layers", "d_model", "head_dim", "d_ff", "steps", "batch_size", "eval_every", "eval_batches", "seeds",
                 "workers", "text_seq_len"):
        if type(getattr(sweep, name)) is not int or getattr(sweep, name) < 1:
            raise ValueError(f"{name}: expected a positive integer, got {getattr(sweep, name)!r}")
    for name in ("mqar_steps", "text_seeds"):
        got = getattr(sweep, name)
        if got is not None and (type(got) is not int or got < 1):
            raise ValueError(f"{name}: expected a positive integer or None, got {got!r}")
    if sweep.d_model % min(sweep.head_dim, sweep.d_model):
        raise ValueError(f"d_model: expected a multiple of head_dim={sweep.head_dim}, got {sweep.d_model}")
    if not sweep.contexts or any(type(c) is not int or c < 1 for c in sweep.contexts):
        raise ValueError(f"contexts: expected positive integers, got {list(sweep.contexts)}")
    recall.gate_dt_fields(sweep.gate_dt)
    MQARConfig(vocab_size=sweep.vocab_size, seq_len=sweep.seq_len, num_pairs=sweep.pairs)
    if "text" in sweep.tasks:
        corpus_files(sweep.corpus)  # the file or folder exists (read in run_sweep)
    for v in variants(sweep):  # also checks that every ratio tiles n_layers
        gap = accountant(sweep, v.pattern)["params_gap"]
        if abs(gap) > PARAM_TOLERANCE:
            raise ValueError(f"d_ff: {v.label} ({v.pattern}) cannot match the all-KDA model's parameters within "
                             f"{PARAM_TOLERANCE:.0%} (off by {gap:+.1%}); raise d_ff or d_model")


def run_sweep(sweep: HybridSweep, out: str | Path | None = None, minutes: float | None = None) -> Path:
    """Run (or resume, when `out` already holds part of it) the sweep; write and print the results."""
    validate(sweep)
    if "text" in sweep.tasks:
        make_task(sweep, "text", sweep.seed)  # the corpus is read and its tokens cached once, before any worker starts
    return run_grid("hybrid", sweep, out, jobs_for=jobs_for, run_one=run_one, report=report, plot=plot, minutes=minutes,
                    partial=True, which=WHICH_FIELDS)
