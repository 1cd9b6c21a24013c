"""The serving engine: a request queue and continuous batching over one slot pool of the hybrid cache.

Every step the scheduler (1) admits waiting requests while a slot is free and the KV / latent block pool holds their
tokens (FIFO, at most `max_batch` running); (2) plans one forward within a budget of `max_num_batched_tokens` tokens:
one token of every running request that has read all its tokens (a decode row) and prompt chunks of as many requests
still reading their prompts as fit, in admission order, each chunk ending at the next multiple of `prefill_chunk` (or
where the budget ends); `priority` "decode" fills the budget with the decode rows first, "prefill" with the chunks
first; (3) runs them all in ONE forward, packed along T (a PackedBatch: memory layers run the chunks through the op's
cu_seqlens, attention / MLA each sequence over its own blocks), or, when there is no prompt chunk, one decode step of
the rows (a SlotBatch), replayed from a CUDA graph of the row count's bucket on CUDA (`cuda_graphs`); (4) samples with
each request's own parameters and generator, streams the tokens, and frees the slots of finished requests.
When a forward needs a block and none is free, the most recently admitted running request is preempted: its slot and
blocks are freed and it waits at the head of the queue with the tokens it has (prompt + output), to be recomputed.
A packed step moves its host ints in two copies (the cache's index buffer, `HybridCache.select_packed`, and the
engine's tokens / head positions / sampled rows / slots), from pinned memory on CUDA (`evict.host_copy.to_device`):
nothing in a step waits for the device but the read of its sampled tokens.

A sequence's tokens are processed as `generate` processes them alone: prompt chunks at the same boundaries
(multiples of `prefill_chunk` from 0, unless the step's budget cuts one), then one token per forward; so greedy outputs
equal `generate`'s (tested in float32 through packing and preemption).

Async steps (`async_steps`; the Engine's default off, the server's on on CUDA): a step is launched (planned, its blocks taken, its forward and sampling
queued on the device) and only then is the step before read (its tokens streamed, stop tokens and max_tokens
checked), so the host's work overlaps the device's. The synchronous engine is the same loop with depth 0: it reads
each step right after launching it. With depth 1 a decode row's token may still be in flight (`Request.inflight`):
the forward reads it from `feed`, each slot's last sampled token on the device (inside the decode graph), and the host
gets the tokens by a non-blocking copy into pinned memory and an event. Penalties record a token and log-probabilities
are computed when it is sampled, so sampling is what the synchronous engine draws. A request whose max_tokens are all
sampled is not planned again; one that stops on a stop token (or EOS, or is cancelled, or fails) is seen a step late,
and the token computed for it meanwhile is dropped, never emitted.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch

from evict.cli_args import first_line
from evict.host_copy import host_ints, to_device
from evict.models.generate import Penalties, sample_next
from evict.serve.graphs import DecodeGraphs, fed

PRIORITIES = ("decode", "prefill")
FINISH = ("stop", "length", "cancelled", "error")  # error: this request's step failed (Request.error says why)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling (evict.models.generate.sample_next): temperature 0 = greedy; min_p / top_k / top_p filter; seed
    fixes the request's own generator; penalties and logit_bias adjust the logits first (evict.models.generate.Penalties);
    logprobs N: each token's log-probability and the N most likely (of the model's distribution, before sampling);
    prompt_logprobs N: the same for each prompt token after the first (from the prefill's logits; then max_tokens may
    be 0: the prompt's log-probabilities alone)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop_tokens: tuple[int, ...] = ()
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias)


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
    penalties: Penalties | None = None
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)  # per token: (its, top N)
    error: str | None = None  # why finish_reason is "error"
    inflight: int = 0  # tokens sampled on the device whose ids the host does not know yet (async steps: 0 to 2)
    # with params.prompt_logprobs: entry j for prompt token j + 1, (its, top N), from the logits at position j
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    plain: bool = field(init=False)  # greedy, no penalties or logprobs, max_tokens > 0: its token is the argmax alone

    def __post_init__(self) -> None:
        p = self.params
        self.plain = not (p.temperature > 0 or p.penalized or p.logprobs is not None or not p.max_tokens)

    @property
    def n_tokens(self) -> int:
        """Prompt + output tokens, those still on their way to the host included."""
        return len(self.prompt) + len(self.out) + self.inflight

    def next_token(self) -> int:
        """The one token at position `cached` (pending(1)[0] without the lists: a decode row's input); -1 when it is
        in flight (sampled by the step before, known only on the device: the forward reads it from `Engine.feed`)."""
        c, P = self.cached, len(self.prompt)
        return self.prompt[c] if c < P else self.out[c - P] if c - P < len(self.out) else -1

    def pending(self, T: int) -> list[int]:
        """The next T tokens not yet in the slot."""
        s, P = self.cached, len(self.prompt)
        return (self.prompt[s : s + T] if s < P else []) + self.out[max(s - P, 0) : max(s + T - P, 0)]


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
                 max_len: int | None = None, prefill_chunk: int = 512, max_num_batched_tokens: int | None = None,
                 priority: str = "decode", cuda_graphs: bool | None = None, decode_prefill_tokens: int | None = None,
                 async_steps: bool = False):
        """`max_num_batched_tokens`: tokens per forward (default: 8192 on CUDA, 1024 on a CPU; at least max_batch);
        `priority`: what fills that budget first, "decode" rows or "prefill" chunks; `cuda_graphs`: replay decode-only
        steps from CUDA graphs (default: on CUDA); `decode_prefill_tokens`: prompt tokens at most in a step that also
        runs decode rows (default: the whole budget), so a decode token waits behind at most that much prefill;
        `async_steps`: launch step n + 1 before the host has read step n's tokens (see the module doc)."""
        self.device = next(model.parameters()).device
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(8192 if self.device.type == "cuda" else 1024, max_batch)
        for name, value in (("max_batch", max_batch), ("cache_budget", cache_budget), ("block_size", block_size),
                            ("prefill_chunk", prefill_chunk), ("max_num_batched_tokens", max_num_batched_tokens)):
            if type(value) is not int or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        if decode_prefill_tokens is None:
            decode_prefill_tokens = max_num_batched_tokens
        if type(decode_prefill_tokens) is not int or decode_prefill_tokens < 1:
            raise ValueError(f"decode_prefill_tokens: expected a positive integer, got {decode_prefill_tokens!r}")
        if max_num_batched_tokens < max_batch:
            raise ValueError(f"max_num_batched_tokens: expected at least max_batch ({max_batch}: every running request's "
                             f"decode token fits one step), got {max_num_batched_tokens}")
        if priority not in PRIORITIES:
            raise ValueError(f"priority: expected one of {', '.join(PRIORITIES)}, got {priority!r}")
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda"
        if cuda_graphs not in (True, False) or (cuda_graphs and self.device.type != "cuda"):
            raise ValueError(f"cuda_graphs: expected True (CUDA models only) or False, got {cuda_graphs!r} on {self.device}")
        if type(async_steps) is not bool:
            raise ValueError(f"async_steps: expected True or False, got {async_steps!r}")
        self.model = model.eval()
        self.vocab = model.cfg.vocab_size
        self.block_size, self.prefill_chunk, self.max_batch = block_size, prefill_chunk, max_batch
        self.max_tokens, self.priority, self.decode_prefill = max_num_batched_tokens, priority, decode_prefill_tokens
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
        scratch = int(cuda_graphs)  # graphs: one more slot and block, where padding rows write
        self.pool = model.new_pool(max_batch + scratch, n_blocks + scratch, block_size, self.max_len)
        self.block_bytes, self.slot_bytes = block_size * per_token, per_slot
        self.pool_bytes = (n_blocks + scratch) * self.block_bytes + (max_batch + scratch) * per_slot
        self.depth = int(async_steps)  # steps launched ahead of the host's reading of their tokens
        # async: each slot's last sampled token [slots] on the device, the input of its next decode row (-1 on the host)
        self.feed = torch.zeros(max_batch + scratch, dtype=torch.int64, device=self.device) if async_steps else None
        self.pin = async_steps and self.device.type == "cuda"  # host <-> device copies through pinned memory, no sync
        self.pending: Sampled | None = None  # the step launched last, its tokens not yet read (async)
        self.graphs = None
        if cuda_graphs:
            self.graphs = DecodeGraphs(model, self.pool, max_batch=max_batch, scratch_slot=max_batch, scratch_block=n_blocks,
                                       feed=self.feed)
        self.peak_blocks = 0
        self.free_slots = list(range(max_batch - 1, -1, -1))
        self.free_blocks = list(range(n_blocks - 1, -1, -1))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.ids = itertools.count(1)
        self.stats = {"requests": 0, "finished": 0, "preemptions": 0, "cancelled": 0, "generated_tokens": 0,
                      "prefill_tokens": 0, "steps": 0,
                      "packed_steps": 0, "graph_steps": 0}
        self.recent: deque[tuple[float, int]] = deque()  # (time, tokens) of the last 10 s, for tokens/s
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        # called by the engine thread after each step (and once as it ends): evict.serve.remote sends a step's
        # events, gathered by the requests' callbacks, as one message there
        self.after_step: Callable[[], None] | None = None

    def warm_up(self) -> None:
        """Capture the decode step's CUDA graph at every bucket now (their Triton compiles included), so that a server
        does it before it answers, not inside its first requests' time; a capture error turns graphs off (a warning)."""
        if self.graphs is None:
            return
        try:
            with torch.inference_mode():
                self.graphs.capture_all()
        except Exception as e:
            log.warning("serve: CUDA graphs off (%s)", first_line(e, 200))
            self.graphs = None

    # -- the door -----------------------------------------------------------------------------------------------
    def check(self, prompt, params: SamplingParams) -> None:
        """Raise ValueError (one line, naming the field) unless the request is valid and fits this engine."""
        check_request(prompt, params, vocab=self.vocab, max_len=self.max_len)

    def submit(self, prompt: list[int], params: SamplingParams, on_token=None, on_finish=None) -> Request:
        self.check(prompt, params)
        if self._thread is not None and not self.alive:
            raise EngineDown("engine: not running (stopped, or its thread died); see the server's log")
        req = Request(list(prompt), params, on_token, on_finish, id=next(self.ids), t_submit=time.perf_counter())
        if params.seed is not None:
            req.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        if params.penalized:
            req.penalties = Penalties.start(torch.tensor([prompt], device=self.device), self.vocab,
                                            presence=params.presence_penalty, frequency=params.frequency_penalty,
                                            repetition=params.repetition_penalty, logit_bias=dict(params.logit_bias))
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
            self.pool.set_blocks(req.slot, req.blocks, non_blocking=self.pin)
            self.peak_blocks = max(self.peak_blocks, self.n_blocks - len(self.free_blocks))
        return True

    def _decode(self, reqs: list[Request]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One token of each request (a decode-only step); (logits [B, V], the rows' slots [B] on the device or None)."""
        toks: list[int] = []
        starts: list[int] = []
        rows: list[int] = []
        for r in reqs:  # one pass (host time at 128 rows: dev/LOG.md session 60): its token, position, slot
            assert r.slot is not None  # every row runs in its slot (step() keeps only those)
            toks.append(r.next_token())
            starts.append(r.cached)
            rows.append(r.slot)
        slots = None
        if self.graphs is not None:
            try:
                logits, slots = self.graphs(toks, rows, starts)
                self.stats["graph_steps"] += 1
            except Exception as e:  # a model the graphs cannot capture (e.g. MoE sizes its batches on the host)
                log.warning("serve: CUDA graphs off (%s)", first_line(e, 200))
                self.graphs = None
        if self.graphs is None:
            self.pool.select(rows, starts, 1)
            tokens = self._tensor(toks)
            if self.feed is not None:
                slots = self._tensor(rows)
                tokens = fed(tokens, self.feed, slots)
            with torch.no_grad():
                logits = self.model(tokens[:, None], cache=self.pool)[:, -1]
        for r in reqs:
            r.cached += 1
        return logits, slots

    def _tensor(self, xs: list) -> torch.Tensor:
        """xs (ints) as an int64 tensor on the device; on CUDA through pinned memory (no wait for the step running)."""
        return to_device(host_ints(xs), self.device)

    def _packed(self, decode: list[Request], chunks: list[tuple[Request, int]]) -> tuple[list[Request], torch.Tensor,
                                                                                     torch.Tensor | None]:
        """One forward over the decode rows and the prompt chunks packed along T: (the requests that sample now, the
        decode rows and the chunks that end their prompt; their logits [N, V]; their slots [N] on the device for
        `feed`, async only). The head runs only at each part's last token and at the prompt positions whose
        log-probabilities a chunk's request asked for (prompt_logprobs), which are recorded here. The step's host
        ints (tokens, head positions, sampled rows, slots) go to the device in one copy (no sync on CUDA)."""
        self.pool.select_packed([(r.slot, r.cached) for r in decode], [(r.slot, r.cached, T) for r, T in chunks])
        D = len(decode)
        toks = [r.next_token() for r in decode] + [t for r, T in chunks for t in r.pending(T)]  # in flight: -1
        at = list(range(D))  # packed indices where the head runs
        pick = list(at)  # rows of `at` that sample: the decode rows, then each chunk that ends its prompt
        wanted: list[tuple[Request, int, int, int]] = []  # (request, first position wanted, how many, row of the first)
        reqs = list(decode)
        end = D
        for r, T in chunks:
            first, n = self._wanted(r, T)
            if n:
                wanted.append((r, first, n, len(at)))
                at += range(end + first - r.cached, end + T - 1)  # the chunk's last position comes next
            end += T
            at.append(end - 1)
            if r.cached + T == r.n_tokens:
                pick.append(len(at) - 1)
                reqs.append(r)
        slots = [r.slot for r in reqs if r.slot is not None] if self.feed is not None else []  # every one has a slot
        buf = to_device(host_ints(toks + at + pick + slots), self.device)
        tokens, rest = buf[:end], buf[end:]
        head, picked, slot_t = rest[: len(at)], rest[len(at) : len(at) + len(pick)], rest[len(at) + len(pick) :]
        if self.feed is not None and decode:  # a decode row's token may be in flight (a prompt chunk's never is)
            tokens[:D] = fed(tokens[:D], self.feed, slot_t[:D])
        with torch.no_grad():
            logits = self.model(tokens[None], cache=self.pool, positions=head[None])[0]  # [len(at), V]
        for r, first, n, row in wanted:
            self._record_prompt(r, first, logits[row : row + n])
        for r in decode:
            r.cached += 1
        for r, T in chunks:
            r.cached += T
        self.stats["packed_steps"] += 1
        return reqs, logits if len(pick) == len(at) else logits[picked], slot_t if self.feed is not None else None

    @staticmethod
    def _wanted(r: Request, T: int) -> tuple[int, int]:
        """(first, n): the positions first .. first + n - 1 of r's next chunk of T tokens are those whose logits give
        a prompt log-probability not yet recorded (position j: prompt token j + 1); n = 0 without prompt_logprobs.
        After a preemption the recomputed positions already recorded are skipped."""
        if r.params.prompt_logprobs is None:
            return 0, 0
        first = max(r.cached, len(r.prompt_logprobs))
        return first, max(min(r.cached + T, len(r.prompt) - 1) - first, 0)

    def _record_prompt(self, r: Request, first: int, logits: torch.Tensor) -> None:
        """r's prompt log-probabilities from the logits [K, V] at positions first .. first + K - 1 (of prompt tokens
        first + 1 .. first + K); a host sync for this request only."""
        tokens = torch.tensor(r.prompt[first + 1 : first + 1 + len(logits)], device=logits.device)
        r.prompt_logprobs += _logprob_entries(*_logprob_parts(logits, tokens, r.params.prompt_logprobs or 0))

    def _plan(self) -> tuple[list[Request], list[tuple[Request, int]]]:
        """This step's decode rows and prompt chunks (request, tokens) within the token budget, by `priority`."""
        left = self.max_tokens
        decode: list[Request] = []
        reading: list[tuple[Request, int]] = []  # (request, tokens it has not read), > 1: prompt chunks to plan
        for r in self.running:  # one pass over the rows, in admission order
            n = r.n_tokens - r.cached
            if n == 1:
                if r.inflight and len(r.out) + r.inflight >= r.params.max_tokens:
                    continue  # its last token is in flight (async): it finishes when that is read
                decode.append(r)
            elif n > 1:
                reading.append((r, n))
        chunks: list[tuple[Request, int]] = []
        if self.priority == "decode":
            decode = decode[:left]
            left -= len(decode)
        prompt = min(left, self.decode_prefill) if decode else left  # prompt tokens this step
        for r, n in reading:
            if prompt == 0:
                break
            T = min(self.prefill_chunk - r.cached % self.prefill_chunk, n, prompt)
            chunks.append((r, T))
            prompt -= T
            left -= T
        if self.priority == "prefill":
            decode = decode[:left]
        return decode, chunks

    def _sample(self, reqs: list[Request], logits: torch.Tensor, slots: torch.Tensor | None) -> Sampled:
        """Draw each request's next token from its row of logits [N, V] on the device (penalties recorded, logprobs
        computed there too: nothing here waits for the step); async: the tokens also go into `feed` at their slots
        (`slots` [N] on the device, or built here) and to the host by a non-blocking copy. A request whose sampling
        fails draws no token (it fails when the step is read), nor does one with max_tokens 0."""
        nxt = logits.argmax(-1)  # [N]; rows that sample replace theirs
        undrawn: dict[int, Exception | None] = {}  # row -> why it drew no token (None: max_tokens 0)
        logprobs: dict[int, tuple[torch.Tensor, ...]] = {}
        for i, r in enumerate(reqs):
            if not r.plain:
                p = r.params
                if not p.max_tokens:  # the prompt's log-probabilities alone: no token
                    undrawn[i] = None
                    continue
                try:
                    if p.temperature > 0 or r.penalties is not None:
                        nxt[i] = self._sample_one(r, logits[i : i + 1])
                    if r.penalties is not None:
                        r.penalties.record(nxt[i : i + 1])
                    if p.logprobs is not None:
                        logprobs[i] = _logprob_parts(logits[i : i + 1], nxt[i : i + 1], p.logprobs)
                except Exception as e:  # this request fails, the others go on
                    undrawn[i] = e
                    continue
            r.inflight += 1
        if self.feed is not None:
            self.feed.index_copy_(0, slots if slots is not None else self._tensor([r.slot for r in reqs]), nxt)
        out = Sampled(reqs, nxt, undrawn, logprobs)
        if self.pin:
            out.to_host()
        return out

    def _read(self, s: Sampled) -> None:
        """The host learns a step's tokens: each goes out to its client (on_token), and a stop token, max_tokens or a
        failed sampling finishes its request. A request finished since the step was launched (by the step before's stop
        token, a cancel, a failure) drops its token: the one extra token of async steps is never emitted."""
        tokens = s.tokens()  # async on CUDA: waits for that step only; else the step's one host sync
        now = time.perf_counter()
        undrawn, logprobs = s.undrawn, s.logprobs
        for i, (r, t) in enumerate(zip(s.reqs, tokens)):
            if undrawn and i in undrawn:
                if r.finish_reason is None:
                    e = undrawn[i]
                    try:
                        if e is not None:
                            raise e
                        self._finish(r, "length")  # max_tokens 0: its prompt's log-probabilities read, and done
                    except Exception as e2:
                        self._fail(r, e2)
                continue
            r.inflight -= 1
            if r.finish_reason is not None:
                continue
            try:
                self._emit(r, t, logprobs.get(i) if logprobs else None, now)
            except Exception as e:
                self._fail(r, e)
        self.recent.append((now, len(s.reqs)))
        while self.recent[0][0] < now - 10:
            self.recent.popleft()

    def step(self) -> bool:
        """One scheduling iteration; False when there was nothing to do. Plans and launches a step, then reads the
        step launched before it (async: while this one runs on the device), or this one at once (synchronous)."""
        self._drain(block=False)
        self._admit()
        if not self.running and self.pending is None:
            return False
        before, self.pending = self.pending, None
        try:
            launched = self._launch() if self.running else None
        finally:  # even when this launch failed, the tokens of the step before are good
            if before is not None:
                self._read(before)
        if launched is not None and not self.depth:
            self._read(launched)
        else:
            self.pending = launched
        return True

    def flush(self) -> None:
        """Read the step in flight now (async), so that every request's tokens are on the host."""
        before, self.pending = self.pending, None
        if before is not None:
            self._read(before)

    def _launch(self) -> Sampled | None:
        """Plan one step, take its blocks, run its forward and sample it (on the device); None if nothing ran."""
        self.stats["steps"] += 1
        decode, chunks = self._plan()
        order = [(r, 1) for r in decode] + chunks
        if self.priority == "prefill":
            order = chunks + [(r, 1) for r in decode]
        room = self.block_size if self.uses_blocks else None  # tokens a block holds; None: no blocks to grow
        for r, n in order:  # blocks in priority order
            if r.slot is not None and room is not None and r.cached + n > len(r.blocks) * room:
                self._grow(r, r.cached + n)  # may preempt the youngest running request (r itself included)
        decode = [r for r in decode if r.slot is not None]
        chunks = [(r, T) for r, T in chunks if r.slot is not None]
        if not decode and not chunks:
            return None
        if not chunks:
            return self._sample(decode, *self._decode(decode))
        self.stats["prefill_tokens"] += sum(T for _, T in chunks)
        reqs, logits, slots = self._packed(decode, chunks)
        return self._sample(reqs, logits, slots) if reqs else None

    # -- one request's sampling, its token out, its failure ----------------------------------------------------
    def _sample_one(self, r: Request, logits: torch.Tensor) -> torch.Tensor:
        """logits [1, V] -> r's next token [] (on device)."""
        p = r.params
        return sample_next(logits, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, generator=r.generator,
                           min_p=p.min_p, penalties=r.penalties)[0]

    def _emit(self, r: Request, t: int, logprobs: tuple[torch.Tensor, ...] | None, now: float) -> None:
        """Append token t to r (its log-probabilities' tensors from `_logprob_parts`, or None), tell its client, finish
        r if done. (Penalties recorded the token when it was sampled.)"""
        r.out.append(t)
        r.t_first = r.t_first or now
        self.stats["generated_tokens"] += 1
        if logprobs is not None:
            r.logprobs += _logprob_entries(*logprobs)
        if r.on_token is not None:
            r.on_token(r, t)
        if t in r.params.stop_tokens:
            self._finish(r, "stop")
        elif len(r.out) >= r.params.max_tokens:
            self._finish(r, "length")

    def _fail(self, r: Request, e: BaseException) -> None:
        """Finish r with finish_reason "error" (its slot and blocks freed); never raises."""
        if r.finish_reason is not None:
            return
        r.error = f"{type(e).__name__}: {first_line(e)}"
        if not isinstance(e, EngineDown):
            log.error("engine: request %d failed (%s)", r.id, r.error)
        try:
            self._finish(r, "error")
        except Exception:  # its on_finish failed too: r is finished and released all the same
            pass

    def _fail_all(self, e: BaseException, *, waiting: bool) -> None:
        """Fail the running requests (a step raised: they were in it), and with `waiting` the queued ones too."""
        for r in list(self.running) + (list(self.waiting) if waiting else []):
            self._fail(r, e)

    # -- the engine thread --------------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        """The engine thread is running (started, not stopped, not dead)."""
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="evict-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop after the current step; every request not finished gets finish_reason "error" (shutting down).
        `timeout`: seconds to wait for the thread (0: do not wait)."""
        self._stop.set()
        if self._thread is not None and timeout != 0:
            self._thread.join(timeout)

    def _loop(self) -> None:
        try:
            with torch.inference_mode():
                while not self._stop.is_set():
                    try:
                        busy = self.step()
                    except Exception as e:  # a forward or the scheduler failed: its requests fail, the engine goes on
                        log.error("engine: a step failed (%s: %s); its %d requests get an error", type(e).__name__,
                                  first_line(e), len(self.running))
                        self._fail_all(e, waiting=False)
                        self.pending = None
                        for r in self.waiting:  # a preempted request's token in flight is lost: it is recomputed
                            r.inflight = 0
                        busy = True
                    if not busy:
                        self._drain(block=True)
                    if self.after_step is not None:
                        self.after_step()
        finally:  # stopped, or this thread dies: nobody may wait for an answer that will not come
            self._stop.set()
            self._drain(block=False)
            self.pending = None
            self._fail_all(EngineDown("the server is shutting down"), waiting=True)
            if self.after_step is not None:
                self.after_step()

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


class EngineDown(RuntimeError):
    """The engine thread is not running: a request cannot be served."""


class Sampled:
    """One step's sampled tokens [N] of `reqs` on their way to the host (`Engine._sample` -> `Engine._read`): the
    device's tensors, or (`to_host`, async on CUDA) pinned copies filled by non-blocking copies and an event."""

    def __init__(self, reqs: list[Request], tokens: torch.Tensor, undrawn: dict[int, Exception | None],
                 logprobs: dict[int, tuple[torch.Tensor, ...]]):
        self.reqs, self._tokens, self.undrawn, self.logprobs = reqs, tokens, undrawn, logprobs
        self.ready: torch.cuda.Event | None = None

    def to_host(self) -> None:
        """Start the copies of the tokens and log-probabilities into pinned memory; an event marks their end."""
        def pinned(t: torch.Tensor) -> torch.Tensor:
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)

        self._tokens = pinned(self._tokens)
        self.logprobs = {i: tuple(pinned(t) for t in parts) for i, parts in self.logprobs.items()}
        self.ready = torch.cuda.Event()
        self.ready.record()

    def tokens(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
        return self._tokens.tolist()


def _logprob_parts(logits: torch.Tensor, tokens: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """Per row of logits [K, V] (on the device, no sync): the log-probability of tokens[k] [K] and the n most likely
    ids and log-probabilities [K, n], in float32 at least (float64 logits stay float64)."""
    lp = logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1)  # [K, V]
    top = lp.topk(min(n, lp.shape[-1]), dim=-1)
    return lp.gather(1, tokens[:, None])[:, 0], top.indices, top.values


def _logprob_entries(its: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> list[tuple[float, list[tuple[int, float]]]]:
    """`_logprob_parts` on the host: per row, (its log-probability, [(id, log-probability)] of the n most likely)."""
    return [(v, list(zip(i, tv))) for v, i, tv in zip(its.tolist(), ids.tolist(), values.tolist())]


def check_request(prompt, params: SamplingParams, *, vocab: int, max_len: int) -> None:
    """Raise ValueError (one line, naming the field) unless the request is valid and fits an engine of `vocab` tokens
    and `max_len` tokens per sequence (Engine.check; evict.serve.remote checks at its door with it too)."""
    if not isinstance(prompt, list) or not prompt or not all(type(t) is int and 0 <= t < vocab for t in prompt):
        raise ValueError(f"prompt: expected a non-empty list of token ids in [0, {vocab})")
    p = params
    if type(p.max_tokens) is not int or p.max_tokens < (0 if p.prompt_logprobs is not None else 1):
        raise ValueError(f"max_tokens: expected a positive integer (0 only with prompt_logprobs), got {p.max_tokens!r}")
    from evict.models.generate import _check_stop_tokens, _is_int, _is_real

    if not _is_real(p.temperature) or p.temperature < 0:
        raise ValueError(f"temperature: expected a finite number >= 0, got {p.temperature!r}")
    if p.top_p is not None and (not _is_real(p.top_p) or not 0 < p.top_p <= 1):
        raise ValueError(f"top_p: expected a number in (0, 1], got {p.top_p!r}")
    if p.top_k is not None and (not _is_int(p.top_k) or p.top_k < 1):
        raise ValueError(f"top_k: expected a positive integer, got {p.top_k!r}")
    if p.seed is not None and (not _is_int(p.seed) or not 0 <= p.seed < 2**63):
        raise ValueError(f"seed: expected an integer in [0, 2**63), got {p.seed!r}")
    _check_stop_tokens(p.stop_tokens, vocab)
    check_penalties(p, vocab)
    if len(prompt) + p.max_tokens > max_len:
        raise ValueError(f"max_tokens: prompt ({len(prompt)} tokens) + max_tokens ({p.max_tokens}) exceed the "
                         f"server's {max_len} tokens per sequence")


def check_penalties(p: SamplingParams, vocab: int) -> None:
    """ValueError (one line, naming the field) unless min_p, the penalties, logit_bias and logprobs are valid."""
    from evict.models.generate import _is_int, _is_real

    if p.min_p is not None and (not _is_real(p.min_p) or not 0 <= p.min_p <= 1):
        raise ValueError(f"min_p: expected a number in [0, 1], got {p.min_p!r}")
    for name in ("presence_penalty", "frequency_penalty"):
        if not _is_real(getattr(p, name)) or not -2 <= getattr(p, name) <= 2:
            raise ValueError(f"{name}: expected a number in [-2, 2], got {getattr(p, name)!r}")
    if not _is_real(p.repetition_penalty) or p.repetition_penalty <= 0:
        raise ValueError(f"repetition_penalty: expected a number > 0, got {p.repetition_penalty!r}")
    for t, b in p.logit_bias:
        if not _is_int(t) or not 0 <= t < vocab or not _is_real(b) or not -100 <= b <= 100:
            raise ValueError(f"logit_bias: expected token ids in [0, {vocab}) with biases in [-100, 100], got {t!r}: {b!r}")
    for name in ("logprobs", "prompt_logprobs"):
        n = getattr(p, name)
        if n is not None and (not _is_int(n) or not 0 <= n <= 20):
            raise ValueError(f"{name}: expected an integer in [0, 20], got {n!r}")


def _max_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
