"""Where one MQAR training step's time goes on the GPU (issue 10): data, eager step, graphed step, top kernels.

    python3 dev/profile_train.py [--arch kda attention] [--L 512 --K 64 --d 128 --batch 256] [--compile] [--no-timing]
    python3 dev/profile_train.py --hybrid KKKMKKKMKKKMKKKM KKKKKKKKKKKKKKKK [--compile]   # lab hybrid --full's models
    python3 dev/profile_train.py --pairs-dim 256 --arch kda attention [--K 512] [--compile]  # lab pairs --full's rungs

--compile: also time the graphed step with each block through torch.compile, and profile the compiled blocks.
--hybrid PATTERN …: instead of the recall lab's cells, the hybrid lab's models of these layer patterns at its
`--full` shapes (hybrid.FULL: L 512, K 64, vocab 8192, batch 64, 16 layers at equal parameters, slow KDA gates), the
question being how long one of its 8,000-step MQAR runs takes on the card (results/full_runs.md).
--pairs-dim D: the pairs lab's `--full` rungs at head dim D (pairs.FULL: one head of dim D per layer at width 256,
vocab 8192, the rung's batch: 256 up to L 512, then 256 x 512 tokens a step, pairs.rung_batch; slow gates) for --arch's
rules at --K pairs (L = 8 K; default the ladder's top, 512 → L 4,096, batch 32),
the question being whether its top rungs (4,000 steps) fit inside one device session (results/full_runs.md).
--device cpu: a smoke run of the same code (eager only, CPU activities in the profile) at small --steps.
"""

import argparse
import time

import torch

from evict.lab import hybrid, pairs, recall
from evict.models import LM, compile_blocks
from evict.tasks.mqar import MQARConfig, MQARTask
from evict.train import TrainConfig, label_positions, train

p = argparse.ArgumentParser()
p.add_argument("--arch", nargs="+", default=["kda", "attention"])
p.add_argument("--hybrid", nargs="+", default=None, metavar="PATTERN", help="hybrid.FULL's model of each pattern")
p.add_argument("--pairs-dim", type=int, default=None, metavar="D", help="pairs.FULL's rung models at head dim D")
p.add_argument("--L", type=int, default=512)
p.add_argument("--K", type=int, default=None, help="default: 64 (recall cells), 512 (--pairs-dim)")
p.add_argument("--d", type=int, default=128)
p.add_argument("--batch", type=int, default=None,
               help="default: 256 (recall cells), the rung's (--pairs-dim), hybrid.FULL's 64 (--hybrid)")
p.add_argument("--steps", type=int, default=60, help="timed steps per variant")
p.add_argument("--compile", action="store_true")
p.add_argument("--no-timing", action="store_true")
p.add_argument("--rows", type=int, default=25)
p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
a = p.parse_args()
cuda = a.device == "cuda"

if a.hybrid:
    sweep = hybrid.FULL
    for pat in a.hybrid:
        if len(pat) != sweep.n_layers or set(pat) - {"K", "M", "A"}:
            p.error(f"--hybrid: expected patterns of {sweep.n_layers} letters K / M / A, got {pat!r}")
    task = hybrid.make_task(sweep, "mqar", 0)
    K, batch = sweep.pairs, a.batch or sweep.batch_size
    models = {pat: (lambda pat=pat: LM(hybrid.model_config(sweep, pat, task.vocab_size)))
              for pat in a.hybrid}
elif a.pairs_dim:
    sweep, K = pairs.FULL, a.K or max(pairs.FULL.pairs)
    if a.pairs_dim > sweep.d_model:
        p.error(f"--pairs-dim: expected a head dim <= {sweep.d_model} (pairs.FULL's width), got {a.pairs_dim}")
    L, rsweep = pairs.seq_len(sweep, K), pairs.recall_sweep(sweep, a.pairs_dim)
    task = MQARTask(MQARConfig(vocab_size=sweep.vocab_size, seq_len=L, num_pairs=K))
    batch = a.batch or pairs.rung_batch(sweep, L)
    models = {f"{arch} d{a.pairs_dim} L{L}": (lambda arch=arch: LM(recall.model_config(arch, sweep.d_model, rsweep, L)))
              for arch in a.arch}
else:
    a.K = a.K or 64
    task = MQARTask(MQARConfig(vocab_size=recall.FULL.vocab_size, seq_len=a.L, num_pairs=a.K))
    K, batch = a.K, a.batch or 256
    models = {arch: (lambda arch=arch: LM(recall.model_config(arch, a.d, recall.FULL, a.L))) for arch in a.arch}
t0 = time.perf_counter()
for i in range(10):
    task.get_batch("train", i, batch)
print(f"get_batch (CPU, {torch.get_num_threads()} threads, batch {batch}): {(time.perf_counter() - t0) / 10 * 1e3:.1f} ms")


def sync() -> None:
    if cuda:
        torch.cuda.synchronize()


for name, make in models.items():
    variants = [dict(graphs=False, prefetch=0)] + ([dict(graphs=True, prefetch=2)] if cuda else [])
    variants += [dict(graphs=True, prefetch=2, compile=True)] if a.compile and cuda else []
    for variant in [] if a.no_timing else variants:
        torch.manual_seed(0)
        model = make()
        tc = TrainConfig(steps=a.steps, batch_size=batch, lr=2.2e-3, eval_every=a.steps, eval_batches=1, device=a.device,
                         progress=False, log_every=a.steps, **variant)
        train(make(), task, TrainConfig(**{**tc.__dict__, "steps": 5, "eval_every": 5}))  # warm-up (compile, graphs)
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        train(model, task, tc)
        sync()
        peak = f", peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB allocated" if cuda else ""
        print(f"{name} {variant}: {(time.perf_counter() - t0) / a.steps * 1e3:.1f} ms/step (one process, incl. 1 eval)"
              f"{peak}")

    torch.manual_seed(0)
    model = make().to(a.device)
    if a.compile:
        compile_blocks(model)
    x, y = (t.to(a.device) for t in task.get_batch("train", 0, batch))

    def step():
        with torch.autocast(a.device, dtype=torch.bfloat16, enabled=cuda):
            pos = label_positions(y, K)
            logits = model(x, positions=pos)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.gather(1, pos).flatten())
        loss.backward()

    for _ in range(3):
        step()
    sync()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(3):
            step()
        sync()
    where = "CUDA kernels" if cuda else "CPU ops"
    print(f"\n{name}{' (compiled blocks)' if a.compile else ''}: top {where} over 3 fwd+bwd steps")
    for key in (["self_cuda_time_total", "self_device_time_total"] if cuda else []) + ["self_cpu_time_total"]:
        try:  # newer torch names the CUDA column "device"
            print(prof.key_averages().table(sort_by=key, row_limit=a.rows, max_name_column_width=90))
            break
        except (AttributeError, KeyError, ValueError):
            continue
