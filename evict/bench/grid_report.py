"""The kernel grid's report: the table, the crossover N where each memory kernel beats each attention kernel, a plot.

    best = best_chunk(rows)        # {(kernel, N, D, pass): (ms, C)}: a memory kernel at its fastest chunk
    crossovers(rows)               # [{memory, attention, D, pass, crossover_N, estimate_N, ...}]
    grid_table(rows), crossover_table(rows), plot_grid(rows, png)

Only rows with status "ok" enter. A memory kernel is compared at its fastest C per (N, D, pass) (every C is in the
JSONL). crossover_N: the smallest measured N from which the memory kernel is faster at that N and at every larger
measured N (None: it is not faster at the largest N measured). estimate_N: where log(attention ms / memory ms),
interpolated linearly in log N between the last measured N it loses at and crossover_N, crosses zero (None when it
wins from the first N measured, or never).
"""

from __future__ import annotations

import math
from pathlib import Path

from evict.report import markdown_table

from .grid import MEMORY_KERNELS, SDPA_BACKENDS


def _ok(rows):
    return [r for r in rows if r.get("status") == "ok" and isinstance(r.get("ms"), (int, float))]


def best_chunk(rows) -> dict:
    """{(kernel, N, D, pass): (ms, C)} with each memory kernel at its fastest chunk and attention at C = None."""
    best: dict = {}
    for r in _ok(rows):
        k = (r["kernel"], r["N"], r["D"], r["pass"])
        if k not in best or r["ms"] < best[k][0]:
            best[k] = (r["ms"], r["C"])
    return best


def crossovers(rows) -> list[dict]:
    best = best_chunk(rows)
    kernels = {k[0] for k in best}
    out = []
    for mem in sorted(kernels & set(MEMORY_KERNELS)):
        for att in sorted(kernels & set(SDPA_BACKENDS)):
            for D, p in sorted({(k[2], k[3]) for k in best if k[0] == mem}):
                Ns = sorted(N for (kk, N, DD, pp) in best if kk == mem and DD == D and pp == p
                            and (att, N, D, p) in best)
                if not Ns:
                    continue
                ratio = [best[(att, N, D, p)][0] / best[(mem, N, D, p)][0] for N in Ns]
                out.append({"memory": mem, "attention": att, "D": D, "pass": p, "Ns": Ns,
                            "ratios": [round(x, 3) for x in ratio], **_crossing(Ns, ratio)})
    return out


def _crossing(Ns: list[int], ratio: list[float]) -> dict:
    """crossover_N and estimate_N from attention / memory time ratios (> 1: the memory kernel is faster)."""
    if ratio[-1] <= 1:
        return {"crossover_N": None, "estimate_N": None}
    i = len(ratio) - 1
    while i > 0 and ratio[i - 1] > 1:
        i -= 1
    if i == 0:
        return {"crossover_N": Ns[0], "estimate_N": None}
    x0, x1 = math.log(Ns[i - 1]), math.log(Ns[i])
    y0, y1 = math.log(ratio[i - 1]), math.log(ratio[i])
    x = x0 + (0 - y0) * (x1 - x0) / (y1 - y0)
    return {"crossover_N": Ns[i], "estimate_N": int(round(math.exp(x)))}


def _fmt_n(n) -> str:
    if n is None:
        return ""
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def crossover_table(rows) -> str:
    table = []
    for c in crossovers(rows):
        if c["crossover_N"] is None:
            where = f"not by {_fmt_n(c['Ns'][-1])}"
        elif c["estimate_N"] is None:
            where = f"<= {_fmt_n(c['crossover_N'])} (faster at every N)"
        else:
            where = f"{_fmt_n(c['crossover_N'])} (~{c['estimate_N']:,})"
        table.append({"memory": c["memory"], "attention": c["attention"], "D": c["D"], "pass": c["pass"],
                      "faster from N": where, "attention / memory at each N": " ".join(f"{x:.2f}" for x in c["ratios"])})
    return markdown_table(table, ["memory", "attention", "D", "pass", "faster from N", "attention / memory at each N"])


def grid_table(rows) -> str:
    """ms per cell: one line per (D, pass, N), one column per kernel (memory kernels at their fastest C, shown)."""
    best = best_chunk(rows)
    kernels = [k for k in (*MEMORY_KERNELS, *SDPA_BACKENDS) if any(b[0] == k for b in best)]
    lines = []
    for D, p, N in sorted({(k[2], k[3], k[1]) for k in best}):
        line: dict = {"D": D, "pass": p, "N": _fmt_n(N)}
        for k in kernels:
            if (k, N, D, p) in best:
                ms, C = best[(k, N, D, p)]
                line[k] = f"{ms:.3f}" + ("" if C is None else f" (C{C})")
        lines.append(line)
    skipped = [r for r in rows if r.get("status") != "ok"]
    text = markdown_table(lines, ["D", "pass", "N", *kernels])
    if skipped:
        notes = sorted({(r["kernel"], r["status"], r.get("note") or "") for r in skipped})
        text += "\n\nCells not timed:\n" + "\n".join(f"- {k}: {s}: {n}" for k, s, n in notes)
    return text


def plot_grid(rows, png: str | Path) -> Path:
    """ms against N (log-log), one panel per (pass, D), one line per kernel (memory kernels at their fastest C)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    best = best_chunk(rows)
    panels = sorted({(k[3], k[2]) for k in best}, key=lambda x: (x[0] != "fwd", x[1]))
    passes = sorted({p for p, _ in panels}, key=lambda x: x != "fwd")
    dims = sorted({D for _, D in panels})
    fig = Figure(figsize=(4 * max(1, len(dims)), 3.4 * max(1, len(passes))), constrained_layout=True)
    FigureCanvasAgg(fig)
    axes = fig.subplots(max(1, len(passes)), max(1, len(dims)), squeeze=False)
    for i, p in enumerate(passes):
        for j, D in enumerate(dims):
            ax = axes[i][j]
            for n, k in enumerate(k for k in (*MEMORY_KERNELS, *SDPA_BACKENDS) if any(b[0] == k for b in best)):
                pts = sorted((N, best[(kk, N, DD, pp)][0]) for (kk, N, DD, pp) in best if kk == k and DD == D and pp == p)
                if pts:
                    ax.plot(*zip(*pts), "o-" if k in MEMORY_KERNELS else "s--", ms=3, label=k, color=f"C{n}")
            ax.set(xscale="log", yscale="log", xlabel="N (tokens per sequence; B x N fixed)", ylabel="ms",
                   title=f"{p}, head dim {D}")
            ax.grid(alpha=0.3, which="both")
    axes[0][0].legend(fontsize=7)
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    return png
