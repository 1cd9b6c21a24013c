"""Report of dev/dist_bench.sh: tokens/s, model FLOPs utilisation and the loss curves of its runs, as a table and JSON.

    python dev/dist_bench.py OUT_DIR RUN [RUN ...]     (each RUN a folder `evict train` wrote under OUT_DIR)

FLOPs per token: evict.models.accounting.train_flops_per_token (6 × active matmul parameters + attention / memory
mixing). Throughput: the mean of the metrics rows' tokens_per_s after the first `--skip` steps (compile, warm-up).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PEAK_BF16 = 989e12  # H200 (and H100 SXM) dense bf16 peak, FLOP/s


def report(out: Path, runs: list[str], skip: int, peak: float) -> dict:
    from evict.report import card
    from evict.models.accounting import train_flops_per_token
    from evict.models.config import ModelConfig

    rows = []
    for name in runs:
        run = json.loads((out / name / "run.json").read_text())
        cfg = ModelConfig.from_dict(run["model"])
        flops = train_flops_per_token(cfg, run["task"]["seq_len"])["total"]
        metrics = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
        train = [m for m in metrics if m["split"] == "train"]
        timed = [m["tokens_per_s"] for m in train if m["step"] > skip] or [train[-1]["tokens_per_s"]]
        tok_s = sum(timed) / len(timed)
        gpus = run["world_size"]
        rows.append({"run": name, "gpus": gpus, "dist": run["train"]["dist"] if gpus > 1 else "-",
                     "params_M": round(_params(cfg) / 1e6, 1), "tokens_per_s": round(tok_s),
                     "flops_per_token": flops, "mfu": tok_s * flops / (gpus * peak),
                     "loss": [[m["step"], m["loss"]] for m in train],
                     "val_loss": [m["loss"] for m in metrics if m["split"] == "val"][-1:]})
    base = rows[0]
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
        pairs = list(zip(r["loss"], base["loss"]))
        r["max_loss_diff_vs_1gpu"] = max(abs(a[1] - b[1]) for a, b in pairs) if pairs else None
    return {"card": card(), "peak_flops": peak, "skip_steps": skip, "runs": rows}


def _params(cfg) -> int:
    from evict.models.accounting import param_report

    return param_report(cfg)["total"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("runs", nargs="+")
    p.add_argument("--skip", type=int, default=10, help="steps left out of the throughput (warm-up, compile)")
    p.add_argument("--peak", type=float, default=PEAK_BF16)
    a = p.parse_args(argv)
    res = report(a.out, a.runs, a.skip, a.peak)
    print("| run | GPUs | dist | params (M) | tokens/s | speedup | MFU | max |loss − 1 GPU| | loss by step | val loss |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in res["runs"]:
        curve = " / ".join(f"{loss:.3f}" for _, loss in r["loss"])
        val = f"{r['val_loss'][0]:.3f}" if r["val_loss"] else "-"
        print(f"| {r['run']} | {r['gpus']} | {r['dist']} | {r['params_M']} | {r['tokens_per_s']:,} | "
              f"{r['speedup']:.2f}× | {100 * r['mfu']:.1f} % | {r['max_loss_diff_vs_1gpu']:.4f} | {curve} | {val} |")
    path = a.out / "dist_bench.json"
    path.write_text(json.dumps(res, indent=2))
    print(f"json: {path}")


if __name__ == "__main__":
    sys.exit(main())
