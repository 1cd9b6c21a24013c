"""Model-level training throughput: one LM at one shape, evict beside the reference implementations, one table.

    bench_model(models=("kda_226m",), batch=4, seq_len=4096, modes=("eager",), references=True, out=...)
    evict bench train --lm kda_226m --batch-size 4 --seq-len 4096 --device cuda --out runs/bench/train_kda.json

Every row trains the same way: float32 parameters, bf16 autocast, fused AdamW, gradient clipping at 1, a loss on every
position of one fixed random batch (evict: `LM(tokens, targets=)`, the chunked linear cross-entropy; transformers /
fla: the model's own `labels=` loss, which shifts the tokens itself: T - 1 positions). `warmup` steps (compilation,
allocator, autotuning) run first, then `steps` timed steps between two synchronizations. Reported: tokens/s, peak
memory (torch.cuda.max_memory_allocated over the timed steps: weights, gradients, AdamW state and activations), MFU,
and the warm-up's seconds (what a fresh process pays before its first fast step). Modes: eager; compiled (each block
torch.compile'd, `compile_blocks` with its default form, lean since session 66); compiled-lean
(`compile_blocks(lean=True)`: the blocks keep less for the backward, recomputing elementwise values there);
compiled-keep (`compile_blocks(lean=False)`: the keep-all form, the default before).

MFU = FLOPs per token × tokens/s / the card's bf16 dense peak (H100 / H200 SXM: 989.4 TFLOPS). FLOPs per token =
6 N + the attention products: N the parameters that multiply (every parameter but the embedding tables; a tied head
counted once, as the head); each softmax-attention layer adds 6 T H (d_qk + d_v) — 12 T d for GPT-2 —, counted in
full as PaLM and nanoGPT count it (not halved for causality); MLA the same with its per-head dims. The memory op's own
products (state reads and writes, in-chunk Gram products) are not counted, so a KDA model's MFU is a lower bound.

References (optional; a row is skipped with its reason when the package is missing): GPT-2 shapes against
transformers' `GPT2LMHeadModel` (sdpa attention, dropout 0, eager and torch.compile of the whole model); a KDA-only
stack against fla's `KDAForCausalLM` (the config `evict.convert.fla.fla_config` maps, fla's own defaults otherwise;
eager). Hybrids (KKKA, KKKM) are compared with evict's KDA-only model of the same width when that runs beside them.
"""

from __future__ import annotations

import math
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from evict.bench.autotune import parallel_autotune_compile
from evict.report import card, markdown_table, write_json
from evict.models import LM, compile_blocks, presets
from evict.models.config import ModelConfig

PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12}  # dense bf16 tensor-core FLOP/s of the SXM cards
MODES = ("eager", "compiled", "compiled-lean", "compiled-keep")  # compiled: compile_blocks' default form (lean);
# compiled-lean: compile_blocks(lean=True); compiled-keep: compile_blocks(lean=False), the keep-all form
_LEAN = {"compiled-lean": True, "compiled-keep": False}
IMPLS = ("evict", "reference")

_KDA_226M: dict[str, Any] = dict(vocab_size=32768, d_model=1024, n_layers=12, n_heads=8, head_dim=128, d_ff=2816,
                                  tie_embeddings=False)
_MLA_1024: dict[str, Any] = dict(kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128)
NAMED: dict[str, Callable[[], ModelConfig]] = {
    # issue 74's shapes: the KDA LM of 226M parameters and its 3:1 hybrids with attention / MLA every fourth layer
    "kda_226m": lambda: presets.get("kda", **_KDA_226M),
    "kkka_226m": lambda: presets.get("kda", pattern="KKKA", **_KDA_226M),
    "kkkm_226m": lambda: presets.get("kda", pattern="KKKM", **_KDA_226M, **_MLA_1024),
    "gpt2_124m": lambda: presets.get("gpt2_124m"),
}


def model_config(name: str, size: str = "tiny") -> ModelConfig:
    """A NAMED shape, or any preset (`evict.models.presets`) at `size`."""
    if name in NAMED:
        return NAMED[name]()
    try:
        return presets.get(name, size=size)
    except ValueError as e:
        raise ValueError(f"model: expected one of {sorted(NAMED)} or a preset ({', '.join(presets.names())}); "
                         f"got {name!r}") from e


