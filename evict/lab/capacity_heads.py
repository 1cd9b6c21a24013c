"""Heads against head dim at fixed total state (`evict lab capacity --heads`): is one d × d memory better or worse
than H memories of d/√H × d/√H, the same H · d_k · d_v numbers of state, at holding S key → value pairs?

The capacity regression of evict/lab/capacity.py (S distinct keys, one-hot targets, loss ½‖y − ŷ‖² per query, 0.5 =
outputs zero), with the memory split into heads. A layout "HxD" is H heads of d_k = d_v = D:

    e = E[key] ∈ R^m                     one learned key embedding, m = √(H · D²): the same width for every layout
                                         of a sweep (it holds one total state), the one-head layout's D
    k_h = φ(W_k^h e), q_h = φ(W_q^h e)   φ: elu+1 with the sum normalisation, per head (as the one-head model)
    v_h = U_h[value] ∈ R^D               a learned value embedding per head (d_v = D, not the one-hot R^S)
    β_h = σ(w_β^h · e + b_β^h)           "delta": learned per head and written token; "additive": 1
    ŷ = W_o [q_1 S_1, …, q_H S_H]        the H reads concatenated, one linear map to R^S

The S predictions Ŷ = Σ_h Q_h S_h W_o^h are a sum of H matrices of rank ≤ D, so rank ≤ min(S, H · D), and the
rank floor of capacity.floor becomes ½·max(0, 1 − H·D/S): at fixed H · D², splitting into more, smaller heads raises
that ceiling (H · D = total / D) — whether a trained memory gets near it, each head holding S pairs in a D × D state
with D ≪ S, is what the sweep measures. Every layout trains with the same steps, Adam and batches as capacity.py's
runs (capacity.fit_job); the break S* per (rule, layout) is capacity.breaks' over the layouts' head dims.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from evict.lab.capacity import (CapacitySweep, _cell_text, _columns, break_axes, breaks, fit_job, floor,
                                 jobs_for, mean_loss, parse_layout, validate, write_then_read)
from evict.lab.sweep import run_grid, seeds_of, seeds_phrase
from evict.report import markdown_table
from evict.tasks.capacity import CapacityBatch

# `--heads`: one total state of 16² = 256 numbers as 1, 4 or 16 heads; S = 16, 32, 64 are the layouts' rank bounds
# H·D, so every S sits at one layout's bound and above or below the others'. Unique keys, both rules, 800 steps at
# lr 0.03 (the training losses flatten by ~500 steps: results/capacity/heads_quick/results.jsonl); the ladder is ours.
# 18 runs, CPU-seconds measured in docs/labs/capacity.md. (The first quick sweep, 64² at S = 48 … 192 and 400 steps,
# cost 31 CPU-minutes and left every layout near outputs-zero at S = 192: it measured speed of learning.)
HEADS = CapacitySweep(sizes=(16, 32, 64), overwrite=(False,), layouts=("1x16", "4x8", "16x4"), steps=800, lr=3e-2)
# `--heads-full` (GPU, not run yet): 128² = 16384 numbers as 1, 4, 16 or 64 heads (rank bounds 128 … 1024), with and
# without overwrites, 5,000 steps, 3 seeds: 240 runs. At the pace of capacity.FULL's runs on an H200 (about 60 s per
# 10,000-step run, 4 at once; results/full_runs.md), scaled by the longer rows (S up to 1024), about 40 minutes.
HEADS_FULL = CapacitySweep(sizes=(64, 128, 256, 512, 1024), layouts=("1x128", "4x64", "16x32", "64x16"), steps=5000,
                           batch_size=64, lr=1e-3, eval_batches=16, seeds=3, workers=4, device="auto")
QUICK, FULL = HEADS, HEADS_FULL  # `evict lab capacity --heads` runs this module's HEADS (run_lab reads QUICK first)


def embed_width(heads: int, d: int) -> int:
    """The key embedding's width m = √(H · D²), rounded: the same for every layout of one total state."""
    return max(1, round(math.sqrt(heads * d * d)))


