"""Issue 73: where an engine step's time goes, in process (no HTTP). The bench's hybrid (KKKM, d 1024, 8 layers, bf16)
serving N x (P prompt + O new) tokens: each step is timed (CUDA synchronized) and classed as a decode-only step (rows)
or a packed step (decode rows + prompt tokens). `--conv torch` forces the short conv's cuDNN form (the form before
this branch for a conv with a tail). `--warmup N` first captures the decode graphs (`Engine.warm_up`) and runs N
requests of the same shape, untimed; `--steps 0` runs the whole load and reports the engine's own req/s and output
tokens/s, TTFT p50 and TPOT p50 (no HTTP: the server and its clients excluded). Prints one JSON line. Run on CUDA:
python dev/serve_step_profile.py [--model hybrid|attention] [--conv auto|torch] [--steps 80] [--warmup 8]
`--decode-only C` instead times decode-only steps of 1 and of N rows, every row at context C (no prefill: the rows'
blocks are taken and their states left zero, which changes no kernel's work): the engine's step (host + graph + sampling)
synchronized one by one (`step_ms_median`) and 30 steps back to back (`step_ms_back_to_back`: with `--async-scheduling`
the host plans step n + 1 while step n runs, so only this number shows it), the graph's replay alone (CUDA events),
and with `--kernels K` torch.profiler tables of K eager steps and K graph steps.
`--async-scheduling` runs the engine with `async_steps=True` (every mode); with `--decode-only`, `--compare-async` runs it
without and then with async steps in one process (one DECODE_PROFILE line each, then DECODE_COMPARE: the back-to-back
steps side by side and each mode's N-row step over its 1-row step, issue 73's TPOT ratio).
`--host-only` (a CPU): the scheduler's own time in a decode-only step of N rows, the model's forward and the cache's
row selection stubbed out (the logits zeros): thread CPU time per step, median of 5 rounds of 200 steps. Run it with
PYTHONPATH on two trees to compare their engines' host cost.
`--host-packed` (a CPU): the same for PACKED steps of the 4K load's shape (`--n` decode rows at context ~4,096 plus two
`--chunk`-token prompt chunks, chunk requests rewound so that every timed step is packed), the forward stubbed but the
cache's `select_packed` real: thread CPU time per step (one intra-op thread; median of 5 rounds of `--rounds` steps) and, from a dispatch-mode
count over 5 steps, the torch ops per step. `--meta-table` puts the pool's block table on the meta device: the cache's device-side index
ops then cost only their dispatch (a GPU launch's host side, not a CPU's compute of [rows, L] gathers and [T, L]
masks) and are counted apart (`device_ops_per_step`: outputs on meta, views excluded: each a launch on a GPU; `device_copies_per_step` the host -> device copies among them). The meta ops run PyTorch's Python
reference decompositions (~0.1 ms each), so `--meta-table` times overstate a launch's host cost: read its op counts."""

import argparse
import collections
import gc
import itertools
import json
import random
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import evict.ops.conv as conv_op
from evict.bench.decode import model_configs
from evict.models import LM
from evict.serve.engine import Engine, SamplingParams

