"""The capacity lab (`evict lab capacity`): how many key → value pairs can one fixed d_key × d_v memory hold before
retrieval breaks, with the additive (linear attention) update and with the delta rule?

Schlag, Irie, Schmidhuber (ICML 2021, synthetic retrieval experiments; numbers in LAB.md): one layer, d_key 64,
S unique keys with one-hot values, loss ½‖y − ŷ‖² per query (0.5 = outputs zero). The additive elu+1 update breaks
between S = 60 and 80 (loss 0.025 at 60, 0.11 at 80); with overwrites (2S writes, every key repeated) the additive
update fails already at S = 20 (0.105) while the delta rule holds to S ≈ 60. The task is `evict.tasks.capacity`.

The model (one layer, nothing but the memory between the key tokens and the prediction):

    e = E[key]                         learned key embedding, d_key = 64 (one table for writes and queries)
    k = φ(W_k e),  q = φ(W_q e)        φ(x) = (elu(x) + 1) / Σ_i (elu(x) + 1)_i: elu+1 with the paper's sum
                                        normalisation, for both rules
    v = one-hot(value) ∈ R^S           the value dimension is S, the number of distinct keys
    β = σ(w_β · e + b_β)               "delta": learned per written token, as the paper's dynamic learning rate;
                                        "additive": 1
    writes then queries, one call of evict.ops.memory (chunked, float32, scale 1): the query tokens carry
    β = 0, so they write nothing and read the state left by the last write; ŷ = q S.

The two rules differ only in the update (delta, β); the feature map is the same. The paper's additive baseline is
Katharopoulos et al.'s elu+1 linear attention; we give it the sum normalisation the paper proposes for its FWPs
instead of the attention denominator φ(q)·Σφ(k) (LAB.md does not say which the paper used here). Without any
normalisation, elu+1 keys and queries (all entries ≈ 1) read outputs of size ≈ d_key: after 300 Adam steps the
loss was still 92 at S = 60 (dev/LOG.md, 2026-11-30). The choices LAB.md leaves open (embedding size, value
dimension S, learned β, Adam lr, steps, batch) are ours, stated here and in the table's header.

The lesson's question (LAB.md: max pairs against head dim — linear in d?) asked of this memory: `LAW` (`evict lab
capacity --law`) repeats the unique-key experiment at d_key 16, 32, 64, 128 with S on the same ladder in S/d
(½ … 1½), takes the break S* (the largest S before the loss first exceeds a threshold) per rule and d_key, and fits
S* ≈ c·d and the log-log slope p. For orthogonal keys the answer is d exactly; whether training finds them is what
the run measures.

A sweep with `layouts` (heads against head dim at one total state: `--heads`) is evict/lab/capacity_heads.py's: its
own model, report and plot over this module's jobs, training (fit_job) and breaks.

A sweep is a grid of (rule, overwrite, d_key, S, seed) runs (or (rule, overwrite, layout, S, seed)); each trains a fresh model with Adam for a fixed number of
steps and reports the loss on held-out batches. Outputs under runs/capacity/<timestamp>/: config.json,
results.jsonl, table.md, capacity.png, runs/<name>/result.json (resumable with evict.lab.sweep.run_jobs).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from evict.distributed import resolve_device
from evict.lab.sweep import (check_at_least_one, check_distinct, check_names, from_json, out_of_time, run_grid,
                              seeds_of, seeds_phrase)
from evict.ops.memory import memory
from evict.report import markdown_table
from evict.tasks.capacity import CapacityBatch, make_batch
from evict.train import read_checkpoint, save_checkpoint

RULES = {"additive": "additive (β = 1)", "delta": "delta rule (learned β)"}
PUBLISHED = {  # Schlag et al. (LAB.md): (rule, overwrite) -> {S: loss}
    ("additive", False): {60: 0.025, 80: 0.11},
    ("additive", True): {20: 0.105},
}
EVAL_SEED_OFFSET = 10_000  # held-out batches come from seed + this: no training seed of a sweep of < 10,000 seeds


def write_then_read(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, *, delta: bool,
                    n_queries: int, chunk_size: int | None = None) -> torch.Tensor:
    """Run W writes and then n_queries reads through evict.ops.memory; returns the reads [B, n_queries, V] (one head)
    or [B, n_queries, H, V] (H heads).

    q, k: [B, W + n_queries, K] or [B, W + n_queries, H, K] (q of the writes and k, v of the queries are ignored: the
    queries carry β = 0); v: [B, W + n_queries, V] or [B, W + n_queries, H, V]; beta: [B, W] or [B, W, H] (the writes'
    β). Scale 1. chunk_size: the chunked form's (None: its own, 64).
    """
    one = k.dim() == 3
    if one:
        q, k, v, beta = q[:, :, None], k[:, :, None], v[:, :, None], beta[:, :, None]
    B, T, H, _ = k.shape
    beta = torch.cat([beta, beta.new_zeros(B, n_queries, H)], dim=1)  # [B, T, H]: queries write nothing
    o, _ = memory(q, k, v, beta=beta, delta=delta, scale=1.0, impl="chunked", check=False,
                  chunk_size=chunk_size)  # [B, T, H, V]
    o = o[:, T - n_queries:]
    return o[:, :, 0] if one else o


class CapacityModel(nn.Module):
    """One memory layer over S key tokens (module docstring). forward(batch) -> predicted values [B, S, S]."""

    def __init__(self, S: int, rule: str, d_key: int = 64):
        super().__init__()
        self.S, self.rule = S, rule
        self.embed = nn.Embedding(S, d_key)  # N(0, 1)
        self.k_proj = nn.Linear(d_key, d_key, bias=False)  # PyTorch's default (Kaiming-uniform) for all three
        self.q_proj = nn.Linear(d_key, d_key, bias=False)
        self.beta_proj = nn.Linear(d_key, 1) if rule == "delta" else None

    def features(self, x: torch.Tensor) -> torch.Tensor:
        phi = F.elu(x) + 1
        return phi / phi.sum(-1, keepdim=True)

    def forward(self, batch: CapacityBatch) -> torch.Tensor:
        tokens = torch.cat([batch.write_keys, batch.query_keys], dim=1)  # [B, T]
        e = self.embed(tokens)  # [B, T, d_key]
        k, q = self.features(self.k_proj(e)), self.features(self.q_proj(e))
        v = F.one_hot(torch.cat([batch.write_values, torch.zeros_like(batch.query_keys)], dim=1), self.S).float()
        W = batch.write_keys.shape[1]
        if self.beta_proj is None:
            beta = torch.ones(e.shape[0], W, device=e.device)
        else:
            beta = torch.sigmoid(self.beta_proj(e[:, :W]))[..., 0]  # [B, W]
        return self.read(q, k, v, beta, batch.query_keys.shape[1])

    def read(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, n_queries: int) -> torch.Tensor:
        """The memory between the writes and the reads (write_then_read); evict.lab.ttt swaps in its update here."""
        return write_then_read(q, k, v, beta, delta=self.rule == "delta", n_queries=n_queries)


def regression_loss(pred: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """½‖y − ŷ‖² per query, averaged over queries and rows; y = one-hot(targets) in R^{pred.shape[-1]}."""
    y = F.one_hot(targets, pred.shape[-1]).to(pred.dtype)
    return 0.5 * (pred - y).pow(2).sum(-1).mean()


@dataclass
class CapacitySweep:
    rules: tuple = ("additive", "delta")
    sizes: tuple = (20, 40, 60, 80, 100)  # S, the number of distinct keys (at every d_key)
    overwrite: tuple = (False, True)
    d_keys: tuple = (64,)
    per_d: tuple = ()  # instead of sizes: S = round(f · d_key) for each f, so every d_key climbs the same ladder in S/d
    threshold: float = 0.05  # S* (the break): the largest S of a ladder, climbed in S, before a loss above this
    steps: int = 400
    batch_size: int = 32
    lr: float = 3e-3
    eval_batches: int = 4
    layouts: tuple = ()  # instead of d_keys: "HxD" memories of H heads of d_k = d_v = D at one total state H·D²
    seed: int = 0
    seeds: int = 1
    workers: int = 2
    device: str = "cpu"


QUICK = CapacitySweep()
FULL = CapacitySweep(  # S well past the break; every number here is ours (LAB.md gives none); not run yet
    sizes=(20, 40, 60, 80, 100, 120, 160, 200, 300), steps=10_000, batch_size=64, lr=1e-3, eval_batches=16, seeds=3,
    workers=4, device="auto",
)
# `--law`: the break S* against d_key (is it linear in d?), both rules, unique keys, S from d/2 to 3d/2 by d/8.
# The published point is d_key 64 (between S = 60 and 80); the other dims and the ladder are ours.
LAW = CapacitySweep(sizes=(), per_d=(0.5, 0.75, 0.875, 1.0, 1.125, 1.25, 1.5), overwrite=(False,),
                    d_keys=(16, 32, 64, 128))


def parse_layout(text: str) -> tuple[int, int]:
    """"16x32" -> (16, 32): H heads of head dim D; else ValueError naming `layouts`."""
    h, sep, d = text.partition("x")
    if not (sep and h.isascii() and h.isdigit() and d.isascii() and d.isdigit() and int(h) >= 1 and int(d) >= 2):
        raise ValueError(f"layouts: expected HxD with H >= 1 heads of head dim D >= 2 (e.g. 4x32), got {text!r}")
    return int(h), int(d)


def check_layouts(layouts: tuple) -> None:
    """Distinct layouts of one total state H · D² (the question is at fixed state); else ValueError."""
    parsed = [parse_layout(t) for t in layouts]
    if not parsed or len({d for _, d in parsed}) != len(parsed):
        raise ValueError(f"layouts: expected layouts of distinct head dims, got {list(layouts)}")
    totals = {h * d * d for h, d in parsed}
    if len(totals) != 1:
        raise ValueError(f"layouts: expected one total state H*D*D for every layout, got {list(layouts)} "
                         f"({', '.join(f'{h}x{d}: {h * d * d}' for h, d in parsed)})")


def key_dims(sweep: CapacitySweep) -> list[int]:
    """The key dims a sweep climbs its ladder at: its layouts' head dims, or its d_keys."""
    return [parse_layout(t)[1] for t in sweep.layouts] if sweep.layouts else list(sweep.d_keys)


