"""The pairs-vs-dimension lab (`evict lab pairs`): the largest number of MQAR pairs a memory recalls at >= 90 %
accuracy, as its head dim d grows — linear in d? (The lesson's question; LAB.md, Capacity.)

Each ladder is one (rule, d, seed): a model of the recall lab (`evict.lab.recall.run_one`, the one MQAR cell: 2
layers of a fixed width d_model, each with one head of dim d, so only the memory grows with d: every memory layer
holds a d × d state, attention a d-dim key and value per token) trained at K = 2, 4, 8, … pairs
(sequence length len_per_pair · K) until a rung stays below the threshold at every one of the sweep's learning
rates. A rung tries the lr the rung below passed at first, then the others in the order listed, and passes at the
first whose run reaches the threshold (its run stops there, the recall lab's target accuracy set to the threshold, and
the rung's other lrs do not run; a run already finished is read first, so a ladder resumed under another lr order
trains nothing its rungs have settled): since a run's accuracy is its best evaluation and a rung fails only once every
lr has, K* is the same as when every lr trains to the end and the best is taken; only the passing rungs' reported
accuracy, lr and steps are the first passing run's. K*(rule, d) is the largest K of the
ladder reached before the first failing rung (0 when the first fails; "≥ K" when the ladder ran out of rungs). The
fit per rule: K* ≈ c · d (least squares through the origin) and the slope p of log K* against log d (K* ∝ d^p; p = 1
is linear in d), over the ds where K* was found and was not cut off by the ladder's top. Outputs under
runs/pairs/<timestamp>/: config.json, results.jsonl (one row per ladder, every rung inside), table.md, pairs.png,
runs/<rule>_d<d>_s<seed>/K<K>_lr<lr>/ (each rung's training run); a timed piece (`--minutes`) that leaves ladders
writes partial_table.md instead: the cells whose every seed's ladder is in, then each ladder still climbing (K passed
so far, the rung it stopped on and that rung's finished runs).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from evict.jsonfile import read_json_object
from evict.lab import recall
from evict.lab.sweep import check_at_least_one, check_distinct, check_names, from_json, run_grid, seeds_of
from evict.report import markdown_table
from evict.tasks.mqar import MQARConfig
from evict.train import write_json

# the lrs' order only says which of a rung's runs trains first (K* is the same in any order, above; each run's folder
# names its lr): a sweep resumes over another order (sweep_folder, dev/grid_restore.py)
UNORDERED_FIELDS = ("lrs",)

RULES = {"linear": "linear attention", "deltanet": "DeltaNet", "gated_deltanet": "Gated DeltaNet", "kda": "KDA",
         "attention": "attention"}


@dataclass
class PairsSweep:
    rules: tuple = tuple(RULES)
    dims: tuple = (8, 16, 32)  # head dim d (one head per layer), at most d_model
    d_model: int = 32
    pairs: tuple = (2, 4, 8, 16, 32)  # the ladder of K, ascending
    threshold: float = 0.9
    len_per_pair: int = 4  # sequence length L = len_per_pair · K (MQAR needs >= 4), at least min_len
    min_len: int = 16
    lrs: tuple = (1e-2,)  # tried in this order (the rung below's passing lr first); a rung passes at the first to pass
    n_layers: int = 2
    vocab_size: int = 128
    steps: int = 500
    batch_size: int = 32
    tokens_per_step: int | None = None  # a rung's batch: batch_size, or fewer where L * batch_size would exceed this
    eval_every: int = 100
    eval_batches: int = 2
    chunk_size: int | None = 16  # None: the memory op picks by shape (CUDA: auto_chunk; CPU: 64)
    gate_dt: tuple = recall.DEFAULT_GATE_DT  # the decay gates' initial dt range (one head per layer: one draw per layer)
    seed: int = 0
    seeds: int = 1
    workers: int = 2
    device: str = "cpu"


QUICK = PairsSweep()  # 2 min 2 s wall on 2 cores, smallest d first (dev/LOG.md, session 31)
FULL = PairsSweep(  # the lesson's dims; Zoology's lrs and vocabulary; steps and ladder ours (LAB.md gives none)
    # run in timed pieces on the card since session 28 (results/full_runs.md)
    dims=(16, 32, 64, 128, 256), d_model=256, pairs=(4, 8, 16, 32, 64, 128, 256, 512), len_per_pair=8,
    # 2.2e-3 first (the recall grid's: it solved most of its cells first), then 4.6e-4, then 1e-2. Pieces 1-7 ran
    # (2.2e-3, 1e-2, 4.6e-4): where 2.2e-3 failed, 1e-2 passed none of the 19 rungs it ran on and 4.6e-4 (third) 4 of
    # 13, so 4.6e-4 goes second since session 42 (results/full_runs.md). A rung starts at the lr its rung below
    # passed at, which saves a 4,000-step failing run on each rung where that lr was not 2.2e-3
    lrs=(2.2e-3, 4.6e-4, 1e-2),
    vocab_size=8192, steps=4000, batch_size=256, eval_every=500, eval_batches=8, chunk_size=None, workers=4, device="auto",
    # the recall grid's 256 x 512 tokens a step at every rung (batch 256 up to L 512, then 128 / 64 / 32 at L 1,024 /
    # 2,048 / 4,096): the same 16,384 labelled queries a step; at batch 256 a KDA step at L 4,096, d 256 took 336 ms
    # (compiled, alone on an H200), so a top rung's 4,000 steps (22 min) could never finish inside one device session
    tokens_per_step=256 * 512,
    # decay gates started slow: with one head a layer, Gated DeltaNet's one gate per layer drawn from the default range
    # (half-lives 1.5-4 tokens on some layer at every seed) capped its K* at d 64; slow, K* grew with d (docs/labs/pairs.md, "Why
    # Gated DeltaNet did not grow with d"). The same start took 16-layer stacks past chance (results/full_runs.md)
    gate_dt=(1e-4, 1e-3),
)


def seq_len(sweep: PairsSweep, K: int) -> int:
    return max(sweep.min_len, sweep.len_per_pair * K)


def rung_batch(sweep: PairsSweep, L: int) -> int:
    """A rung's batch at sequence length L: `batch_size`, fewer where that would pass `tokens_per_step` tokens (so
    every rung sees the same number of labelled queries a step, L / len_per_pair per sequence)."""
    return sweep.batch_size if sweep.tokens_per_step is None else min(sweep.batch_size, sweep.tokens_per_step // L)


def recall_sweep(sweep: PairsSweep, d: int) -> recall.RecallSweep:
    """The recall lab's settings for the rungs at head dim d (one head of dim d per layer, width sweep.d_model); each
    rung runs them at its own batch (`rung_batch`)."""
    return recall.RecallSweep(
        archs=tuple(sweep.rules), d_models=(sweep.d_model,), lrs=tuple(sweep.lrs), head_dim=d, n_heads=1,
        n_layers=sweep.n_layers,
        vocab_size=sweep.vocab_size, steps=sweep.steps, chunk_size=sweep.chunk_size, batch_size=sweep.batch_size,
        eval_every=sweep.eval_every, eval_batches=sweep.eval_batches, seed=sweep.seed, device=sweep.device, workers=1,
        gate_dt=tuple(sweep.gate_dt), target_accuracy=sweep.threshold,  # a rung's run stops once it has passed
    )


def _rung_dir(job: dict, K: int, lr: float) -> Path:
    return Path(job["dir"]) / f"K{K}_lr{lr:g}"


def _rung(job: dict, rsweep: dict, K: int, lr: float, L: int) -> dict | None:
    """One training run of the recall lab's cell, written to its result.json (_climb reads the finished ones). None:
    stopped at the end of a timed piece (the job's stop_at; its checkpoint resumes it)."""
    folder = _rung_dir(job, K, lr)
    done = folder / "result.json"
    folder.mkdir(parents=True, exist_ok=True)
    res = recall.run_one({"arch": job["rule"], "seq_len": L, "pairs": K, "d_model": rsweep["d_models"][0], "lr": lr,
                          "seed": job["seed"], "dir": str(folder), "sweep": rsweep, "stop_at": job.get("stop_at"),
                          "piece_seconds": job.get("piece_seconds")})
    if res is None:
        return None
    write_json(done, res)  # whole or not at all: a ladder resumes from its rungs' result.json
    return res


def _climb(job: dict, train: bool = True) -> dict:
    """Climb one ladder as far as it goes: its finished rungs ("rungs"), the largest K passed ("best_k"), "stopped"
    (a rung's run stopped at the end of a timed piece, or was not finished with `train` off) and then the stopped
    rung's K and its finished runs ("at", "tried")."""
    sweep = from_json(PairsSweep, job["sweep"])
    rsweep = dataclasses.asdict(recall_sweep(sweep, job["d"]))
    rungs: list[dict] = []
    best_k, seconds, passed_at = 0, 0.0, None
    for K in sorted(sweep.pairs):
        L = seq_len(sweep, K)
        batch = rung_batch(sweep, L)
        # up to the first lr that passes: the rung below's passing lr first, then the rest in the sweep's order (a
        # rung fails only once every lr has; a resumed ladder derives the same order from its finished rungs). The
        # rung's finished runs are read first, all of them: in the same order they are that order's first runs up to
        # the passing one anyway; under another order (UNORDERED_FIELDS) a finished passing run settles the rung
        # without training the lrs now before it, and every run trained counts in the card time
        order = sorted(sweep.lrs, key=lambda lr: lr != passed_at)
        finished = {lr: f for lr in order if (f := _rung_dir(job, K, lr) / "result.json").exists()}
        runs = [read_json_object(f, "out") for f in finished.values()]
        for lr in (lr for lr in order if lr not in finished):
            if any(r["accuracy"] >= sweep.threshold for r in runs):
                break
            run = _rung(job, {**rsweep, "batch_size": batch}, K, lr, L) if train else None
            if run is None:
                return {"rungs": rungs, "best_k": best_k, "seconds": seconds, "stopped": True, "at": K, "tried": runs}
            runs.append(run)
        top = max(runs, key=lambda r: r["accuracy"])
        seconds += sum(r["seconds"] for r in runs)
        rungs.append({"pairs": K, "seq_len": L, "batch": batch, "accuracy": top["accuracy"],
                      "lr": top["lr"], "steps": top["steps"], "state_size": top["state_size"], "params": top["params"],
                      **({"curve": top["curve"]} if "curve" in top else {})})
        if top["accuracy"] < sweep.threshold:
            break
        best_k, passed_at = K, top["lr"]
    return {"rungs": rungs, "best_k": best_k, "seconds": seconds, "stopped": False}


def run_one(job: dict) -> dict | None:
    """Climb one (rule, d, seed) ladder; module-level so worker processes can run it. None: a rung stopped at the end
    of a timed piece (the finished rungs stay in their folders; the next piece climbs on from there)."""
    logging.getLogger("evict").setLevel(logging.WARNING)
    c = _climb(job)
    if c["stopped"]:
        return None
    topped = c["best_k"] == max(job["sweep"]["pairs"])
    return {"rule": job["rule"], "d": job["d"], "seed": job["seed"], "max_pairs": c["best_k"], "ladder_top": topped,
            "rungs": c["rungs"], "seconds": round(c["seconds"], 1),
            "label": f"{job['rule']} d={job['d']} K*={'≥' if topped else ''}{c['best_k']}"}


def climbing(sweep: PairsSweep, jobs: list[dict]) -> str:
    """The partial table's second part: the ladders not finished (`jobs`, those run_grid got None for) that have
    finished rungs, as far as they have climbed — K passed so far and the rung they stopped on, with its runs
    finished so far (each lr's best accuracy; a rung fails only once every lr has) — read from their folders."""
    rows, idle = [], 0
    for job in jobs:
        c = _climb(job, train=False)
        if not c["stopped"]:  # every rung in after all (run_jobs' None came first): the next piece writes its row
            continue
        if not c["rungs"] and not c["tried"]:
            idle += 1
            continue
        tried = ", ".join(f"{r['accuracy']:.3f} at lr {r['lr']:g}" for r in c["tried"]) or "none finished"
        rows.append({"rule": RULES[job["rule"]], "d": job["d"], "seed": job["seed"],
                     "passed so far": f"K ≤ {c['best_k']}" if c["best_k"] else "none",
                     "climbing at": f"K {c['at']} (L {seq_len(sweep, c['at'])})",
                     f"its runs ({len(sweep.lrs)} lrs)": tried,
                     "card time": f"{(c['seconds'] + sum(r['seconds'] for r in c['tried'])) / 60:.0f} min"})
    if not rows:
        return f"No ladder has a finished rung yet ({idle} not started)."
    head = (f"Ladders still climbing ({len(rows)}; {idle} more not started): K passed so far (a lower bound on K*) "
            "and the rung each stopped on, with its runs finished so far (a run stops once it reaches "
            f"{sweep.threshold:g}; the rung fails only once every lr has). Card time: its finished runs', "
            "wall-clock, with other runs sharing the card.")
    cols = ["rule", "d", "seed", "passed so far", "climbing at", f"its runs ({len(sweep.lrs)} lrs)", "card time"]
    return f"{head}\n\n{markdown_table(rows, cols)}"


def jobs_for(sweep: PairsSweep, root: Path) -> list[dict]:
    """One ladder per (rule, d, seed), smallest d first (the workers take them in next_rung's order). A ladder at d 256
    has runs longer than a piece, and those finish only across pieces on one machine (results/full_runs.md,
    session 31)."""
    sw = dataclasses.asdict(sweep)
    return [{"rule": r, "d": d, "seed": s, "dir": str(root / "runs" / f"{r}_d{d}_s{s}"), "sweep": sw}
            for s in seeds_of(sweep) for d in sorted(sweep.dims) for r in sweep.rules]


def next_rung(job: dict) -> tuple[int, int]:
    """The order a sweep's workers take its unfinished ladders in (run_jobs' `first`): those with a run in flight on
    the rung they climb (its checkpoint.pt, on a machine that kept the folder) first, to finish it; then the shortest
    rung (its L) first, so that a piece on a fresh machine finishes rungs rather than starting runs longer than itself
    (session 43: 16 ladders, 8 workers, the first 8 all on rungs of 8-11 minutes). (0 or 1, L), from the folders."""
    c = _climb(job, train=False)
    if not c["stopped"]:  # every rung in: its worker only reads them back
        return (0, 0)
    sweep, K = from_json(PairsSweep, job["sweep"]), c["at"]
    # a run in flight: its checkpoint without its result (a finished run keeps its checkpoint too)
    flying = any((f / "checkpoint.pt").exists() and not (f / "result.json").exists()
                 for f in (_rung_dir(job, K, lr) for lr in sweep.lrs))
    return (0 if flying else 1, seq_len(sweep, K))


def cells(results: list[dict], seeds: int | None = None) -> dict:
    """(rule, d) -> (K* of every seed, whether any seed ran off the ladder's top). `seeds`: only the cells with that
    many ladders (a partial sweep's cell short of a seed's ladder is not known yet)."""
    out: dict = {}
    for r in sorted(results, key=lambda r: r["seed"]):
        ks, top = out.get((r["rule"], r["d"]), ([], False))
        out[(r["rule"], r["d"])] = (ks + [r["max_pairs"]], top or r["ladder_top"])
    return {k: v for k, v in out.items() if seeds is None or len(v[0]) == seeds}


def fit(points: list[tuple[int, float]]) -> dict | None:
    """K* against d: c of K* ≈ c·d (least squares through the origin) and the log-log slope p (K* ∝ d^p); None with
    fewer than two points."""
    pts = [(d, k) for d, k in points if k > 0]
    if len(pts) < 2:
        return None
    c = sum(d * k for d, k in pts) / sum(d * d for d, _ in pts)
    xs, ys = [math.log2(d) for d, _ in pts], [math.log2(k) for _, k in pts]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    p = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else float("nan")
    return {"c": c, "p": p, "points": len(pts)}


def fits(sweep: PairsSweep, results: list[dict]) -> dict:
    """rule -> fit over the ds whose K* (mean over seeds) was found below the ladder's top; None for a rule with a cell
    not known yet (a partial sweep)."""
    cs = cells(results, sweep.seeds)
    out: dict = {}
    for r in sweep.rules:
        if any((r, d) not in cs for d in sweep.dims):
            out[r] = None
            continue
        pts = [(d, sum(cs[(r, d)][0]) / len(cs[(r, d)][0])) for d in sorted(sweep.dims) if not cs[(r, d)][1]]
        out[r] = fit(pts)
    return out


def _k_text(ks: list[int], top: bool) -> str:
    body = " / ".join(str(k) for k in ks)
    return ("≥ " if top else "") + body


def report(sweep: PairsSweep, results: list[dict]) -> str:
    """K* per (rule, d) over seeds and each rule's fits. A partial sweep's (run_grid's partial_table.md) cells short
    of a seed's ladder show —, and so do the fits of a rule with such a cell."""
    cs, fs = cells(results, sweep.seeds), fits(sweep, results)
    dims = sorted(sweep.dims)
    rows = []
    for r in sweep.rules:
        f = fs[r]
        row = {"rule": RULES[r], **{f"d={d}": _k_text(*cs[(r, d)]) if (r, d) in cs else "—" for d in dims},
               "K* ≈ c·d": f"c = {f['c']:.2f}" if f else "—",
               "K* ∝ d^p": f"p = {f['p']:.2f} ({f['points']} dims)" if f else "—"}
        rows.append(row)
    seeds = ", ".join(map(str, seeds_of(sweep)))
    head = (f"K* = the largest K of the ladder {list(sorted(sweep.pairs))} recalled at >= {sweep.threshold:g} MQAR "
            f"accuracy before the first failing rung (lrs {list(sweep.lrs)} in that order, a rung passing at the first "
            f"to reach it; seeds {seeds}, one K* per seed, `a / b`); {sweep.n_layers} layers of width {sweep.d_model}, "
            f"one head of dim d each, L = max({sweep.min_len}, {sweep.len_per_pair}K), vocab {sweep.vocab_size}, "
            f"{sweep.steps} steps of batch {_batch_text(sweep)} (a run stopping once it reaches {sweep.threshold:g}). "
            "≥: the ladder's top passed (no fit through it). Fits over the other dims: c of K* ≈ c·d, and the log-log "
            "slope p (p = 1: linear in d).")
    return f"{head}\n\n{markdown_table(rows, ['rule', *[f'd={d}' for d in dims], 'K* ≈ c·d', 'K* ∝ d^p'])}"


def _batch_text(sweep: PairsSweep) -> str:
    """The batch of the table's caption: one number, or the rungs' batches where tokens_per_step lowers them."""
    batches = {L: rung_batch(sweep, L) for L in (seq_len(sweep, K) for K in sorted(sweep.pairs))}
    if len(set(batches.values())) == 1:
        return str(sweep.batch_size)
    lower = ", ".join(f"{b} at L {L}" for L, b in batches.items() if b < sweep.batch_size)
    return f"{sweep.batch_size} up to {sweep.tokens_per_step:,} tokens ({lower})"


def plot(sweep: PairsSweep, results: list[dict], path: Path) -> Path:
    """K* against d on log-log axes per rule (open markers: cut off by the ladder's top), the fit as a dotted line,
    and K = d for reference."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cs, fs = cells(results), fits(sweep, results)
    dims, ladder = sorted(sweep.dims), sorted(sweep.pairs)
    floor = ladder[0] / 2
    fig = Figure(figsize=(6.4, 4.4), constrained_layout=True)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for i, r in enumerate(sweep.rules):
        shift = 2 ** (0.04 * (i - (len(sweep.rules) - 1) / 2))
        ks = [sum(cs[(r, d)][0]) / len(cs[(r, d)][0]) for d in dims]
        tops = [cs[(r, d)][1] for d in dims]
        xs = [d * shift for d in dims]
        ys = [k if k > 0 else floor for k in ks]  # 0 (the first rung failed) drawn on the floor row, "0"
        ax.plot(xs, ys, color=f"C{i}", lw=1, alpha=0.6)
        ax.scatter([x for x, t in zip(xs, tops) if not t], [y for y, t in zip(ys, tops) if not t], color=f"C{i}",
                   label=RULES[r], zorder=3)
        ax.scatter([x for x, t in zip(xs, tops) if t], [y for y, t in zip(ys, tops) if t], facecolors="none",
                   edgecolors=f"C{i}", zorder=3)
        f = fs[r]
        if f and math.isfinite(f["p"]):
            pts = [(d, k) for d, k, t in zip(dims, ks, tops) if k > 0 and not t]
            gm = 2 ** (sum(math.log2(k) - f["p"] * math.log2(d) for d, k in pts) / len(pts))
            ax.plot(dims, [gm * d ** f["p"] for d in dims], ls=":", color=f"C{i}",
                    label=f"  fit: K* ∝ d^{f['p']:.2f}")
    ax.plot(dims, dims, color="k", lw=0.7, ls="--", label="K = d")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(dims, [str(d) for d in dims])
    ax.set_yticks([floor, *ladder], ["0", *map(str, ladder)])
    ax.set_ylim(floor / 1.4, ladder[-1] * 1.4)
    ax.set_xlabel(f"head dim d (one head per layer, d_model {sweep.d_model})")
    ax.set_ylabel(f"largest K at >= {sweep.threshold:g} accuracy")
    ax.set_title(f"MQAR pairs vs head dim ({sweep.steps} steps; open: ladder top reached)", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    fig.savefig(path, dpi=120)
    return path


def validate(sweep: PairsSweep) -> None:
    check_names("rules", sweep.rules, RULES)
    check_distinct("dims", sweep.dims, 1, "head dims")
    if max(sweep.dims) > sweep.d_model:
        raise ValueError(f"dims: expected head dims <= d_model = {sweep.d_model}, got {max(sweep.dims)}")
    check_distinct("pairs", sweep.pairs, 1, "K")
    if not 0 < sweep.threshold <= 1:
        raise ValueError(f"threshold: expected a number in (0, 1], got {sweep.threshold}")
    if sweep.len_per_pair < 4:
        raise ValueError(f"len_per_pair: expected >= 4 (MQAR needs L >= 4K), got {sweep.len_per_pair}")
    if not sweep.lrs or not all(lr > 0 for lr in sweep.lrs):
        raise ValueError(f"lrs: expected learning rates > 0, got {list(sweep.lrs)}")
    check_at_least_one(sweep, ("steps", "batch_size", "eval_every", "eval_batches", "seeds", "workers", "min_len",
                               "n_layers", "d_model"))
    longest, tokens = seq_len(sweep, max(sweep.pairs)), sweep.tokens_per_step
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < longest):
        raise ValueError(f"tokens_per_step: expected None or an integer >= the longest rung's L = {longest}, got {tokens!r}")
    for K in sweep.pairs:
        try:
            MQARConfig(vocab_size=sweep.vocab_size, seq_len=seq_len(sweep, K), num_pairs=K)
        except ValueError as e:
            raise ValueError(f"pairs: K = {K} does not fit: {e}") from None
    for r in sweep.rules:
        for d in sweep.dims:
            recall.model_config(r, d, recall_sweep(sweep, d), seq_len(sweep, max(sweep.pairs)))  # validates widths


def run_sweep(sweep: PairsSweep, out: str | Path | None = None, minutes: float | None = None) -> Path:
    """Run (or resume, when `out` already holds part of it) the sweep; write and print the results."""
    validate(sweep)
    return run_grid("pairs", sweep, out, jobs_for=jobs_for, run_one=run_one, report=report, plot=plot, minutes=minutes,
                    partial=True, unordered=UNORDERED_FIELDS, progress=climbing, first=next_rung)