class HeadsCapacityModel(nn.Module):
    """One memory layer of `heads` heads of d_k = d_v = d over S key tokens (module docstring).
    forward(batch) -> predicted values [B, S, S]."""

    def __init__(self, S: int, rule: str, heads: int, d: int):
        super().__init__()
        self.S, self.rule, self.heads, self.d = S, rule, heads, d
        m = embed_width(heads, d)
        self.embed = nn.Embedding(S, m)  # N(0, 1)
        self.k_proj = nn.Linear(m, heads * d, bias=False)
        self.q_proj = nn.Linear(m, heads * d, bias=False)
        self.values = nn.Embedding(S, heads * d)
        self.beta_proj = nn.Linear(m, heads) if rule == "delta" else None
        self.out = nn.Linear(heads * d, S, bias=False)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        phi = F.elu(x.unflatten(-1, (self.heads, self.d))) + 1  # [..., H, d]
        return phi / phi.sum(-1, keepdim=True)

    def forward(self, batch: CapacityBatch) -> torch.Tensor:
        tokens = torch.cat([batch.write_keys, batch.query_keys], dim=1)  # [B, T]
        e = self.embed(tokens)  # [B, T, m]
        k, q = self.features(self.k_proj(e)), self.features(self.q_proj(e))  # [B, T, H, d]
        values = torch.cat([batch.write_values, torch.zeros_like(batch.query_keys)], dim=1)  # [B, T]
        v = self.values(values).unflatten(-1, (self.heads, self.d))  # [B, T, H, d]: the queries' are never written
        W = batch.write_keys.shape[1]
        if self.beta_proj is None:
            beta = torch.ones(e.shape[0], W, self.heads, device=e.device)
        else:
            beta = torch.sigmoid(self.beta_proj(e[:, :W]))  # [B, W, H]
        o = write_then_read(q, k, v, beta, delta=self.rule == "delta", n_queries=batch.query_keys.shape[1],
                            chunk_size=16 if self.d <= 32 else None)  # small heads: 16 (each head's [C, C] work)
        return self.out(o.flatten(-2))  # [B, S, H, d] -> [B, S, S]


def heads_floor(S: int, heads: int, d: int) -> float:
    """The rank floor with H heads of D: ½·max(0, 1 − H·D/S) (module docstring)."""
    return floor(S, heads * d)


def _layouts(sweep: CapacitySweep) -> list[tuple[int, int]]:
    return sorted((parse_layout(t) for t in sweep.layouts), key=lambda hd: hd[0])  # one head first


def _label(h: int, d: int) -> str:
    return f"{h}×{d}²"


def report(sweep: CapacitySweep, results: list[dict]) -> str:
    """Held-out loss per (layout, S) and rule, the rank floor beside it, then the break S* per rule and layout."""
    cells, cols, layouts = mean_loss(results), _columns(sweep), _layouts(sweep)
    rows = []
    for h, d in layouts:
        for S in sorted(sweep.sizes):
            row = {"layout": _label(h, d), "H·D": str(h * d), "S": str(S), "floor": f"{heads_floor(S, h, d):.3f}"}
            row.update({name: _cell_text(sweep, cells[(r, ow, d, S)]) for r, ow, name in cols})
            rows.append(row)
    h0, d0 = layouts[0]
    head = (f"Heads against head dim at one total state H·D² = {h0 * d0 * d0} (layouts "
            f"{', '.join(_label(h, d) for h, d in layouts)}; key embedding width {embed_width(h0, d0)}): held-out loss "
            f"½‖y − ŷ‖² per query after {sweep.steps} Adam steps (lr {sweep.lr:g}, batch {sweep.batch_size}; "
            f"{sweep.eval_batches} held-out batches; 0.5 = outputs zero); {seeds_phrase(seeds_of(sweep))}. floor: "
            "½·max(0, 1 − H·D/S), the least loss of H heads of D (the reads have rank ≤ H·D).")
    bs = breaks(sweep, results)
    brows = [{"rule": name, **{_label(h, d): ("≥ " if bs[(r, ow, d)][1] else "") + str(bs[(r, ow, d)][0])
                               for h, d in layouts}} for r, ow, name in cols]
    return (f"{head}\n\n{markdown_table(rows, ['layout', 'H·D', 'S', 'floor', *(c[2] for c in cols)])}\n\n"
            f"The break S*: the largest S with every mean loss up to it ≤ {sweep.threshold:g} (≥: nothing on the "
            f"ladder broke).\n\n{markdown_table(brows, ['rule', *(_label(h, d) for h, d in layouts)])}")


