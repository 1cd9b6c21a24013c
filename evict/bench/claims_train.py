"""The trained half of `evict bench claims` (claim `attn_res_train`): does AttnRes buy training efficiency at small scale?

Kimi's AttnRes report: Block AttnRes reaches the loss a PreNorm baseline reaches with ~1.25x its compute (a "1.25x
compute advantage"), measured on scaling-law runs up to Kimi Linear 48B. Here, at a size that trains in minutes:

    rows = compare_attn_res(QUICK)     # the same LM without AttnRes at 1x and 1.25x the steps, with AttnRes at 1x

Per seed (the seed fixes the initial weights' generator and the batches: both arms see the same tokens in the same
order), three runs of evict's training loop on the character-level corpus: plain at `steps`, plain at 1.25 x `steps`
(its own warmup + cosine schedule, so it is a longer run, not a point on the 1x curve) and AttnRes at `steps`.
Compute is matched by counting, not by wall time (the CPU's eager AttnRes reads are elementwise kernels whose time
says nothing about FLOPs): model FLOPs per token of each (evict.models.accounting) plus the AttnRes reads' own.

The compute multiplier m of a seed: the compute the plain model would need to reach AttnRes's final val loss at
1x, interpolating the plain loss linearly in log(compute) between its 1x and 1.25x runs, over AttnRes's own counted
compute (m > 1: AttnRes is ahead at matched compute; m = 1.25 matches the report; an AttnRes loss outside the two
plain runs' is an extrapolation, flagged).
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import torch

FACTOR = 1.25  # the report's compute advantage: the plain model's second budget
QUICK: dict[str, Any] = dict(preset="attention", d_model=64, n_heads=2, head_dim=32, d_ff=128, n_layers=6,
                             attn_res_block=2, seq_len=64, batch=16, steps=150, lr=3e-3, warmup=15, eval_every=25,
                             eval_batches=8, seeds=(0, 1), device="cpu", threads=1)  # 2 threads on shared cores: 15x slower
FULL: dict[str, Any] = dict(preset="attention", d_model=384, n_heads=6, head_dim=64, d_ff=1024, n_layers=12,
                            attn_res_block=3, seq_len=256, batch=64, steps=3000, lr=1e-3, warmup=150, eval_every=250,
                            eval_batches=32, seeds=(0, 1, 2), device="cuda", threads=None)


def model_config(s: dict, vocab_size: int, attn_res: bool):
    from evict.models import presets

    return presets.get(s["preset"], vocab_size=vocab_size, d_model=s["d_model"], n_heads=s["n_heads"],
                       head_dim=s["head_dim"], d_ff=s["d_ff"], n_layers=s["n_layers"], max_seq_len=s["seq_len"],
                       attn_res=attn_res, attn_res_block=s["attn_res_block"])


def read_sources(n_layers: int, block: int) -> list[int]:
    """The number of depth sources each AttnRes read point mixes, in order (evict.models.lm's bookkeeping): layer i's
    mixer read (none in layer 0: its only source is the embedding), its FFN read, then the final read."""
    out = []
    for i in range(n_layers):
        closed, partial = 1 + i // block, i % block != 0  # the embedding + closed blocks; the current block's sum
        if i > 0:
            out.append(closed + partial)
        out.append(closed + 1)  # the FFN reads the current block's sum with this layer's mixer output in it
    out.append(1 + n_layers // block + (n_layers % block != 0))
    return out


def attn_res_flops_per_token(cfg) -> int:
    """Training FLOPs per token of the AttnRes reads (3 x forward): per read over S sources of width D, an RMSNorm of
    each source (~4 D), its logit q . key (2 D), the weighted sum (2 D): ~8 S D forward (the softmax over S is O(S))."""
    if not cfg.attn_res:
        return 0
    return 3 * sum(8 * S * cfg.d_model for S in read_sources(cfg.n_layers, cfg.attn_res_block))


def flops_per_token(cfg, seq_len: int) -> int:
    from evict.models.accounting import train_flops_per_token

    return int(train_flops_per_token(cfg, seq_len)["total"]) + attn_res_flops_per_token(cfg)


def _run(s: dict, task, cfg, steps: int, seed: int) -> dict:
    from evict.models import LM
    from evict.train import TrainConfig, train

    torch.manual_seed(seed)
    model = LM(cfg)
    tc = TrainConfig(steps=steps, batch_size=s["batch"], lr=s["lr"], warmup_steps=min(s["warmup"], steps),
                     eval_every=s["eval_every"], eval_batches=s["eval_batches"], seed=seed, threads=s["threads"],
                     device=s["device"], progress=False)
    t0 = time.time()
    r = train(model, task, tc)
    curve = [(h["step"], round(float(h["loss"]), 4)) for h in r.history if h.get("split") == "val"]
    out = {"steps": r.steps_done, "final val loss": round(float(r.final_val_loss), 4), "curve": curve,
           "params": sum(p.numel() for p in model.parameters()), "seconds": round(time.time() - t0, 1)}
    if r.steps_done != steps:  # diverged (a training loss not finite): its loss is not that of `steps` steps
        out["stopped"] = f"at step {r.steps_done} of {steps}" + (" (training loss not finite)" if r.diverged_at else "")
    return out


def multiplier(plain_1x: float, plain_more: float, attn_res: float, flops_ratio: float = 1.0,
               factor: float = FACTOR) -> tuple[float | None, str]:
    """The compute multiplier m (see the module docstring) and a note: '' when AttnRes's loss lies between the plain
    runs' (no extrapolation), else which way it lies outside. The plain runs' compute is 1 and `factor`, AttnRes's
    `flops_ratio` (its counted FLOPs over the plain 1x run's), so m = factor ** ((plain_1x - attn_res) /
    (plain_1x - plain_more)) / flops_ratio. None when the plain longer run is not below its 1x run (no slope)."""
    if not plain_more < plain_1x:
        return None, f"the plain {factor:.3g}x run is not below its 1x run: no slope"
    steps = factor ** ((plain_1x - attn_res) / (plain_1x - plain_more))
    note = "" if 1 <= steps <= factor else ("extrapolated: AttnRes is behind the plain 1x run" if steps < 1
                                            else f"extrapolated: AttnRes is ahead of the plain {factor:.3g}x run")
    return round(steps / flops_ratio, 3), note


def setting(full: bool, device: str, seeds=None) -> dict:
    """The comparison's setting: FULL (the GPU scale) or QUICK on `device`, with `seeds` instead of its own if given."""
    s = dict(FULL if full else QUICK, device=device)
    if seeds is not None:
        s["seeds"] = tuple(seeds)
    return s


def kept_seeds(s: dict, earlier: dict | None) -> dict[int, list[dict]]:
    """Of an earlier result (compare_attn_res's dict, e.g. read back from a claims JSON), the runs of each seed whose
    three arms all ran, by seed — when it was trained at setting `s` in every field but `seeds`; else ValueError naming
    the fields that differ. None: nothing kept."""
    if earlier is None:
        return {}
    if not (isinstance(earlier, dict) and isinstance(earlier.get("setting"), dict) and isinstance(earlier.get("runs"), list)):
        raise ValueError("expected an attn_res_train result (its setting and runs)")
    from evict.lab.sweep import config_differences

    differ = config_differences(json.loads(json.dumps(s)), earlier["setting"], which=("seeds",))
    if differ:
        raise ValueError(f"trained at another setting ({', '.join(differ)} differ)")
    by: dict[int, list[dict]] = {}
    for r in earlier["runs"]:
        by.setdefault(r["seed"], []).append(r)
    return {seed: rs for seed, rs in by.items() if sorted(r["arm"] for r in rs) == sorted(ARMS)}


def compare_attn_res(s: dict | None = None, *, progress: bool = True, earlier: dict | None = None) -> dict:
    """The runs of every seed, the per-seed table and the summary (see the module docstring). `earlier`: a result of
    the same setting but its seeds (kept_seeds) whose whole seeds are kept, not trained again: the result holds its
    seeds, then those of `s` it lacked (so a GPU run can be trained a seed per call)."""
    from evict.tasks.text import TextTask

    s = dict(QUICK if s is None else s)
    kept = kept_seeds(s, earlier)
    s["seeds"] = (*kept, *(seed for seed in s["seeds"] if seed not in kept))
    runs: list[dict] = []
    for seed in s["seeds"]:
        if seed in kept:
            runs += sorted(kept[seed], key=lambda r: ARMS.index(r["arm"]))
            if progress:
                print(f"seed {seed}: its {len(ARMS)} runs kept from the earlier result", flush=True)
            continue
        task = TextTask(seq_len=s["seq_len"], seed=seed)
        for name, on, steps in (("plain", False, s["steps"]), (MORE, False, round(FACTOR * s["steps"])),
                                ("AttnRes", True, s["steps"])):
            cfg = model_config(s, task.vocab_size, on)
            r = {"seed": seed, "arm": name, "attn_res": on, **_run(s, task, cfg, steps, seed)}
            r["train FLOPs"] = flops_per_token(cfg, s["seq_len"]) * r["steps"] * s["batch"] * s["seq_len"]  # as run
            runs.append(r)
            if progress:
                print(f"seed {seed} {name}: {r['steps']} steps, val loss {r['final val loss']}, {r['seconds']} s", flush=True)
    setting = {k: (list(v) if isinstance(v, tuple) else v) for k, v in s.items()}
    return {"setting": setting, "factor": FACTOR, "runs": runs, **summarize(runs)}


MORE = f"plain x{FACTOR:g}"
ARMS = ("plain", MORE, "AttnRes")  # a seed's runs, in the order they train


def summarize(runs: list[dict]) -> dict:
    """{"table": one row per seed, "summary": over seeds} from the runs (each seed's plain, plain x1.25 and AttnRes).
    Compute ratios are the runs' counted FLOPs (the longer plain run is round(1.25 x steps) steps). A seed with a run
    stopped before its steps (a diverged loss) has no multiplier and stays out of the summary."""
    table, whole = [], []  # whole: the rows of seeds whose three runs all ran their steps (the summary's)
    for seed in dict.fromkeys(r["seed"] for r in runs):
        got = {r["arm"]: r for r in runs if r["seed"] == seed}
        plain, more, ar = got["plain"], got[MORE], got["AttnRes"]
        ratio = ar["train FLOPs"] / plain["train FLOPs"]
        stopped = [f"the {n} run stopped {g['stopped']}" for n, g in got.items() if g.get("stopped")]
        if stopped:  # a run cut short has no loss at its budget: no multiplier from it
            m, note = None, "; ".join(stopped)
        else:
            m, note = multiplier(plain["final val loss"], more["final val loss"], ar["final val loss"], ratio,
                                 factor=more["train FLOPs"] / plain["train FLOPs"])
        table.append({"seed": seed, "plain": plain["final val loss"], MORE: more["final val loss"],
                      "AttnRes": ar["final val loss"], "AttnRes - plain": round(ar["final val loss"] - plain["final val loss"], 4),
                      "AttnRes FLOPs / plain FLOPs": round(ratio, 4), "compute multiplier": m, "note": note})
        if not stopped:
            whole.append(table[-1])
    ms = [r["compute multiplier"] for r in whole if r["compute multiplier"] is not None]
    summary = {"seeds": len(whole), **({"seeds cut short": len(table) - len(whole)} if len(whole) < len(table) else {}),
               "AttnRes below plain 1x": sum(r["AttnRes - plain"] < 0 for r in whole),
               "mean AttnRes - plain": round(sum(r["AttnRes - plain"] for r in whole) / len(whole), 4) if whole else None,
               "geometric mean multiplier": round(math.exp(sum(map(math.log, ms)) / len(ms)), 3) if ms else None}
    return {"table": table, "summary": summary}


def plot(result: dict, png) -> Any:
    """Val loss against training FLOPs, one line per run (plain solid, plain x1.25 dotted, AttnRes dashed)."""
    from pathlib import Path

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    s = result["setting"]
    fig = Figure(figsize=(6.5, 4), constrained_layout=True)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    style = {"plain": "-", MORE: ":", "AttnRes": "--"}
    for r in result["runs"]:
        per_step = r["train FLOPs"] / r["steps"]
        ax.plot([st * per_step for st, _ in r["curve"]], [loss for _, loss in r["curve"]], style[r["arm"]],
                color=f"C{s['seeds'].index(r['seed'])}", lw=1.2, label=f"seed {r['seed']} {r['arm']}")
    ax.set(xlabel="training FLOPs (counted)", ylabel="val loss (nats / char)",
           title=f"AttnRes vs plain: {s['preset']} d {s['d_model']}, {s['n_layers']} layers, block {s['attn_res_block']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    return png


def with_overrides(base: dict, **kw) -> dict:
    """base with the given settings replaced (a test's tiny run)."""
    unknown = set(kw) - set(base)
    if unknown:
        raise ValueError(f"unknown settings {sorted(unknown)}; expected some of {sorted(base)}")
    return {**base, **kw}

