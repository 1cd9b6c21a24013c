"""tests/test_train_fast.py's `test_mqar_learns_on_cuda` run, over seeds and forms of the memory op: is a low score
the run's seed, the graphed step, the chunk size, the kept factors, or the Triton kernels themselves?

    python dev/learns_gpu.py --archs gated_deltanet gla --seeds 0 1 2 --variants graphed eager fp32 chunked c64 nokeep

Variants (each the test's run, L 64 K 4, heads of 16, 200 steps at lr 1e-2, bf16 autocast, with one thing changed):
  graphed: the test itself (CUDA-graphed step; Triton kernels at the sweep's chunks of 16)
  eager:   the same step without the CUDA graph
  fp32:    the graphed step without autocast (float32 throughout)
  chunked: the memory op's torch chunked form instead of the Triton kernels (the CPU's path)
  c64:     the Triton kernels at chunks of 64
  nokeep:  the backward recomputes the forward's factors (`keep_factors=False`)
One line per run: arch, variant, seed, validation accuracy at each evaluation. `--out F` writes them as JSON.
On a machine without CUDA `--device cpu` runs the same (graphed is then eager). The CPU's numbers for the
test's run (`--device cpu --variants eager`, one thread, session 12): Gated DeltaNet seeds 0-10 best 0.10-0.96 (two
near 0.1), GLA seeds 0-4 0.058-0.092; the H200 gave 0.038 and 0.048 (seed 0), below every CPU seed.
"""

import argparse
import functools
import json
import time

import torch

from evict import LM
from evict.lab.recall import RecallSweep, model_config
from evict.layers import memory_mixer
from evict.tasks.mqar import MQARConfig, MQARTask
from evict.train import TrainConfig, train

VARIANTS = ("graphed", "eager", "fp32", "chunked", "c64", "nokeep")


def run(arch: str, variant: str, seed: int, steps: int, device: str) -> dict:
    sweep = RecallSweep(vocab_size=128, head_dim=16, chunk_size=64 if variant == "c64" else 16)
    torch.manual_seed(seed)
    model = LM(model_config(arch, 64, sweep, 64))
    task = MQARTask(MQARConfig(vocab_size=128, seq_len=64, num_pairs=4))
    lr = 3e-3 if arch == "kimi_linear" else 1e-2  # as in the test
    cfg = TrainConfig(steps=steps, batch_size=64, lr=lr, eval_every=50, eval_batches=4, device=device,
                      amp="none" if variant == "fp32" else "bf16",
                      progress=False, graphs=variant != "eager" and device == "cuda")
    original = memory_mixer.memory
    if variant == "chunked":
        memory_mixer.memory = functools.partial(original, impl="chunked")
    elif variant == "nokeep":
        memory_mixer.memory = functools.partial(original, keep_factors=False)
    t0 = time.perf_counter()
    try:
        res = train(model, task, cfg)
    finally:
        memory_mixer.memory = original
    return dict(arch=arch, variant=variant, seed=seed, accuracy=[round(h["accuracy"], 4) for h in res.history],
                best=res.best_val_accuracy, seconds=round(time.perf_counter() - t0, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archs", nargs="+", default=["gated_deltanet", "gla", "kda"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for arch in args.archs:
        for variant in args.variants:
            for seed in args.seeds:
                r = run(arch, variant, seed, args.steps, args.device)
                rows.append(r)
                print(f"{arch:15s} {variant:8s} seed {seed}: {r['accuracy']} best {r['best']:.3f} ({r['seconds']} s)",
                      flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=args.device, cuda=torch.cuda.get_device_name() if args.device == "cuda" else None,
                           torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