def sizes_at(sweep: CapacitySweep, d: int) -> list[int]:
    """The S of a sweep at key dim d, ascending: its `sizes`, or round(f · d) for each f of `per_d`."""
    return sorted({max(2, round(f * d)) for f in sweep.per_d}) if sweep.per_d else sorted(sweep.sizes)


def _batch_to(batch: CapacityBatch, device: torch.device) -> CapacityBatch:
    return CapacityBatch(*(getattr(batch, f.name).to(device) for f in dataclasses.fields(batch)))


def run_one(job: dict) -> dict | None:
    """Train one run's CapacityModel (fit_job); module-level so worker processes can run it."""
    return fit_job(job, lambda: CapacityModel(job["S"], job["rule"], job["d_key"]))


def fit_job(job: dict, make_model: Callable[[], nn.Module]) -> dict | None:
    """Train one (rule, overwrite, S, seed) model with Adam; module-level so worker processes can run it. In a timed
    piece a run starts only while the piece lasts, and one still training at the piece's end saves checkpoint.pt
    (weights, Adam's state, the curve so far, its seconds) in its folder and returns None; the next piece on that
    folder resumes it from there to the same result (its batches depend only on (seed, step))."""
    logging.getLogger("evict").setLevel(logging.WARNING)
    if out_of_time(job):
        return None
    sweep = from_json(CapacitySweep, job["sweep"])
    S, seed, overwrite, d = job["S"], job["seed"], job["overwrite"], job["d_key"]
    device = resolve_device(sweep.device)
    torch.manual_seed(seed)
    model = make_model().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=sweep.lr)
    ckpt = Path(job["dir"]) / "checkpoint.pt"
    first, earlier, curve = 0, 0.0, []
    if ckpt.exists():
        saved = read_checkpoint(ckpt)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        first, earlier = saved["step"], saved["seconds"]
        curve = [(i, torch.tensor(c)) for i, c in saved["curve"]]
    start = time.perf_counter()
    for step in range(first, sweep.steps):
        if step > first and out_of_time(job):  # the piece is over: keep what was trained for the next one
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            save_checkpoint(ckpt, {"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                                   "seconds": earlier + time.perf_counter() - start,
                                   "curve": [(i, c.item()) for i, c in curve]})
            return None
        batch = _batch_to(make_batch(S, sweep.batch_size, overwrite=overwrite, seed=seed, step=step), device)
        loss = regression_loss(model(batch), batch.targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % max(1, sweep.steps // 10) == 0:
            curve.append((step + 1, loss.detach()))  # read after training: no host sync inside the loop
    model.eval()
    with torch.no_grad():
        held_out = (make_batch(S, sweep.batch_size, overwrite=overwrite, seed=seed + EVAL_SEED_OFFSET, step=i)
                    for i in range(sweep.eval_batches))
        losses = [regression_loss(model(b), b.targets).item() for b in (_batch_to(h, device) for h in held_out)]
    final = sum(losses) / len(losses)
    ckpt.unlink(missing_ok=True)  # finished: its result.json replaces it
    return {
        "rule": job["rule"], "overwrite": overwrite, "d_key": d, "S": S, "seed": seed, "loss": final,
        "train_curve": [[i, c.item()] for i, c in curve],
        "steps": sweep.steps, "seconds": round(earlier + time.perf_counter() - start, 1),
        "params": sum(p.numel() for p in model.parameters()),
        "label": f"{job['rule']} d={d} S={S}{' ow' if overwrite else ''} {final:.3f}",
    }


def _name(rule: str, overwrite: bool, d: int, S: int, seed: int, layout: str | None = None) -> str:
    return f"{rule}_{'ow' if overwrite else 'unique'}_{f'h{layout}' if layout else f'd{d}'}_S{S}_s{seed}"


def jobs_for(sweep: CapacitySweep, root: Path) -> list[dict]:
    """Every (seed, d_key or layout, S, overwrite, rule) run, the costliest (largest d, then S) first."""
    sw = dataclasses.asdict(sweep)
    layout_of = {parse_layout(t)[1]: t for t in sweep.layouts}  # head dim -> layout (a sweep's head dims are distinct)
    return [{"rule": r, "overwrite": ow, "d_key": d, "S": S, "seed": s, "sweep": sw,
             **({"layout": layout_of[d]} if d in layout_of else {}),
             "dir": str(root / "runs" / _name(r, ow, d, S, s, layout_of.get(d)))}
            for s in seeds_of(sweep) for d in sorted(key_dims(sweep), reverse=True)
            for S in reversed(sizes_at(sweep, d)) for ow in sweep.overwrite for r in sweep.rules]


def _line(rule: str, overwrite: bool) -> str:
    return f"{RULES[rule]}{', overwrites (2S writes)' if overwrite else ', unique keys (S writes)'}"


def mean_loss(results: list[dict]) -> dict:
    """(rule, overwrite, d_key, S) -> (mean, min, max) final loss over seeds."""
    cells: dict = {}
    for r in results:
        cells.setdefault((r["rule"], r["overwrite"], r["d_key"], r["S"]), []).append(r["loss"])
    return {key: (sum(v) / len(v), min(v), max(v)) for key, v in cells.items()}


def breaks(sweep: CapacitySweep, results: list[dict]) -> dict:
    """(rule, overwrite, d_key) -> (S*, top): S* the largest S of the ladder below which every mean loss is at most
    the threshold (0 if the first already is above it); top: no S of the ladder broke (S* is a lower bound)."""
    cells, out = mean_loss(results), {}
    for r in sweep.rules:
        for ow in sweep.overwrite:
            for d in key_dims(sweep):
                best, top = 0, True
                for S in sizes_at(sweep, d):
                    if cells[(r, ow, d, S)][0] > sweep.threshold:
                        top = False
                        break
                    best = S
                out[(r, ow, d)] = (best, top)
    return out


def law(sweep: CapacitySweep, results: list[dict]) -> dict:
    """(rule, overwrite) -> the fit of S* against d_key (evict.lab.pairs.fit: S* ≈ c·d and the log-log slope p)
    over the dims whose ladder broke inside it; None with fewer than two."""
    from evict.lab.pairs import fit

    bs = breaks(sweep, results)
    return {(r, ow): fit([(d, bs[(r, ow, d)][0]) for d in sorted(sweep.d_keys) if not bs[(r, ow, d)][1]])
            for r in sweep.rules for ow in sweep.overwrite}


def floor(S: float, d: float) -> float:
    """The least loss any memory with a d × S state can reach on S unique keys: ½·max(0, 1 − d/S) per query.

    The S reads form Ŷ = Q M (queries [S, d] times the state [d, S]), a matrix of rank ≤ d, and the targets form the
    identity (after ordering); by Eckart–Young the closest rank-d matrix leaves ‖I − Ŷ‖² = S − d, so the mean of
    ½‖y − ŷ‖² over the S queries is at least ½(S − d)/S, whatever the update rule."""
    return 0.5 * max(0.0, 1 - d / S)


def is_law(sweep: CapacitySweep) -> bool:
    """A sweep over several key dims or with sizes relative to d: reported as the break against d_key."""
    return len(sweep.d_keys) > 1 or bool(sweep.per_d)


def _columns(sweep: CapacitySweep) -> list[tuple[str, bool, str]]:
    return [(r, ow, f"{r}{' + overwrites' if ow else ''}") for ow in sweep.overwrite for r in sweep.rules]


def _cell_text(sweep: CapacitySweep, cell: tuple) -> str:
    mean, lo, hi = cell
    return f"{mean:.3f}" if sweep.seeds == 1 else f"{mean:.3f} ({lo:.3f}–{hi:.3f})"


def report(sweep: CapacitySweep, results: list[dict]) -> str:
    """Final held-out loss per S (rows) and (rule, overwrite) (columns), the published number in brackets; with
    several key dims (or sizes relative to d) one row per (d_key, S) and the breaks S* with their fit below."""
    cells, cols = mean_loss(results), _columns(sweep)
    rows = []
    for d in sorted(sweep.d_keys):
        for S in sizes_at(sweep, d):
            row = {"d_key": str(d), "S": str(S), "S / d": f"{S / d:.3g}", "floor": f"{floor(S, d):.3f}"}
            for r, ow, name in cols:
                pub = PUBLISHED.get((r, ow), {}).get(S) if d == 64 else None
                row[name] = _cell_text(sweep, cells[(r, ow, d, S)]) + (f" [published {pub:g}]" if pub is not None else "")
            rows.append(row)
    keys = ["d_key", "S", "S / d", "floor"] if is_law(sweep) else ["S", "floor"]
    head = (f"Held-out loss ½‖y − ŷ‖² per query after {sweep.steps} Adam steps (lr {sweep.lr:g}, batch "
            f"{sweep.batch_size}; {sweep.eval_batches} held-out batches; 0.5 = outputs zero); d_key "
            f"{', '.join(map(str, sorted(sweep.d_keys)))}, one-hot values in R^S; {seeds_phrase(seeds_of(sweep))}. "
            "Published: Schlag et al. 2021 (LAB.md, d_key 64). Rules: "
            + "; ".join(f"{r} = {RULES[r]}" for r in sweep.rules) + "."
            + " floor: ½·max(0, 1 − d/S), the least loss of any d × S memory on S distinct keys (Eckart–Young).")
    text = f"{head}\n\n{markdown_table(rows, [*keys, *(c[2] for c in cols)])}"
    if not is_law(sweep):
        return text
    bs, fits = breaks(sweep, results), law(sweep, results)
    brows = []
    for r, ow, name in cols:
        row = {"rule": name}
        for d in sorted(sweep.d_keys):
            best, top = bs[(r, ow, d)]
            row[f"d {d}"] = ("≥ " if top else "") + str(best)
        f = fits[(r, ow)]
        row["fit"] = "—" if f is None else f"S* ≈ {f['c']:.2f}·d, p = {f['p']:.2f} ({f['points']} dims)"
        brows.append(row)
    return (f"{text}\n\nThe break S*: the largest S of each ladder with every mean loss up to it ≤ {sweep.threshold:g} "
            "(≥: nothing on the ladder broke; no fit through it). Fit: S* ≈ c·d through the origin, and the slope p of "
            "log S* against log d (p = 1: linear in d).\n\n"
            + markdown_table(brows, ["rule", *(f"d {d}" for d in sorted(sweep.d_keys)), "fit"]))


def plot(sweep: CapacitySweep, results: list[dict], path: Path) -> Path:
    """Loss vs S, one line per (rule, overwrite), published points as crosses; with several key dims (or sizes
    relative to d): loss vs S / d_key per (rule, d_key) beside the break S* against d_key with its fit."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cells, cols = mean_loss(results), _columns(sweep)
    several = is_law(sweep)
    fig = Figure(figsize=(11.5 if several else 6.4, 4.2), constrained_layout=True)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2) if several else [fig.subplots()]
    ax = axes[0]
    dims = sorted(sweep.d_keys)
    for i, (r, ow, name) in enumerate(cols):
        for j, d in enumerate(dims):
            sizes = sizes_at(sweep, d)
            xs = [S / d for S in sizes] if several else sizes
            ax.plot(xs, [cells[(r, ow, d, S)][0] for S in sizes], marker="os^v"[i % 4], ls="--" if ow else "-",
                    color=f"C{j if several else i}", alpha=1.0 if not several or i == 0 else 0.6,
                    label=f"{name}, d {d}" if several else _line(r, ow))
        pub = PUBLISHED.get((r, ow), {})
        if pub and 64 in dims:
            ax.scatter([S / 64 if several else S for S in pub], list(pub.values()), marker="x", s=60, zorder=3,
                       color="k" if several else f"C{i}", label=f"published: {RULES[r]}{' + overwrites' if ow else ''}")
    ax.axhline(0.5, color="k", lw=0.6, ls=":")
    if several:
        xs = sorted({S / d for d in dims for S in sizes_at(sweep, d)} | {1.0})
        ax.plot(xs, [floor(x, 1) for x in xs], color="k", lw=1.4, alpha=0.5,
                label="floor ½(1 − d/S): any d × S memory")
        ax.axhline(sweep.threshold, color="grey", lw=0.6, ls="-.")
    else:
        xs = sorted(set(sizes_at(sweep, dims[0])) | {dims[0]})
        ax.plot(xs, [floor(S, dims[0]) for S in xs], color="k", lw=1.4, alpha=0.5,
                label=f"floor ½(1 − {dims[0]}/S): any {dims[0]} × S memory")
    ax.set_xlabel("S / d_key" if several else "S (distinct keys)")
    ax.set_ylabel("held-out loss ½‖y − ŷ‖²  (0.5 = outputs zero)")
    ax.set_title(f"Capacity: one memory, d_key {', '.join(map(str, dims))}, {sweep.steps} steps", fontsize=10)
    ax.legend(fontsize=7)
    if several:
        bs, fits, ax = breaks(sweep, results), law(sweep, results), axes[1]
        for i, (r, ow, name) in enumerate(cols):
            pts = [(d, bs[(r, ow, d)]) for d in dims]
            ax.plot([d for d, _ in pts], [b for _, (b, _) in pts], marker="os^v"[i % 4], color=f"C{i}", label=name,
                    ls="--" if ow else "-")
            ax.scatter([d for d, (_, top) in pts if top], [b for _, (b, top) in pts if top], s=90, facecolors="none",
                       edgecolors=f"C{i}")
            f = fits[(r, ow)]
            if f is not None:
                ax.plot(dims, [f["c"] * d for d in dims], color=f"C{i}", lw=0.8, ls=":",
                        label=f"  fit: S* ≈ {f['c']:.2f}·d (p = {f['p']:.2f})")
        ax.plot(dims, dims, color="k", lw=0.6, ls="-.", label="S = d_key")
        break_axes(ax, sweep, "d_key", "the key dim")
    fig.savefig(path, dpi=120)
    return path


def break_axes(ax, sweep: CapacitySweep, xlabel: str, against: str) -> None:
    """Finish a plot of the break S* (log-log, base 2) against `xlabel`."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"S* (largest S at loss ≤ {sweep.threshold:g})")
    ax.set_title(f"The break against {against} (open: ladder's top)", fontsize=10)
    ax.legend(fontsize=7)


def validate(sweep: CapacitySweep) -> None:
    check_names("rules", sweep.rules, RULES)
    if bool(sweep.sizes) == bool(sweep.per_d):
        raise ValueError(f"sizes / per_d: expected exactly one of them, got sizes {list(sweep.sizes)} and per_d "
                         f"{list(sweep.per_d)}")
    if sweep.sizes:
        check_distinct("sizes", sweep.sizes, 2, "S")
    if sweep.per_d and (any(not f > 0 for f in sweep.per_d) or len(set(sweep.per_d)) != len(sweep.per_d)):
        raise ValueError(f"per_d: expected distinct fractions of d_key > 0, got {list(sweep.per_d)}")
    check_distinct("d_keys", sweep.d_keys, 1, "key dims")
    if sweep.layouts:
        check_layouts(sweep.layouts)
        if tuple(sweep.d_keys) != CapacitySweep.d_keys:
            raise ValueError(f"d_keys: the heads sweep takes its head dims from layouts, got d_keys {list(sweep.d_keys)}")
        if sweep.per_d:
            raise ValueError(f"per_d: the heads sweep takes sizes, got per_d {list(sweep.per_d)}")
    merged = [d for d in sorted(sweep.d_keys) if sweep.per_d and len(sizes_at(sweep, d)) != len(sweep.per_d)]
    if merged:
        raise ValueError(f"per_d: {list(sweep.per_d)} rounds two fractions to one S at d_key {merged[0]}; use fewer "
                         "fractions or larger key dims")
    if not 0 < sweep.threshold < 0.5:
        raise ValueError(f"threshold: expected a loss in (0, 0.5), got {sweep.threshold}")
    if not sweep.overwrite or any(not isinstance(o, bool) for o in sweep.overwrite):
        raise ValueError(f"overwrite: expected False and/or True, got {list(sweep.overwrite)}")
    check_at_least_one(sweep, ("steps", "batch_size", "eval_batches", "seeds", "workers"))


def run_sweep(sweep: CapacitySweep, out: str | Path | None = None, minutes: float | None = None) -> Path:
    """Run (or resume, when `out` already holds part of it) the sweep; write and print the results."""
    validate(sweep)
    if sweep.layouts:
        raise ValueError("layouts: a heads sweep runs through evict.lab.capacity_heads.run_sweep (--heads)")
    return run_grid("capacity", sweep, out, jobs_for=jobs_for, run_one=run_one, report=report, plot=plot,
                    minutes=minutes)
