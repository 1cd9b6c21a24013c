"""Where one MQAR training step's time goes on the GPU (issue 10): data, eager step, graphed step, top kernels.

    python3 dev/profile_train.py [--arch kda attention] [--L 512 --K 64 --d 128 --batch 256] [--compile] [--no-timing]

--compile: also time the graphed step with each block through torch.compile, and profile the compiled blocks.
"""

import argparse
import time

import torch

from evict.lab.recall import FULL, model_config
from evict.models import LM
from evict.tasks.mqar import MQARConfig, MQARTask
from evict.train import TrainConfig, train

p = argparse.ArgumentParser()
p.add_argument("--arch", nargs="+", default=["kda", "attention"])
p.add_argument("--L", type=int, default=512)
p.add_argument("--K", type=int, default=64)
p.add_argument("--d", type=int, default=128)
p.add_argument("--batch", type=int, default=256)
p.add_argument("--compile", action="store_true")
p.add_argument("--no-timing", action="store_true")
p.add_argument("--rows", type=int, default=25)
a = p.parse_args()
task = MQARTask(MQARConfig(vocab_size=FULL.vocab_size, seq_len=a.L, num_pairs=a.K))
t0 = time.perf_counter()
for i in range(10):
    task.get_batch("train", i, a.batch)
print(f"get_batch (CPU, {torch.get_num_threads()} threads): {(time.perf_counter() - t0) / 10 * 1e3:.1f} ms")

for arch in a.arch:
    variants = [dict(graphs=False, prefetch=0), dict(graphs=True, prefetch=2)]
    variants += [dict(graphs=True, prefetch=2, compile=True)] if a.compile else []
    for variant in [] if a.no_timing else variants:
        torch.manual_seed(0)
        model = LM(model_config(arch, a.d, FULL, a.L))
        tc = TrainConfig(steps=60, batch_size=a.batch, lr=2.2e-3, eval_every=60, eval_batches=1, device="cuda",
                         progress=False, log_every=60, **variant)
        train(LM(model_config(arch, a.d, FULL, a.L)), task, TrainConfig(**{**tc.__dict__, "steps": 5, "eval_every": 5}))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        train(model, task, tc)
        torch.cuda.synchronize()
        print(f"{arch} {variant}: {(time.perf_counter() - t0) / 60 * 1e3:.1f} ms/step (one process, incl. 1 eval)")

    torch.manual_seed(0)
    model = LM(model_config(arch, a.d, FULL, a.L)).cuda()
    if a.compile:
        for blk in model.blocks:
            blk.compile()
    x, y = (t.cuda() for t in task.get_batch("train", 0, a.batch))
    from evict.train import label_positions

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pos = label_positions(y, a.K)
            logits = model(x, positions=pos)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.gather(1, pos).flatten())
        loss.backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    print(f"\n{arch}{' (compiled blocks)' if a.compile else ''}: top CUDA kernels over 3 fwd+bwd steps")
    try:
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=a.rows, max_name_column_width=90))
    except (AttributeError, KeyError, ValueError):  # newer torch names the column "device"
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=a.rows, max_name_column_width=90))
