"""`evict bench grid`: the kernel table (issue 79, C1) — the memory op against softmax attention over (N, d, C).

    run_grid(out="runs/bench/grid.jsonl", device="cuda")           # the full grid, one JSONL row per cell
    run_grid(out=..., **QUICK)                                      # the --quick subset

Kernels (a cell is one kernel at one N (tokens per sequence), head dim D, chunk C and pass):
    evict_kda, evict_gdn   evict's memory op (KDA: per-channel decay; Gated DeltaNet: scalar decay), delta rule,
                           the Triton kernels on CUDA (C in 16, 32, 64), the chunked PyTorch form on a CPU
    fla_kda, fla_gdn       fla's chunk_kda / chunk_gated_delta_rule (optional oracle, when installed; its chunk is
                           its own 64, so these cells have C = 64)
    sdpa_flash, sdpa_cudnn, sdpa_efficient, sdpa_math
                           causal softmax attention through F.scaled_dot_product_attention with ONE backend forced
                           (sdpa_kernel); the aten op that actually ran is recorded from the profiler ("ran")
Attention does not chunk: its cells have C = None. Batch B = tokens // N, so every cell processes the same number of
tokens; H heads of dim D (q, k, v, o all [B, N, H, D]); bf16 on CUDA, float32 on a CPU.

A cell ends in one status: ok (ms = median time), unsupported (the kernel refuses this shape or device: the reason),
skipped (its estimated memory exceeds what is free, or an exact-mask quadratic form past --max-math-tokens), oom (it ran
out of memory anyway; recorded, the grid goes on) or error (any other exception, first line). Rows are appended and
flushed as each cell ends; a rerun with the same --out skips every cell already in the file (resumable).
"""

from __future__ import annotations

import json
import os
import warnings
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F

from evict.bench.autotune import parallel_autotune_compile
from evict.cli_args import UserError, first_line, out_of_memory
from evict.jsonfile import jsonl_records
from evict.report import card, median_ms

LENGTHS = (1024, 4096, 16384, 65536)
HEAD_DIMS = (64, 128, 256)
CHUNKS = (16, 32, 64, 128)
PASSES = ("fwd", "fwd+bwd")
MEMORY_KERNELS = {"evict_kda": "kda", "evict_gdn": "gated_deltanet", "fla_kda": "kda", "fla_gdn": "gated_deltanet"}
SDPA_BACKENDS = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION", "sdpa_efficient": "EFFICIENT_ATTENTION",
                 "sdpa_math": "MATH"}
KERNELS = tuple(MEMORY_KERNELS) + tuple(SDPA_BACKENDS)
DEFAULT_KERNELS = ("evict_kda", "evict_gdn", "fla_kda", "fla_gdn", "sdpa_flash", "sdpa_cudnn")
TOKENS = 65536  # B * N in every cell
HEADS = 16
QUICK = dict(lengths=(1024, 16384), head_dims=(128,), chunks=(32, 64))
FLA_CHUNK = 64
TRITON_CHUNKS = (16, 32, 64)
KEY = ("kernel", "N", "D", "C", "pass", "B", "H", "dtype", "device")


def cells(*, lengths=LENGTHS, head_dims=HEAD_DIMS, chunks=CHUNKS, kernels=DEFAULT_KERNELS, passes=PASSES,
          tokens=TOKENS, heads=HEADS, device="cpu") -> list[dict]:
    """The grid's cells in run order (cheap first: by N, then D), each a dict of KEY's fields."""
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    out = []
    for N in sorted(lengths):
        for D in head_dims:
            for kernel in kernels:
                if kernel.startswith("fla_"):
                    cs: tuple = (FLA_CHUNK,)
                elif kernel.startswith("evict_"):
                    cs = tuple(chunks)
                else:
                    cs = (None,)
                for C in cs:
                    for p in passes:
                        out.append({"kernel": kernel, "N": N, "D": D, "C": C, "pass": p, "B": tokens // N, "H": heads,
                                    "dtype": dtype, "device": "cuda" if device.startswith("cuda") else "cpu"})
    return out


def key(row: dict) -> tuple:
    return tuple(row.get(k) for k in KEY)


