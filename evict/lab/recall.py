"""The recall lab: MQAR accuracy across every memory, as pairs grow (`evict recall`).

A sweep is a grid of (architecture, (seq_len, pairs), d_model, lr, seed) runs of 2-layer models; each seed's cell is
its best validation accuracy over learning rates (as in Zoology), and the table shows the mean over seeds with the
range (min–max) beside it. Outputs under runs/recall/<timestamp>/: config.json, results.jsonl (one row per run, seed
included), table.md (mean and range, then every seed), scorecard.md, recall_vs_pairs.png, recall_vs_state.png.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from evict.distributed import resolve_device
from evict.lab.sweep import (check_minutes, compiles, curve, diverged, fresh_compile, from_json, out_of_time, run_jobs,
                             seeds_of, stopped_message, sweep_folder, with_deadline, write_results)
from evict.models import LM, ModelConfig, presets
from evict.report import markdown_table
from evict.tasks.mqar import MQARConfig, MQARTask
from evict.train import TrainConfig, train

ARCHS = ("attention", "linear", "deltanet", "gated_deltanet", "kda", "gla", "kimi_linear")
SCORECARD = [  # (architecture, stores, write, read, eviction, sweep arch measured for it)
    ("GPT-2", "every k,v — O(N)", "append", "softmax, sharp", "none", "attention"),
    ("Linear attention", "fixed d×d", "add kᵀv", "qS, blended", "accidental (interference)", "linear"),
    ("DeltaNet", "fixed d×d", "erase-then-write", "qS", "targeted replace", "deltanet"),
    ("Gated DeltaNet", "fixed d×d", "fade·erase·write", "qS", "replace + global decay", "gated_deltanet"),
    ("KDA", "fixed d×d", "per-channel fade·erase·write", "qS", "replace + per-channel decay", "kda"),
    ("GLA", "fixed d×d", "per-channel fade·write", "qS", "per-channel decay", "gla"),
    ("MLA", "latents — O(N), ~28× smaller", "append latents", "softmax, sharp", "none (smaller rent)", "mla"),
    ("Kimi Linear 3:1", "both", "both", "both", "division of labour", "kimi_linear"),
    ("Kimi K3", "states + shelves + experts + depth snapshots", "+ routing", "+ depth attention", "four policies", "k3_mini"),
]


DEFAULT_GATE_DT = (ModelConfig.gate_dt_min, ModelConfig.gate_dt_max)  # the labs' gate_dt default: ModelConfig's


@dataclass
class RecallSweep:
    archs: tuple = ARCHS
    settings: tuple = ((32, 2), (32, 4), (32, 8))  # (seq_len, num_pairs)
    d_models: tuple = (32,)
    lrs: tuple = (1e-2,)
    # The order a cell's lrs are tried in: () runs each cell's lrs side by side (adjacent jobs); a non-empty order runs
    # the grid in rounds, every cell's first lr before any cell's second, so a cell solved (>= target_accuracy) in an
    # early round skips its later lrs (run_one) instead of training them alongside. Listed lrs first, then the rest
    # of `lrs`. A schedule, not a protocol change: the best over lr of a solved cell is >= the target either way.
    lr_order: tuple = ()
    head_dim: int = 16
    n_heads: int | None = None  # None: d_model // head_dim heads; evict lab pairs uses 1 (one head of head_dim)
    n_layers: int = 2
    vocab_size: int = 128
    steps: int = 400
    chunk_size: int | None = 16  # short chunks: fastest on a CPU, per-channel decay in the two-factor range; None: by shape
    batch_size: int = 32
    eval_every: int = 100
    eval_batches: int = 4
    target_accuracy: float = 0.99
    simple: bool = False
    train_examples: int | None = None  # None: fresh training batches; N: one fixed set of N, in epochs (MQARConfig)
    seed: int = 0
    seeds: int = 1  # runs seeds seed, seed+1, …: model init and training batches differ, the val set is shared
    workers: int = 2
    device: str = "cpu"
    compile: bool = False  # CUDA: each block through torch.compile inside the step's CUDA graph (BENCHMARKS.md)
    gate_dt: tuple = DEFAULT_GATE_DT  # the decay gates' initial dt range (ModelConfig.gate_dt_min / gate_dt_max)
    model_set: dict = field(default_factory=dict)  # ModelConfig fields laid over the lab's models (`--set KEY=VALUE`)
    notes: dict = field(default_factory=dict)


QUICK = RecallSweep(seeds=2)  # 3 seeds took 463 s CPU (2 cores: ~4 min + install > 5 min); dev/LOG.md
FULL = RecallSweep(
    settings=((64, 4), (128, 8), (256, 16), (512, 64)), d_models=(64, 128, 256),
    lrs=(1e-4, 4.6e-4, 2.2e-3, 1e-2), lr_order=(2.2e-3, 1e-2, 4.6e-4), head_dim=32, vocab_size=8192, steps=8000,
    batch_size=256, eval_every=500, chunk_size=None, eval_batches=8, workers=4, device="auto", compile=True,  # 4 cells share one GPU: 8
    # gave no more cell-steps/s; chunk_size None: the op's by shape, 16 at heads of 32 on CUDA (dev/LOG.md session 9)
)


def model_config(arch: str, d_model: int, sweep: RecallSweep, seq_len: int):
    """A 2-layer model of `arch` at width d_model; heads of sweep.head_dim (d_model // head_dim of them unless
    sweep.n_heads is set); dense SwiGLU FFNs (no MoE) everywhere.

    Every mixer gets the same kernel-4 short causal conv on q/k/v (the delta family has it anyway): recall then
    measures the memory, not how fast plain attention learns a previous-token head from scratch.
    """
    hd = min(sweep.head_dim, d_model)
    fields = dict(
        vocab_size=sweep.vocab_size, d_model=d_model, n_layers=sweep.n_layers,
        n_heads=sweep.n_heads or d_model // hd, head_dim=hd, d_ff=2 * d_model, moe=None, attn_res=False,
        short_conv=True, kv_lora_rank=max(16, d_model // 2), qk_nope_dim=hd, qk_rope_dim=max(2, hd // 2), v_head_dim=hd,
        chunk_size=sweep.chunk_size, max_seq_len=max(seq_len, 64), **gate_dt_fields(sweep.gate_dt),
    )
    return presets.get(arch, size="tiny", **{**fields, **model_set_fields(sweep.model_set)})


def model_set_fields(model_set: dict) -> dict:
    """A sweep's `model_set` (ModelConfig field -> value, laid over the lab's choices), checked: a name that is not a
    ModelConfig field, or one the lab owns (the vocabulary and width: --vocab, --d-model), is a ValueError."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    for key in model_set:
        if key not in known:
            raise ValueError(f"model_set (--set): {key!r} is not a ModelConfig field")
        if key in ("vocab_size", "d_model"):
            raise ValueError(f"model_set (--set): {key} is the sweep's own (--vocab / --d-model), not a --set field")
    return dict(model_set)


