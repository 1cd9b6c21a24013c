"""The serving engine: a request queue and continuous batching over one slot pool of the hybrid cache.

Every step the scheduler (1) admits waiting requests while a slot is free and the KV / latent block pool holds their
tokens (FIFO); (2) runs one prefill chunk of the oldest request still reading its prompt; (3) runs one decode step of
every request that has read all its tokens, one new token each, each at its own position (a SlotBatch); (4) samples
with each request's own parameters and generator, streams the tokens, and frees the slots of finished requests.
When a forward needs a block and none is free, the most recently admitted running request is preempted: its slot and
blocks are freed and it waits at the head of the queue with the tokens it has (prompt + output), to be recomputed.

A sequence's tokens are processed exactly as `generate` processes them alone: prompt chunks at the same boundaries
(multiples of `prefill_chunk` from 0), then one token per forward; so greedy outputs equal `generate`'s.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch

from evict.models.generate import sample_next

FINISH = ("stop", "length", "cancelled")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling: temperature 0 = greedy; top_k / top_p filter; seed fixes the request's own generator."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop_tokens: tuple[int, ...] = ()


@dataclass(eq=False)
class Request:
    prompt: list[int]
    params: SamplingParams
    on_token: Callable[[Request, int], None] | None = None  # fn(request, token id), called from the engine thread
    # fn(request), called once, from the engine thread, after the last on_token
    on_finish: Callable[[Request], None] | None = None
    id: int = 0
    out: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    slot: int | None = None
    blocks: list[int] = field(default_factory=list)
    cached: int = 0  # tokens of prompt + out already in the slot
    preemptions: int = 0
    generator: torch.Generator | None = None
    t_submit: float = 0.0
    t_first: float | None = None

    @property
    def n_tokens(self) -> int:
        return len(self.prompt) + len(self.out)

    def pending(self, T: int) -> list[int]:
        """The next T tokens not yet in the slot."""
        s, P = self.cached, len(self.prompt)
        return (self.prompt[s : s + T] if s < P else []) + self.out[max(s - P, 0) : s + T - P]


def arena_bytes(pool) -> tuple[int, int]:
    """(bytes per token of the KV / latent block arenas, bytes per slot of recurrent states and conv tails)."""
    per_token = per_slot = 0
    for st in pool.states:
        for f in fields(st):
            t = getattr(st, f.name)
            if isinstance(t, torch.Tensor):
                n = t.numel() * t.element_size()
                if f.name in ("S", "conv"):
                    per_slot += n // pool.batch_size
                else:
                    per_token += n // (t.shape[0] * t.shape[1])
    return per_token, per_slot


class Engine:
    """Continuous batching for one LM. `submit` and `cancel` are thread-safe; `step` runs in one thread (`start`)."""

    def __init__(self, model, *, max_batch: int = 16, cache_budget: int = 256 << 20, block_size: int = 16,
                 max_len: int | None = None, prefill_chunk: int = 512):
        for name, value in (("max_batch", max_batch), ("cache_budget", cache_budget), ("block_size", block_size),
                            ("prefill_chunk", prefill_chunk)):
            if type(value) is not int or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        self.model = model.eval()
        self.vocab = model.cfg.vocab_size
        self.device = next(model.parameters()).device
        self.block_size, self.prefill_chunk, self.max_batch = block_size, prefill_chunk, max_batch
        per_token, per_slot = arena_bytes(model.new_pool(1, 1, block_size, block_size))
        self.uses_blocks = per_token > 0
        left = cache_budget - max_batch * per_slot
        n_blocks = left // (per_token * block_size) if self.uses_blocks else 1
        if left < 0 or n_blocks < 1:
            raise ValueError(f"cache_budget: {cache_budget} bytes hold no block of {block_size} tokens beside {max_batch} "
                             f"slots of {per_slot} bytes; need at least {max_batch * per_slot + per_token * block_size}")
        limit = n_blocks * block_size if self.uses_blocks else 1 << 20
        if model.cfg.pos == "learned":
            limit = min(limit, model.cfg.max_seq_len)
        self.max_len = limit if max_len is None else max_len
        if type(self.max_len) is not int or not 1 <= self.max_len <= limit:
            raise ValueError(f"max_len: expected an integer in [1, {limit}] (the pool and the model's positions), got {max_len!r}")
        self.n_blocks = n_blocks
        self.pool = model.new_pool(max_batch, n_blocks, block_size, self.max_len)
        self.block_bytes, self.slot_bytes = block_size * per_token, per_slot
        self.pool_bytes = n_blocks * self.block_bytes + max_batch * per_slot
        self.peak_blocks = 0
        self.free_slots = list(range(max_batch - 1, -1, -1))
        self.free_blocks = list(range(n_blocks - 1, -1, -1))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.ids = itertools.count(1)
        self.stats = {"requests": 0, "finished": 0, "preemptions": 0, "cancelled": 0, "generated_tokens": 0,
                      "prefill_tokens": 0, "steps": 0}
        self.recent: deque[tuple[float, int]] = deque()  # (time, tokens) of the last 10 s, for tokens/s
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # -- the door -----------------------------------------------------------------------------------------------
    def check(self, prompt, params: SamplingParams) -> None:
        """Raise ValueError (one line, naming the field) unless the request is valid and fits this engine."""
        if not isinstance(prompt, list) or not prompt or not all(type(t) is int and 0 <= t < self.vocab for t in prompt):
            raise ValueError(f"prompt: expected a non-empty list of token ids in [0, {self.vocab})")
        p = params
        if type(p.max_tokens) is not int or p.max_tokens < 1:
            raise ValueError(f"max_tokens: expected a positive integer, got {p.max_tokens!r}")
        from evict.models.generate import _check_stop_tokens, _is_int, _is_real

        if not _is_real(p.temperature) or p.temperature < 0:
            raise ValueError(f"temperature: expected a finite number >= 0, got {p.temperature!r}")
        if p.top_p is not None and (not _is_real(p.top_p) or not 0 < p.top_p <= 1):
            raise ValueError(f"top_p: expected a number in (0, 1], got {p.top_p!r}")
        if p.top_k is not None and (not _is_int(p.top_k) or p.top_k < 1):
            raise ValueError(f"top_k: expected a positive integer, got {p.top_k!r}")
        if p.seed is not None and (not _is_int(p.seed) or not 0 <= p.seed < 2**63):
            raise ValueError(f"seed: expected an integer in [0, 2**63), got {p.seed!r}")
        _check_stop_tokens(p.stop_tokens, self.vocab)
        if len(prompt) + p.max_tokens > self.max_len:
            raise ValueError(f"max_tokens: prompt ({len(prompt)} tokens) + max_tokens ({p.max_tokens}) exceed the "
                             f"server's {self.max_len} tokens per sequence")

    def submit(self, prompt: list[int], params: SamplingParams, on_token=None, on_finish=None) -> Request:
        self.check(prompt, params)
        req = Request(list(prompt), params, on_token, on_finish, id=next(self.ids), t_submit=time.perf_counter())
        if params.seed is not None:
            req.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        self.inbox.put(("add", req))
        return req

    def cancel(self, req: Request) -> None:
        """Stop a request (client gone, stop text seen): its slot is freed at the next step."""
        self.inbox.put(("cancel", req))

    # -- scheduling ---------------------------------------------------------------------------------------------
    def _drain(self, block: bool) -> None:
        try:
            item = self.inbox.get(timeout=0.05) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            verb, req = item
            if verb == "add":
                self.waiting.append(req)
                self.stats["requests"] += 1
            elif req.finish_reason is None:
                self._finish(req, "cancelled")
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _release(self, req: Request) -> None:
        if req.slot is not None:
            self.running.remove(req)
            self.free_slots.append(req.slot)
            self.free_blocks.extend(reversed(req.blocks))
            req.slot, req.blocks, req.cached = None, [], 0

    def _finish(self, req: Request, reason: str) -> None:
        self._release(req)
        if req in self.waiting:
            self.waiting.remove(req)
        req.finish_reason = reason
        self.stats["finished"] += 1
        self.stats["cancelled"] += reason == "cancelled"
        if req.on_finish is not None:
            req.on_finish(req)

    def _blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size) if self.uses_blocks else 0

    def _admit(self) -> None:
        while self.waiting and self.free_slots:
            req = self.waiting[0]
            if self._blocks_for(req.n_tokens) > len(self.free_blocks):
                return
            self.waiting.popleft()
            req.slot = self.free_slots.pop()
            self.pool.reset_slot(req.slot)
            self.running.append(req)
            self._grow(req, req.n_tokens)  # its prompt's blocks, taken now (they fit: checked above)

    def _grow(self, req: Request, n_tokens: int) -> bool:
        """Give req blocks for its first n_tokens positions, preempting younger requests; False if req itself was."""
        need = self._blocks_for(n_tokens) - len(req.blocks)
        while need > len(self.free_blocks):
            victim = self.running[-1]
            self._release(victim)
            victim.preemptions += 1
            self.stats["preemptions"] += 1
            self.waiting.appendleft(victim)
            if victim is req:
                return False
        if need > 0:
            req.blocks += [self.free_blocks.pop() for _ in range(need)]
            self.pool.set_blocks(req.slot, req.blocks)
            self.peak_blocks = max(self.peak_blocks, self.n_blocks - len(self.free_blocks))
        return True

    def _forward(self, reqs: list[Request], T: int) -> torch.Tensor:
        """Run T new tokens of each request (their tokens[cached : cached + T]); logits of the last [B, V]."""
        self.pool.select([r.slot for r in reqs], [r.cached for r in reqs], T)
        toks = torch.tensor([r.pending(T) for r in reqs], dtype=torch.int64, device=self.device)
        with torch.no_grad():
            logits = self.model(toks, cache=self.pool)[:, -1]  # [B, V]
        for r in reqs:
            r.cached += T
        return logits

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> None:
        nxt = logits.argmax(-1)  # [B]; rows that sample replace theirs
        for i, r in enumerate(reqs):
            p = r.params
            if p.temperature > 0:
                nxt[i] = sample_next(logits[i : i + 1], temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                                     generator=r.generator)[0]
        now = time.perf_counter()
        for r, t in zip(reqs, nxt.tolist()):  # one host sync per step: the tokens go out to the clients
            r.out.append(t)
            r.t_first = r.t_first or now
            self.stats["generated_tokens"] += 1
            if r.on_token is not None:
                r.on_token(r, t)
            if t in r.params.stop_tokens:
                self._finish(r, "stop")
            elif len(r.out) >= r.params.max_tokens:
                self._finish(r, "length")
        self.recent.append((now, len(reqs)))
        while self.recent[0][0] < now - 10:
            self.recent.popleft()

    def step(self) -> bool:
        """One scheduling iteration; False when there was nothing to do."""
        self._drain(block=False)
        self._admit()
        if not self.running:
            return False
        self.stats["steps"] += 1
        prefill = next((r for r in self.running if r.n_tokens - r.cached > 1), None)
        if prefill is not None:
            T = min(self.prefill_chunk - prefill.cached % self.prefill_chunk, prefill.n_tokens - prefill.cached)
            if self._grow(prefill, prefill.cached + T):
                self.stats["prefill_tokens"] += T
                logits = self._forward([prefill], T)
                if prefill.cached == prefill.n_tokens:
                    self._sample([prefill], logits)
        decode = [r for r in self.running if r.n_tokens - r.cached == 1 and r is not prefill]
        decode = [r for r in decode if r.slot is not None and self._grow(r, r.cached + 1)]
        decode = [r for r in decode if r.slot is not None]  # a later _grow may have preempted an earlier row
        if decode:
            self._sample(decode, self._forward(decode, 1))
        return True

    # -- the engine thread --------------------------------------------------------------------------------------
    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="evict-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        with torch.inference_mode():
            while not self._stop.is_set():
                if not self.step():
                    self._drain(block=True)

    def run_until_idle(self) -> None:
        """Step in this thread until every submitted request has finished (tests, offline use)."""
        with torch.inference_mode():
            while self.step() or not self.inbox.empty() or self.waiting:
                pass

    def metrics(self) -> dict:
        now = time.perf_counter()
        recent = [(t, n) for t, n in list(self.recent) if t >= now - 10]  # a snapshot: the engine thread appends
        span = now - recent[0][0] if recent else 0.0
        tok_s = sum(n for _, n in recent) / span if span > 0 else 0.0
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else _max_rss()
        return {**self.stats, "running": len(self.running), "waiting": len(self.waiting), "tokens_per_second": tok_s,
                "slots_used": self.max_batch - len(self.free_slots), "slots_total": self.max_batch,
                "blocks_used": self.n_blocks - len(self.free_blocks), "blocks_total": self.n_blocks,
                "pool_bytes": self.pool_bytes, "peak_memory_bytes": peak,
                "pool_peak_used_bytes": self.peak_blocks * self.block_bytes + self.max_batch * self.slot_bytes}


def _max_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