def read_rows(path: str | os.PathLike) -> list[dict]:
    """The rows of a grid JSONL file ([] if it does not exist); a malformed line is one UserError naming it."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    try:
        records = list(jsonl_records(path, "--out"))
    except ValueError as e:
        raise UserError(f"{e}; expected a grid JSONL file") from None
    for i, row in records:
        if not isinstance(row, dict) or any(k not in row for k in KEY):
            raise UserError(f"--out: {path} line {i} is not a grid row (expected the fields {', '.join(KEY)})")
        rows.append(row)
    return rows


# -- memory estimates (a cell that cannot fit is skipped before it allocates) ------------------------------------

def free_bytes(device: str) -> int:
    """Free memory where the cell runs: the device's (cudaMemGetInfo) or the host's available pages."""
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info()[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def estimate_bytes(cell: dict) -> int:
    """A generous upper estimate of a cell's peak memory: inputs, gradients, per-chunk states, and the N x N scores
    of the math backend (the only form that materializes them)."""
    B, N, H, D, C = cell["B"], cell["N"], cell["H"], cell["D"], cell["C"] or 64
    elem = 2 if cell["dtype"] == "bfloat16" else 4
    train = 3 if cell["pass"] == "fwd+bwd" else 1
    tokens = B * N * H * D
    if cell["kernel"] in MEMORY_KERNELS:
        act = tokens * (5 * elem + 4) * train  # q, k, v, o, do + a float32 per-channel gate
        states = B * H * (-(-N // C)) * D * D * 4 * 2  # per-chunk states (and their gradients)
        factors = B * H * N * C * 4 * 3 * train  # the per-chunk [C, C] factors kept for the backward
        return act + states + factors
    act = tokens * 4 * elem * train
    if cell["kernel"] == "sdpa_math":
        act += B * H * N * N * 4 * 2 * train  # scores and probabilities in float32
    return act


# -- one cell ------------------------------------------------------------------------------------------------------

def _timer(device: str):
    return median_ms(device, warmup_ms=10, rep_ms=50, repeats=5)


def _sdpa_ran(fn) -> str:
    """The aten attention op(s) one call of fn dispatched to (the backend that actually ran), seen by a dispatch mode."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[str] = []

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket.__name__)
            if "attention" in name and name not in seen:
                seen.append(name)
            return func(*args, **(kwargs or {}))

    with Seen():
        fn()
    return ", ".join(seen) or "no fused attention op (matmuls and softmax: the math form)"


def _memory_fn(cell: dict, device: str, dtype: torch.dtype):
    """(callable, note) for a memory-op cell, or raise _Unsupported."""
    from evict.bench.ops import _fla, rule_inputs
    from evict.ops import memory

    kernel, rule = cell["kernel"], MEMORY_KERNELS[cell["kernel"]]
    x = rule_inputs(rule, cell["B"], cell["N"], cell["H"], cell["D"], dtype=dtype, device=device)
    args = [x["q"], x["k"], x["v"], x["log_alpha"], x["beta"]]
    train = cell["pass"] == "fwd+bwd"
    if train:
        args = [t.requires_grad_(True) for t in args]
    do = torch.randn_like(x["v"])
    if kernel.startswith("fla_"):
        if not device.startswith("cuda"):
            raise _Unsupported("fla's kernels run on CUDA only")
        chunk_fns, _ = _fla()
        if rule not in chunk_fns:
            raise _Unsupported("fla is not installed")
        f = chunk_fns[rule]
        run = lambda: f(*args)[0]
        impl = "fla"
    else:
        impl = "triton" if device.startswith("cuda") else "chunked"
        if impl == "triton" and cell["C"] not in TRITON_CHUNKS:
            raise _Unsupported(f"the Triton kernels take C in {TRITON_CHUNKS} (C = {cell['C']} would run at 64)")
        run = lambda: memory(*args[:3], log_alpha=args[3], beta=args[4], delta=True, check=False, impl=impl,
                             chunk_size=cell["C"])[0]
    if not train:
        def fwd():
            with torch.no_grad():
                return run()
        return fwd, impl
    return (lambda: torch.autograd.grad(run(), args, do)), impl


