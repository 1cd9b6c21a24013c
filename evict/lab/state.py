"""The state-tracking lab (`evict lab state`): can a memory track parity, mod-5 arithmetic, S3 / S5 products on
sequences longer than it was trained on? Grazzi et al. (ICLR 2025): the delta rule with β ∈ [0, 2] (negative
eigenvalues of the state transition I − β kᵀk) solves parity; with β ∈ [0, 1] it cannot.

`--counters` (quick, CPU) and `--counters-full` (GPU) run the bounded counters of evict/tasks/state.py — a counter
mod 3 and mod 5 and the depth of a Dyck-1 prefix of depth ≤ 4 — with β ∈ [0, 1] and β ∈ [0, 2] beside linear
attention and attention: does the sign flip that parity needs help a rotation (Z_m, m ≥ 3) or a bounded count?

A sweep is a grid of (task, model, seed) runs of `evict.train.train` on `evict.tasks.state.StateTask`: train at
lengths 3–40, evaluate at 40–256. A run's score is its best validation accuracy over evaluations, rescaled
(scaled accuracy: chance 0, perfect 1); a cell is the best of its seeds, as in the paper. Each run also scores its
final model at the test positions past the longest training length only (`beyond_scaled_accuracy`): the plain
score counts every position of a test row, and the first 40 are ones a model that never generalises also fits; and the
same per span of positions that doubles (`beyond_scaled_by_position`: 40–79, 80–159, 160–255). Outputs under
runs/state/<timestamp>/: config.json, results.jsonl (one row per run), table.md, state.png, runs/<name>/result.json;
a timed piece (`--minutes`) that leaves runs writes partial_table.md instead (the cells whose every seed is in).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from evict.lab.sweep import check_names, diverged, from_json, lab_train_config, out_of_time, run_grid, seeds_of
from evict.models import LM, presets
from evict.report import markdown_table
from evict.tasks.state import TASKS, StateConfig, StateTask, check_task, scaled_accuracy
from evict.train import train

MODELS = {  # name -> (preset family, neg_eigval, label)
    "deltanet": ("deltanet", False, "DeltaNet β∈[0,1]"),
    "deltanet_neg": ("deltanet", True, "DeltaNet β∈[0,2]"),
    "gated_deltanet": ("gated_deltanet", False, "Gated DeltaNet β∈[0,1]"),
    "gated_deltanet_neg": ("gated_deltanet", True, "Gated DeltaNet β∈[0,2]"),
    "kda": ("kda", False, "KDA β∈[0,1]"),
    "kda_neg": ("kda", True, "KDA β∈[0,2]"),
    "attention": ("attention", False, "attention (RoPE)"),
    "linear": ("linear", False, "linear attention"),
}
PUBLISHED = {  # Grazzi et al., scaled accuracy, best of 3 seeds (LAB.md): model -> {task: value}; their modular
    # arithmetic is Deletang et al.'s, × before + and − (evict/tasks/state.py): mod_arith_prec, not left-to-right mod_arith
    "deltanet": {"parity": 0.017, "mod_arith_prec": 0.314},
    "deltanet_neg": {"parity": 1.000, "mod_arith_prec": 0.971},
    "attention": {"parity": 0.022, "mod_arith_prec": 0.031},
}
WHICH_FIELDS = ("tasks", "models", "seeds")  # they choose which runs exist; each run's row names its own (dev/grid_restore.py)


@dataclass
class StateSweep:
    tasks: tuple = ("parity",)
    models: tuple = ("deltanet", "deltanet_neg")
    d_model: int = 64
    n_heads: int = 2
    n_layers: int = 2
    steps: int = 300
    batch_size: int = 64
    lr: float = 1e-3
    train_lengths: tuple = (3, 40)
    test_lengths: tuple = (40, 256)
    eval_every: int = 100
    eval_batches: int = 2
    chunk_size: int | None = 16  # None: the memory op picks by shape (CUDA: auto_chunk; CPU: 64)
    seed: int = 0
    seeds: int = 1  # seeds seed, seed+1, …: model init and training batches differ, the test set is shared
    workers: int = 2
    device: str = "cpu"


QUICK = StateSweep(  # 6 runs of 500 steps, two at a time: ~4 min on 2 cores (dev/LOG.md, 2026-11-30)
    models=("deltanet", "deltanet_neg", "kda", "kda_neg", "attention", "linear"), steps=500, lr=3e-3, eval_every=250,
)
FULL = StateSweep(  # Grazzi et al.'s protocol (LAB.md); the step count is ours, LAB.md does not give one
    tasks=TASKS, models=tuple(MODELS), d_model=128, n_heads=4, steps=20_000, batch_size=256, eval_every=1000,
    eval_batches=8, chunk_size=None, seeds=3, workers=4, device="auto",
)

COUNTER_TASKS = ("count_mod3", "count_mod5", "dyck4")
COUNTERS = replace(  # QUICK's settings, 6 runs: a counter mod 3 and Dyck-1 depth <= 4 (count_mod5 with --tasks)
    QUICK, tasks=("count_mod3", "dyck4"), models=("deltanet", "deltanet_neg", "linear"),
)
COUNTERS_FULL = replace(  # FULL's protocol at half its steps: 72 runs; at the pace of FULL on an H200 (120 runs of
    # 20,000 steps in ~2.5 h, 14-16 at once; results/full_runs.md) about 45 min, not run yet
    FULL, tasks=COUNTER_TASKS, steps=10_000,
)


def model_config(model: str, sweep: StateSweep, vocab_size: int):
    """A sweep.n_layers-deep model of `model` (a MODELS key); every mixer has the kernel-4 short conv; dense SwiGLU."""
    family, neg, _ = MODELS[model]
    hd = sweep.d_model // sweep.n_heads
    return presets.get(
        family, size="tiny", vocab_size=vocab_size, d_model=sweep.d_model, n_layers=sweep.n_layers,
        n_heads=sweep.n_heads, head_dim=hd, d_ff=2 * sweep.d_model, moe=None, attn_res=False, short_conv=True,
        neg_eigval=neg, chunk_size=sweep.chunk_size, max_seq_len=max(sweep.test_lengths[1], sweep.train_lengths[1]),
    )


def _task(name: str, sweep: StateSweep, seed: int) -> StateTask:
    return StateTask(StateConfig(task=name, train_lengths=tuple(sweep.train_lengths), test_lengths=tuple(sweep.test_lengths),
                                 train_seed=seed))


def position_spans(sweep: StateSweep) -> list[tuple[int, int]]:
    """The test positions past training, in spans that double: [N, 2N), [2N, 4N), … up to the longest test row
    (N = the longest training length; 40 → 40–79, 80–159, 160–255 at the default lengths)."""
    lo, end, spans = sweep.train_lengths[1], sweep.test_lengths[1], []
    while lo < end:
        spans.append((lo, min(2 * lo, end)))
        lo *= 2
    return spans


def position_accuracy(model: LM, task: StateTask, sweep: StateSweep) -> tuple[float, dict[str, float]]:
    """Accuracy of `model` at the labelled test positions past every training position (index >= train_lengths[1]),
    on the same test batches as the training loop's evaluation — how far the state tracking carries, without the
    first 40 tokens of each row that a model which only fits the training lengths also gets right — and the same
    per span of position_spans ("40-79": accuracy; spans with no label are left out): where it stops carrying."""
    device = next(model.parameters()).device
    spans = position_spans(sweep)
    model.eval()
    hits = torch.zeros(len(spans), 2, dtype=torch.float64)
    with torch.no_grad():
        for i in range(sweep.eval_batches):
            x, y = task.get_batch("val", i, sweep.batch_size)
            pred = model(x.to(device)).argmax(-1).cpu()  # [B, T]
            pos = torch.arange(y.shape[1])[None, :]
            for j, (a, b) in enumerate(spans):
                mask = (y != -100) & (pos >= a) & (pos < b)  # [B, T]
                hits[j] += torch.stack([((pred == y) & mask).sum(), mask.sum()]).double()
    total = hits.sum(0)
    by_span = {f"{a}-{b - 1}": (h[0] / h[1]).item() for (a, b), h in zip(spans, hits) if h[1] > 0}
    return (total[0] / total[1].clamp_min(1)).item(), by_span


def run_one(job: dict) -> dict | None:
    """Train one (task, model, seed) run; module-level so worker processes can run it."""
    logging.getLogger("evict").setLevel(logging.WARNING)
    if out_of_time(job):
        return None  # a timed piece is over: left for the next one
    sweep = from_json(StateSweep, job["sweep"])
    seed = job["seed"]
    task = _task(job["task"], sweep, seed)
    torch.manual_seed(seed)
    model = LM(model_config(job["model"], sweep, task.vocab_size))
    res = train(model, task, lab_train_config(sweep, seed, job))
    if res.interrupted:
        return None  # stopped at the piece's end: its checkpoint resumes it
    classes = task.cfg.classes
    scaled = scaled_accuracy(res.best_val_accuracy, classes)
    beyond, by_span = position_accuracy(model, task, sweep)
    return {
        "task": job["task"], "model": job["model"], "seed": seed, "accuracy": res.best_val_accuracy,
        "final_accuracy": res.final_val_accuracy, "scaled_accuracy": scaled,
        "final_scaled_accuracy": scaled_accuracy(res.final_val_accuracy, classes), "classes": classes,
        "beyond_accuracy": beyond, "beyond_scaled_accuracy": scaled_accuracy(beyond, classes),
        "beyond_scaled_by_position": {k: scaled_accuracy(v, classes) for k, v in by_span.items()},
        "steps": res.steps_done, "seconds": round(res.total_seconds, 1),
        "params": sum(p.numel() for p in model.parameters()), **diverged(res),
        "label": f"{job['task']} {job['model']} {scaled:.2f}",
    }


def jobs_for(sweep: StateSweep, root: Path) -> list[dict]:
    sw = dataclasses.asdict(sweep)
    return [{"task": t, "model": m, "seed": s, "dir": str(root / "runs" / f"{t}_{m}_s{s}"), "sweep": sw}
            for t in sweep.tasks for s in seeds_of(sweep) for m in sweep.models]


def best_of_seeds(results: list[dict], seeds: int | None = None) -> dict:
    """(task, model) -> the run with the highest scaled accuracy over seeds. `seeds`: only the cells with that many
    runs (a partial sweep's cell short of a seed's run has no best of seeds yet)."""
    best: dict = {}
    count: dict = {}
    for r in results:
        key = (r["task"], r["model"])
        count[key] = count.get(key, 0) + 1
        if key not in best or r["scaled_accuracy"] > best[key]["scaled_accuracy"]:
            best[key] = r
    return {k: r for k, r in best.items() if seeds is None or count[k] == seeds}


def report(sweep: StateSweep, results: list[dict]) -> str:
    """Best of seeds per (model, task), the published number beside it, then every seed's scaled accuracy, then the
    best seed's score past training per span of positions. A partial sweep's (run_grid's partial_table.md) cells
    short of a seed's run, and its seeds not run yet, show —."""
    best = best_of_seeds(results, sweep.seeds)
    by_seed = {(r["task"], r["model"], r["seed"]): r for r in results}
    past = sweep.train_lengths[1]
    rows, seed_rows = [], []
    for m in sweep.models:
        row, srow = {"model": MODELS[m][2]}, {"model": MODELS[m][2]}
        for t in sweep.tasks:
            row[t] = _score(best.get((t, m)), "scaled_accuracy")
            pub = PUBLISHED.get(m, {}).get(t)
            row[f"{t} (published)"] = f"{pub:.3f}" if pub is not None else "—"
            row[f"{t} past {past}"] = _score(best.get((t, m)), "beyond_scaled_accuracy")
            runs = [by_seed.get((t, m, s)) for s in seeds_of(sweep)]
            srow[t] = " / ".join(_score(r, "scaled_accuracy") for r in runs)
            known = [r["scaled_accuracy"] for r in runs if r is not None]
            if len(runs) > 1 and len(known) == len(runs):  # the mean beside the best: best of 3 can favour a lucky seed
                srow[t] += f" (mean {sum(known) / len(known):.3f})"
        rows.append(row)
        seed_rows.append(srow)
    cols = [c for t in sweep.tasks for c in (t, f"{t} (published)", f"{t} past {past}")]
    seeds = ", ".join(map(str, seeds_of(sweep)))
    head = (f"Scaled accuracy (chance 0, perfect 1) at test lengths {sweep.test_lengths[0]}–{sweep.test_lengths[1]} after "
            f"training at {sweep.train_lengths[0]}–{past}; best of seeds {seeds}; {sweep.n_layers} layers, "
            f"d {sweep.d_model}, {sweep.n_heads} heads, {sweep.steps} steps, batch {sweep.batch_size}, lr {sweep.lr:g}. "
            "Published: Grazzi et al. (2 layers, d 128, best of 3 seeds). `past N`: the same run's final model scored "
            "only at test positions beyond every training position (index >= N).")
    spans = [f"{a}-{b - 1}" for a, b in position_spans(sweep)]
    pos_rows = [{"model": MODELS[m][2], **{f"{t} {k}": _span(best.get((t, m)), k) for t in sweep.tasks for k in spans}}
                for m in sweep.models]
    return (f"{head}\n\n{markdown_table(rows, ['model', *cols])}\n\nEvery seed ({seeds}), scaled accuracy, and their mean\n\n"
            f"{markdown_table(seed_rows, ['model', *sweep.tasks])}\n\nPast {past}, by test position "
            "(the best seed's final model, scaled accuracy; — : no label there, or a run from before these were "
            f"recorded)\n\n{markdown_table(pos_rows, list(pos_rows[0]))}")


def _score(run: dict | None, key: str) -> str:
    return "—" if run is None else f"{run[key]:.3f}"


def _span(run: dict | None, span: str) -> str:
    value = None if run is None else run.get("beyond_scaled_by_position", {}).get(span)
    return "—" if value is None else f"{value:.3f}"


def plot(sweep: StateSweep, results: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = best_of_seeds(results)
    fig, ax = plt.subplots(figsize=(1.6 + 1.2 * len(sweep.tasks) * max(1, len(sweep.models) / 4), 4.2))
    width = 0.8 / len(sweep.models)
    for i, m in enumerate(sweep.models):
        xs = [j + (i - (len(sweep.models) - 1) / 2) * width for j in range(len(sweep.tasks))]
        ax.bar(xs, [best[(t, m)]["scaled_accuracy"] for t in sweep.tasks], width, label=MODELS[m][2])
        ax.scatter(xs, [best[(t, m)]["beyond_scaled_accuracy"] for t in sweep.tasks], marker="_", s=400 * width,
                   color="k", zorder=3, label=f"past {sweep.train_lengths[1]} only" if i == 0 else None)
    ax.set_xticks(range(len(sweep.tasks)), list(sweep.tasks))
    ax.axhline(0, color="k", lw=0.6)
    ax.set_ylim(min(-0.05, *(r[k] for r in results for k in ("scaled_accuracy", "beyond_scaled_accuracy"))) - 0.02, 1.05)
    ax.set_ylabel("scaled accuracy (best of seeds)")
    ax.set_title(f"State tracking: train {sweep.train_lengths[0]}–{sweep.train_lengths[1]}, "
                 f"test {sweep.test_lengths[0]}–{sweep.test_lengths[1]}", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def validate(sweep: StateSweep) -> None:
    if not sweep.tasks or len(set(sweep.tasks)) != len(sweep.tasks):
        raise ValueError(f"tasks: expected distinct task names, got {list(sweep.tasks)}")
    for task in sweep.tasks:
        check_task(task)
    check_names("models", sweep.models, MODELS)
    if sweep.seeds < 1:
        raise ValueError(f"seeds: expected >= 1, got {sweep.seeds}")
    if sweep.d_model % sweep.n_heads:
        raise ValueError(f"d_model: {sweep.d_model} is not a multiple of n_heads={sweep.n_heads}")
    for t in sweep.tasks:
        _task(t, sweep, sweep.seed)  # validates the lengths


def run_sweep(sweep: StateSweep, out: str | Path | None = None, minutes: float | None = None) -> Path:
    """Run (or resume, when `out` already holds part of it) the sweep; write and print the results."""
    validate(sweep)
    return run_grid("state", sweep, out, jobs_for=jobs_for, run_one=run_one, report=report, plot=plot, minutes=minutes,
                    partial=True, which=WHICH_FIELDS)
