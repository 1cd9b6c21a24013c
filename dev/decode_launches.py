"""Kernel launches of one memory layer's decode step, counted on the CPU (issue 73: the wide step's small launches).

A TorchDispatchMode counts the aten ops (views excluded: they launch nothing) of one decode step of B rows of a slot
pool, in an LM of one memory layer of the bench hybrid's width (d 1024, 8 heads of 128, bf16): the embedding, the
layer, its FFN, norms and head, and the cache's gathers and scatters of the rows' states (`slot_states`,
`write_back`). The two ops whose CPU form differs from their CUDA one are counted as what they launch on CUDA: the
memory step as one Triton launch plus the copies its wrapper makes of inputs it cannot read in place, and the short
conv as its Triton path's launches (tree before conv_step: [tail; x] cat, the weight's float32 cast, the kernel, the
slice's copy; with conv_step: one). Run it on two trees to compare (PYTHONPATH=<tree>):
    python dev/decode_launches.py [--rows 128] [--kind kda] [--dtype bfloat16]
Prints one JSON line: launches, and the ops by name.
"""

import argparse
import collections
import json

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import evict.layers.conv as conv_layer
import evict.layers.memory_mixer as mm
from evict.models import LM
from evict.models.config import ModelConfig

VIEWS = {"view", "_unsafe_view", "unbind", "select", "slice", "as_strided", "expand", "t", "transpose", "reshape",
         "unsqueeze", "squeeze", "alias", "detach", "permute", "split", "chunk", "lift_fresh"}


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        if name not in VIEWS:
            self.ops[name] += 1
        return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--kind", default="kda", help="the memory layer (K kda, D deltanet, G gated_deltanet)")
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    torch.manual_seed(0)
    letter = {"kda": "K", "deltanet": "D", "gated_deltanet": "G"}[a.kind]
    cfg = ModelConfig(d_model=1024, n_layers=1, pattern=letter, n_heads=8, head_dim=128, d_ff=2816)
    model = LM(cfg).to(dtype).eval()
    pool = model.new_pool(a.rows + 1, 1, 16, 16)
    mode = Count()
    real_step, real_conv = mm.memory_step, conv_layer.short_conv

    def step(q, k, v, S, **kw):  # on CUDA: one launch, plus a copy of each input step_triton cannot read in place
        with _disable_current_modes():
            for name, t in (("q", q), ("k", k), ("v", v)):
                heads = t.stride(2) == 1 and t.stride(1) == t.shape[2]
                inplace = heads and k.stride(0) == q.stride(0) if "pre" in kw else t.is_contiguous()
                mode.ops[f"step_triton copy {name}"] += not inplace
            mode.ops["_step_kernel (Triton)"] += 1
            return real_step(q, k, v, S, **kw)

    def conv(x, w, tail=None):  # on CUDA with a tail: cat, w.float(), the kernel, the slice's .contiguous()
        with _disable_current_modes():
            mode.ops["short_conv: cat, w.float(), kernel, copy"] += 4 if tail is not None else 2
            return real_conv(x, w, tail)

    mm.memory_step, conv_layer.short_conv = step, conv
    if hasattr(conv_layer, "conv_step"):  # this tree's conv step: one launch on CUDA
        real_cstep = conv_layer.conv_step

        def cstep(x, w, tails, rows=None):
            with _disable_current_modes():
                mode.ops["_conv_step_kernel (Triton)"] += 1
                return real_cstep(x, w, tails, rows)

        conv_layer.conv_step = cstep
    x = torch.randint(0, cfg.vocab_size, (a.rows, 1))
    with torch.no_grad():
        pool.select(list(range(a.rows)), [0] * a.rows, 1)
        with mode:
            model(x, cache=pool)
    print(json.dumps({"kind": a.kind, "rows": a.rows, "dtype": a.dtype, "launches": sum(mode.ops.values()),
                      "ops": dict(mode.ops.most_common())}))


if __name__ == "__main__":
    main()
