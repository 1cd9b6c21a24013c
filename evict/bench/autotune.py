"""Shorter Triton autotuning for a reference library's first step: compile every config at once, then time them.

Triton's autotuner (`triton.autotune`) compiles and times its configs one after the other the first time a kernel
meets a new key; a library with dozens of tuned kernels of dozens of configs each (fla's KDA: minutes on a fresh
machine) spends most of that in the compiler (`ptxas` mostly), one core at a time. Inside `parallel_autotune_compile()`
an autotuner about to time its configs first compiles all of them on a thread pool (Triton's own `AsyncCompileMode`,
Triton >= 3.5; the `ptxas` subprocesses run side by side), then times them exactly as before: the same configs, the same
timing, so the same choice. Nothing changes for a kernel that is already tuned. Where Triton lacks the mode it is a
no-op, and any failure of the early compile leaves the ordinary path to compile (and report) as it would have.
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Iterator


def precompile(tuner: Any, configs: list, kwargs: dict, pool: ThreadPoolExecutor, async_mode: type) -> None:
    """Compile (not launch) `tuner`'s kernel for each of `configs` with the arguments of its current run
    (`tuner.nargs`: the positional arguments by name, empty for a launch by keywords as fla's; `kwargs`: grid, warmup
    and the rest, exactly as the timing passes them to the kernel)."""
    args = list(tuner.nargs.values())
    with async_mode(pool, ignore_errors=True):
        for cfg in configs:
            try:
                tuner.fn.run(*args, **{**kwargs, **cfg.all_kwargs(), "warmup": True})
            except Exception:  # the timing compiles this config again and reports its error as it always did
                pass


@contextmanager
def parallel_autotune_compile(workers: int | None = None, log: bool = True) -> Iterator[dict]:
    """While active, Triton autotuners compile their configs on `workers` threads (default: the CPU count) before
    timing them. Yields a dict counting what it did: kernels tuned, configs compiled, seconds spent compiling."""
    stats: dict[str, Any] = {"kernels": 0, "configs": 0, "compile s": 0.0, "active": False}
    try:
        from triton import AsyncCompileMode
        from triton.runtime.autotuner import Autotuner
    except ImportError:  # Triton < 3.5 (or none): the ordinary one-by-one path
        yield stats
        return
    original = Autotuner.prune_configs
    pool = ThreadPoolExecutor(workers or os.cpu_count() or 1)
    start = time.perf_counter()

    def prune_configs(self, kwargs):  # called once per new key, right before the configs are timed
        configs = original(self, kwargs)
        if len(configs) > 1 and getattr(self, "nargs", None) is not None:  # nargs: set by run (empty: keywords)
            t0 = time.perf_counter()
            try:
                precompile(self, configs, kwargs, pool, AsyncCompileMode)
            except Exception as e:  # e.g. another AsyncCompileMode active: the ordinary path compiles
                print(f"parallel autotune compile: skipped for {self.base_fn.__name__} ({type(e).__name__}: {e})",
                      file=sys.stderr, flush=True)
                return configs
            dt = time.perf_counter() - t0
            stats["kernels"] += 1
            stats["configs"] += len(configs)
            stats["compile s"] += dt
            if log:
                print(f"autotune {self.base_fn.__name__}: {len(configs)} configs compiled in {dt:.1f} s "
                      f"(at {t0 - start:.0f} s)", file=sys.stderr, flush=True)  # a gap to the next line: timing
        return configs

    Autotuner.prune_configs = prune_configs
    stats["active"] = True
    try:
        yield stats
    finally:
        Autotuner.prune_configs = original
        pool.shutdown(wait=True)
        stats["compile s"] = round(stats["compile s"], 1)
