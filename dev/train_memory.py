"""Issue 74: where a KDA LM's training memory goes. Every tensor one block (and the LM's final norm + chunked loss)
saves for the backward, by module and op, with the bytes per block scaled to the training shape; then parameters,
gradients and AdamW's state.

    python3 dev/train_memory.py [--model kda_226m] [--batch 4] [--seq-len 4096] [--run-len 64] [--device auto]
                                [--compiled [--lean]] [--json FILE]

Runs the LM cut to one block (the same config, n_layers=1) under bf16 autocast, one forward with gradients, inside
`evict.bench.saved.saved_tensors` (a saved_tensors_hooks pack hook). On CUDA it runs at --batch x --seq-len itself (the
real kernels: the memory op's Triton custom op, the Triton conv); on the CPU at batch 1 x --run-len, scaled to the
shape, the conv in its PyTorch form and the memory op keeping what its Triton form keeps on CUDA (its inputs and its
per-chunk factors: `evict.bench.saved.triton_op_saves`), its output from the chunked form.
Rows whose size does not grow with the tokens (autocast's bf16 copies of weights) are listed apart, unscaled.

--compiled: the block compiled as `LM.compile_blocks(lean=...)` compiles it (--lean: the lean partition), and the table
lists what the partitioned forward graph keeps (`evict.bench.saved.compiled_saves`: module paths relative to the
block, ops are aten's). On CUDA the step runs (the real kernels, Inductor); on the CPU the graph is traced with the
memory op and the conv as the custom ops CUDA runs (`triton_path`) and nothing runs, at --run-len 320 by default
(whole chunks of 64; 320 shares no factor with the state's size, so the state is listed as fixed). The embedding and
loss run eager in either mode (the eager table lists them).
"""

import argparse
import contextlib
import dataclasses
import json
import sys
from collections import defaultdict

import torch

from evict.bench.model import model_config
from evict.bench.saved import compiled_saves, saved_bytes, saved_tensors, triton_op_saves, triton_path
from evict.models import LM

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--model", default="kda_226m")
p.add_argument("--batch", type=int, default=4)
p.add_argument("--seq-len", type=int, default=4096)
p.add_argument("--run-len", type=int, default=None, help="tokens run on the CPU (then scaled): 64, compiled 320")
p.add_argument("--compiled", action="store_true", help="what the compiled block keeps (Inductor's partition)")
p.add_argument("--lean", action="store_true", help="with --compiled: compile_blocks(lean=True)")
p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
p.add_argument("--json", default=None)
a = p.parse_args()
if a.run_len is None:
    a.run_len = 320 if a.compiled else 64


def fail(message: str):
    """Bad input: one line on stderr, exit 2."""
    print(f"train_memory: {message}", file=sys.stderr)
    sys.exit(2)


if a.lean and not a.compiled:
    fail("--lean: a form of --compiled; give both")
if min(a.batch, a.seq_len, a.run_len) < 1:
    fail(f"--batch, --seq-len, --run-len: expected positive ints, got {a.batch}, {a.seq_len}, {a.run_len}")
dev = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
if dev == "cuda" and not torch.cuda.is_available():
    fail("--device cuda: CUDA is not available on this machine")
try:
    full = model_config(a.model)
except ValueError as e:
    fail(f"--model: {e}")
cfg = dataclasses.replace(full, n_layers=1, pattern=full.layer_mixers()[0])
torch.manual_seed(0)
model = LM(cfg).to(dev)
B, T = (a.batch, a.seq_len) if dev == "cuda" else (1, a.run_len)
scale = a.batch * a.seq_len / (B * T)
x = torch.randint(0, cfg.vocab_size, (B, T), device=dev)


def step():
    with torch.autocast(dev, dtype=torch.bfloat16):
        return model(x, targets=x).loss


if a.compiled:
    model.compile_blocks(lean=a.lean)
    with triton_path() if dev == "cpu" else contextlib.nullcontext():
        graphs = compiled_saves(step, model, B * T, run=dev != "cpu")
    rows = [dataclasses.replace(r, module=f"blocks.0.{r.module}".rstrip(".")) for r in graphs[0].saved]
else:
    with triton_op_saves() if dev == "cpu" else contextlib.nullcontext():
        rows = saved_tensors(step, model, B * T)
MiB = 2**20
groups: dict = defaultdict(lambda: [0, 0, ""])
for r in rows:
    if r.param or not r.nbytes:
        continue
    key = (r.module or "(loss)", r.op, str(list(r.shape)).replace(" ", ""), str(r.dtype).removeprefix("torch."), r.fixed)
    g = groups[key]
    g[0] += 1
    g[1] += r.nbytes
form = f"compiled{' lean' if a.lean else ''}" if a.compiled else "eager"
how = "traced" if a.compiled and dev == "cpu" else "run"
print(f"{a.model} cut to one block, {form}, device {dev}, {how} at B{B} T{T}, scaled to B{a.batch} T{a.seq_len} "
      f"(x{scale:g}); torch {torch.__version__}")
print(f"{'module':26s} {'op':24s} {'shape (as run)':22s} {'dtype':9s} {'B/token':>8s} {'MiB (scaled)':>12s}")
table = []
for (mod, op, shape, dtype, fixed), (n, nb, _) in sorted(groups.items(), key=lambda kv: kv[0][0]):
    per = 0 if fixed else nb / (B * T)
    mib = nb / MiB if fixed else nb * scale / MiB
    table.append(dict(module=mod, op=op, shape=shape, dtype=dtype, count=n, fixed=fixed, bytes_per_token=per, MiB=mib))
    print(f"{mod:26s} {op[:24]:24s} {shape:22s} {dtype:9s} {'fixed' if fixed else f'{per:.0f}':>8s} {mib:12.1f}"
          + (f"  x{n}" if n > 1 else ""))
block = saved_bytes(rows, "blocks.0") / (B * T)
block_fixed = saved_bytes(rows, "blocks.0", fixed=True)
rest = (saved_bytes(rows) - saved_bytes(rows, "blocks.0")) / (B * T)
per_block = sum(p.numel() for p in model.blocks[0].parameters())
n_params = sum(p.numel() for p in model.parameters()) + (full.n_layers - 1) * per_block  # the full model's
tokens = a.batch * a.seq_len
summary = {
    "block B/token": round(block), "block MiB": round(block * tokens / MiB, 1), "block fixed MiB": round(block_fixed / MiB, 1),
    f"{full.n_layers} blocks GiB": round(full.n_layers * (block * tokens + block_fixed) / 2**30, 2),
    **({} if a.compiled else {"embedding + final norm + loss MiB": round(rest * tokens / MiB, 1)}),
    "parameters (float32) GiB": round(4 * n_params / 2**30, 2),
    "+ grads + AdamW (m, v) GiB": round(3 * 4 * n_params / 2**30, 2),
}
if dev == "cpu" and not a.compiled:
    summary["note"] = ("CPU: the op's saves are its Triton form's (inputs + factors, at the run's chunk padding); "
                       "rms_norm keeps its output too (CUDA's fused norm keeps 1/rms instead)")
print(json.dumps(summary, indent=1))
if a.json:
    with open(a.json, "w") as f:
        json.dump(dict(model=a.model, form=form, device=dev, batch=a.batch, seq_len=a.seq_len, run=[B, T], rows=table,
                       summary=summary), f, indent=1)
