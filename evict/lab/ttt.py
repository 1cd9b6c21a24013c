"""The test-time-training lab (`evict lab ttt`): the delta rule is one SGD step on ½‖k S − v‖²; do the step's natural
extensions (evict/ops/memory/ttt.py: momentum, an Adagrad-style per-key step, several inner steps, a damped diagonal
Newton step) buy capacity — more pairs held by a state of the same size — or only speed of learning?

Two tasks, each a sweep of fixed-state memories trained from scratch with Adam, one row per (task, rule, size, seed):

    capacity   the capacity lab's regression (evict.lab.capacity, Schlag et al.): S distinct keys with one-hot values
               written, then every key queried, loss ½‖y − ŷ‖² (0.5 = outputs zero), held-out batches; its model with
               keys and queries L2-normalised (DeltaNet's convention: then β is an SGD step size on a unit key)
               instead of elu+1 sum-normalised, d_key fixed, S climbing past it (the rank floor ½(1 − d/S)).
    mqar       MQAR (evict.tasks.mqar, Zoology) with K pairs at a fixed sequence length, through one memory layer:
               e = E[x_t]; k_t = norm(W_k e_{t−1}) (the key token before a value), q_t = norm(W_q e_t),
               v_t = W_v e_t, β_t = σ(w·[e_t, e_{t−1}]), logits = W_o (q_t S_t); accuracy at the labelled positions.

Every rule is the same model; only the update differs (RULES). Capacity: the final held-out metric after `steps`.
Speed of learning: the held-out metric along the way (every eval_every steps), summarised by its value at the first
evaluation. The state each rule carries is reported beside it (momentum doubles it: M is d_key × d_v).
A run in flight when a --minutes piece ends saves checkpoint.pt and the next piece resumes it (batches depend only on
(seed, step), so the result is the same).
Outputs under runs/ttt/<timestamp>/: config.json, results.jsonl, table.md, ttt.png, runs/<name>/result.json.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from evict.distributed import resolve_device
from evict.lab.capacity import CapacityModel, floor, regression_loss
from evict.lab.sweep import check_at_least_one, check_distinct, check_names, from_json, out_of_time, run_grid, seeds_of
from evict.ops.memory.ttt import TTT, ttt_memory
from evict.report import markdown_table
from evict.tasks.capacity import make_batch
from evict.tasks.mqar import MQARConfig, MQARTask
from evict.train import read_checkpoint, save_checkpoint

RULES = {  # name -> (what it is, the settings, momentum μ on every write or None)
    "delta": ("the delta rule: one SGD step of learned size β", TTT(), None),
    "momentum": ("+ momentum μ = 0.5 on the state update", TTT(), 0.5),
    "adagrad": ("+ Adagrad-style per-key-row step, a = 1", TTT(adaptive=1.0), None),
    "steps3": ("+ 3 inner SGD steps per token", TTT(inner_steps=3), None),
    "newton": ("+ damped diagonal Newton step, c = 1", TTT(second_order=1.0), None),
}
TASKS = ("capacity", "mqar")
EVAL_SEED_OFFSET = 10_000


def _form(rule: str) -> str:
    """The op's form for a rule: the chunked one where it exists, else the step form token by token (both tested
    against the float64 reference; the reference's literal gradient matrices cost more on the autograd tape)."""
    ttt = RULES[rule][1]
    return "chunked" if ttt.adaptive == 0 and ttt.second_order == 0 else "step"


def _memory(rule: str, q, k, v, beta, mu_mask):
    """One head through the TTT op: q, k [B, T, K]; v [B, T, V]; beta, mu_mask [B, T] (where momentum acts)."""
    _, ttt, mu = RULES[rule]
    momentum = None if mu is None else mu * mu_mask
    o, _ = ttt_memory(q[:, :, None], k[:, :, None], v[:, :, None], beta=beta[:, :, None],
                      momentum=None if momentum is None else momentum[:, :, None], scale=1.0, ttt=ttt,
                      impl=_form(rule), chunk_size=16, check=False)
    return o[:, :, 0]


class TTTCapacityModel(CapacityModel):
    """The capacity lab's model (learned β per write) with L2-normalised keys and queries and the TTT update."""

    def __init__(self, S: int, rule: str, d_key: int):
        super().__init__(S, "delta", d_key)
        self.ttt_rule = rule

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, dim=-1)

    def read(self, q, k, v, beta, n_queries: int) -> torch.Tensor:
        B, W = beta.shape
        beta = torch.cat([beta, beta.new_zeros(B, n_queries)], dim=1)  # [B, T]: queries write nothing
        writes = torch.cat([beta.new_ones(B, W), beta.new_zeros(B, n_queries)], dim=1)  # and carry no momentum
        return _memory(self.ttt_rule, q, k, v, beta, writes)[:, W:]