def matmul_params(model: nn.Module, head: nn.Linear) -> int:
    """Parameters that multiply: all but the embedding tables (a head tied to one counts once, as the head)."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    n = sum(p.numel() for p in model.parameters() if id(p) not in tables)
    return n + (head.weight.numel() if id(head.weight) in tables else 0)


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Forward + backward FLOPs per token of the softmax-attention products (QKᵀ and AV, full T: not halved)."""
    total = 0
    for letter in cfg.layer_mixers():
        if letter == "A":
            total += 6 * seq_len * cfg.n_heads * 2 * cfg.head_size
        elif letter == "M":
            total += 6 * seq_len * cfg.n_heads * (cfg.qk_nope_dim + cfg.qk_rope_dim + cfg.v_head_dim)
    return total


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    if "PCIe" in name:
        return None
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


@dataclass
class _Subject:
    impl: str  # "evict", "transformers", "fla"
    model: nn.Module
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (tokens [B, T], targets [B, T]) -> mean loss
    flops_per_token: float


def _evict(cfg: ModelConfig, seq_len: int, device: torch.device, checkpoint_blocks: bool) -> _Subject:
    model = LM(cfg, checkpoint_blocks=checkpoint_blocks).to(device)
    flops = 6 * matmul_params(model, model.head) + attention_flops_per_token(cfg, seq_len)
    return _Subject("evict", model, lambda x, y: model(x, targets=y).loss, flops)


def _transformers_gpt2(cfg: ModelConfig, seq_len: int, device: torch.device) -> _Subject:
    from transformers import GPT2Config, GPT2LMHeadModel

    hf = GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.max_seq_len, n_embd=cfg.d_model, n_layer=cfg.n_layers,
                    n_head=cfg.n_heads, n_inner=cfg.ffn_hidden, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                    layer_norm_epsilon=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings)
    hf._attn_implementation = "sdpa"
    model = GPT2LMHeadModel(hf).to(device)  # type: ignore[arg-type]  # transformers' stub types .to oddly
    flops = 6 * matmul_params(model, model.lm_head) + attention_flops_per_token(cfg, seq_len)
    return _Subject("transformers", model, lambda x, y: model(input_ids=x, labels=x).loss, flops)


def _fla_kda(cfg: ModelConfig, seq_len: int, device: torch.device) -> _Subject:
    from fla.models import KDAConfig, KDAForCausalLM

    from evict.convert.fla import fla_config

    fields = {k: v for k, v in fla_config(cfg).items() if k not in ("model_type", "architectures")}
    model = KDAForCausalLM(KDAConfig(**fields)).to(device)
    flops = 6 * matmul_params(model, model.lm_head) + attention_flops_per_token(cfg, seq_len)
    return _Subject("fla", model, lambda x, y: model(input_ids=x, labels=x).loss, flops)


def _reference(cfg: ModelConfig) -> tuple[str, Callable] | None:
    """The reference implementation for this config, if one maps: (its name, its builder)."""
    letters = set(cfg.layer_mixers())
    if letters == {"A"} and cfg.pos == "learned" and cfg.ffn == "gelu" and cfg.norm == "layernorm" and cfg.bias:
        return "transformers", _transformers_gpt2
    if letters == {"K"} and cfg.moe is None and not cfg.attn_res and cfg.ffn == "swiglu":
        return "fla", _fla_kda
    return None


def _measure(subject: _Subject, x: torch.Tensor, y: torch.Tensor, *, warmup: int, steps: int,
             compiled: bool, lean: bool | None = None, profile: int = 0) -> dict[str, Any]:
    model, device = subject.model, x.device
    model.train()
    loss_fn = subject.loss
    if compiled:
        compile_blocks(model, lean=lean)  # an LM per block (one dynamo cache per block form), as `evict train --compile`
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
    amp = torch.autocast(device.type, dtype=torch.bfloat16)

    def step() -> torch.Tensor:
        with amp:
            loss = loss_fn(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=device.type == "cuda" or None)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    w0 = time.perf_counter()
    for _ in range(warmup):
        step()
    sync()
    warm_s = time.perf_counter() - w0  # compilation, autotuning, allocator growth: the cost of a fresh process
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        last = step()
    sync()
    dt = time.perf_counter() - t0
    tps = x.numel() * steps / dt
    peak = peak_flops(device)
    loss = float(last)
    if not math.isfinite(loss):
        raise ValueError(f"{subject.impl}: the training loss is not finite after {warmup + steps} steps ({loss})")
    mem = round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None
    out: dict[str, Any] = {"tok/s": round(tps), "peak GiB": mem,
                           "MFU %": None if peak is None else round(100 * subject.flops_per_token * tps / peak, 1),
                           "ms/step": round(1000 * dt / steps, 1), "loss": round(loss, 3), "warmup s": round(warm_s, 1)}
    if profile:
        out["kernels"] = _kernel_table(step, sync, device, profile)
    return out


