"""Tables and records of measured numbers (benchmarks and labs): the environment card, timing, markdown tables, JSON."""

from __future__ import annotations

import datetime
import json
import platform
import time
from pathlib import Path

import torch


def card() -> dict:
    """Where and with what a result was measured."""
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            info["triton"] = None
    return info


def wall_time(fn, *, repeats: int = 3, warmup: int = 1) -> float:
    """Median wall-clock seconds of fn() on the CPU (synchronizing CUDA if used)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def median_ms(device: str, *, warmup_ms: int = 25, rep_ms: int = 100, repeats: int = 3, warmup: int = 1):
    """A timer fn -> median milliseconds of fn(): triton's do_bench (warm-up and repetition in ms) on CUDA, wall_time
    (`repeats` timed calls after `warmup` calls) elsewhere."""
    if device.startswith("cuda"):
        from triton.testing import do_bench

        return lambda fn: float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    return lambda fn: wall_time(fn, repeats=repeats, warmup=warmup) * 1e3


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


def write_json(path: str | Path, payload: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))
    return path