def _sdpa_fn(cell: dict, device: str, dtype: torch.dtype):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, SDPA_BACKENDS[cell["kernel"]], None)
    if backend is None:
        raise _Unsupported(f"torch {torch.__version__} has no SDPBackend.{SDPA_BACKENDS[cell['kernel']]}")
    B, N, H, D = cell["B"], cell["N"], cell["H"], cell["D"]
    train = cell["pass"] == "fwd+bwd"
    q, k, v = (torch.randn(B, H, N, D, device=device, dtype=dtype, requires_grad=train) for _ in range(3))
    do = torch.randn_like(q)

    def run():
        with sdpa_kernel([backend]), (nullcontext() if train else torch.no_grad()):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return torch.autograd.grad(o, (q, k, v), do) if train else o
    return run, None


class _Unsupported(Exception):
    pass


def run_cell(cell: dict, device: str, *, timer=None, max_math_tokens: int = 16384) -> dict:
    """Time one cell; the row (cell + status, ms, ran, note). Never raises for the cell's own failures."""
    row = dict(cell)
    dtype = torch.bfloat16 if cell["dtype"] == "bfloat16" else torch.float32
    need, free = estimate_bytes(cell), free_bytes(device)
    if cell["kernel"] == "sdpa_math" and cell["N"] > max_math_tokens:
        return {**row, "status": "skipped", "note": f"math backend past N = {max_math_tokens} (N x N scores)"}
    if need > 0.8 * free:
        return {**row, "status": "skipped", "note": f"needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"}
    timer = timer or _timer(device)
    fn = None
    try:
        if cell["kernel"] in MEMORY_KERNELS:
            fn, impl = _memory_fn(cell, device, dtype)
            row["ran"] = impl
        else:
            fn, _ = _sdpa_fn(cell, device, dtype)
            with warnings.catch_warnings(record=True) as said:  # SDPA says why a backend refuses in warnings
                warnings.simplefilter("always")
                try:
                    fn()  # fails here if the forced backend cannot take this shape / device
                except RuntimeError as e:
                    if not any(m in str(e) for m in ("No available kernel", "No viable backend")):
                        raise
                    why = [str(w.message) for w in said if "not used because" in str(w.message) or "requires" in str(w.message)]
                    raise _Unsupported(first_line(RuntimeError(why[0] if why else str(e)), 200)) from None
            row["ran"] = _sdpa_ran(fn)
        row["ms"] = round(float(timer(fn)), 4)
        row["status"] = "ok"
    except _Unsupported as e:
        row.update(status="unsupported", note=str(e))
    except Exception as e:  # a cell's failure is its row, not the grid's end
        if out_of_memory(e):
            row.update(status="oom", note=first_line(e, 120))
        elif "not supported" in str(e).lower():
            row.update(status="unsupported", note=first_line(e, 200))
        else:
            row.update(status="error", note=f"{type(e).__name__}: {first_line(e, 160)}")
    finally:
        del fn
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return row


def run_grid(out: str | os.PathLike, *, device: str = "cpu", progress: bool = True, timer=None,
             max_math_tokens: int = 16384, **grid) -> list[dict]:
    """Run every cell not already in `out` (JSONL, appended and flushed per row); returns all rows of the file."""
    todo_all = cells(device=device, **grid)
    rows = read_rows(out)
    done = {key(r) for r in rows}
    todo = [c for c in todo_all if key(c) not in done]
    info = card()
    stamp = {"date": info["date"], "torch": info["torch"], "gpu": info.get("gpu"), "triton": info.get("triton")}
    fla_version = _fla_version()
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    if progress:
        print(f"{len(todo_all) - len(todo)} of {len(todo_all)} cells already in {path}; running {len(todo)}", flush=True)
    from tqdm.auto import tqdm

    fla_cuda = device.startswith("cuda") and any(c["kernel"].startswith("fla_") for c in todo)
    # fla tunes its kernels per shape, each config compiled one after the other (75-116 s a cell on an H100, session
    # 70): its configs compile side by side first, then are timed as before (the same choice; evict/bench/autotune.py)
    tuning: AbstractContextManager[dict] = parallel_autotune_compile(log=False) if fla_cuda else nullcontext({})
    with tuning, path.open("a") as f:
        for cell in tqdm(todo, desc="cells", disable=not progress):
            row = run_cell(cell, device, timer=timer, max_math_tokens=max_math_tokens)
            row.update(stamp)
            if cell["kernel"].startswith("fla_"):
                row["fla"] = fla_version
            f.write(json.dumps(row) + "\n")
            f.flush()
            rows.append(row)
    return rows


def _fla_version() -> str | None:
    try:
        import fla

        return getattr(fla, "__version__", "?")
    except ImportError:
        return None
