"""The chunk dial: the cost law of the chunked memory op beside its measured wall-clock, per chunk size C.

    Dial(T, H, D, B)      the measured shape (gated delta rule, scalar gate, float32 on the CPU)
    cost(dial, C)         FLOPs per head = 2·T·d² (history folded into S) + 2·T·C·d (intra-chunk tiles)
    Measurer(dial, dir)   times `memory(..., impl="chunked", chunk_size=C)` for every C once, on a thread, with
                          progress; the result is cached as JSON (keyed by shape, torch version and CPU)
    gpu_numbers()         the committed CUDA timings of dev/chunk_dial_gpu.py (evict/explore/data/), or None

The law says small chunks are cheapest; a real machine says otherwise: at C = 1 the op is a loop of T tiny steps
(launch and memory bound), at C = T one T×T triangle. The wall-clock has its bottom in between.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import threading
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import TypedDict, cast

import torch

from evict.jsonfile import read_json_object
from evict.ops import memory
from evict.report import card, wall_time

GPU_DATA = "data/chunk_dial_gpu.json"


@dataclass(frozen=True)
class Dial:
    T: int = 1024
    H: int = 4
    D: int = 64
    B: int = 1
    repeats: int = 5
    threads: int = 1  # torch CPU threads while measuring (one core: steadier on a shared machine)

    def __post_init__(self):
        for name in ("T", "H", "D", "B", "repeats", "threads"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        if self.T & (self.T - 1) or self.T > 1024:
            raise ValueError(f"T: expected a power of two up to 1024 (the largest chunk), got {self.T}")

    def sizes(self) -> list[int]:
        return [2**i for i in range(self.T.bit_length()) if 2**i <= self.T]


def cost(dial: Dial, C: int) -> dict:
    """The cost law per head and for the whole measured shape (B·H heads), and the T×T work map's split."""
    if C not in dial.sizes():
        raise ValueError(f"C: expected a power of two from 1 to T={dial.T}, got {C!r}")
    T, d = dial.T, dial.D
    state, intra = 2 * T * d * d, 2 * T * C * d
    n = T // C
    pairs = T * (T + 1) // 2
    intra_pairs = n * C * (C + 1) // 2
    return {"C": C, "chunks": n, "flops_state_per_head": state, "flops_intra_per_head": intra,
            "flops_per_head": state + intra, "flops": dial.B * dial.H * (state + intra),
            "pairs": pairs, "intra_pairs": intra_pairs, "folded_pairs": pairs - intra_pairs}


def inputs(dial: Dial, device="cpu", dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B, T, H, D = dial.B, dial.T, dial.H, dial.D
    q = torch.randn(B, T, H, D, generator=g)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=g), dim=-1)
    v = torch.randn(B, T, H, D, generator=g)
    la = torch.nn.functional.logsigmoid(torch.randn(B, T, H, generator=g) + 3)  # Gated DeltaNet's scalar gate
    beta = torch.sigmoid(torch.randn(B, T, H, generator=g))
    to = lambda x, dt: x.to(device=device, dtype=dt)
    return dict(q=to(q, dtype), k=to(k, dtype), v=to(v, dtype), log_alpha=to(la, torch.float32), beta=to(beta, torch.float32))


def time_chunk(dial: Dial, C: int, x: dict) -> float:
    """Median seconds of one chunked forward at chunk size C."""
    def run():
        memory(x["q"], x["k"], x["v"], log_alpha=x["log_alpha"], beta=x["beta"], delta=True, impl="chunked",
               chunk_size=C, check=False)

    with torch.no_grad():
        return wall_time(run, repeats=dial.repeats, warmup=1)


def _cache_key(dial: Dial) -> str:
    ident = json.dumps({**asdict(dial), "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
                        "cores": os.cpu_count()}, sort_keys=True)
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "evict" / "explore"


class _Progress(TypedDict):
    done: int  # sizes measured so far
    total: int
    error: str | None  # what stopped the measurement, for the page


class Measurer:
    """One measurement per (shape, machine): `start()` runs it on a thread (once); `state()` reports progress;
    `result()` is the cached JSON (or None)."""

    def __init__(self, dial: Dial, cache_dir: Path | None = None):
        self.dial = dial
        self.path = Path(cache_dir or default_cache_dir()) / f"chunk_dial_{_cache_key(dial)}.json"
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._progress: _Progress = {"done": 0, "total": len(dial.sizes()), "error": None}

    def result(self) -> dict | None:
        """The cached measurement, or None when there is none or it is damaged (unreadable JSON, sizes of another
        shape, a time that is not a finite positive number of seconds): a damaged cache is measured again."""
        if not self.path.is_file():
            return None
        try:
            data = read_json_object(self.path, "chunk dial cache")
        except ValueError:
            return None
        return data if _valid_measurement(data, self.dial) else None

    def state(self) -> dict:
        with self._lock:
            p = dict(self._progress)
        running = self._thread is not None and self._thread.is_alive()
        status = "done" if self.result() is not None else "running" if running else "error" if p["error"] else "idle"
        return {"status": status, **p}

    def start(self) -> dict:
        with self._lock:
            if self.result() is None and (self._thread is None or not self._thread.is_alive()):
                self._progress = {"done": 0, "total": len(self.dial.sizes()), "error": None}
                self._thread = threading.Thread(target=self._run, name="chunk-dial", daemon=True)
                self._thread.start()
        return self.state()

    def _run(self) -> None:
        threads = torch.get_num_threads()
        torch.set_num_threads(self.dial.threads)
        try:
            x = inputs(self.dial)
            seconds = []
            for C in self.dial.sizes():
                seconds.append(time_chunk(self.dial, C, x))
                with self._lock:
                    self._progress["done"] += 1
            payload = {"sizes": self.dial.sizes(), "seconds": seconds, "shape": asdict(self.dial), "card": card(),
                       "op": "memory(delta=True, scalar gate, impl='chunked'), float32, forward"}
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(payload, indent=1))
            os.replace(tmp, self.path)
        except Exception as e:  # reported to the page; the thread must not die silently
            with self._lock:
                self._progress["error"] = f"{type(e).__name__}: {e}"
        finally:
            torch.set_num_threads(threads)


def _valid_measurement(data: dict, dial: Dial) -> bool:
    seconds = data.get("seconds")
    return (data.get("sizes") == dial.sizes() and isinstance(seconds, list) and len(seconds) == len(dial.sizes())
            and all(type(s) in (int, float) and math.isfinite(s) and s > 0 for s in seconds)
            and data.get("shape") == asdict(dial))


def gpu_numbers() -> dict | None:
    """The committed GPU timings, checked; None while none have been measured."""
    path = resources.files("evict.explore").joinpath(GPU_DATA)
    if not path.is_file():
        return None
    data = read_json_object(cast(Path, path), "chunk dial GPU numbers")  # the package is installed as files
    sizes, seconds = data.get("sizes"), data.get("seconds")
    if not (isinstance(sizes, list) and isinstance(seconds, list) and len(sizes) == len(seconds) and sizes
            and isinstance(data.get("card"), dict) and isinstance(data.get("shape"), dict)
            and all(type(s) in (int, float) and math.isfinite(s) and s > 0 for s in seconds)):
        raise ValueError(f"chunk dial GPU numbers: {path} lacks matching 'sizes' and 'seconds' (finite, positive), 'card' and 'shape'")
    return data
