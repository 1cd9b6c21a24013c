"""Plots of training metrics (metrics.jsonl written by evict.train) with matplotlib's Agg canvas.

No pyplot: a Figure drawn on a FigureCanvasAgg sets no global backend and keeps no figure registry.
"""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def read_metrics(jsonl_path: str | Path) -> list[dict]:
    """The rows of a metrics.jsonl file, in order."""
    return [json.loads(line) for line in Path(jsonl_path).read_text().splitlines() if line.strip()]


def plot_metrics(jsonl_path: str | Path, png_path: str | Path) -> Path:
    """Loss (train and val) vs step, and val accuracy vs step beside it, saved as a PNG; returns png_path."""
    rows = read_metrics(jsonl_path)
    train = [r for r in rows if r.get("split") == "train"]
    val = [r for r in rows if r.get("split") == "val"]
    fig = Figure(figsize=(10, 4), constrained_layout=True)
    FigureCanvasAgg(fig)
    ax_loss, ax_acc = fig.subplots(1, 2)
    if train:
        ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train", lw=1)
    if val:
        ax_loss.plot([r["step"] for r in val], [r["loss"] for r in val], "o-", label="val", ms=3)
        ax_acc.plot([r["step"] for r in val], [r["accuracy"] for r in val], "o-", color="C1", ms=3)
    ax_loss.set(xlabel="step", ylabel="cross-entropy", title="loss")
    ax_loss.legend()
    ax_acc.set(xlabel="step", ylabel="accuracy", title="val accuracy", ylim=(0, 1.02))
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=120)
    return png_path