class MQARMemory(nn.Module):
    """One memory layer on MQAR tokens (module docstring): forward(x [B, L]) -> logits [B, L, vocab]."""

    def __init__(self, vocab: int, d_model: int, d_key: int, rule: str):
        super().__init__()
        self.rule = rule
        self.embed = nn.Embedding(vocab, d_model)
        self.k_proj, self.q_proj = nn.Linear(d_model, d_key, bias=False), nn.Linear(d_model, d_key, bias=False)
        self.v_proj = nn.Linear(d_model, d_key, bias=False)
        self.beta_proj = nn.Linear(2 * d_model, 1)
        self.out = nn.Linear(d_key, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.embed(x)  # [B, L, d_model]
        prev = F.pad(e, (0, 0, 1, 0))[:, :-1]  # e_{t-1}, zero at t = 0
        k, q = F.normalize(self.k_proj(prev), dim=-1), F.normalize(self.q_proj(e), dim=-1)
        beta = torch.sigmoid(self.beta_proj(torch.cat([e, prev], dim=-1)))[..., 0]  # [B, L]
        o = _memory(self.rule, q, k, self.v_proj(e), beta, torch.ones_like(beta))
        return self.out(o)


@dataclass
class TTTSweep:
    rules: tuple = tuple(RULES)
    d_key: int = 8  # the state is d_key × d_key in MQAR, d_key × S in the capacity regression
    tasks: tuple = TASKS
    steps: int = 400  # Adam steps of every run, held-out evaluations every eval_every
    batch_size: int = 32
    lr: float = 3e-3
    eval_every: int = 50
    eval_batches: int = 2
    sizes: tuple = (6, 10, 14)  # capacity: S distinct keys at d_key (S / d = 0.75, 1.25, 1.75)
    d_model: int = 32  # MQAR: the embedding width, the sequence length, the vocabulary and the pairs K
    seq_len: int = 32
    vocab_size: int = 64
    pairs: tuple = (4, 8)
    seed: int = 0
    seeds: int = 1
    workers: int = 2
    device: str = "cpu"

QUICK = TTTSweep()
FULL = TTTSweep(  # sized for one GPU in < 90 min by estimate (not run yet; every number here is ours): d_key 32, S and
    # K around d, T <= 128 for the token-loop rules (adagrad, newton)
    sizes=(24, 32, 40, 48, 64), pairs=(16, 24, 32), d_key=32, d_model=128, seq_len=128, vocab_size=256,
    steps=3000, batch_size=64, lr=1e-3, eval_every=250, eval_batches=8, seeds=3, workers=4, device="auto",
)


def _metric(task: str) -> str:
    return "loss" if task == "capacity" else "accuracy"


def _model(job: dict, sweep: TTTSweep) -> nn.Module:
    if job["task"] == "capacity":
        return TTTCapacityModel(job["size"], job["rule"], sweep.d_key)
    return MQARMemory(sweep.vocab_size, sweep.d_model, sweep.d_key, job["rule"])


def _evaluate(model: nn.Module, job: dict, sweep: TTTSweep, task, device) -> float:
    """The held-out metric: capacity loss ½‖y − ŷ‖², or MQAR accuracy over the labelled positions."""
    model.eval()
    vals = []
    with torch.no_grad():
        for i in range(sweep.eval_batches):
            if job["task"] == "capacity":
                b = make_batch(job["size"], sweep.batch_size, overwrite=False, seed=job["seed"] + EVAL_SEED_OFFSET,
                               step=i)
                b = type(b)(*(getattr(b, f.name).to(device) for f in dataclasses.fields(b)))
                vals.append(regression_loss(model(b), b.targets).item())
            else:
                x, y = (t.to(device) for t in task.get_batch("val", i, sweep.batch_size))
                pred, at = model(x).argmax(-1), y != -100
                vals.append(((pred == y) & at).sum().item() / at.sum().item())
    model.train()
    return sum(vals) / len(vals)


def _loss(model: nn.Module, job: dict, sweep: TTTSweep, task, step: int, device) -> torch.Tensor:
    if job["task"] == "capacity":
        b = make_batch(job["size"], sweep.batch_size, overwrite=False, seed=job["seed"], step=step)
        b = type(b)(*(getattr(b, f.name).to(device) for f in dataclasses.fields(b)))
        return regression_loss(model(b), b.targets)
    x, y = (t.to(device) for t in task.get_batch("train", step, sweep.batch_size))
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100)