WIDTH = dict(d_model=1024, n_layers=8, n_heads=8, head_dim=128, d_ff=2816, kv_lora_rank=512, qk_nope_dim=128,
             qk_rope_dim=64, v_head_dim=128)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--conv", choices=["auto", "torch"], default="auto")
    ap.add_argument("--model", default="hybrid")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--width", default="bench", choices=["bench", "tiny"])
    ap.add_argument("--kernels", type=int, default=0, help="profile the last K steps (with --steps 0: steps 12 .. 12+K-1, "
                    "packed ones at the bench's load) with torch.profiler; print its tables")
    ap.add_argument("--warmup", type=int, default=0, help="untimed requests of the same shape first (and every graph)")
    ap.add_argument("--decode-prefill-tokens", type=int, help="the engine's cap on prompt tokens in a step that decodes")
    ap.add_argument("--out", type=int, default=512, help="new tokens per request")
    ap.add_argument("--decode-only", type=int, default=0, metavar="C", help="decode steps only, rows at context C")
    ap.add_argument("--host-only", action="store_true", help="the scheduler's host time a decode step (CPU, forward stubbed)")
    ap.add_argument("--host-packed", action="store_true", help="the host time of a packed step (CPU, forward stubbed)")
    ap.add_argument("--chunk", type=int, default=4096, help="--host-packed: tokens of each of the two prompt chunks")
    ap.add_argument("--meta-table", action="store_true", help="--host-packed: the pool's block table on the meta device")
    ap.add_argument("--rounds", type=int, default=20, help="--host-packed: steps per timed round")
    ap.add_argument("--async-scheduling", action="store_true", help="the engine's async_steps: plan ahead of the device")
    ap.add_argument("--compare-async", action="store_true", help="--decode-only without, then with async steps")
    a = ap.parse_args()
    if a.host_only:
        return host_only(a.n, a.async_scheduling)
    if a.host_packed:
        return host_packed(a.n, a.chunk, a.rounds, a.async_scheduling, a.meta_table)
    if a.conv == "torch":
        conv_op.kernel_runs_on = lambda x: False
    torch.manual_seed(0)
    with torch.device(a.device):
        model = LM(model_configs((a.model,), size="tiny", width=WIDTH if a.width == "bench" else {})[a.model])
    model = model.to(torch.bfloat16 if a.device == "cuda" else torch.float32).eval()
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)

    def engine(async_steps: bool) -> Engine:
        return Engine(model, max_batch=128, cache_budget=(4 << 30) if a.device == "cuda" else (64 << 20), block_size=256,
                      prefill_chunk=4096, max_len=4608, decode_prefill_tokens=a.decode_prefill_tokens, async_steps=async_steps)

    if a.decode_only:
        res = {}
        for mode in ([False, True] if a.compare_async else [a.async_scheduling]):
            res[mode] = decode_only(a, engine(mode), sync, mode)
            gc.collect()
            if a.device == "cuda":
                torch.cuda.empty_cache()  # the first engine's pool and graphs go before the second's are made
        if a.compare_async:
            key, n = "step_ms_back_to_back", f"rows_{a.n}"
            print("DECODE_COMPARE", json.dumps({
                f"{n}_sync_ms": res[False][n][key], f"{n}_async_ms": res[True][n][key],
                "rows_1_sync_ms": res[False]["rows_1"][key], "rows_1_async_ms": res[True]["rows_1"][key],
                f"{n}_replay_ms": res[False][n].get("replay_ms"), f"{n}_async_replay_ms": res[True][n].get("replay_ms"),
                "async_speedup": res[False][n][key] / res[True][n][key],
                "ratio_to_batch1_sync": res[False][n][key] / res[False]["rows_1"][key],
                "ratio_to_batch1_async": res[True][n][key] / res[True]["rows_1"][key]}))
        return
    eng = engine(a.async_scheduling)
    rng = random.Random(0)
    if a.warmup:
        eng.warm_up()
        for _ in range(a.warmup):
            eng.submit([rng.randrange(256) for _ in range(4096)], SamplingParams(max_tokens=a.out, temperature=0))
        eng.run_until_idle()
    ends = {}  # request -> perf_counter at its finish, for TPOT = (end - first token) / (tokens - 1)
    for _ in range(a.n):
        eng.submit([rng.randrange(256) for _ in range(4096)], SamplingParams(max_tokens=a.out, temperature=0),
                   on_finish=lambda r: ends.__setitem__(r, time.perf_counter()))
    steps = []
    start, done0, gen0 = time.perf_counter(), eng.stats["finished"], eng.stats["generated_tokens"]
    with torch.inference_mode():
        for i in itertools.count():
            if (a.steps and i == a.steps) or (not a.steps and eng.stats["finished"] - done0 == a.n):
                break
            if a.kernels and i == (a.steps - a.kernels if a.steps else 12):  # the last K steps, or K packed ones
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                              + ([torch.profiler.ProfilerActivity.CUDA] if a.device == "cuda" else []))
                prof.__enter__()
            before = dict(eng.stats)
            sync()
            t0 = time.perf_counter()
            eng.step()
            sync()
            dt = time.perf_counter() - t0
            d = {k: eng.stats[k] - before[k] for k in ("generated_tokens", "prefill_tokens", "packed_steps", "graph_steps")}
            steps.append((dt, d))
            if a.kernels and not a.steps and i == 12 + a.kernels - 1:
                prof.__exit__(None, None, None)
    wall = time.perf_counter() - start
    if a.kernels:
        if a.steps:
            prof.__exit__(None, None, None)
        key = "cuda_time_total" if a.device == "cuda" else "cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    packed = [dt for dt, d in steps if d["packed_steps"]]
    decode = [dt for dt, d in steps if not d["packed_steps"]]
    tokens = [d["prefill_tokens"] for dt, d in steps if d["packed_steps"]]
    print("STEP_PROFILE", json.dumps({
        "model": a.model, "conv": a.conv, "async_steps": a.async_scheduling, "steps": len(steps), "packed_steps": len(packed), "wall_s": wall,
        "requests_per_s": (eng.stats["finished"] - done0) / wall, "output_tokens_per_s": (eng.stats["generated_tokens"] - gen0) / wall,
        "decode_prefill_tokens": eng.decode_prefill,
        "tpot_p50_ms": statistics.median((t - r.t_first) / (len(r.out) - 1) for r, t in ends.items()) * 1e3 if ends else None,
        "ttft_p50_s": statistics.median(r.t_first - r.t_submit for r in ends) if ends else None,
        "packed_ms_median": statistics.median(packed) * 1e3 if packed else None,
        "packed_prompt_tokens_per_s": sum(tokens) / sum(packed) if packed else None,
        "decode_steps": len(decode), "decode_ms_median": statistics.median(decode) * 1e3 if decode else None,
        "first_5_ms": [round(dt * 1e3, 1) for dt, _ in steps[:5]],
        "last_5": [(round(dt * 1e3, 2), d["generated_tokens"]) for dt, d in steps[-5:]]}))