def plot(sweep: CapacitySweep, results: list[dict], path: Path) -> Path:
    """Loss against S per layout (solid: delta, dashed: additive; dotted: the layout's rank floor), and the break S*
    against the number of heads."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cells, cols, layouts = mean_loss(results), _columns(sweep), _layouts(sweep)
    sizes = sorted(sweep.sizes)
    fig = Figure(figsize=(11.5, 4.2), constrained_layout=True)
    FigureCanvasAgg(fig)
    ax, bx = fig.subplots(1, 2)
    for j, (h, d) in enumerate(layouts):
        for i, (r, ow, name) in enumerate(cols):
            ax.plot(sizes, [cells[(r, ow, d, S)][0] for S in sizes], marker="os^v"[i % 4], color=f"C{j}",
                    ls="-" if r == "delta" else "--", alpha=1.0 if not ow else 0.6, label=f"{_label(h, d)}, {name}")
        ax.plot(sizes, [heads_floor(S, h, d) for S in sizes], color=f"C{j}", lw=0.8, ls=":")
    ax.axhline(0.5, color="k", lw=0.6, ls=":")
    ax.axhline(sweep.threshold, color="grey", lw=0.6, ls="-.")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("S (distinct keys)")
    ax.set_ylabel("held-out loss ½‖y − ŷ‖²  (dotted: rank floor)")
    ax.set_title(f"One total state {layouts[0][0] * layouts[0][1] ** 2}, split into heads; {sweep.steps} steps",
                 fontsize=10)
    ax.legend(fontsize=6)
    bs = breaks(sweep, results)
    for i, (r, ow, name) in enumerate(cols):
        pts = [(h, bs[(r, ow, d)]) for h, d in layouts]
        bx.plot([h for h, _ in pts], [max(b, 1) for _, (b, _) in pts], marker="os^v"[i % 4], color=f"C{i}", label=name,
                ls="-" if r == "delta" else "--")
        bx.scatter([h for h, (_, top) in pts if top], [max(b, 1) for _, (b, top) in pts if top], s=90,
                   facecolors="none", edgecolors=f"C{i}")
    bx.plot([h for h, _ in layouts], [h * d for h, d in layouts], color="k", lw=0.6, ls="-.", label="H·D (rank bound)")
    break_axes(bx, sweep, "heads H (head dim D = √(state / H))", "the split")
    fig.savefig(path, dpi=120)
    return path


def run_one(job: dict) -> dict | None:
    """Train one run's HeadsCapacityModel (capacity.fit_job); module-level so worker processes can run it."""
    return fit_job(job, lambda: HeadsCapacityModel(job["S"], job["rule"], *parse_layout(job["layout"])))


def run_sweep(sweep: CapacitySweep, out: str | Path | None = None, minutes: float | None = None) -> Path:
    """Run (or resume) a heads sweep (one with layouts); write and print the results."""
    validate(sweep)
    if not sweep.layouts:
        raise ValueError("layouts: expected a heads sweep's layouts (HxD ...), got none")
    return run_grid("capacity", sweep, out, jobs_for=jobs_for, run_one=run_one, report=report, plot=plot,
                    minutes=minutes)

