"""The eviction-stories lab (`evict lab stories`): the lesson's figures 7 and 8 computed by the op at d = 4
(`evict.stories`), then the same question asked of trained models — on the context-switch task
(`evict.tasks.switch`: facts, a distractor paragraph, a switch marker, a new topic, questions about the facts and
the new topic), which per-channel decays does a trained KDA layer choose at the switch, and does the fact survive
where a Gated DeltaNet's (one scalar gate per head) does not?

A run trains one model (`evict.train.train`) and then reads its memory layers on held-out rows: the exact inputs of
every call of the memory op are recorded (log α, k), and from them, per layer, head and channel c:

    gate at the switch      α_switch[c] = exp(log α[switch, c])            mean over rows
    survival across it      Π_{u = 2F .. t} α[u, c], t from the last fact onwards (the facts' channels' fate)
    a pair's survival       Σ_c k[p, c]² · Π_{u = p+1 .. Q} α[u, c]: the share of the pair's key (unit length)
                            that is left when the questions start (Q), by decay alone; p = the pair's value token,
                            where the short conv sees key and value together — our choice of where a pair is written
    a pair's read share     what a question actually reads of it: every token u writes along its key k_u; that key is
                            carried to the question t through every later decay and erase (x ← α ⊙ x, then
                            x ← x − β k (k · x) with the delta rule: the state's own recurrence on a column) and
                            matched by the question's query, |q_t · x_u(t)|; a pair's share is that of its value
                            token and the token after it (where trained models write the association: the key, value
                            and next token are in the short conv's window there; the value token alone reads ~0),
                            out of all tokens — for the asked pair, and (fact questions) the distractor's pairs
    accuracy                on the fact questions and on the new-topic questions separately

The decay-only survival ignores the erases and what else the read matches; the read share counts both (dev/LOG.md
has how the two compare with per-question accuracy on the quick runs).

Gated DeltaNet's one gate per head is the same α on every channel. Outputs under runs/stories/<timestamp>/:
config.json, results.jsonl, table.md, stories.png (survival per channel across the switch), lesson.json and
lesson.png (figures 7 and 8 at d = 4), runs/<model>_s<seed>/ (training metrics and result.json).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from evict.lab.sweep import (check_at_least_one, check_names, diverged, from_json, lab_train_config, out_of_time,
                              run_grid, seeds_of)
from evict.layers import memory_mixer
from evict.models import LM, presets
from evict.report import markdown_table
from evict.stories import fade_curve, twin_boards
from evict.tasks.switch import SwitchConfig, SwitchTask
from evict.train import train

MODELS = {"kda": "KDA (per-channel gate)", "gated_deltanet": "Gated DeltaNet (scalar gate)"}
TASK_FIELDS = ("facts", "distractor", "new", "fact_keys", "topic_keys", "values")


@dataclass
class StoriesSweep:
    models: tuple = tuple(MODELS)
    facts: int = 2
    distractor: int = 8
    new: int = 8
    fact_keys: int = 8
    topic_keys: int = 32
    values: int = 32
    d_model: int = 32
    n_heads: int = 1
    head_dim: int = 16  # fewer channels than pairs written (F + J + N = 18): keeping everything interferes
    n_layers: int = 1
    steps: int = 600
    batch_size: int = 32
    lr: float = 3e-3
    eval_every: int = 200
    eval_batches: int = 4
    chunk_size: int | None = 16  # None: the memory op picks by shape (CUDA: auto_chunk; CPU: 64)
    seed: int = 0
    seeds: int = 1
    workers: int = 2
    device: str = "cpu"


QUICK = StoriesSweep(n_layers=2, steps=1500, lr=1e-2, eval_every=500, seeds=2)  # 168 s of CPU (docs/labs/stories.md)
FULL = StoriesSweep(  # every number here is ours (the lesson gives the story, not a protocol); not run yet
    facts=4, distractor=48, new=48, fact_keys=32, topic_keys=256, values=256, d_model=128, n_heads=2, head_dim=64,
    n_layers=2, steps=10_000, batch_size=128, eval_every=500, eval_batches=8, chunk_size=None, seeds=3, workers=4,
    device="auto",
)


def task_config(sweep: StoriesSweep, seed: int) -> SwitchConfig:
    return SwitchConfig(**{f: getattr(sweep, f) for f in TASK_FIELDS}, train_seed=seed)


def model_config(model: str, sweep: StoriesSweep, vocab_size: int, seq_len: int):
    """A sweep.n_layers-deep `model` (a MODELS key) with the kernel-4 short conv and dense SwiGLU FFNs."""
    return presets.get(
        model, size="tiny", vocab_size=vocab_size, d_model=sweep.d_model, n_layers=sweep.n_layers,
        n_heads=sweep.n_heads, head_dim=sweep.head_dim, d_ff=2 * sweep.d_model, moe=None, attn_res=False,
        short_conv=True, chunk_size=sweep.chunk_size, max_seq_len=max(seq_len, 64),
    )


@contextlib.contextmanager
def recording():
    """Inside: every call of the memory op by a memory layer appends its (q, k, log_alpha, beta, delta) to the yielded
    list (q, k float32 [B, T, H, D]; log_alpha and beta float32 or None)."""
    calls, real = [], memory_mixer.memory

    def record(q, k, v, *, log_alpha=None, beta=None, delta=False, **kw):
        f = lambda t: None if t is None else t.detach().float()
        calls.append((f(q), f(k), f(log_alpha), f(beta), bool(delta)))
        return real(q, k, v, log_alpha=log_alpha, beta=beta, delta=delta, **kw)

    memory_mixer.memory = record
    try:
        yield calls
    finally:
        memory_mixer.memory = real


def carried_keys(k, la, beta, delta: bool, writes: list[int], times) -> dict:
    """Each pair's written key carried forward by the state's own recurrence on a column: x_p = k_p at its write p,
    then per later token x ← α_u ⊙ x and, with the delta rule, x ← x − β_u k_u (k_u · x). With every token a write and no
    initial state the state after token t is exactly Σ_p x_p(t) (β_p v_p)^T (each erase (I − β k k^T) acts on the earlier
    pairs' keys), which is what makes q_t · x_p(t) the key-match of pair p in the read at t. k, la [B, T, H, D], beta [B, T, H] or None;
    returns {t: [B, H, P, D]} for t in `times`."""
    B, T, H, D = k.shape
    X = k.new_zeros(B, H, len(writes), D)
    at, want, out = {p: j for j, p in enumerate(writes)}, set(times), {}
    for t in range(T):
        X = X * la[:, t].exp()[:, :, None, :]
        if delta:
            b = beta[:, t] if beta is not None else k.new_ones(B, H)
            X = X - b[:, :, None, None] * k[:, t, :, None, :] * torch.einsum("bhpd,bhd->bhp", X, k[:, t])[..., None]
        if t in at:
            X = X.clone()
            X[:, :, at[t]] = k[:, t]
        if t in want:
            out[t] = X
    return out


def read_shares(q, k, la, beta, delta: bool, groups: list[tuple[int, ...]], start: int, asked: torch.Tensor) -> dict:
    """Read shares (module docstring) at every question t >= start: every token is a write; a pair's share is
    Σ_{p in its group} |q_t · x_p(t)| / Σ_{all tokens u <= t} |q_t · x_u(t)|. q, k, la [B, T, H, D] (la expanded per
    channel), beta [B, T, H] or None; groups: each pair's positions; asked [B, n] the pair each question asks for.
    Returns {"asked": [B, n, H], "by_pair": [B, n, H, P]}."""
    B, T, H, D = k.shape
    X = carried_keys(k, la, beta, delta, list(range(T)), range(start, T))
    m = torch.stack([torch.einsum("bhpd,bhd->bhp", X[t], q[:, t]).abs() for t in range(start, T)], dim=1)  # [B, n, H, T]
    by_pair = torch.stack([m[..., list(g)].sum(-1) for g in groups], dim=-1) / m.sum(-1, keepdim=True).clamp_min(1e-30)
    return {"asked": by_pair.gather(3, asked[:, :, None, None].expand(B, asked.shape[1], H, 1))[..., 0],
            "by_pair": by_pair}


def read_memory(model: LM, task: SwitchTask, sweep: StoriesSweep) -> dict:
    """Accuracy per section and, per layer, the gates and survivals of the module docstring, on the val batches."""
    cfg = task.cfg
    device = next(model.parameters()).device
    F, J, N, s, Q = cfg.facts, cfg.distractor, cfg.new, cfg.switch_at, cfg.questions_at
    hits = torch.zeros(2, 2, dtype=torch.float64)  # [section (fact, new), (right, asked)]
    layers: list[dict] = []
    model.eval()
    with torch.no_grad():
        for i in range(sweep.eval_batches):
            x, y, asks = task.batch("val", i, sweep.batch_size)
            with recording() as calls:
                pred = model(x.to(device)).argmax(-1).cpu()[:, Q:]  # [B, F + N]
            right = (pred == y[:, Q:]).double()
            for sec in (0, 1):
                hits[sec] += torch.stack([(right * (asks == sec)).sum(), (asks == sec).sum().double()])
            # each pair's value token and the pair each question asks for (keys are distinct in a row)
            vals = [2 * j + 1 for j in range(F + J)] + [s + 2 + 2 * j for j in range(N)]
            keys = x[:, [p - 1 for p in vals]]  # [B, P]
            asked = (x[:, Q:, None] == keys[:, None, :]).long().argmax(-1)  # [B, F + N]
            fact_q, new_q = (asks == 0).double(), (asks == 1).double()  # [B, F + N]
            for li, (q, k, la, beta, delta) in enumerate(calls):
                q, k = q.cpu(), k.cpu()  # [B, T, H, D]
                la = torch.zeros_like(k) if la is None else la.cpu()
                la = la[..., None].expand_as(k) if la.dim() == 3 else la  # scalar gate: one α for every channel
                rs = read_shares(q, k, la, None if beta is None else beta.cpu(), delta, [(p, p + 1) for p in vals], Q, asked)
                junk = rs["by_pair"][..., F:F + J].sum(-1)  # [B, F + N, H]: the distractor's share of each read
                cum = la.cumsum(1)  # [B, T, H, D]: log of Π_{u <= t} α[u]

                def survive(p: int) -> torch.Tensor:  # a pair written at p: key share left at Q - 1, [B, H]
                    return (k[:, p] ** 2 * (cum[:, Q - 1] - cum[:, p]).exp()).sum(-1)

                def survive_all(ps: range) -> torch.Tensor:  # summed over pairs written at ps, [B, H] (zeros if none)
                    return sum((survive(p) for p in ps), cum.new_zeros(cum.shape[0], cum.shape[2]))

                sums = {
                    "alpha_switch": la[:, s].exp().sum(0),  # [H, D]
                    "alpha_distractor": la[:, 2 * F:s].exp().mean(1).sum(0),
                    "alpha_new": la[:, s + 1:Q].exp().mean(1).sum(0),
                    "across_switch": (cum[:, 2 * F - 1:] - cum[:, 2 * F - 1:2 * F]).exp().sum(0),  # [T', H, D]
                    "fact": survive_all(range(1, 2 * F, 2)).sum(0) / F,  # [H]
                    "distractor": survive_all(range(2 * F + 1, 2 * (F + J), 2)).sum(0) / max(J, 1),
                    "new": survive_all(range(s + 2, s + 2 + 2 * N, 2)).sum(0) / N,
                    # read shares, averaged over the questions of each section in each row: [H]
                    "fact_read": (rs["asked"] * fact_q[..., None]).sum(1).sum(0) / F,
                    "distractor_read": (junk * fact_q[..., None]).sum(1).sum(0) / F,
                    "new_read": (rs["asked"] * new_q[..., None]).sum(1).sum(0) / N,
                }
                if li == len(layers):
                    layers.append({key: torch.zeros_like(v) for key, v in sums.items()})
                for key, v in sums.items():
                    layers[li][key] += v
    rows = sweep.eval_batches * sweep.batch_size
    return {
        "fact_accuracy": (hits[0, 0] / hits[0, 1]).item(), "new_accuracy": (hits[1, 0] / hits[1, 1]).item(),
        "layers": [{key: (v / rows).tolist() for key, v in layer.items()} for layer in layers],
        "across_from": 2 * F - 1, "switch_at": s, "questions_at": Q,
    }


def run_one(job: dict) -> dict | None:
    """Train one (model, seed) run and read its memory; module-level so worker processes can run it."""
    logging.getLogger("evict").setLevel(logging.WARNING)
    if out_of_time(job):
        return None  # a timed piece is over: left for the next one
    sweep = from_json(StoriesSweep, job["sweep"])
    seed = job["seed"]
    task = SwitchTask(task_config(sweep, seed))
    torch.manual_seed(seed)
    model = LM(model_config(job["model"], sweep, task.vocab_size, task.seq_len))
    res = train(model, task, lab_train_config(sweep, seed, job))
    if res.interrupted:
        return None  # stopped at the piece's end: its checkpoint resumes it
    mem = read_memory(model, task, sweep)
    return {
        "model": job["model"], "seed": seed, "accuracy": res.final_val_accuracy, "best_accuracy": res.best_val_accuracy,
        **mem, "steps": res.steps_done, "seconds": round(res.total_seconds, 1),
        "params": sum(p.numel() for p in model.parameters()), **diverged(res),
        "label": f"{job['model']} fact {mem['fact_accuracy']:.2f} new {mem['new_accuracy']:.2f}",
    }


def jobs_for(sweep: StoriesSweep, root: Path) -> list[dict]:
    sw = dataclasses.asdict(sweep)
    return [{"model": m, "seed": s, "dir": str(root / "runs" / f"{m}_s{s}"), "sweep": sw}
            for s in seeds_of(sweep) for m in sweep.models]


def _spread(values: list[float]) -> str:
    v = sorted(values)
    return f"{v[0]:.2f} / {v[len(v) // 2]:.2f} / {v[-1]:.2f}"


def lesson_table() -> str:
    """Figures 7 and 8 at d = 4 (evict.stories): Mochi's and the junk's survival at the query."""
    f, t = fade_curve(0.2, baseline=1.0), twin_boards()
    rows = [{"figure": "7 fade curve, one scalar gate, slam 0.2", "Mochi": f["survival"]["mochi"][f["query"]],
             "junk": f["survival"]["junk"][f["query"]], "lesson": "both 20 %"}]
    for name, lesson in (("scalar", "Mochi faded with the junk"), ("per_channel", "Mochi ≈ 95 %, junk ≈ 10 %")):
        run = t[name]
        rows.append({"figure": f"8 twin boards, {name.replace('_', '-')} gate", "Mochi": run["survival"]["mochi"][24],
                     "junk": run["survival"]["junk"][24], "lesson": lesson})
    for r in rows:
        r["Mochi"], r["junk"] = f"{r['Mochi']:.1%}", f"{r['junk']:.1%}"
    return markdown_table(rows, ["figure", "Mochi", "junk", "lesson"])


def report(sweep: StoriesSweep, results: list[dict]) -> str:
    """The lesson's d = 4 numbers, then per trained run and layer: accuracies, gates and survivals."""
    rows = []
    for r in sorted(results, key=lambda r: (list(sweep.models).index(r["model"]), r["seed"])):
        for li, layer in enumerate(r["layers"]):
            sw = [a for head in layer["alpha_switch"] for a in head]
            rest = sorted(a for head in layer["alpha_distractor"] + layer["alpha_new"] for a in head)
            rows.append({
                "model": MODELS[r["model"]], "seed": r["seed"], "layer": li,
                "fact acc": f"{r['fact_accuracy']:.3f}", "new-topic acc": f"{r['new_accuracy']:.3f}",
                "α at switch (min / median / max over channels)": _spread(sw),
                "α elsewhere (median)": f"{rest[len(rest) // 2]:.3f}",
                "fact survives": " / ".join(f"{x:.2f}" for x in layer["fact"]),
                "distractor survives": " / ".join(f"{x:.2f}" for x in layer["distractor"]),
                "new survives": " / ".join(f"{x:.2f}" for x in layer["new"]),
                "fact read share": " / ".join(f"{x:.2f}" for x in layer["fact_read"]),
                "distractor share of fact reads": " / ".join(f"{x:.2f}" for x in layer["distractor_read"]),
                "new read share": " / ".join(f"{x:.2f}" for x in layer["new_read"]),
            })
    cols = list(rows[0]) if rows else ["model"]
    head = (f"Trained on the context-switch task: {sweep.facts} facts, {sweep.distractor} distractor pairs, switch, "
            f"{sweep.new} new pairs, then {sweep.facts + sweep.new} questions; {sweep.n_layers} layer(s), d_model "
            f"{sweep.d_model}, {sweep.n_heads} head(s) of dim {sweep.head_dim}, {sweep.steps} steps of batch "
            f"{sweep.batch_size}, lr {sweep.lr:g}. Accuracies and survivals on {sweep.eval_batches} held-out batches. "
            "Survives: the share of a pair's key (unit length, at its value token) left when the questions start "
            "by decay alone, per head (a / b); read share: of what a question's query matches among the pairs' keys "
            "as the state carries them (decays and delta erasures), the share of the asked pair (and, on fact "
            "questions, of the distractor's pairs); α elsewhere: the median channel's mean gate outside the switch.")
    return (f"The lesson at d = 4 (evict.stories, the op in float64)\n\n{lesson_table()}\n\n{head}\n\n"
            f"{markdown_table(rows, cols)}")


def plot(sweep: StoriesSweep, results: list[dict], path: Path) -> Path:
    """Survival per channel across the switch, one panel per (run, layer, head); channels sorted by α at the switch."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = [(r, li, h) for r in sorted(results, key=lambda r: (list(sweep.models).index(r["model"]), r["seed"]))
              for li, layer in enumerate(r["layers"]) for h in range(len(layer["alpha_switch"]))]
    cols = min(4, len(panels))
    rows = -(-len(panels) // cols)
    fig = Figure(figsize=(3.6 * cols, 3.0 * rows), constrained_layout=True)
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False).flatten()
    for ax, (r, li, h) in zip(axes, panels):
        curves = torch.tensor(r["layers"][li]["across_switch"])[:, h]  # [T', D]
        xs = list(range(r["across_from"], r["across_from"] + curves.shape[0]))
        order = torch.tensor(r["layers"][li]["alpha_switch"][h]).argsort(descending=True)
        for rank, c in enumerate(order.tolist()):
            ax.plot(xs, curves[:, c].tolist(), lw=1, color=(rank / max(1, len(order) - 1), 0.3, 0.6))
        ax.axvline(r["switch_at"], color="k", ls="--", lw=0.8)
        ax.axvline(r["questions_at"], color="grey", ls=":", lw=0.8)
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"{MODELS[r['model']].split(' (')[0]} s{r['seed']} layer {li} head {h}\n"
                     f"fact acc {r['fact_accuracy']:.2f}, new {r['new_accuracy']:.2f}", fontsize=8)
        ax.set_xlabel("token (dashed: switch, dotted: questions)", fontsize=7)
        ax.set_ylabel("survival per channel since the facts", fontsize=7)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    fig.savefig(path, dpi=110)
    return path


def lesson_plot(path: Path) -> Path:
    """Figure 7 (Mochi's survival over the story for three slams, one scalar gate) beside figure 8 (the read of cat
    at the end, scalar vs per-channel, as a share of Mochi and of the junk)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9.6, 3.6), constrained_layout=True)
    FigureCanvasAgg(fig)
    ax7, ax8 = fig.subplots(1, 2)
    for slam in (1.0, 0.5, 0.2):
        f = fade_curve(slam)
        xs = list(range(f["tokens"]))
        ax7.plot(xs, [float("nan") if v is None else v for v in f["survival"]["mochi"]], label=f"Mochi, slam {slam:g}")
    ax7.axvline(f["switch"], color="k", ls="--", lw=0.8)
    ax7.axvline(f["query"], color="grey", ls=":", lw=0.8)
    ax7.set(xlabel="token", ylabel="survival (read · value / |value|²)", ylim=(0, 1.05),
            title="7 fade curve: one scalar gate (baseline 0.99)")
    ax7.legend(fontsize=7)
    t = twin_boards()
    names = ["mochi", "junk", "tax"]
    for i, board in enumerate(("scalar", "per_channel")):
        run = t[board]
        ax8.bar([j + (i - 0.5) * 0.38 for j in range(3)], [run["survival"][n][run["query"]] for n in names], 0.38,
                label=f"{board.replace('_', '-')} gate")
    ax8.set_xticks(range(3), ["Mochi (ch 0)", "junk (ch 2-3)", "tax form (ch 1)"])
    ax8.set(ylabel="survival at the query", ylim=(0, 1.05), title="8 twin boards: one knob vs four")
    ax8.legend(fontsize=7)
    fig.savefig(path, dpi=110)
    return path


def validate(sweep: StoriesSweep) -> None:
    check_names("models", sweep.models, MODELS)
    check_at_least_one(sweep, ("steps", "batch_size", "eval_every", "eval_batches", "seeds", "workers", "n_layers",
                               "d_model", "n_heads", "head_dim"))
    task = SwitchTask(task_config(sweep, sweep.seed))  # validates the task's sizes
    for m in sweep.models:
        model_config(m, sweep, task.vocab_size, task.seq_len)  # validates the widths


def run_sweep(sweep: StoriesSweep, out: str | Path | None = None, minutes: float | None = None) -> Path:
    """Run (or resume, when `out` already holds part of it) the sweep; write and print the results, and the lesson's
    d = 4 figures (lesson.json, lesson.png) beside them."""
    validate(sweep)
    root = run_grid("stories", sweep, out, jobs_for=jobs_for, run_one=run_one, report=report, plot=plot, minutes=minutes)
    (root / "lesson.json").write_text(json.dumps({"fade_curve": fade_curve(), "twin_boards": twin_boards()}))
    print(f"wrote {root / 'lesson.json'}, {lesson_plot(root / 'lesson.png')}")
    return root
