"""What a forward keeps for its backward: every tensor saved for autograd, by module and op, counted once per storage.

    rows = saved_tensors(fn, model)      # fn() runs the forward and returns the loss (or any output)
    saved_bytes(rows)                    # activation bytes: each storage once, parameters left out

A `torch.autograd.graph.saved_tensors_hooks` pack hook sees every tensor as it is saved and the module whose forward
is running then (a stack kept by global forward pre/post hooks: the innermost module) and the op (the innermost torch
function running, kept by a TorchFunctionMode: `linear`, `rms_norm`, `mul`; "Function" for an autograd.Function's or
a custom op's saves, which come after its forward). Inside a recomputed region (torch.utils.checkpoint) the region's
own saves go to its hooks, not these: what is listed is what is held. A storage saved by several ops
(a Linear's input that a norm also keeps) is one allocation and is counted once, under its first saver. Tensors that
share storage with a parameter (the weights a Linear saves) are marked `param` and left out of the activation bytes;
bf16 copies of weights made by autocast are activations of the step (their numel does not grow with tokens).
"""

from __future__ import annotations

import contextlib
import importlib
import operator
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode


@dataclass
class Saved:
    module: str  # the innermost module running when it was saved ("" outside every module)
    op: str  # the torch function that saved it ("Function": an autograd.Function or a custom op)
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int  # bytes of its storage (0 for a repeat of a storage counted before, or a parameter's)
    param: bool  # shares storage with a parameter
    fixed: bool  # shaped like a parameter (an autocast copy of a weight) or smaller than one row per token: does not
    # grow with the tokens


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.device, t.untyped_storage().data_ptr())


class _OpNames(TorchFunctionMode):
    """The innermost torch function running (F.linear, torch.sigmoid, Tensor.mul, ...): the op that saves."""

    def __init__(self):
        super().__init__()
        self.stack: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.stack.append(getattr(func, "__name__", str(func)))
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.stack.pop()


def saved_tensors(fn: Callable[[], object], model: nn.Module, tokens: int) -> list[Saved]:
    """Run fn() (a forward with gradients) and list every tensor it saves for the backward (see the module doc); the
    outputs are dropped (with them the graph and what it held)."""
    names = {m: n for n, m in model.named_modules()}
    stack: list[str] = []
    packed: list[tuple[str, str, torch.Tensor]] = []

    def pre(mod, _args):
        stack.append(names.get(mod, stack[-1] if stack else ""))

    def post(_mod, _args, _out):
        stack.pop()

    ops = _OpNames()

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append((stack[-1] if stack else "", ops.stack[-1] if ops.stack else "Function", t))
        return t

    h1 = nn.modules.module.register_module_forward_pre_hook(pre)
    h2 = nn.modules.module.register_module_forward_hook(post, always_call=True)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ops:
            fn()
    finally:
        h1.remove()
        h2.remove()
    params = {_storage_key(p) for p in model.parameters()}
    shapes = {tuple(p.shape) for p in model.parameters()} | {tuple(p.shape)[::-1] for p in model.parameters()}
    rows, counted = [], set()
    for module, op, t in packed:
        key = _storage_key(t)
        param = key in params
        first = key not in counted and not param and t.numel() > 0
        counted.add(key)
        rows.append(Saved(module, op, tuple(t.shape), t.dtype,
                          t.untyped_storage().nbytes() if first else 0, param,
                          tuple(t.shape) in shapes or t.numel() < tokens))
    return rows


def saved_bytes(rows: list[Saved], prefix: str = "", *, fixed: bool = False) -> int:
    """Activation bytes of the rows whose module starts with `prefix` (each storage once, parameters out): those that
    grow with the tokens, or (fixed=True) those that do not."""
    return sum(r.nbytes for r in rows if r.module.startswith(prefix) and r.fixed == fixed)


class _Keeps(torch.autograd.Function):
    """Keeps `kept` for a backward that never runs here: the memory op's saves, for an account of them."""

    @staticmethod
    def forward(ctx, o, *kept):
        ctx.save_for_backward(*kept)
        return o.view_as(o)


@contextlib.contextmanager
def triton_op_saves(factors: bool = True) -> Iterator[None]:
    """Inside: the memory op (any form) keeps for its backward what its Triton form keeps on CUDA: its inputs q, k, v,
    log alpha, beta and (`factors`, the default keep_factors=True) its per-chunk factors (empty tensors of the sizes
    `triton.autograd._kept_layout` gives, at `auto_chunk`'s chunk); its output is the form's own, computed without a
    graph. For an account on a machine without CUDA (dev/train_memory.py, tests); nothing here can train."""
    mem: Any = importlib.import_module("evict.ops.memory")  # the module (evict.ops.memory the name is the function)
    real = mem._dispatch

    def dispatch(q, k, v, la, beta, delta, *rest):
        with torch.no_grad():
            o, S = real(q, k, v, la, beta, delta, *rest)
        kept = [t for t in (q, k, v, la, beta) if t is not None]
        if factors:
            from evict.ops.memory.triton.autograd import _kept_layout, auto_chunk

            B, _, H, K = q.shape
            kept += [q.new_empty(n, dtype=dt) for n, dt in _kept_layout(q, v, la, delta, auto_chunk(B, H, K), 1) if n]
        return _Keeps.apply(o, *kept), S

    mem._dispatch = dispatch
    try:
        yield
    finally:
        mem._dispatch = real