def decode_only(a, eng, sync, async_steps: bool) -> dict:
    """Decode-only steps at 1 and a.n rows, each row at context a.decode_only (see the module doc); one JSON line."""
    eng.warm_up()
    res = {"model": a.model, "context": a.decode_only, "async_steps": async_steps}
    for rows in (1, a.n):
        reqs = [eng.submit([t % 256 for t in range(a.decode_only)], SamplingParams(max_tokens=eng.max_len - a.decode_only,
                                                                       temperature=0)) for _ in range(rows)]
        with torch.inference_mode():
            eng._drain(block=False)
            eng._admit()
            assert len(eng.running) == rows, "the pool does not hold the rows"
            for r in reqs:
                r.cached = len(r.prompt) - 1  # the prompt is "read": its last token is the next decode row
            timed = []
            for i in range(40):
                sync()
                t0 = time.perf_counter()
                eng.step()
                sync()
                timed.append(time.perf_counter() - t0)
            out = {"step_ms_median": statistics.median(timed[10:]) * 1e3}
            sync()
            t0 = time.perf_counter()
            for _ in range(30):
                eng.step()
            eng.flush()
            sync()
            out["step_ms_back_to_back"] = (time.perf_counter() - t0) / 30 * 1e3
            if eng.graphs is not None:
                graph = eng.graphs.graphs[next(x for x in eng.graphs.buckets if x >= rows)][0]
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                ev[0].record()
                for _ in range(50):
                    graph.replay()
                ev[1].record()
                sync()
                out["replay_ms"] = ev[0].elapsed_time(ev[1]) / 50
            eng.flush()
            graphs, eng.graphs = eng.graphs, None
            for _ in range(3):  # eager warm-up (Triton's per-shape compiles)
                eng.step()
            sync()
            t0 = time.perf_counter()
            for _ in range(5):
                eng.step()
            sync()
            out["eager_step_ms"] = (time.perf_counter() - t0) / 5 * 1e3
            if a.kernels and rows == a.n:
                for name in ("eager", "graph"):
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + (
                            [torch.profiler.ProfilerActivity.CUDA] if a.device == "cuda" else [])) as prof:
                        for _ in range(a.kernels):
                            eng.step()
                        sync()
                    print(f"== {name} decode steps x {a.kernels} at {rows} rows, by self CUDA time")
                    key = "self_cuda_time_total" if a.device == "cuda" else "self_cpu_time_total"
                    print(prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=70))
                    print(f"== {name} decode steps x {a.kernels} at {rows} rows, by self CPU time")
                    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70))
                    eng.graphs = graphs
            eng.graphs = graphs
            eng.flush()
            for r in reqs:
                eng._finish(r, "cancelled")
        res[f"rows_{rows}"] = out
    print("DECODE_PROFILE", json.dumps(res))
    return res


