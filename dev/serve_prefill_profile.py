"""Issue 73: one packed prefill step of the serving engine as the 32K load shapes it, per layer type, for the bench's
hybrid (KKKM: 6 KDA + 2 MLA) and attention (8 layers d 1024, bf16). The 32K load (64 x (32K + 64), 4,096-token chunks,
an 8,192-token budget) runs steps of two 4K chunks at the same offset o (two requests read their prompts side by side),
o = 0, 4K, .., 28K; this script lays those steps out in a slot pool (arenas filled with random latents / keys, the
chunk's prefix "already read") and runs exactly the engine's packed forward (`select_packed`, the LM on the pool, logits
at each part's last token). Scenarios per model: one chunk alone at each `--offsets` (B1 T4096 per sequence), the
load's two-chunk step at every offset, and one step packing a chunk at each of `--offsets`. Prints, per scenario, the
step's wall time (synchronized median), each layer type's time (CUDA events around every mixer and FFN, summed over the
layers of that type; "rest" = embedding, norms, head, host), and the hand-counted FLOPs and bytes of each layer type
(the cost model below) with the rate they imply. Then: the load's prefill time predicted from its steps (64 requests);
the real engine's step (`Engine.step`, two requests prefilled side by side: the same shapes) against the bare
forward's; torch.profiler kernel tables of one layer of each type run alone on a load step's inputs (`--kernels`
rows) and of the whole step; and the load itself in process through the engine (`--load-requests` x (prompt +
`--load-out`) after `--load-warmup` requests, a 70 GiB pool as the bench's): TTFT, step times early against late, the
slowest steps with their plan, the allocator's retries (see engine_load).
`--models` takes hybrid, attention and hybrid_nopad (the hybrid with MLA's values not padded for flash: the attention
op's PAD_VALUES_FOR_FLASH off, the kernel before this change) side by side. `--cost-only`: the cost model alone (CPU,
no step run). `--cpu`: tiny width, float32, 32-token chunks of 128-token prompts on the CPU (checks the script runs).
Run on CUDA: python dev/serve_prefill_profile.py [--models hybrid attention hybrid_nopad] [--kernels 12]"""

import argparse
import gc
import importlib
import json
import statistics
import time

import torch
from torch import nn

from evict.bench.decode import model_configs
from evict.layers.attention import Attention
from evict.layers.memory_mixer import MemoryMixer
from evict.layers.mla import MLA
from evict.models import LM
from evict.serve.engine import Engine, SamplingParams

attention_op = importlib.import_module("evict.ops.attention")  # the module (evict.ops exports its function)
WIDTH = dict(d_model=1024, n_layers=8, n_heads=8, head_dim=128, d_ff=2816, kv_lora_rank=512, qk_nope_dim=128,
             qk_rope_dim=64, v_head_dim=128)
KDA_CHUNK = 64  # the memory op's chunk for packed sequences (triton/autograd.auto_chunk)


