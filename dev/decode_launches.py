"""Kernel launches of one memory layer's decode step, counted on the CPU (issue 73: the wide step's small launches).

A TorchDispatchMode counts the aten ops one decode step issues (views excluded: they launch nothing), with the memory
step itself counted as what it is on CUDA: one Triton launch plus the copies its wrapper makes of inputs it cannot read
in place (`step_triton`'s .contiguous()). The layer is the bench hybrid's KDA layer (d 1024, 8 heads of 128, bf16)
at B rows of a slot pool. Run it on two trees to compare (PYTHONPATH=<tree>):
    python dev/decode_launches.py [--rows 128] [--kind kda] [--dtype bfloat16]
Prints one JSON line: launches, and the ops by name.
"""

import argparse
import collections
import json

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import evict.layers.memory_mixer as mm
from evict.cache import RecurrentState
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
    ap.add_argument("--kind", default="kda")
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=1024, n_heads=8, head_dim=128, neg_eigval=False)
    layer = mm.MemoryMixer(cfg, a.kind).to(dtype).eval()
    pool = layer.new_state(a.rows + 1, 1, dtype=dtype)
    rows = torch.arange(a.rows)
    state = RecurrentState(S=pool.S, conv=pool.conv[rows] if pool.conv is not None else None)
    state.rows = rows
    x = torch.randn(a.rows, 1, 1024, dtype=dtype)
    mode = Count()
    real = mm.memory_step

    def step(q, k, v, S, **kw):  # on CUDA: one launch, plus a copy of each input step_triton cannot read in place
        with _disable_current_modes():
            for name, t in (("q", q), ("k", k), ("v", v)):
                heads = t.stride(2) == 1 and t.stride(1) == t.shape[2]
                inplace = heads and k.stride(0) == q.stride(0) if "pre" in kw else t.is_contiguous()
                mode.ops[f"step_triton copy {name}"] += not inplace
            mode.ops["_step_kernel (Triton)"] += 1
            return real(q, k, v, S, **kw)

    mm.memory_step = step
    with torch.no_grad(), mode:
        layer(x, state)
    print(json.dumps({"kind": a.kind, "rows": a.rows, "dtype": a.dtype, "launches": sum(mode.ops.values()),
                      "ops": dict(mode.ops.most_common())}))


if __name__ == "__main__":
    main()
