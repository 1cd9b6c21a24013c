"""Training throughput of the lab's small models on one GPU (`evict bench train`).

N processes train one MQAR cell each at the same time (the way `evict recall --full` fills a GPU); the number is
aggregate cell-steps per second: N · steps / (last finish − first start), measured after a short warm-up that
compiles the kernels. Variants switch the training loop's fast paths on one at a time, side by side in one run:

    before   float32, eager, head and loss over every position, batches made inline (the loop of issue 10's report)
    bf16     + bf16 autocast
    labels   + head and loss at the K labelled positions only, batches made ahead by a thread
    graphs   + the whole step replayed from one CUDA graph (the default of `evict recall --full`)
    compiled + each block through torch.compile (Inductor fuses the per-layer elementwise chain: norms, conv, SiLU,
             L2 norms, gates, casts) inside the same graph
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

from evict.report import card, markdown_table, write_json

VARIANTS: dict[str, dict[str, Any]] = {
    "before": dict(amp="none", graphs=False, select_labels=False, prefetch=0),
    "bf16": dict(amp="bf16", graphs=False, select_labels=False, prefetch=0),
    "labels": dict(amp="bf16", graphs=False, select_labels=True, prefetch=2),
    "graphs": dict(amp="bf16", graphs=True, select_labels=True, prefetch=2),
    "compiled": dict(amp="bf16", graphs=True, select_labels=True, prefetch=2, compile=True),
}

_barrier: Any = None  # the multiprocessing Barrier each worker gets from _init


def _init(barrier) -> None:
    global _barrier
    _barrier = barrier


def _cell(job: dict) -> dict:
    import torch

    from evict.lab.recall import FULL, model_config
    from evict.models import LM
    from evict.tasks.mqar import MQARConfig, MQARTask
    from evict.train import TrainConfig, train

    torch.set_num_threads(job["threads"])
    L, K, d = job["seq_len"], job["pairs"], job["d_model"]
    task = MQARTask(MQARConfig(vocab_size=FULL.vocab_size, seq_len=L, num_pairs=K))

    def run(steps: int):
        torch.manual_seed(job["rank"])
        model = LM(model_config(job["arch"], d, FULL, L))
        tc = TrainConfig(steps=steps, batch_size=FULL.batch_size, lr=2.2e-3, eval_every=steps, eval_batches=1,
                         device="cuda", progress=False, log_every=steps, **VARIANTS[job["variant"]])
        return train(model, task, tc)

    run(5)  # compile kernels, fill the allocator
    torch.cuda.synchronize()
    _barrier.wait()
    t0 = time.time()
    res = run(job["steps"])
    torch.cuda.synchronize()
    return {"t0": t0, "t1": time.time(), "steps": res.steps_done, "val_loss": res.final_val_loss}


def bench_train(*, archs, setting, d_model: int, procs: int, steps: int, variants, out=None) -> list[dict]:
    import torch

    if not torch.cuda.is_available():
        raise ValueError("device: `evict bench train` measures a GPU; no CUDA device is available")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"variants: expected names from {list(VARIANTS)}, got {unknown}")
    L, K = setting
    threads = max(1, (mp.cpu_count() or 1) // procs)
    rows = []
    for arch in archs:
        for variant in variants:
            ctx = mp.get_context("spawn")
            barrier = ctx.Barrier(procs)
            jobs = [dict(arch=arch, seq_len=L, pairs=K, d_model=d_model, steps=steps, variant=variant, rank=r,
                         threads=threads) for r in range(procs)]
            with ctx.Pool(procs, initializer=_init, initargs=(barrier,)) as pool:
                res = pool.map(_cell, jobs, chunksize=1)
            wall = max(r["t1"] for r in res) - min(r["t0"] for r in res)
            agg = procs * steps / wall
            rows.append({"arch": arch, "variant": variant, "procs": procs, "steps": steps,
                         "cell-steps/s": round(agg, 1), "per process": round(agg / procs, 2),
                         "val loss": round(sum(r["val_loss"] for r in res) / procs, 3)})
            print(rows[-1], flush=True)
    for arch in archs:
        base = next((r for r in rows if r["arch"] == arch and r["variant"] == variants[0]), None)
        for r in rows:
            if r["arch"] == arch and base is not None:
                r[f"vs {variants[0]}"] = f"{r['cell-steps/s'] / base['cell-steps/s']:.2f}x"
    cols = ["arch", "variant", "procs", "steps", "cell-steps/s", "per process", f"vs {variants[0]}", "val loss"]
    print(f"\nMQAR L={L} K={K} d={d_model} batch 256 vocab 8192, {procs} processes on one GPU\n")
    print(markdown_table(rows, cols))
    if out:
        write_json(out, {"card": card(), "setting": [L, K], "d_model": d_model, "rows": rows})
    return rows