def args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["hybrid", "attention", "hybrid_nopad"],
                    choices=["hybrid", "hybrid_nopad", "attention"])
    ap.add_argument("--chunk", type=int, help="prompt chunk (default 4096; --cpu 32)")
    ap.add_argument("--prompt", type=int, help="prompt length of the load (default 32768; --cpu 128)")
    ap.add_argument("--offsets", type=int, nargs="+", help="single-chunk offsets (default 0, prompt/2, prompt-chunk)")
    ap.add_argument("--requests", type=int, default=64, help="requests of the load (its predicted prefill time)")
    ap.add_argument("--decode", type=int, default=0, help="decode rows added to each load step (at the chunk's offset)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kernels", type=int, default=12, help="rows of each kernel table (0: no profiler)")
    ap.add_argument("--cpu", action="store_true", help="tiny width, float32, small shapes on the CPU")
    ap.add_argument("--cost-only", action="store_true", help="print the cost model at the bench width and exit (CPU)")
    ap.add_argument("--load-requests", type=int, help="the load in process through the real engine: this many requests "
                    "(default 32; --cpu 4; 0: not run)")
    ap.add_argument("--load-models", nargs="+", default=["hybrid", "attention"],
                    choices=["hybrid", "hybrid_nopad", "attention"], help="models that run it (after every model's steps)")
    ap.add_argument("--load-warmup", type=int, help="untimed requests first (default 8; --cpu 1)")
    ap.add_argument("--load-out", type=int, help="new tokens per request (default 64; --cpu 4)")
    ap.add_argument("--load-budget", type=float, help="its pool in GiB (default 70, the bench's; --cpu 0.0625)")
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()
    small = a.cpu
    a.chunk = a.chunk or (32 if small else 4096)
    a.prompt = a.prompt or (128 if small else 32768)
    a.offsets = a.offsets or [0, a.prompt // 2, a.prompt - a.chunk]
    for name, big, tiny in (("load_requests", 32, 4), ("load_warmup", 8, 1), ("load_out", 64, 4), ("load_budget", 70, 0.0625)):
        if getattr(a, name) is None:
            setattr(a, name, tiny if small else big)
    if a.chunk < 1 or a.prompt % a.chunk or any(o % a.chunk or not 0 <= o < a.prompt for o in a.offsets):
        ap.error("--prompt must be a multiple of --chunk and --offsets multiples of --chunk below --prompt")
    a.device = "cpu" if small or a.cost_only else "cuda"
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("needs CUDA (or --cpu / --cost-only)")
    return a


def build(kind: str, a) -> LM:
    torch.manual_seed(0)
    dev = torch.device(a.device)
    with dev:
        model = LM(model_configs((kind,), size="tiny", width={} if a.cpu else WIDTH)[kind])
    return model.to(torch.float32 if a.device == "cpu" else torch.bfloat16).eval()


def scenarios(a) -> list[tuple[str, list[tuple[int, int]], list[tuple[int, int, int]]]]:
    """(name, decode rows (slot, position), chunks (slot, start, tokens)) of each step; slots 0.. chunks, then decode."""
    C, out = a.chunk, []
    for o in a.offsets:
        out.append((f"1x{C}@{o}", [], [(0, o, C)]))
    n = max(2, len(a.offsets))
    for o in range(0, a.prompt, C):
        out.append((f"load 2x{C}@{o}", [(n + i, o + C) for i in range(a.decode)], [(0, o, C), (1, o, C)]))
    out.append(("packed " + "+".join(str(o) for o in a.offsets), [], [(i, o, C) for i, o in enumerate(a.offsets)]))
    return out


def new_pool(model: LM, a, n_slots: int):
    """A pool whose slots each own blocks for a whole prompt (+ the decode rows' token), arenas random."""
    bs = 256 if a.prompt % 256 == 0 else a.chunk
    per = -(-(a.prompt + 1) // bs)
    pool = model.new_pool(n_slots, n_slots * per, bs, per * bs)
    for s in range(n_slots):
        pool.set_blocks(s, list(range(s * per, (s + 1) * per)))
    gen = torch.Generator(device=a.device).manual_seed(1)
    for st in pool.states:
        for name in ("k", "v", "c", "k_rope"):
            t = getattr(st, name, None)
            if t is not None:
                t.copy_(torch.randn(t.shape, generator=gen, device=a.device, dtype=t.dtype) * 0.5)
    return pool


def step(model: LM, pool, decode, chunks, vocab: int):
    """The engine's packed forward (Engine._packed without the bookkeeping): logits at each part's last token."""
    pool.select_packed(decode, chunks)
    T = len(decode) + sum(n for _, _, n in chunks)
    toks = torch.randint(0, vocab, (1, T), device=pool.table.device)
    ends, at = list(range(len(decode))), len(decode)
    for _, _, n in chunks:
        at += n
        ends.append(at - 1)
    with torch.inference_mode():
        return model(toks, cache=pool, positions=torch.tensor([ends], device=pool.table.device))


def sync(a):
    if a.device == "cuda":
        torch.cuda.synchronize()


def timed(fn, a) -> float:
    """Median wall ms of a.reps calls after two untimed ones, each synchronized."""
    ts = []
    for i in range(a.reps + 2):
        sync(a)
        t0 = time.perf_counter()
        fn()
        sync(a)
        if i >= 2:
            ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def label(model: LM) -> list[tuple[str, nn.Module]]:
    """(layer type, module) of every mixer and FFN: 'K' (KDA), 'M' (MLA), 'A' (attention), 'ffn'."""
    out = []
    for blk in model.layers():
        out += [(blk.letter, blk.mixer), ("ffn", blk.ffn)]
    return out


def split(fn, model: LM, a) -> tuple[dict[str, float], float]:
    """ms of each layer type in one call of fn (CUDA events before and after each module; perf_counter on a CPU),
    and the call's own ms (from the first mark before it to the last after it)."""
    marks: list[tuple[str, object, object]] = []
    hooks = []
    now = (lambda: time.perf_counter() * 1e3) if a.device == "cpu" else None

    def mark():
        if now is not None:
            return now()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    for name, mod in label(model):
        hooks.append(mod.register_forward_pre_hook(lambda m, x, name=name: marks.append((name, mark(), None))))
        hooks.append(mod.register_forward_hook(lambda m, x, y, name=name: marks.append((name, None, mark()))))
    try:
        sync(a)
        first = mark()
        fn()
        last = mark()
        sync(a)
    finally:
        for h in hooks:
            h.remove()
    out: dict[str, float] = {}
    for (name, start, _), (_, _, end) in zip(marks[0::2], marks[1::2]):
        ms = end - start if now is not None else start.elapsed_time(end)  # type: ignore[union-attr]
        out[name] = out.get(name, 0.0) + ms
    return out, (last - first if now is not None else first.elapsed_time(last))  # type: ignore[union-attr,operator]


def visible(o: int, T: int) -> int:
    """(query, key) pairs under the causal mask of T queries after o cached keys."""
    return T * o + T * (T + 1) // 2


def linear_params(mod: nn.Module) -> int:
    return sum(m.weight.numel() for m in mod.modules() if isinstance(m, nn.Linear))


def cost(model: LM, decode, chunks) -> dict[str, tuple[float, float]]:
    """Hand-counted (FLOPs, bytes) of one step per layer type, summed over its layers. FLOPs: 2 per multiply-add of
    every Linear over the step's N tokens; attention 4 H D per visible (query, key) pair (scores and values);
    MLA the up-projection of each part's whole prefix (2 L r H (n + e)) + 2 H (n + p + e) per visible pair; KDA's
    chunked op ~ N H (10 c D + 6 D^2) (intra-chunk c x c products and the state's D x D ones, c = 64). Bytes: the
    weights once, the cache read (keys / values or latents of each prefix), MLA's up-projected keys and values
    written and read, KDA's float32 states read and written; activations not counted."""
    parts = [(o, 1) for _, o in decode] + [(o, n) for _, o, n in chunks]
    N = sum(n for _, n in parts)
    es = next(model.parameters()).element_size()
    out: dict[str, tuple[float, float]] = {}
    for name, mod in label(model):
        f, b = 2.0 * N * linear_params(mod), float(sum(p.numel() for p in mod.parameters()) * es)
        if isinstance(mod, Attention):
            f += sum(4 * mod.n_heads * mod.hd * visible(o, T) for o, T in parts)
            b += sum((o + T) * 2 * mod.n_kv * mod.hd * es for o, T in parts)
        elif isinstance(mod, MLA):
            f += sum(2 * (o + T) * mod.r * mod.H * (mod.n + mod.e) + 2 * mod.H * (mod.n + mod.p + mod.e) * visible(o, T)
                     for o, T in parts)
            b += sum((o + T) * ((mod.r + mod.p) + 2 * mod.H * (mod.n + mod.p + mod.e)) * es for o, T in parts)
        elif isinstance(mod, MemoryMixer):
            f += N * mod.H * (10 * KDA_CHUNK * mod.D + 6 * mod.D**2)
            b += len(parts) * 2 * mod.H * mod.D * mod.D * 4
        prev = out.get(name, (0.0, 0.0))
        out[name] = (prev[0] + f, prev[1] + b)
    return out


def run_model(kind: str, a, results: dict) -> None:
    base = "hybrid" if kind.startswith("hybrid") else kind
    attention_op.PAD_VALUES_FOR_FLASH = kind != "hybrid_nopad"
    model = build(base, a)
    vocab = model.cfg.vocab_size
    pool = new_pool(model, a, max(2, len(a.offsets)) + a.decode)
    rows = []
    print(f"\n== {kind} ({a.device}, {next(model.parameters()).dtype}, PAD_VALUES_FOR_FLASH="
          f"{attention_op.PAD_VALUES_FOR_FLASH})")
    print("| step | tokens | ms | " + " | ".join(f"{n} ms" for n in ("K", "M", "A", "ffn", "rest")) + " | GFLOP | TFLOP/s by type |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, dec, chunks in scenarios(a):
        fn = lambda: step(model, pool, dec, chunks, vocab)  # noqa: E731
        ms = timed(fn, a)
        parts, whole = split(fn, model, a)
        costs = cost(model, dec, chunks)
        rate = {n: costs[n][0] / (parts[n] * 1e-3) / 1e12 for n in parts if parts[n] > 0}
        row = {"step": name, "tokens": len(dec) + sum(c[2] for c in chunks), "ms": ms,
               "by_type_ms": parts, "rest_ms": whole - sum(parts.values()), "gflop": {n: c[0] / 1e9 for n, c in costs.items()},
               "gbytes": {n: c[1] / 1e9 for n, c in costs.items()}, "tflops": rate}
        rows.append(row)
        cells = [f"{parts[n]:.2f}" if n in parts else "-" for n in ("K", "M", "A", "ffn")]
        print(f"| {name} | {row['tokens']} | {ms:.2f} | " + " | ".join(cells) + f" | {row['rest_ms']:.2f} | "
              f"{sum(row['gflop'].values()):.4g} | " + ", ".join(f"{n} {r:.3g}" for n, r in rate.items()) + " |")
    load = [r["ms"] for r in rows if r["step"].startswith("load")]
    steps = a.requests * a.prompt // (2 * a.chunk)
    predicted = statistics.mean(load) * steps / 1e3
    print(f"load: mean step {statistics.mean(load):.2f} ms x {steps} steps = {predicted:.2f} s of prefill for "
          f"{a.requests} x {a.prompt} tokens ({a.requests * a.prompt / predicted:,.0f} prompt tok/s)")
    eng = engine_steps(model, a)
    print(f"engine: two requests of {a.prompt} prompt tokens + 1 new, {len(eng)} packed steps (2x{a.chunk} at each "
          f"offset) through Engine.step: mean {statistics.mean(eng):.2f} ms a step against the bare forward's "
          f"{statistics.mean(load):.2f} ms (the engine's bookkeeping and sampling: the difference)")
    results[kind] = {"rows": rows, "load_mean_step_ms": statistics.mean(load), "load_prefill_s": predicted,
                     "engine_step_ms": eng}
    if a.kernels:
        kernel_tables(model, pool, a, kind, vocab)
    del model, pool
    if a.device == "cuda":
        torch.cuda.empty_cache()


def run_load(kind: str, a, results: dict) -> None:
    """engine_load for one model (after every model's steps: the longest part runs last)."""
    attention_op.PAD_VALUES_FOR_FLASH = kind != "hybrid_nopad"
    print(f"\n== {kind}: the load through the engine, in process")
    model = build("hybrid" if kind.startswith("hybrid") else kind, a)
    try:
        results.setdefault(kind, {})["engine_load"] = engine_load(model, a)
    except Exception as e:  # e.g. the pool does not fit beside this process's leftovers: the other models go on
        print(f"engine load ({kind}) failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    del model
    gc.collect()
    if a.device == "cuda":
        torch.cuda.empty_cache()


def engine_steps(model: LM, a) -> list[float]:
    """Wall ms of each step of the real engine (no CUDA graphs, in process) prefilling two requests of a.prompt tokens
    side by side, as the load pairs them: the same packed steps as the load's, with the engine's own host work.
    The second of two rounds (the first warms)."""
    eng = Engine(model, max_batch=2, cache_budget=(4 << 30) if a.device == "cuda" else (64 << 20), block_size=256 if
                 a.prompt % 256 == 0 else a.chunk, max_len=a.prompt + 1, prefill_chunk=a.chunk,
                 max_num_batched_tokens=2 * a.chunk, cuda_graphs=False)
    gen = torch.Generator().manual_seed(2)
    for _ in range(2):
        for _ in range(2):
            eng.submit(torch.randint(0, model.cfg.vocab_size, (a.prompt,), generator=gen).tolist(),
                       SamplingParams(max_tokens=1, temperature=0))
        times = []
        with torch.inference_mode():
            while True:
                sync(a)
                t0 = time.perf_counter()
                busy = eng.step()
                sync(a)
                if not busy:
                    break
                times.append((time.perf_counter() - t0) * 1e3)
    return times


def engine_load(model: LM, a) -> dict:
    """The load itself in process, as the bench's server runs it (no HTTP): the engine's decode graphs captured
    first (`warm_up`), a.load_warmup requests untimed, then a.load_requests x (a.prompt + a.load_out) submitted at
    once. Prints wall, req/s, TTFT p50 / p99, the step times (the first half of the timed run, by steps to TTFT p50,
    against the rest: a one-off cost early shows there), the slowest steps with their plan (decode rows, chunk
    sizes), and the caching allocator's retries and cudaMallocs during the timed run (memory pressure beside a
    70 GiB pool)."""
    N, P, O = a.load_requests, a.prompt, a.load_out
    eng = Engine(model, max_batch=max(N, a.load_warmup), cache_budget=int(a.load_budget * (1 << 30)),
                 block_size=256 if P % 256 == 0 else a.chunk, max_len=P + O, prefill_chunk=a.chunk)
    eng.warm_up()
    plans: list[tuple[int, list[int]]] = []
    plan = eng._plan

    def traced():
        d, c = plan()
        plans.append((len(d), [T for _, T in c]))
        return d, c

    eng._plan = traced  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(3)

    def run(n: int):
        reqs = [eng.submit(torch.randint(0, model.cfg.vocab_size, (P,), generator=gen).tolist(),
                           SamplingParams(max_tokens=O, temperature=0)) for _ in range(n)]
        plans.clear()
        times, t0 = [], time.perf_counter()
        with torch.inference_mode():
            while True:
                s = time.perf_counter()
                if not eng.step():
                    break
                sync(a)
                times.append((time.perf_counter() - s) * 1e3)
        return reqs, times, time.perf_counter() - t0

    stats = (lambda: torch.cuda.memory_stats()) if a.device == "cuda" else (lambda: {})
    try:
        run(a.load_warmup)
        m0 = stats()
        reqs, times, wall = run(N)
        m1 = stats()
    finally:
        del eng._plan  # the traced plan refers to the engine: without this cycle its 70 GiB pool goes with it
    ttft = sorted(r.t_first - r.t_submit for r in reqs)
    p50 = ttft[len(ttft) // 2]
    clock, half = 0.0, len(times)
    for i, t in enumerate(times):
        clock += t / 1e3
        if clock >= p50:
            half = i + 1
            break
    slow = sorted(range(len(times)), key=lambda i: -times[i])[:8]
    out = {"requests": N, "wall_s": wall, "requests_per_s": N / wall, "ttft_p50_s": p50, "ttft_p99_s": ttft[-1],
           "steps": len(times), "step_ms_median": statistics.median(times),
           "steps_to_ttft_p50": half, "ms_per_step_to_p50": sum(times[:half]) / half,
           "ms_per_step_after": sum(times[half:]) / max(len(times) - half, 1),
           "slowest": [(round(times[i], 1), i, plans[i][0], plans[i][1]) for i in slow],
           "alloc_retries": m1.get("num_alloc_retries", 0) - m0.get("num_alloc_retries", 0),
           "cuda_mallocs": m1.get("num_device_alloc", 0) - m0.get("num_device_alloc", 0)}
    print(f"engine load in process: {N} x ({P} + {O}) after {a.load_warmup} warm-up: wall {wall:.2f} s, "
          f"{N / wall:.2f} req/s, TTFT p50 {p50:.2f} s p99 {ttft[-1]:.2f} s; {len(times)} steps, median "
          f"{out['step_ms_median']:.1f} ms; {out['ms_per_step_to_p50']:.1f} ms a step to TTFT p50 ({half} steps), "
          f"{out['ms_per_step_after']:.1f} after; allocator retries {out['alloc_retries']}, cudaMallocs "
          f"{out['cuda_mallocs']}")
    print("  slowest steps (ms, index, decode rows, chunks):", out["slowest"])
    return out


def kernel_tables(model: LM, pool, a, kind: str, vocab: int) -> None:
    """torch.profiler tables of one module of each layer type run alone (a.reps times) on the inputs it had in the
    load's step at the last chunk's offset, then of the whole step."""
    o = a.prompt - a.chunk
    dec = [(max(2, len(a.offsets)) + i, o + a.chunk) for i in range(a.decode)]
    chunks = [(0, o, a.chunk), (1, o, a.chunk)]
    seen: dict[str, tuple[nn.Module, tuple]] = {}
    hooks = [mod.register_forward_pre_hook(lambda m, x, name=name: seen.setdefault(name, (m, x)) and None)
             for name, mod in label(model)]
    step(model, pool, dec, chunks, vocab)
    for h in hooks:
        h.remove()
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if a.device == "cuda" else [])
    key = "self_cpu_time_total" if a.device == "cpu" else "self_cuda_time_total"
    for name, (mod, x) in seen.items():
        with torch.inference_mode():
            mod(*x)  # warm (the step already compiled every kernel)
            sync(a)
            with torch.profiler.profile(activities=acts) as prof:
                for _ in range(a.reps):
                    mod(*x)
                sync(a)
        print(f"\n== {kind}: one {name} layer alone x {a.reps}, load step 2x{a.chunk}@{o}, by {key}")
        print(prof.key_averages().table(sort_by=key, row_limit=a.kernels, max_name_column_width=70))
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(a.reps):
            step(model, pool, dec, chunks, vocab)
        sync(a)
    for k in dict.fromkeys((key, "self_cpu_time_total")):  # kernels, then the host (syncs, launches)
        print(f"\n== {kind}: the whole step x {a.reps}, load step 2x{a.chunk}@{o}, by {k}")
        print(prof.key_averages().table(sort_by=k, row_limit=a.kernels, max_name_column_width=70))


def cost_only(a) -> None:
    """The cost model of the load's steps at the bench width, per model and layer type (no step runs)."""
    a.cpu = False
    total = {}
    for kind in ("hybrid", "attention"):
        with torch.device("meta"):
            model = LM(model_configs((kind,), size="tiny", width=WIDTH)[kind]).to(torch.bfloat16)
        by: dict[str, list[float]] = {}
        for name, dec, chunks in scenarios(a):
            if name.startswith("load"):
                for n, (f, b) in cost(model, dec, chunks).items():
                    by.setdefault(n, [0.0, 0.0])
                    by[n][0] += f / 1e12
                    by[n][1] += b / 1e9
        total[kind] = sum(f for f, _ in by.values())
        print(f"{kind}: the load's {a.prompt // a.chunk} step shapes (2x{a.chunk} at each offset), summed: "
              + ", ".join(f"{n} {f:.2f} TFLOP {b:.1f} GB" for n, (f, b) in by.items()) + f"; total {total[kind]:.2f} TFLOP")
    print(f"FLOPs hybrid / attention: {total['hybrid'] / total['attention']:.3f}")


def main():
    a = args()
    if a.cost_only:
        return cost_only(a)
    if a.device == "cuda":
        import triton

        print("card", torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    results: dict = {}
    for kind in a.models:
        run_model(kind, a, results)
    if {"hybrid", "attention"} <= set(results):
        r = results["hybrid"]["load_prefill_s"] / results["attention"]["load_prefill_s"]
        print(f"\nload prefill time hybrid / attention: {r:.3f} (attention / hybrid throughput {1 / r:.3f}x)")
    for kind in a.load_models if a.load_requests else []:
        run_load(kind, a, results)
    attention_op.PAD_VALUES_FOR_FLASH = True
    print("PREFILL_PROFILE", json.dumps({k: {n: v.get(n) for n in ("load_mean_step_ms", "load_prefill_s", "engine_load")}
                                         for k, v in results.items()}))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