def state_numbers(rule: str, d_key: int, d_v: int) -> int:
    """What a rule carries per head: S (d_key × d_v), M with momentum, n or h (d_key) with adaptive / second order."""
    _, ttt, mu = RULES[rule]
    return d_key * d_v * (1 if mu is None else 2) + d_key * ((ttt.adaptive > 0) + (ttt.second_order > 0))


def run_one(job: dict) -> dict | None:
    """Train one (task, rule, size, seed) model with Adam; held-out metric every eval_every steps."""
    logging.getLogger("evict").setLevel(logging.WARNING)
    if out_of_time(job):
        return None
    sweep = from_json(TTTSweep, job["sweep"])
    device = resolve_device(sweep.device)
    torch.manual_seed(job["seed"])
    task = None if job["task"] == "capacity" else MQARTask(MQARConfig(
        vocab_size=sweep.vocab_size, seq_len=sweep.seq_len, num_pairs=job["size"], train_seed=job["seed"]))
    model = _model(job, sweep).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=sweep.lr)
    ckpt = Path(job["dir"]) / "checkpoint.pt"
    first, earlier, curve = 0, 0.0, []
    if ckpt.exists():  # a run a timed piece left: its weights, Adam's state, the curve so far
        saved = read_checkpoint(ckpt)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        first, earlier, curve = saved["step"], saved["seconds"], saved["curve"]
    start = time.perf_counter()
    for step in range(first, sweep.steps):
        if step > first and out_of_time(job):
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            save_checkpoint(ckpt, {"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "curve": curve,
                                   "seconds": earlier + time.perf_counter() - start})
            return None
        loss = _loss(model, job, sweep, task, step, device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % sweep.eval_every == 0 or step + 1 == sweep.steps:
            curve.append([step + 1, round(_evaluate(model, job, sweep, task, device), 4)])
    final = curve[-1][1]
    ckpt.unlink(missing_ok=True)
    d_v = job["size"] if job["task"] == "capacity" else sweep.d_key
    return {"task": job["task"], "rule": job["rule"], "size": job["size"], "seed": job["seed"],
            "metric": _metric(job["task"]), "final": final, "early": curve[0][1], "curve": curve,
            "state_numbers": state_numbers(job["rule"], sweep.d_key, d_v), "steps": sweep.steps,
            "seconds": round(earlier + time.perf_counter() - start, 1), "device": device.type,
            "label": f"{job['task']} {job['rule']} {job['size']} {final:.3f}"}


def _sizes(sweep: TTTSweep, task: str) -> tuple:
    return sweep.sizes if task == "capacity" else sweep.pairs


def jobs_for(sweep: TTTSweep, root: Path) -> list[dict]:
    """Every (seed, task, size, rule) run, MQAR (the costlier) and the largest sizes first."""
    sw = dataclasses.asdict(sweep)
    return [{"task": t, "rule": r, "size": n, "seed": s, "sweep": sw,
             "dir": str(root / "runs" / f"{t}_{r}_{n}_s{s}")}
            for s in seeds_of(sweep) for t in sorted(sweep.tasks, reverse=True) for n in sorted(_sizes(sweep, t),
                                                                                              reverse=True)
            for r in sweep.rules]


def cells(results: list[dict]) -> dict:
    """(task, rule, size) -> (mean final, mean early) over seeds."""
    out: dict = {}
    for r in results:
        out.setdefault((r["task"], r["rule"], r["size"]), []).append((r["final"], r["early"]))
    return {k: (sum(f for f, _ in v) / len(v), sum(e for _, e in v) / len(v)) for k, v in out.items()}


def report(sweep: TTTSweep, results: list[dict]) -> str:
    """Per task: one row per rule, each size's final metric and, in brackets, its value at the first evaluation;
    the rule's state numbers beside it."""
    c, parts = cells(results), []
    seeds = seeds_of(sweep)
    for task in sweep.tasks:
        sizes = sorted(_sizes(sweep, task))
        name = "S" if task == "capacity" else "K"
        rows = []
        for r in sweep.rules:
            d_v = max(sizes) if task == "capacity" else sweep.d_key
            row = {"rule": r, "state": f"{state_numbers(r, sweep.d_key, d_v):,}" + (" (d_v = S)" if task ==
                                                                                       "capacity" else "")}
            for n in sizes:
                final, early = c[(task, r, n)]
                row[f"{name} {n}"] = f"{final:.3f} ({early:.3f})"
            rows.append(row)
        if task == "capacity":
            rows.append({"rule": "floor", "state": "", **{f"S {n}": f"{floor(n, sweep.d_key):.3f}" for n in sizes}})
            what = (f"capacity regression, held-out loss ½‖y − ŷ‖² (lower is better; 0.5 = outputs zero), d_key "
                    f"{sweep.d_key}, S distinct keys; floor ½·max(0, 1 − d/S): the least loss of any d × S read")
        else:
            what = (f"MQAR, held-out accuracy (higher is better), one memory layer, d_key = d_v = {sweep.d_key}, "
                    f"seq_len {sweep.seq_len}, vocab {sweep.vocab_size}, K pairs")
        parts.append(f"**{what}.** Cell: after {sweep.steps} steps (after {sweep.eval_every}, the first evaluation)."
                     f"\n\n{markdown_table(rows, ['rule', 'state', *(f'{name} {n}' for n in sizes)])}")
    head = (f"The TTT frame: Adam lr {sweep.lr:g}, batch {sweep.batch_size}, {sweep.eval_batches} held-out batches, "
            f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}"
            f"{' (mean)' if len(seeds) > 1 else ''}. Rules: "
            + "; ".join(f"{r} = {RULES[r][0]}" for r in sweep.rules) + ". state: numbers per head.")
    return head + "\n\n" + "\n\n".join(parts)


