"""Decode-only steps of a slot pool replayed from CUDA graphs captured at bucketed batch sizes.

A step of n decode rows runs the graph of the smallest bucket b >= n: the rows' tokens, slots and positions are
copied into the graph's static inputs, the b - n padding rows point at a scratch slot whose block table names a
scratch block (their writes land there and are never read), and the forward (block-table lookups, the layers, the
head) replays without Python dispatch. The forward inside is the model's own slot-pool forward (the paged decode ops
read keys in place), so a replay computes exactly what the eager step computes. Graphs are captured on first use of
their bucket (or all at once: `capture_all`), after two warm-up runs on a side stream (Triton compiles), and share one memory pool.
The inputs are staged in pinned memory (`evict.host_copy`), so a step's launch does not wait for the one running;
with `feed` (the engine's async steps) a token -1 is read inside the graph from feed[slot] (the slot's last sampled
token, still on the device).
"""

from __future__ import annotations

import torch

from evict.host_copy import host_ints, to_device


def fed(tokens: torch.Tensor, feed: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """A step's input tokens [N] (device): an entry -1 (in flight) is its slot's last sampled token, feed[slots[i]]."""
    return torch.where(tokens >= 0, tokens, feed[slots])


def buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 to 32, 16 to 128, 32 beyond; max_batch last."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b = b * 2 if b < 8 else b + (8 if b < 32 else 16 if b < 128 else 32)
    return out + [max_batch]


class DecodeGraphs:
    def __init__(self, model, pool, *, max_batch: int, scratch_slot: int, scratch_block: int,
                 feed: torch.Tensor | None = None):
        self.model, self.pool, self.scratch, self.feed = model, pool, scratch_slot, feed
        self.buckets = buckets(max_batch)
        self.device = pool.table.device
        pool.set_blocks(scratch_slot, [scratch_block] * pool.table.shape[1])
        self.graphs: dict[int, tuple] = {}  # bucket -> (graph, tokens [b, 1], rows [b], starts [b], logits [b, V])
        self.mempool = torch.cuda.graph_pool_handle()

    def __call__(self, tokens: list[int], rows: list[int], starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [n, V], the rows' slots [n] on the device) of one decode step of n rows (valid until the next call)."""
        n = len(rows)
        b = next(x for x in self.buckets if x >= n)
        if b not in self.graphs:
            self.graphs[b] = self._capture(b)
        graph, tok, rws, st, out = self.graphs[b]
        pad = b - n
        host = host_ints(tokens + [0] * pad + rows + [self.scratch] * pad + starts + [0] * pad)
        dev = to_device(host, self.device).view(3, b)  # pinned on CUDA: the launch does not wait for the step running
        tok.copy_(dev[0, :, None])
        rws.copy_(dev[1])
        st.copy_(dev[2])
        graph.replay()
        return out[:n], rws[:n]

    def capture_all(self) -> None:
        """Capture every bucket now (`Engine.warm_up`), not on first use inside a step."""
        for b in self.buckets:
            if b not in self.graphs:
                self.graphs[b] = self._capture(b)

    def _capture(self, b: int) -> tuple:
        tok = torch.zeros(b, 1, dtype=torch.int64, device=self.device)
        rows = torch.full((b,), self.scratch, dtype=torch.int64, device=self.device)
        starts = torch.zeros(b, dtype=torch.int64, device=self.device)

        def forward() -> torch.Tensor:
            self.pool.select_static(rows, starts)
            x = tok if self.feed is None else fed(tok[:, 0], self.feed, rows)[:, None]  # [b, 1]
            return self.model(x, cache=self.pool)[:, -1]  # [b, V]

        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up off the capture stream: every row is the scratch slot
            for _ in range(2):
                forward()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool, capture_error_mode="thread_local"):
            out = forward()
        return graph, tok, rows, starts, out