def host_only(n: int, async_steps: bool) -> None:
    """Thread CPU time of Engine.step over decode-only steps of n rows with the forward stubbed; one JSON line."""
    model = LM(model_configs(("hybrid",), size="tiny", width={})["hybrid"]).eval()
    eng = Engine(model, max_batch=n, cache_budget=64 << 20, block_size=256, prefill_chunk=64, max_len=4096,
                 async_steps=async_steps)
    logits = torch.zeros(n, 1, eng.vocab)
    eng.model.forward = lambda tokens, **kw: logits[: tokens.shape[0]]
    eng.pool.select = lambda *a, **kw: None
    reqs = [eng.submit([t % 256 for t in range(100)], SamplingParams(max_tokens=3900, temperature=0)) for _ in range(n)]
    rounds = []
    with torch.inference_mode():
        eng._drain(block=False)
        eng._admit()
        for r in reqs:
            r.cached = len(r.prompt) - 1
        for _ in range(5):
            eng.step()
        for _ in range(5):
            t0 = time.thread_time_ns()
            for _ in range(200):
                eng.step()
            rounds.append((time.thread_time_ns() - t0) / 200 / 1e3)
    print("HOST_PROFILE", json.dumps({"rows": n, "async_steps": async_steps, "host_us_per_step_median": statistics.median(rounds),
                                      "rounds_us": [round(x, 1) for x in rounds]}))


class OpCount(TorchDispatchMode):
    """Counts the aten ops dispatched while on, by name, and those whose output is on the meta device (`--meta-table`:
    the block table's device ops, each a launch on a GPU)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.meta: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket.__name__)
        self.ops[name] += 1
        copy = name in ("to", "_to_copy", "copy_")  # `to` is an alias-returning op: a view only where it copies nothing
        if (copy or not func.is_view) and any(isinstance(t, torch.Tensor) and t.is_meta
                                              for t in (out if isinstance(out, (tuple, list)) else [out])):
            self.meta[name] += 1
        return out


def host_packed(n: int, chunk: int, rounds: int, async_steps: bool, meta: bool) -> None:
    """Thread CPU time and torch ops of Engine.step over packed steps (n decode rows + two chunks); one JSON line."""
    torch.set_num_threads(1)  # the index ops are small: intra-op threads only add noise (spin-waits) on a shared CPU
    model = LM(model_configs(("hybrid",), size="tiny", width={})["hybrid"]).eval()
    eng = Engine(model, max_batch=n + 2, cache_budget=320 << 20, block_size=256, prefill_chunk=chunk,
                 max_len=3 * chunk + 1024, max_num_batched_tokens=n + 2 * chunk, async_steps=async_steps)
    logits = torch.zeros(1, n + 2 * chunk, eng.vocab)
    eng.model.forward = lambda tokens, positions, **kw: logits[:, : positions.shape[1]]
    if meta:  # the pool's index tensors on the meta device: their ops cost their dispatch only, as a launch's host side
        eng.pool.table = eng.pool.table.to("meta")
    rows = [eng.submit([t % 256 for t in range(chunk)], SamplingParams(max_tokens=2048, temperature=0)) for _ in range(n)]
    chunks = [eng.submit([t % 256 for t in range(3 * chunk)], SamplingParams(max_tokens=1, temperature=0)) for _ in range(2)]

    def step():
        for r in chunks:  # rewound: every step runs both requests' next chunk (at 0 or chunk), none completes
            if r.cached >= 2 * chunk:
                r.cached = 0
        eng.step()

    with torch.inference_mode():
        eng._drain(block=False)
        eng._admit()
        assert len(eng.running) == n + 2, "the pool does not hold the rows"
        for r in rows:
            r.cached = len(r.prompt) - 1
        for _ in range(5):
            step()
        packed0 = eng.stats["packed_steps"]
        times = []
        for _ in range(5):
            t0 = time.thread_time_ns()
            for _ in range(rounds):
                step()
            times.append((time.thread_time_ns() - t0) / rounds / 1e3)
        assert eng.stats["packed_steps"] - packed0 == 5 * rounds, "a timed step was not packed"
        with OpCount() as count:
            for _ in range(5):
                step()
    ops = {k: v / 5 for k, v in count.ops.most_common()}
    print("HOST_PACKED", json.dumps({"decode_rows": n, "chunks": [chunk, chunk], "async_steps": async_steps, "meta_table": meta,
                                     "device_ops_per_step": sum(count.meta.values()) / 5,
                                     "device_copies_per_step": sum(count.meta[k] for k in ("to", "_to_copy", "copy_")) / 5,
                                     "host_us_per_step_median": statistics.median(times),
                                     "rounds_us": [round(x, 1) for x in times], "ops_per_step": sum(ops.values()),
                                     "copies_per_step": ops.get("_to_copy", 0) + ops.get("copy_", 0), "ops": ops}))


if __name__ == "__main__":
    main()