class _Captured(Exception):
    """Raised after the first partition when `compiled_saves(run=False)`: nothing of the compiled graph runs."""


@dataclass
class Partition:
    """One compiled graph's split into forward and backward: what the forward keeps, what the backward runs."""
    saved: list[Saved]
    backward_ops: Counter  # op name -> how many nodes of it the backward graph has (recomputed ones among them)


def _op_name(node: Any) -> str:
    """aten.mm.default -> mm, evict.short_conv_forward.default -> evict.short_conv_forward, getitem k of an op's
    tuple -> op[k]; a graph input -> placeholder."""
    if node.op != "call_function":
        return node.op
    if node.target is operator.getitem:
        return f"{_op_name(node.args[0])}[{node.args[1]}]"
    name = str(node.target).removeprefix("aten.")
    return name.rsplit(".", 1)[0] if name.count(".") else name


def _partition(fw: Any, bw: Any, n_out: int, shapes: set, tokens: int) -> Partition:
    """The saved values of a partitioned forward graph (its outputs after the first n_out, the user's outputs), and
    the backward graph's op counts."""
    from torch.multiprocessing.reductions import StorageWeakRef

    (outs,) = [n.args[0] for n in fw.graph.nodes if n.op == "output"]
    rows, counted = [], set()
    for node in outs[n_out:]:
        t = node.meta.get("val") if node is not None else None
        if not isinstance(t, torch.Tensor):
            continue  # a saved size (SymInt)
        stack = node.meta.get("nn_module_stack") or {}
        path = list(stack.values())[-1][0] if stack else ""
        module = path.replace("L['self']", "").lstrip(".")  # relative to the compiled module
        shape = tuple(int(s) for s in t.shape)
        param = node.op == "placeholder" and shape in shapes and t.dtype == torch.float32
        key = StorageWeakRef(t.untyped_storage())
        first = key not in counted and not param and t.numel() > 0
        counted.add(key)
        rows.append(Saved(module, _op_name(node), shape, t.dtype, t.untyped_storage().nbytes() if first else 0, param,
                          shape in shapes or t.numel() < tokens or t.numel() % tokens != 0))
    ops = Counter(_op_name(n) for n in bw.graph.nodes if n.op == "call_function")
    return Partition(rows, ops)


def compiled_saves(fn: Callable[[], object], model: nn.Module, tokens: int, *, run: bool = True) -> list[Partition]:
    """What each graph Inductor compiles while fn() runs keeps for its backward: the forward graph's saved values as
    its partitioner (min-cut) chose them, one Partition per graph in compile order, each value's storage counted once
    (views of one buffer are one). module: the value's module path relative to the compiled module (a block's:
    "mixer.wqkv"); op: the aten op that made it ("placeholder": a graph input kept, the block's input or a parameter,
    marked `param`). `fixed` rows do not grow with the tokens (a weight's bf16 copy, a final state): their numel is
    not a multiple of `tokens` (run at a length that shares no factor with the state sizes, and whole chunks: 320).
    Dynamo's caches are reset first, so every graph compiles here. run=False: stop after the first graph's partition
    (nothing compiled runs: a CPU trace of the CUDA path, whose Triton custom ops cannot run here, `triton_path`)."""
    import torch._dynamo
    import torch._inductor.compile_fx as compile_fx

    real = compile_fx.min_cut_rematerialization_partition
    shapes = {tuple(p.shape) for p in model.parameters()} | {tuple(p.shape)[::-1] for p in model.parameters()}
    graphs: list[Partition] = []

    def partition(joint, inputs, **kw):
        fw, bw = real(joint, inputs, **kw)
        graphs.append(_partition(fw, bw, kw["num_fwd_outputs"], shapes, tokens))
        if not run:
            raise _Captured
        return fw, bw

    torch._dynamo.reset()
    compile_fx.min_cut_rematerialization_partition = partition
    try:
        fn()
    except Exception as e:  # dynamo wraps a backend's exception (BackendCompilerFailed, its inner_exception)
        if run or not graphs or not any(isinstance(c, _Captured) for c in (e, getattr(e, "inner_exception", None))):
            raise
    finally:
        compile_fx.min_cut_rematerialization_partition = real
        if not run:
            torch._dynamo.reset()
    return graphs


@contextlib.contextmanager
def triton_path() -> Iterator[None]:
    """Inside: the memory op and the short conv take their Triton forms (the torch.library custom ops) whatever the
    device, as on CUDA: for tracing a CUDA block's graph on a CPU (`compiled_saves(run=False)`); nothing can run."""
    conv: Any = importlib.import_module("evict.ops.conv")
    mem: Any = importlib.import_module("evict.ops.memory")
    runs, real, dispatch = conv.kernel_runs_on, mem.triton_runs_on, mem._dispatch
    conv.kernel_runs_on = mem.triton_runs_on = lambda t: True
    mem._dispatch = lambda *a: dispatch(*a[:9], "triton", *a[10:])  # impl (the 10th argument): the custom op
    try:
        yield
    finally:
        conv.kernel_runs_on, mem.triton_runs_on, mem._dispatch = runs, real, dispatch
