"""Train the depth lens's two small models on Shakespeare (CPU, minutes) and write the lens the explore app shows.

    python dev/depth_lens.py [--steps 200] [--out runs/depth_lens]

Two runs of `evict train` with the same flags and seed: k3_mini (tiny) cut to 8 layers of width 64 with one AttnRes
block per layer (the final read mixes the embedding and 8 depth snapshots), and the same config with
attn_res=False (the plain residual). Then both read the same validation passage and `evict.explore.depth.lens`
records the AttnRes weights and the hidden-state RMS per depth. Output: evict/explore/data/depth_lens.json (no
weights; the trained models stay in --out).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch

from evict.cli import main as evict_main
from evict.explore.depth import DATA, lens
from evict.models import LM
from evict.tasks.tokenizers import load_tokenizer

SETS = ["n_layers=8", "attn_res_block=1", "d_model=64", "head_dim=32", "d_ff=128", "kv_lora_rank=32", "q_lora_rank=32",
        'moe={"n_routed": 4, "top_k": 1, "d_expert": 64, "n_shared": 1, "latent_dim": 32}']
PASSAGE_CHARS = 64


def train_args(out: Path, steps: int, attn_res: bool) -> list[str]:
    sets = [x for s in SETS + [f"attn_res={'true' if attn_res else 'false'}"] for x in ("--set", s)]
    return ["train", "--preset", "k3_mini", "--size", "tiny", *sets, "--steps", str(steps), "--seq-len", "64",
            "--batch-size", "16", "--lr", "3e-3", "--eval-every", str(steps), "--eval-batches", "4", "--threads", "1",
            "--seed", "0", "--out", str(out)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--out", default="runs/depth_lens")
    args = p.parse_args(argv)
    runs = {}
    for name, flag in (("attn_res", True), ("plain", False)):
        out = Path(args.out) / name
        cmd = train_args(out, args.steps, flag)
        if evict_main(cmd) != 0:
            return 1
        runs[name] = {"command": "evict " + shlex.join(cmd), **json.loads((out / "summary.json").read_text())}
    models = {name: LM.load(Path(args.out) / name / "model") for name in runs}
    tok = load_tokenizer(Path(args.out) / "attn_res" / "model" / "tokenizer.json")
    from evict.tasks.text import TextTask

    task = TextTask(seq_len=PASSAGE_CHARS)
    x, _ = task.get_batch("val", 0, 1)  # the first validation window: the last plays, never trained on
    text = tok.decode(x[0].tolist())
    result = lens(models["attn_res"], models["plain"], x)
    payload = {"command": f"python dev/depth_lens.py --steps {args.steps}", "text": text,
               "tokens": [tok.decode([i]) for i in x[0].tolist()],
               "training": {k: {key: v[key] for key in ("command", "steps", "val_loss", "unigram_loss", "wall_seconds", "params")}
                            for k, v in runs.items()},
               "torch": torch.__version__, **result}
    path = Path(__file__).resolve().parent.parent / "evict" / "explore" / DATA
    path.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"depth lens: {path} (final-read weights over {len(result['attn_res']['sources'])} sources, "
          f"{len(result['plain']['layer_rms'])} plain layers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