def plot(sweep: TTTSweep, results: list[dict], path: Path) -> Path:
    """Per task: the final metric against size (solid) and the first evaluation's (dotted), and the learning curves
    at the largest size."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    c = cells(results)
    fig = Figure(figsize=(11, 3.8 * len(sweep.tasks)), constrained_layout=True)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(sweep.tasks), 2, squeeze=False)
    for row, task in enumerate(sweep.tasks):
        sizes, ax, ax2 = sorted(_sizes(sweep, task)), axes[row][0], axes[row][1]
        for i, r in enumerate(sweep.rules):
            ax.plot(sizes, [c[(task, r, n)][0] for n in sizes], marker="os^vD"[i % 5], color=f"C{i}", label=r)
            ax.plot(sizes, [c[(task, r, n)][1] for n in sizes], color=f"C{i}", ls=":", alpha=0.7)
            runs = [x for x in results if x["task"] == task and x["rule"] == r and x["size"] == max(sizes)]
            if runs:
                ax2.plot([s for s, _ in runs[0]["curve"]], [v for _, v in runs[0]["curve"]], marker="os^vD"[i % 5],
                         color=f"C{i}", label=r)
        if task == "capacity":
            ax.plot(sizes, [floor(n, sweep.d_key) for n in sizes], color="k", lw=1.4, alpha=0.5, label="rank floor")
        name = "S (distinct keys)" if task == "capacity" else "K (pairs)"
        ylabel = "held-out loss (lower is better)" if task == "capacity" else "held-out accuracy"
        ax.set(xlabel=name, ylabel=ylabel, title=f"{task}: after {sweep.steps} steps (dotted: after {sweep.eval_every})")
        ax2.set(xlabel="step", ylabel=ylabel, title=f"{task}: learning curves at {name.split()[0]} = {max(sizes)}"
                                                   f" (seed {sweep.seed})")
        ax.legend(fontsize=7)
        ax2.legend(fontsize=7)
    fig.savefig(path, dpi=110)
    return path


def validate(sweep: TTTSweep) -> None:
    check_names("rules", sweep.rules, RULES)
    check_names("tasks", sweep.tasks, TASKS)
    check_distinct("sizes", sweep.sizes, 2, "S")
    check_distinct("pairs", sweep.pairs, 1, "K")
    check_at_least_one(sweep, ("d_key", "d_model", "steps", "batch_size", "eval_every", "eval_batches", "seeds",
                               "workers"))
    if "mqar" in sweep.tasks:
        for K in sweep.pairs:
            try:
                MQARConfig(vocab_size=sweep.vocab_size, seq_len=sweep.seq_len, num_pairs=K)
            except ValueError as e:
                raise ValueError(f"pairs: {e}") from None
    if not sweep.lr > 0:
        raise ValueError(f"lr: expected > 0, got {sweep.lr}")


def run_sweep(sweep: TTTSweep, out: str | Path | None = None, minutes: float | None = None) -> Path:
    """Run (or resume, when `out` already holds part of it) the sweep; write and print the results."""
    validate(sweep)
    return run_grid("ttt", sweep, out, jobs_for=jobs_for, run_one=run_one, report=report, plot=plot, minutes=minutes)
