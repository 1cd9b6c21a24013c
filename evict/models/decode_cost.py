"""One decode step's cost, measured: a cache filled to a context, the bytes it holds, and the median time of a one-token
step (eager, or replayed from a CUDA graph; the fast or the previous decode path; compiled or not).

`evict bench decode` (evict/bench/decode.py) times every model kind with these; the labs time their own models
with them too (`evict lab context`). Decode cost does not depend on what the memory holds, only on its shape, so
no prompt is prefilled: one token is run through a fresh cache (this creates the recurrent states and conv tails),
every cache tensor is then filled with random numbers, and `cache.pos` is set to the context length. Each timed
step resets `cache.pos` to the context, runs the one-token forward and samples greedily, so every step attends
over exactly `context` past tokens. On CUDA each step is bracketed by torch.cuda.synchronize().
"""

from __future__ import annotations

import statistics
import time
from dataclasses import fields

import torch

from evict.cli_args import first_line
from evict.layers.attention import Attention
from evict.layers.mla import MLA
from evict.layers.moe import MoE
from evict.models.lm import LM


def cache_bytes(cache, context: int) -> int:
    """Bytes per sequence the cache holds at `context` tokens (KV / latent buffers counted up to context)."""
    total = 0
    for st in cache.states:
        for f in fields(st):
            t = getattr(st, f.name)
            if not isinstance(t, torch.Tensor):
                continue
            n = t.numel() * t.element_size() // cache.batch_size
            if f.name in ("k", "v", "c", "k_rope"):  # [B, L_max, ...] buffers indexed by position
                n = n * context // cache.max_len
            total += n
    return total


def filled_cache(model: LM, batch: int, context: int, extra: int):
    """A cache at position `context` whose every tensor holds random numbers (see the module docstring)."""
    device = next(model.parameters()).device
    cache = model.new_cache(batch, context + extra)
    model(torch.zeros(batch, 1, dtype=torch.int64, device=device), cache=cache)  # creates recurrent states
    for st in cache.states:
        for f in fields(st):
            t = getattr(st, f.name)
            if isinstance(t, torch.Tensor):
                t.normal_(0.0, 1.0 if f.name in ("k", "v", "c", "k_rope") else 0.02)
    cache.pos = context
    return cache


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


VARIANTS = ("graph", "before", "compiled", "eager")


def set_fast_path(model: LM, on: bool) -> None:
    """Switch the decode kernels of attention / MLA layers and the MoE dispatch between the fast and the previous path."""
    for m in model.modules():
        if isinstance(m, (Attention, MLA)):
            m.decode_kernel = on
        if isinstance(m, MoE):
            m.dispatch = "auto" if on else "sort"


def compiled(model: LM):
    """The model's forward compiled by torch.compile (static shapes: one graph per batch size and position, as the
    bench replays a fixed step); graph breaks fall back to eager pieces."""
    return torch.compile(model, dynamic=False)


@torch.inference_mode()
def time_decode(model: LM, batch: int, context: int, *, steps: int, warmup: int, fn=None) -> float:
    """Median seconds of one decode step (one token for each of `batch` sequences) at `context`."""
    device = next(model.parameters()).device
    cache = filled_cache(model, batch, context, extra=1)
    tok = torch.zeros(batch, 1, dtype=torch.int64, device=device)  # [B, 1]
    times = []
    for i in range(warmup + steps):
        cache.pos = context
        sync(device)
        t0 = time.perf_counter()
        tok = (model if fn is None else fn)(tok, cache=cache)[:, -1].argmax(-1, keepdim=True)  # [B, 1]
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def time_decode_graphed(model: LM, batch: int, context: int, *, steps: int, warmup: int, fn=None) -> float:
    """Median seconds of one decode step replayed from a CUDA graph captured at `context` (CUDA only).

    The graph holds one whole decode step at a fixed position: each replay writes the same cache slot and reads
    the same `context` past tokens, i.e. exactly the work of a step at that context, without Python dispatch.
    Raises RuntimeError when the model cannot be captured (e.g. MoE dispatch sizes its expert batches on the host).
    """
    device = next(model.parameters()).device
    cache = filled_cache(model, batch, context, extra=1)
    tok = torch.zeros(batch, 1, dtype=torch.int64, device=device)  # [B, 1]
    fn = model if fn is None else fn
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm up (Triton compiles) off the capture stream
        for _ in range(3):
            cache.pos = context
            fn(tok, cache=cache)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    cache.pos = context
    with torch.cuda.graph(graph):
        nxt = fn(tok, cache=cache)[:, -1].argmax(-1, keepdim=True)  # [B, 1]
    times = []
    for i in range(warmup + steps):
        sync(device)
        t0 = time.perf_counter()
        graph.replay()
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    del nxt, graph
    return statistics.median(times)


def time_variant(model: LM, variant: str, batch: int, ctx: int, steps: int, warmup: int) -> tuple[float, str]:
    """(seconds per step, how it was timed) for one variant; a graph that cannot be captured falls back to eager."""
    set_fast_path(model, variant != "before")
    fn = compiled(model) if variant == "compiled" else model
    try:
        if variant == "eager":
            return time_decode(model, batch, ctx, steps=steps, warmup=warmup), "eager"
        try:
            return time_decode_graphed(model, batch, ctx, steps=steps, warmup=warmup, fn=fn), "graph"
        except Exception as e:  # keep an eager time, say why (capture refused, or compile failed)
            why = first_line(e, 60)
            return time_decode(model, batch, ctx, steps=steps, warmup=warmup), f"eager (no graph: {why})"
    finally:
        set_fast_path(model, True)
