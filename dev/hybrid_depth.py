"""Why the hybrid lab's MQAR runs stay at chance at 16 layers (session 17): one model of the hybrid lab (its
`model_config`: equal parameters, heads of head_dim, short conv) trained on MQAR with the optimizer knobs the lab
fixes (warmup 0, one lr, one batch) varied, best validation accuracy per variant.

    python3 dev/hybrid_depth.py --layers 16 --pattern A --runs lr=1e-2 lr=1e-2,warmup=50 lr=3e-3 lr=1e-2,steps=900
    python3 dev/hybrid_depth.py --full --pattern K --runs steps=8000 --minutes 8 --out k.json   # --full's shapes (GPU)
    python3 dev/hybrid_depth.py --pattern K --runs lr=1e-2,steps=1200 --set gate_dt_max=1e-2   # a ModelConfig field
    python3 dev/hybrid_depth.py --pattern K --shape seq_len=128 --shape pairs=32   # a HybridSweep field (between
                                                                                  # the quick and full shapes)

`--pattern X` is the all-X model (K: KDA, M: MLA, A: attention); a full pattern string (`KKKM…`) is used as given.
`--minutes M` stops every run M minutes after the script started (the row then says how far it got): the learning
curve of a long schedule's first part, which is what shows whether and when a model leaves chance. One process runs
its runs one after another; `bash dev/gpu.sh hybriddepth` runs several processes side by side under MPS.
`--run-dir DIR` keeps each run's checkpoint in DIR/<pattern>_<run>, so the same command continues a long schedule
where the last one stopped (back-to-back device calls on one warm machine; the curve then covers every call).
"""

import argparse
import dataclasses
import json
import time
from dataclasses import replace

import torch

from evict.cli_args import parse_overrides
from evict.lab import hybrid, recall
from evict.lab.sweep import curve
from evict.models import LM
from evict.train import train


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--full", action="store_true", help="hybrid.FULL's shapes (default: hybrid.QUICK's)")
    p.add_argument("--layers", type=int, default=16, help="depth of a one-letter --pattern")
    p.add_argument("--pattern", default="A")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--runs", nargs="+", default=["lr=1e-2"], help="KEY=VALUE,… with keys lr, warmup, steps, batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--minutes", type=float, default=None, help="stop every run this long after the start")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="a ModelConfig field laid over the lab's model")
    p.add_argument("--shape", action="append", metavar="KEY=VALUE",
                   help="a HybridSweep field (seq_len, pairs, vocab_size, d_model, head_dim, …) laid over the mode's")
    p.add_argument("--run-dir", default=None, help="checkpoint folder: each run resumes from its last stop")
    p.add_argument("--out", default=None, help="JSON file for the rows")
    a = p.parse_args()
    stop_at = None if a.minutes is None else time.time() + 60 * a.minutes
    pattern = a.pattern * a.layers if len(a.pattern) == 1 else a.pattern  # a full pattern sets the depth itself
    try:
        model_set = recall.model_set_fields(parse_overrides(a.set))  # the recall lab's check of --set names
        shape = parse_overrides(a.shape)
        fields = {f.name for f in dataclasses.fields(hybrid.HybridSweep)} - {"n_layers"}
        for key in shape:
            if key not in fields:
                raise ValueError(f"--shape: {key!r} is not a HybridSweep field (n_layers comes from --pattern / --layers)")
        sweep = replace(hybrid.FULL if a.full else hybrid.QUICK, n_layers=len(pattern), **shape)
        hybrid.validate(replace(sweep, ratios=("1:0",), placement_ratios=()))  # sizes; the pattern is ours
    except ValueError as e:
        raise SystemExit(str(e)) from None
    task = hybrid.make_task(sweep, "mqar", a.seed)
    rows = []
    for spec in a.runs:
        kv = dict(item.split("=") for item in spec.split(","))
        lr, warmup = float(kv.get("lr", sweep.lr)), int(kv.get("warmup", 0))
        steps, batch = int(kv.get("steps", a.steps or hybrid.task_steps(sweep, "mqar"))), int(kv.get("batch", sweep.batch_size))
        torch.manual_seed(a.seed)
        model = LM(replace(hybrid.model_config(sweep, pattern, task.vocab_size), **model_set))
        run_dir = None if a.run_dir is None else f"{a.run_dir}/{pattern}_{spec.replace('=', '').replace(',', '_')}"
        tc = hybrid.train_config(sweep, "mqar", a.seed, steps=steps, batch_size=batch, lr=lr, warmup_steps=warmup,
                                 stop_at=stop_at, out_dir=run_dir)  # the lab's run of this model, these knobs changed
        t0 = time.perf_counter()
        res = train(model, task, tc)
        row = {"pattern": pattern, **({"set": model_set} if model_set else {}), **({"shape": shape} if shape else {}), "lr": lr, "warmup": warmup,
               "steps": steps, "batch": batch, "best": round(res.best_val_accuracy, 4), "steps_done": res.steps_done,
               "stopped": res.interrupted,
               "seconds": round(time.perf_counter() - t0, 1), "total_seconds": round(res.total_seconds, 1), "curve": curve(res)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