def gate_dt_fields(gate_dt) -> dict:
    """ModelConfig's gate_dt_min / gate_dt_max from a sweep's `gate_dt` (MIN, MAX), checked here so that a bad range
    names the sweep's field (pairs: --gate-dt; validate builds every model config)."""
    if len(gate_dt) != 2 or not 0 < gate_dt[0] <= gate_dt[1]:
        raise ValueError(f"gate_dt: expected MIN MAX with 0 < MIN <= MAX, got {list(gate_dt)}")
    return {"gate_dt_min": gate_dt[0], "gate_dt_max": gate_dt[1]}


def solved_marker(job: dict) -> Path | None:
    """The file a run of this (arch, L, K, d, seed) cell writes once it reaches the sweep's target accuracy: the cell's
    best over learning rates is then known to be >= the target, so its other learning rates stop (Zoology's early stop
    at 0.99, per cell) at their next evaluation, or do not start. Only for jobs that name a `solved_dir` (jobs_for)."""
    if job.get("solved_dir") is None:
        return None
    return Path(job["solved_dir"]) / f"{job['arch']}_L{job['seq_len']}_K{job['pairs']}_d{job['d_model']}_s{job['seed']}"


def expected_seconds(job: dict, steps: int) -> float | None:
    """How long a run of `steps` steps of this job's cell takes, from the runs of the same (L, K, d) the sweep has
    finished (their result.json beside the job's folder): the median seconds per step of the same architecture's runs
    of >= 1,000 steps, else of any architecture's; None when there are none. Used by a piece (`--minutes`) not to start
    a run it cannot finish, whose work a machine that does not keep runs/ between calls would lose."""
    same: list[float] = []
    other: list[float] = []
    for f in Path(job["dir"]).parent.glob("*/result.json"):
        try:
            r = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if (r.get("seq_len"), r.get("pairs"), r.get("d_model")) != (job["seq_len"], job["pairs"], job["d_model"]):
            continue
        if (r.get("steps") or 0) >= 1000 and r.get("seconds"):
            (same if r.get("arch") == job["arch"] else other).append(r["seconds"] / r["steps"])
    rates = sorted(same or other)
    return None if not rates else rates[len(rates) // 2] * steps


def _outlasts_a_piece(job: dict, need: float | None) -> bool:
    return need is not None and job.get("piece_seconds") is not None and need > job["piece_seconds"]


def longer_than_a_piece(job: dict, steps: int) -> bool:
    """Whether a run of a timed piece's job is expected to take longer than a whole piece (expected_seconds): it
    can only finish over several pieces, resuming from its checkpoint, on a machine that keeps the sweep's folder."""
    return _outlasts_a_piece(job, expected_seconds(job, steps))


def starts_now(job: dict, steps: int) -> bool:
    """Whether a timed piece starts this job's run now: when it is expected to finish before the piece's stop_at (or
    nothing is known yet), or, for a run longer than a whole piece (which would otherwise never start), while at least
    half the piece is left, so it trains that long before its checkpoint; else a later, smaller job goes first."""
    need = expected_seconds(job, steps)  # reads the cell's finished result.json files: once per call
    left = job["stop_at"] - time.time()
    if need is None or need <= left:
        return True
    return _outlasts_a_piece(job, need) and left >= job["piece_seconds"] / 2


def left_estimate(jobs: list[dict], results: list, steps: int) -> tuple[float, int, int]:
    """What a stopped sweep has left: (seconds, runs estimated, runs without an estimate) — the expected_seconds of
    every unfinished run whose cell is not solved yet, at the full `steps` (an upper bound: runs stop at the target).
    Runs of cells with no finished run of >= 1,000 steps have no estimate."""
    total, known, unknown = 0.0, 0, 0
    for job, res in zip(jobs, results):
        marker = solved_marker(job)
        if res is not None or (marker is not None and marker.exists()):
            continue
        need = expected_seconds(job, steps)
        if need is None:
            unknown += 1
        else:
            total, known = total + need, known + 1
    return total, known, unknown


def run_one(job: dict) -> dict | None:
    """Train one (arch, L, K, d, lr) cell; module-level so worker processes can run it.

    A run whose cell another learning rate has already solved (solved_marker) stops at its next evaluation and keeps
    the accuracy it reached (`stopped`); one that had not started is not trained (`accuracy` None, `skipped`)."""
    logging.getLogger("evict").setLevel(logging.WARNING)
    sweep = from_json(RecallSweep, job["sweep"])
    L, K, d = job["seq_len"], job["pairs"], job["d_model"]
    seed = job["seed"]
    row = {"arch": job["arch"], "seq_len": L, "pairs": K, "d_model": d, "lr": job["lr"], "seed": seed}
    marker = solved_marker(job)
    on_gpu = resolve_device(sweep.device).type == "cuda"
    fresh_compile(sweep)
    torch.manual_seed(seed)
    cfg = model_config(job["arch"], d, sweep, L)
    model = LM(cfg)
    state_size, params = model.state_size(L), sum(p.numel() for p in model.parameters())
    if marker is not None and marker.exists() and not (Path(job["dir"]) / "checkpoint.pt").exists():
        return {**row, "accuracy": None, "skipped": f"cell solved first by {marker.read_text().strip()}", "steps": 0,
                "state_size": state_size, "params": params, "label": f"{job['arch']} K={K} skipped (cell solved)"}
    task = MQARTask(MQARConfig(vocab_size=sweep.vocab_size, seq_len=L, num_pairs=K, simple=sweep.simple, train_seed=seed,
                               train_examples=sweep.train_examples))
    stop_at = job.get("stop_at")
    if out_of_time(job):
        return None  # out of time before it started: left for the next piece
    if stop_at is not None and not (Path(job["dir"]) / "checkpoint.pt").exists() and not starts_now(job, sweep.steps):
        return None  # would not finish in this piece: the worker takes a later (smaller) job instead
    tc = TrainConfig(steps=sweep.steps, batch_size=sweep.batch_size, lr=job["lr"], weight_decay=0.1, warmup_steps=0,
                     eval_every=sweep.eval_every, eval_batches=sweep.eval_batches, target_accuracy=sweep.target_accuracy,
                     seed=seed, device=sweep.device, out_dir=job["dir"], progress=False, log_every=50,
                     graphs=on_gpu, compile=compiles(sweep), checkpoint_every=sweep.eval_every, stop_at=stop_at,
                     stop_file=None if marker is None else str(marker))
    res = train(model, task, tc)
    if res.interrupted:
        return None
    solved = res.best_val_accuracy >= sweep.target_accuracy
    if solved and marker is not None and not marker.exists():
        marker.parent.mkdir(parents=True, exist_ok=True)
        tmp = marker.with_suffix(f".{job['lr']:g}.tmp")
        tmp.write_text(f"lr={job['lr']:g} at step {res.steps_done}\n")
        tmp.replace(marker)
    loss = res.final_val_loss  # ln(V/2) when the model guesses uniformly over the values
    out = {**row, "accuracy": res.best_val_accuracy, "final_accuracy": res.final_val_accuracy,
           "final_loss": round(loss, 4) if math.isfinite(loss) else None, "steps": res.steps_done,
           "seconds": round(res.total_seconds, 1), "state_size": state_size, "params": params, "curve": curve(res),
           "label": f"{job['arch']} K={K} acc={res.best_val_accuracy:.2f}"}
    if res.stopped_early and not solved and marker is not None:
        out["stopped"] = f"cell solved first by {marker.read_text().strip()}"
    if res.diverged_at is not None:  # accuracy: the best before the loss stopped being finite
        out.update(diverged(res), label=out["label"] + f" (diverged at step {res.diverged_at})")
    return out


def jobs_for(sweep: RecallSweep, root: Path) -> list[dict]:
    """Every run of the grid; the costliest settings (most pairs) first, so the last runs to finish are short ones.

    A run's folder is named by its cell, plus `_s<seed>` when the sweep has several seeds (one seed keeps the names
    of sweeps written before seeds existed, so they still resume).
    """
    sw = dataclasses.asdict(sweep)
    order, cells = lr_rounds(sweep), [(arch, d) for arch in sweep.archs for d in sweep.d_models]
    runs = ([(arch, d, lr) for lr in order for arch, d in cells] if sweep.lr_order
            else [(arch, d, lr) for arch, d in cells for lr in order])  # within one (L, K, seed)
    jobs = []
    for (L, K) in sorted(sweep.settings, key=lambda s: (-s[0] * s[1], -s[1])):
        for seed in seeds_of(sweep):
            for arch, d, lr in runs:
                name = f"{arch}_L{L}_K{K}_d{d}_lr{lr:g}" + (f"_s{seed}" if sweep.seeds > 1 else "")
                jobs.append({"arch": arch, "seq_len": L, "pairs": K, "d_model": d, "lr": lr, "seed": seed,
                             "dir": str(root / "runs" / name), "solved_dir": str(root / "solved"), "sweep": sw})
    return jobs


def lr_rounds(sweep: RecallSweep) -> list[float]:
    """A sweep's lrs in the order they are tried: those of lr_order (that are in lrs) first, then the rest of lrs."""
    first = [lr for lr in sweep.lr_order if lr in sweep.lrs]
    return first + [lr for lr in sweep.lrs if lr not in first]


def best_over_lr(results: list[dict]) -> dict:
    """(arch, L, K, d, seed) -> the result with the highest accuracy over learning rates."""
    best: dict[tuple, dict] = {}
    for r in results:
        if r["accuracy"] is None:  # not trained: its cell was solved at another lr first (run_one)
            continue
        key = (r["arch"], r["seq_len"], r["pairs"], r["d_model"], r["seed"])
        if key not in best or r["accuracy"] > best[key]["accuracy"]:
            best[key] = r
    return best


@dataclass
class Cell:
    """One (arch, L, K, d) cell over seeds: each seed's best-over-lr accuracy, and their mean and range."""

    accuracies: list  # in seed order
    seeds: list
    state_size: int

    @property
    def mean(self) -> float:
        return statistics.fmean(self.accuracies)

    @property
    def spread(self) -> tuple[float, float]:
        return min(self.accuracies), max(self.accuracies)

    def __str__(self) -> str:
        """`0.512 (0.136–0.707)`: mean (min–max over seeds); the bare number for a single seed."""
        if len(self.accuracies) == 1:
            return f"{self.mean:.3f}"
        lo, hi = self.spread
        return f"{self.mean:.3f} ({lo:.3f}–{hi:.3f})"


def over_seeds(best: dict) -> dict:
    """best_over_lr's (arch, L, K, d, seed) -> result, folded into (arch, L, K, d) -> Cell."""
    cells: dict = {}
    for (arch, L, K, d, seed), r in sorted(best.items(), key=lambda kv: kv[0][4]):
        c = cells.setdefault((arch, L, K, d), Cell([], [], r["state_size"]))
        c.accuracies.append(r["accuracy"])
        c.seeds.append(seed)
    return cells


def table(sweep: RecallSweep, cells: dict, d: int) -> str:
    """Mean (range) per cell; a cell not in `cells` (a partial report: not finished yet) shows —."""
    cols = [f"K={K} (L={L})" for L, K in sweep.settings]
    rows = []
    for arch in sweep.archs:
        last = cells.get((arch, sweep.settings[-1][0], sweep.settings[-1][1], d))
        row = {"architecture": arch, "state (numbers/seq, largest L)": last.state_size if last else "—"}
        for (L, K), c in zip(sweep.settings, cols):
            row[c] = str(cells[(arch, L, K, d)]) if (arch, L, K, d) in cells else "—"
        rows.append(row)
    return markdown_table(rows, ["architecture", *cols, "state (numbers/seq, largest L)"])


def seed_table(sweep: RecallSweep, cells: dict, d: int) -> str:
    """Every seed's accuracy per cell, `a / b / c` in seed order."""
    cols = [f"K={K} (L={L})" for L, K in sweep.settings]
    rows = [{"architecture": arch, **{c: " / ".join(f"{a:.3f}" for a in cells[(arch, L, K, d)].accuracies)
                                      if (arch, L, K, d) in cells else "—" for (L, K), c in zip(sweep.settings, cols)}}
            for arch in sweep.archs]
    return markdown_table(rows, ["architecture", *cols])


def scorecard(sweep: RecallSweep, cells: dict) -> str:
    L, K = sweep.settings[-1]
    d = max(sweep.d_models)
    col = f"measured MQAR acc (K={K}, L={L}, d={d})"
    rows = []
    for name, stores, write, read, evict, arch in SCORECARD:
        c = cells.get((arch, L, K, d))
        rows.append({"Architecture": name, "Stores": stores, "Write": write, "Read": read, "Eviction": evict,
                     col: str(c) if c else "not in this sweep"})
    return markdown_table(rows, ["Architecture", "Stores", "Write", "Read", "Eviction", col])


def plots(sweep: RecallSweep, cells: dict, root: Path) -> list[Path]:
    """Mean over seeds, with a bar over the range (min–max) when there are several."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = max(sweep.d_models)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ks = [K for _, K in sweep.settings]
    for i, arch in enumerate(sweep.archs):
        shift = 2 ** (0.03 * (i - (len(sweep.archs) - 1) / 2))  # side by side on the log axis, so ranges don't hide
        _mean_and_range(ax, [k * shift for k in ks], [cells[(arch, L, K, d)] for L, K in sweep.settings], arch)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.minorticks_off()
    p1 = _finish(plt, fig, ax, "key-value pairs K", f"Recall vs pairs — {sweep.n_layers} layers, d={d}{_seeds_note(sweep)}",
                 root / "recall_vs_pairs.png")

    L, K = sweep.settings[-1]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for arch in sweep.archs:
        cs = sorted((cells[(arch, L, K, dd)] for dd in sweep.d_models), key=lambda c: c.state_size)
        _mean_and_range(ax, [c.state_size for c in cs], cs, arch)
    ax.set_xscale("log")
    p2 = _finish(plt, fig, ax, f"memory held per sequence at L={L} (numbers, all layers)",
                 f"Recall vs state size — K={K}{_seeds_note(sweep)}", root / "recall_vs_state.png")
    return [p1, p2]


def _seeds_note(sweep: RecallSweep) -> str:
    return f"; mean, range over {sweep.seeds} seeds" if sweep.seeds > 1 else ""


def _mean_and_range(ax, xs: list, cs: list, label: str) -> None:
    means = [c.mean for c in cs]
    err = [[c.mean - c.spread[0] for c in cs], [c.spread[1] - c.mean for c in cs]]
    ax.errorbar(xs, means, yerr=err if any(len(c.accuracies) > 1 for c in cs) else None, marker="o", capsize=3, label=label)


def _finish(plt, fig, ax, xlabel: str, title: str, path: Path) -> Path:
    """Shared styling of the lab's accuracy plots; saves and closes the figure."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel("MQAR accuracy (best over lr)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def known_rows(sweep: RecallSweep, jobs: list[dict], results: list) -> list[dict]:
    """The finished rows (seed added) of the (arch, L, K, d, seed) cells whose best over lr is known: every lr has
    finished, or one has reached the target accuracy (the others stop at it; the best is then >= the target)."""
    by: dict[tuple, list] = {}
    for job, r in zip(jobs, results):
        by.setdefault((job["arch"], job["seq_len"], job["pairs"], job["d_model"], job["seed"]), []).append(
            None if r is None else {**r, "seed": job["seed"]})  # results of older runs lack the seed
    rows = []
    for rs in by.values():
        done = [r for r in rs if r is not None]
        if len(done) == len(rs) or any(r["accuracy"] is not None and r["accuracy"] >= sweep.target_accuracy for r in done):
            rows += done
    return rows


def report(sweep: RecallSweep, results: list[dict]) -> tuple[str, str]:
    """The markdown tables (mean and range per cell, then every seed; one block per d_model) and the scorecard. A cell
    short of a seed's result (a partial report, from known_rows) is left out: the tables show — there."""
    cells = {k: c for k, c in over_seeds(best_over_lr(results)).items() if len(c.accuracies) == sweep.seeds}
    seeds = ", ".join(str(s) for s in seeds_of(sweep))
    blocks = []
    for d in sweep.d_models:
        blocks.append(f"d_model = {d}; seeds {seeds}" + (f"; mean (min–max) over the {sweep.seeds} seeds" if sweep.seeds > 1 else "")
                      + f"\n\n{table(sweep, cells, d)}")
        if sweep.seeds > 1:
            blocks.append(f"d_model = {d}, each seed ({seeds})\n\n{seed_table(sweep, cells, d)}")
    return "\n\n".join(blocks), scorecard(sweep, cells)


def data_note(sweep: RecallSweep) -> str:
    """What a table's title says about the training data and any model fields set (`--set`): nothing for fresh
    batches and the lab's own models (the default)."""
    n = sweep.train_examples
    data = "" if n is None else f", trained on one fixed set of {n:,} examples (epochs of {n / sweep.batch_size:g} steps)"
    return data + "".join(f", {k}={json.dumps(v)}" for k, v in sweep.model_set.items())


def run_sweep(sweep: RecallSweep, out: str | Path | None = None, minutes: float | None = None) -> Path:
    """Run (or resume, when `out` already holds part of it) the sweep; write and print the results.

    `minutes`: stop after about this long — runs in flight checkpoint and stop, no new run starts, nor one that the
    finished runs of its (L, K, d) say would not end in time but would in a fresh piece (starts_now; a later, smaller job
    goes instead; a run longer than a whole piece starts in a piece's first half and resumes in the next) — and
    say how much is left; the same command (same `out`) continues. Tables and plots are written once every run has finished;
    a stopped sweep writes partial_table.md with the cells known so far (known_rows)."""
    check_minutes(minutes)
    unknown = [a for a in sweep.archs if a not in presets.FAMILIES]
    if unknown:
        raise ValueError(f"archs: unknown architecture(s) {unknown}; expected names from {list(presets.FAMILIES)}")
    if sweep.seeds < 1:
        raise ValueError(f"seeds: expected >= 1, got {sweep.seeds}")
    for L, K in sweep.settings:
        MQARConfig(vocab_size=sweep.vocab_size, seq_len=L, num_pairs=K, simple=sweep.simple,
                   train_examples=sweep.train_examples)  # validates
    # fields added since an older config.json was written take their defaults, so an old sweep resumes
    root = sweep_folder("recall", sweep, out, defaults=json.loads(json.dumps(dataclasses.asdict(RecallSweep()))))
    jobs = jobs_for(sweep, root)
    print(f"recall sweep: {len(jobs)} runs (seeds {', '.join(map(str, seeds_of(sweep)))}) -> {root}")
    jobs = with_deadline(jobs, minutes)
    results = run_jobs(run_one, jobs, workers=sweep.workers, desc="recall")
    left = sum(r is None for r in results)
    note = data_note(sweep)
    title = f"MQAR accuracy (best over lr {list(sweep.lrs)}), {sweep.n_layers} layers, vocab {sweep.vocab_size}{note}"
    if left:
        tables, _ = report(sweep, known_rows(sweep, jobs, results))
        head = f"Partial: {len(jobs) - left} of {len(jobs)} runs finished; — = a cell whose best over lr is not known yet. {title}"
        (root / "partial_table.md").write_text(f"{head}\n\n{tables}\n")
        print(f"{stopped_message(minutes, jobs, left, root)}; the cells known so far are in {root / 'partial_table.md'}")
        seconds, timed, untimed = left_estimate(jobs, results, sweep.steps)
        if timed:
            print(f"left, at most: {seconds / 60 / max(1, sweep.workers):.0f} min with {sweep.workers} workers for the "
                  f"{timed} runs whose cells have timed runs (full steps; runs stop at {sweep.target_accuracy:g}), "
                  f"{untimed} runs more without an estimate")
        long = sum(r is None and longer_than_a_piece(j, sweep.steps) for j, r in zip(jobs, results))
        if long:
            print(f"{long} of the runs left take longer than one piece of {minutes:g} min: they finish over several "
                  f"pieces, resuming from their checkpoints, so keep {root} between pieces")
        return root
    finished = [r for r in results if r is not None]  # all of them (none left)
    rows = [{**r, "seed": job["seed"]} for r, job in zip(finished, jobs)]  # results of older runs lack the seed
    write_results(root, rows)
    tables, card = report(sweep, rows)
    # a fixed training set or --set fields: the table's title says so (the default's table is bare)
    (root / "table.md").write_text((f"{title}\n\n" if note else "") + tables + "\n")
    (root / "scorecard.md").write_text(card + "\n")
    pngs = plots(sweep, over_seeds(best_over_lr(rows)), root)
    print(f"\n{title}\n\n{tables}\n")
    print(f"{card}\n")
    print("wrote " + ", ".join(str(p) for p in [root / "table.md", root / "scorecard.md", *pngs]))
    return root
