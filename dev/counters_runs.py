"""Where do the counters quick models miss count_mod3? Retrain `evict lab state --counters`'s count_mod3 runs (seed
0, the COUNTERS settings) and score each final model on the lab's test batches by the run length of the current
token: a token that ends a run of r equal tokens (r >= 5: the kernel-4 short conv's window is all one token, so a
layer's key, value and β are the same every step) against the rest, inside and past the training lengths.

    PYTHONPATH=$PWD python dev/counters_runs.py [deltanet_neg deltanet linear]   # ~20 min a model, loaded 2 cores
"""

from __future__ import annotations

import json
import sys
import tempfile
import time

import torch

from evict.lab.state import COUNTERS, MODELS, _task, model_config
from evict.lab.sweep import lab_train_config
from evict.models import LM
from evict.train import train

SPANS = {"r1": (1, 2), "r2-4": (2, 5), "r>=5": (5, 10**9)}


def run_lengths(x: torch.Tensor) -> torch.Tensor:
    """[B, T] tokens -> [B, T]: how many equal tokens end at each position (1 where the token differs from the last)."""
    r = torch.ones_like(x)
    for t in range(1, x.shape[1]):
        r[:, t] = torch.where(x[:, t] == x[:, t - 1], r[:, t - 1] + 1, 1)
    return r


def score(model: LM, task, sweep) -> dict:
    """Accuracy on the lab's test batches by run length, moves only (up / down; a stay never changes the count), split
    at the longest training length."""
    hits: dict = {}
    model.eval()
    with torch.no_grad():
        for i in range(sweep.eval_batches):
            x, y = task.get_batch("val", i, sweep.batch_size)  # [B, T]
            ok = model(x).argmax(-1) == y
            r, pos = run_lengths(x), torch.arange(x.shape[1])[None, :]
            move = (y != -100) & (x != 0)
            for where, at in (("<40", pos < sweep.train_lengths[1]), (">=40", pos >= sweep.train_lengths[1])):
                for name, (lo, hi) in SPANS.items():
                    m = move & at & (r >= lo) & (r < hi)
                    h = hits.setdefault(f"{where} {name}", [0, 0])
                    h[0] += int((ok & m).sum())
                    h[1] += int(m.sum())
    return {k: {"accuracy": round(a / n, 3) if n else None, "n": n} for k, (a, n) in hits.items()}


def main(models: list[str]) -> None:
    sweep = COUNTERS
    for name in models:
        task = _task("count_mod3", sweep, 0)
        torch.manual_seed(0)
        model = LM(model_config(name, sweep, task.vocab_size))
        t0 = time.time()
        with tempfile.TemporaryDirectory() as d:
            res = train(model, task, lab_train_config(sweep, 0, {"dir": d}))
        print(json.dumps({"model": name, "best_val_accuracy": round(res.best_val_accuracy, 3),
                          "seconds": round(time.time() - t0), "by_run_length": score(model, task, sweep)}), flush=True)


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__)
        sys.exit(0)
    bad = [m for m in sys.argv[1:] if m not in MODELS]
    if bad:
        print(f"models: expected names from {sorted(MODELS)}, got {bad}", file=sys.stderr)
        sys.exit(2)
    main(sys.argv[1:] or ["deltanet_neg", "deltanet", "linear"])