def _kernel_table(step: Callable[[], torch.Tensor], sync: Callable[[], None], device: torch.device, rows: int) -> str:
    """torch.profiler over one more step: the top `rows` kernels by their own device time (CPU ops on a CPU)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        step()
        sync()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=100)


def bench_model(*, models=("kda_226m",), size: str = "tiny", batch: int = 4, seq_len: int = 4096,
                modes=("eager",), references: bool = True, warmup: int = 3, steps: int = 10,
                checkpoint_blocks: bool = False, device: str = "cuda", out=None, profile: int = 0,
                impls=None, parallel_compile: bool = True) -> list[dict]:
    """Train each of `models` (NAMED shapes or presets at `size`) at batch × seq_len in each of `modes`, beside its
    reference when `references`; print one table, write JSON to `out` (rewritten after every row, so a run cut short
    keeps the rows it finished). Returns the rows.

    profile: > 0 profiles one more step of every row (torch.profiler) and prints its top `profile` kernels by device
    time; the tables go into the JSON (each row's "kernels") and beside it as text (`out` with .kernels.txt).
    impls: None for all, or the implementations to run of ("evict", "reference"): ("reference",) runs only
    transformers' / fla's rows (rows of separate runs are put side by side by `merge`).
    parallel_compile: fla's rows compile their autotuned kernels' configs in parallel before timing them
    (`evict.bench.autotune`; the choice is unchanged). False where Triton's autotune results are already on disk
    (TRITON_CACHE_DIR restored from an earlier run): then only the chosen configs compile."""
    for name, value, low in (("batch", batch, 1), ("seq_len", seq_len, 1), ("warmup", warmup, 1), ("steps", steps, 1),
                             ("profile", profile, 0)):
        if type(value) is not int or value < low:
            raise ValueError(f"{name}: expected {'a positive' if low else 'a non-negative'} integer, got {value!r}")
    impls = IMPLS if impls is None else tuple(impls)
    if not impls or any(i not in IMPLS for i in impls):
        raise ValueError(f"impls: expected names from {IMPLS}, got {list(impls)}")
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"modes: expected names from {MODES}, got {list(modes)}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: no CUDA device is available")
    configs = {name: model_config(name, size) for name in models}  # every name checked before the first model runs
    for name, cfg in configs.items():
        if cfg.pos == "learned" and seq_len > cfg.max_seq_len:
            raise ValueError(f"seq_len: {name} has learned positions for {cfg.max_seq_len} tokens, got {seq_len}")
    if "evict" not in impls:  # only references asked for: each model must have one, or the run would do nothing
        lacking = [name for name, cfg in configs.items() if not references or _reference(cfg) is None]
        if lacking:
            why = "references=False" if not references else "no reference model maps to them (GPT-2 or KDA-only)"
            raise ValueError(f"impls: ('reference',) runs nothing for {lacking}: {why}")
    rows: list[dict] = []
    meta = {"card": card(), "batch": batch, "seq_len": seq_len, "modes": list(modes), "warmup": warmup, "steps": steps,
            "checkpoint_blocks": checkpoint_blocks}

    def save() -> None:
        if out:
            _write(out, meta, rows)

    for name, cfg in configs.items():
        g = torch.Generator().manual_seed(0)
        data = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=g).to(dev)
        x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
        ref = _reference(cfg) if references else None
        for mode in modes:
            builders: list[tuple[str, Callable[[], _Subject]]] = []
            if "evict" in impls:
                builders.append(("evict", lambda: _evict(cfg, seq_len, dev, checkpoint_blocks)))
            if ref is not None and "reference" in impls and not (ref[0] == "fla" and mode != "eager"):
                builders.append((ref[0], lambda: ref[1](cfg, seq_len, dev)))
            for impl, build in builders:
                row: dict[str, Any] = {"model": name, "impl": impl, "mode": mode, "shape": f"B{batch} T{seq_len}"}
                torch.manual_seed(0)
                try:
                    subject = build()
                except ImportError as e:
                    row["note"] = f"skipped: {e}"
                    rows.append(row)
                    print(row, flush=True)
                    save()
                    continue
                row["params M"] = round(sum(p.numel() for p in subject.model.parameters()) / 1e6, 1)
                row["GFLOP/token"] = round(subject.flops_per_token / 1e9, 3)
                fla = impl == "fla" and parallel_compile
                tuning: AbstractContextManager[dict] = parallel_autotune_compile() if fla else nullcontext({})
                with tuning as tuned:
                    row.update(_measure(subject, x, y, warmup=warmup, steps=steps, compiled=mode != "eager",
                                        lean=_LEAN.get(mode),
                                        profile=profile))
                if tuned.get("kernels"):
                    row["note"] = (f"{tuned['kernels']} autotuned kernels, {tuned['configs']} configs compiled in "
                                   f"parallel first ({tuned['compile s']} s)")
                rows.append(row)
                save()
                print({k: v for k, v in row.items() if k != "kernels"}, flush=True)
                if "kernels" in row:
                    print(f"{name} {impl} {mode}: top {profile} kernels of one step\n{row['kernels']}", flush=True)
                del subject
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    _ratios(rows)
    print(f"\nmodel-level training, bf16 autocast, fused AdamW, {steps} timed steps after {warmup}"
          f"{', activation checkpointing per block' if checkpoint_blocks else ''}\n")
    print(markdown_table(rows, COLUMNS))
    return rows


COLUMNS = ["model", "impl", "mode", "shape", "params M", "tok/s", "peak GiB", "MFU %", "ms/step", "vs", "tok/s ratio",
           "memory ratio", "loss", "warmup s", "note"]


def _write(out, meta: dict, rows: list[dict]) -> None:
    """The run's JSON (ratios recomputed over its rows) and, where rows were profiled, their kernel tables as text."""
    from pathlib import Path

    _ratios(rows)
    write_json(out, {**meta, "rows": rows})
    tables = [r for r in rows if "kernels" in r]
    if tables:
        Path(out).with_suffix(".kernels.txt").write_text("".join(
            f"## {r['model']} {r['impl']} {r['mode']} {r['shape']}: {r['tok/s']} tok/s, peak {r['peak GiB']} GiB\n"
            f"{r['kernels']}\n" for r in tables))


def merge(paths, out=None) -> list[dict]:
    """Rows of several `bench_model` JSONs of one run (one process per row, say) in one table, the ratios computed
    across them (evict against transformers / fla in the same mode, hybrids against evict's KDA-only model); the
    merged JSON keeps each file's settings beside its rows (`runs`)."""
    import json
    from pathlib import Path

    runs, rows = [], []
    for p in paths:
        data = json.loads(Path(p).read_text())
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            raise ValueError(f"paths: expected bench_model JSON files with a 'rows' list, got {str(p)!r}")
        runs.append({"file": Path(p).name, **{k: v for k, v in data.items() if k != "rows"}})
        rows += [{k: v for k, v in r.items() if k not in ("vs", "tok/s ratio", "memory ratio")} for r in data["rows"]]
    if out:
        _write(out, {"card": runs[0].get("card") if runs else None, "runs": runs}, rows)
    else:
        _ratios(rows)
    print(markdown_table(rows, COLUMNS))
    return rows


def _ratios(rows: list[dict]) -> None:
    """evict's rows against their reference in the same mode (transformers / fla; a compiled row with no compiled fla
    row against fla's eager one, labelled so), hybrids against evict's KDA-only model of the same width in the same mode: tokens/s ratio (> 1: evict faster) and peak-memory ratio (< 1: less).
    Only rows of the same shape are compared (`merge` may bring rows of several runs together)."""
    def find(model, impl, mode, shape):
        return next((r for r in rows if (r["model"], r["impl"], r["mode"], r.get("shape")) == (model, impl, mode, shape)
                     and "tok/s" in r), None)

    for r in rows:
        if r["impl"] != "evict" or "tok/s" not in r:
            continue
        at = r.get("shape")
        base = next((b for b in (find(r["model"], i, r["mode"], at) for i in ("transformers", "fla")) if b), None)
        if base is None and r["model"] in ("kkka_226m", "kkkm_226m"):
            base = find("kda_226m", "evict", r["mode"], at)
        if base is None and r["mode"] != "eager":  # fla's model runs eager only (its kernels are its speed): a compiled
            base = find(r["model"], "fla", "eager", at)  # evict row is what a user would put beside fla as fla runs
        if base is None:
            continue
        r["vs"] = f"{base['impl']} {base['model']}" if base["model"] != r["model"] else base["impl"]
        if base["mode"] != r["mode"]:
            r["vs"] += f" ({base['mode']})"
        r["tok/s ratio"] = round(r["tok/s"] / base["tok/s"], 2)
        if r["peak GiB"] is not None and base["peak GiB"]:
            r["memory ratio"] = round(r["peak GiB"] / base["peak GiB"], 2)
