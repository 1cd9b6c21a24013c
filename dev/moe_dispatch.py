"""One MoE layer's routed experts, forward + backward, for each training dispatch of evict.ops.moe.experts (issue 16).

    python3 dev/moe_dispatch.py [--device cuda --dtype bfloat16] [--N 4096 --D 256 --E 16 --k 2 --H 128]
    python3 dev/moe_dispatch.py --model kimi_linear [--n-layers 18 --batch 2 --seq-len 256] [--device cuda ...]

Per dispatch: the median wall time of one forward + backward (x, weights, w1, w3, w2 all require grad), the number of
aten ops it dispatches (counted below autograd, so forward and backward ops both count: on CUDA each is about one
kernel launch), on CUDA the number of GPU kernels the profiler sees, and the largest error against the float64
`padded` form (itself tested equal to experts_reference). With --model: the same for one forward + backward of the
whole LM (that preset at size small, every MoE layer set to the dispatch; bf16 autocast when --dtype bfloat16), where
the error column is the loss's relative difference from the first dispatch's. Prints a table; --out writes JSON.
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from evict.layers.ffn import swiglu
from evict.layers.moe import MoE
from evict.models import LM, presets
from evict.ops import moe as ops
from evict.report import card, markdown_table, wall_time, write_json


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--N", type=int, default=4096)
    p.add_argument("--D", type=int, default=256)
    p.add_argument("--E", type=int, default=16)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--H", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dispatch", nargs="+", default=["sort", "padded", "grouped", "dense"])
    p.add_argument("--model", help="a preset: time and count one LM forward + backward instead of one expert op")
    p.add_argument("--n-layers", type=int, default=18)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--out")
    a = p.parse_args()
    dev, dt = torch.device(a.device), getattr(torch, a.dtype)
    rows = model_rows(a, dev, dt) if a.model else op_rows(a, dev, dt)
    info = {**card(), "device": str(dev), "dtype": a.dtype}
    info.update({"model": a.model, "n_layers": a.n_layers, "batch": a.batch, "seq_len": a.seq_len} if a.model
                else {"shape": dict(N=a.N, D=a.D, E=a.E, k=a.k, H=a.H)})
    print(info)
    print(markdown_table(rows, list(rows[0]) if rows else []))
    if a.out:
        write_json(a.out, {"card": info, "rows": rows})


def _measure(step, repeats: int, dev: torch.device) -> dict:
    """ms (median) and aten ops of step(); on CUDA also the GPU kernels the profiler sees."""
    step()
    with _CountOps() as counter:
        step()
    row = {"ms": round(wall_time(step, repeats=repeats) * 1e3, 2), "aten_ops": sum(counter.ops.values())}
    if dev.type == "cuda":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        row["gpu_kernels"] = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return row


def model_rows(a, dev: torch.device, dt: torch.dtype) -> list[dict]:
    torch.manual_seed(0)
    model = LM(presets.get(a.model, size="small", n_layers=a.n_layers)).to(dev).train()
    tokens = torch.randint(0, model.cfg.vocab_size, (a.batch, a.seq_len), device=dev)
    rows, first = [], None
    for name in a.dispatch:
        for m in model.modules():
            if isinstance(m, MoE):
                m.dispatch = name
        losses = []

        def step():
            model.zero_grad(set_to_none=True)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dt == torch.bfloat16):
                out = model(tokens)
            loss = (out[0] if isinstance(out, tuple) else out).float().square().mean()
            loss.backward()
            losses.append(loss.detach())

        try:
            row = {"dispatch": name, **_measure(step, a.repeats, dev)}
        except ValueError as e:  # grouped where torch._grouped_mm cannot run these experts
            print(f"{name}: skipped, {e}")
            continue
        first = losses[0] if first is None else first
        row["max_rel_err"] = f"{(losses[0] - first).abs().item() / first.abs().item():.1e}"
        rows.append(row)
    return rows


def op_rows(a, dev: torch.device, dt: torch.dtype) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(a.N, a.D, generator=g)
    w1, w3 = (torch.randn(a.E, a.H, a.D, generator=g) * a.D**-0.5 for _ in range(2))
    w2 = torch.randn(a.E, a.D, a.H, generator=g) * a.H**-0.5
    weights, index, _ = ops.route(torch.randn(a.N, a.E, generator=g), None, a.k)
    dy = torch.randn(a.N, a.D, generator=g)
    index = index.to(dev)

    def leaves(dtype):
        return [t.to(dev, dtype).requires_grad_(True) for t in (x, weights, w1, w3, w2)]

    want = leaves(torch.float64)
    y = ops.experts(want[0], want[1], index, *want[2:], swiglu, dispatch="padded")
    want_grads = torch.autograd.grad(y, want, dy.to(dev, torch.float64))
    rows = []
    for name in a.dispatch:
        ins = leaves(dt)
        why = ops.grouped_mm_support(ins[0], *ins[2:]) if name == "grouped" else None
        if why is not None:
            print(f"{name}: skipped, needs {why}")
            continue

        def step():
            out = ops.experts(ins[0], ins[1], index, *ins[2:], swiglu, dispatch=name)
            return out, torch.autograd.grad(out, ins, dy.to(dev, dt))

        out, grads = step()
        err = max((u.double() - v).abs().max().item() / v.abs().max().item()
                  for u, v in zip((out, *grads), (y, *want_grads)))
        rows.append({"dispatch": name, **_measure(step, a.repeats, dev), "max_rel_err": f"{err:.1e}"})
    return rows


if __name__ == "__main__":
    main()
