"""The training loop shared by every task: AdamW, warmup + cosine, clipping, eval, JSONL metrics, checkpoints.

The loop knows a task only through `Task.get_batch(split, step, batch_size)` and a model only through
`model(inputs) -> logits [B, T, V]` (or a tuple / an object with `.logits` whose first item is the logits) — or, when
its forward takes `targets=`, `model(inputs, targets=y) -> LossOut` (evict's LM: the chunked linear cross-entropy, which
never holds the batch's float32 logits) — plus two optional hooks: `model.aux_loss()` (a Tensor or None, read after each forward and added to the
loss; e.g. MoE balancing) and `model.after_step()` (called after each optimizer step; e.g. MoE bias updates).

Batches are a function of the step, so a run resumed from a checkpoint (model, optimizer, RNG
states) takes exactly the same steps as one that was never interrupted.

`batch_size` is the global batch of one optimizer step: split over the ranks of a torch.distributed run (torchrun;
evict.distributed wraps the model in FSDP2 or DDP) and then into `grad_accum` micro-batches per rank. Rank r takes
rows [r·B/world, (r+1)·B/world) of train batch `step` (and of each val batch), so a run on N ranks with
accumulation computes the same losses as one process at the same global batch. Only rank 0 shows progress, logs
and writes the metrics; checkpoints are one file on one rank, or torch.distributed.checkpoint shards on several.

Resuming (out_dir/checkpoint.pt) continues the step count, RNG and optimizer; `check_resume` says which changed
flags are honoured (schedule, optimizer settings, steps, logging: re-planned from the resume step) and which are
refused (seed, batch_size: they change which data the finished steps saw).
"""

from __future__ import annotations

import dataclasses
import errno
import inspect
from typing import Any
import json
import logging
import math
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from . import distributed
from .cli_args import first_line
from .jsonfile import replace_text
from .ops.loss import LossOut
from .runfolder import run_lock, trim_metrics
from .tasks.base import Task

logger = logging.getLogger(__name__)

_AMP = ("auto", "bf16", "none")
FIXED_ON_RESUME = ("seed", "batch_size")  # a resumed run must keep these: they decide the data of every step


@dataclass
class TrainConfig:
    """Everything the loop needs; saved in every checkpoint."""

    steps: int = 1000
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.1
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0  # cosine decays lr to lr · min_lr_ratio at the last step
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float | None = 1.0  # None or 0 = no clipping
    eval_every: int = 100
    eval_batches: int = 4
    target_accuracy: float | None = None  # stop early once val accuracy >= this
    seed: int = 0
    threads: int | None = None  # torch.set_num_threads
    device: str = "auto"  # "auto" = cuda if available else cpu
    amp: str = "auto"  # "auto" = bf16 autocast on CUDA only; "bf16" = always; "none" = off
    out_dir: str | None = None  # metrics.jsonl and checkpoint.pt go here
    checkpoint_every: int | None = None  # a checkpoint is also written at the end when out_dir is set
    resume: bool = True  # continue from out_dir/checkpoint.pt if it exists
    progress: bool = True
    log_every: int = 10
    graphs: bool = False  # replay the whole step (forward, backward, clip, AdamW) from one CUDA graph; CUDA only
    select_labels: bool = True  # head and loss at the labelled positions only, for tasks with `labels_per_row`
    prefetch: int = 2  # CUDA: batches prepared ahead by a background thread (0 = inline)
    stop_at: float | None = None  # wall-clock time (time.time()): checkpoint and return early once past it (resumable)
    stop_file: str | None = None  # a path whose existence, seen at an evaluation, ends the run there (stopped_early)
    grad_accum: int = 1  # micro-batches per rank per optimizer step (batch_size is the global batch)
    compile: bool = False  # torch.compile each block (or the whole model if it has no `blocks`)
    compile_lean: bool | None = None  # with compile: True the lean compiled form, compile_blocks(lean=True) (blocks keep
    # less for the backward and recompute elementwise values and the short conv there); False the keep-all form; None
    # the module's default (evict.models.compile_blocks.LEAN: lean)
    checkpoint_blocks: bool = False  # activation checkpointing per block (sets evict's LM's gradient_checkpointing)
    dist: str = "fsdp"  # under torchrun: "fsdp" (FSDP2, per block) or "ddp"
    tensorboard: bool = False  # also write the metrics rows as TensorBoard scalars into out_dir/tensorboard

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "eval_every", "eval_batches", "log_every", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.lr * self.weight_decay >= 1:  # AdamW multiplies each matrix by 1 - lr·wd per step: <= 0 flips or zeroes it
            raise ValueError(f"weight_decay must be < 1 / lr = {1 / self.lr:g} (AdamW scales the weights by "
                             f"1 - lr · weight_decay each step), got {self.weight_decay:g}")
        if not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(f"warmup_steps must be in [0, steps={self.steps}], got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas}")
        self.betas = (float(self.betas[0]), float(self.betas[1]))
        if self.grad_clip is not None and self.grad_clip < 0:
            raise ValueError(f"grad_clip must be >= 0 or None, got {self.grad_clip}")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1 or None, got {self.checkpoint_every}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1 or None, got {self.threads}")
        if self.amp not in _AMP:
            raise ValueError(f"amp must be one of {_AMP}, got {self.amp!r}")
        if self.target_accuracy is not None and not 0.0 < self.target_accuracy <= 1.0:
            raise ValueError(f"target_accuracy must be in (0, 1] or None, got {self.target_accuracy}")
        if self.prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {self.prefetch}")
        if self.batch_size % self.grad_accum:
            raise ValueError(f"batch_size must be a multiple of grad_accum={self.grad_accum}, got {self.batch_size}")
        if self.dist not in distributed.DIST:
            raise ValueError(f"dist must be one of {distributed.DIST}, got {self.dist!r}")
        if self.compile_lean and not self.compile:
            raise ValueError("compile_lean: the lean form is a form of the compiled blocks; needs compile=True, got "
                             "compile=False")
        if self.graphs and self.grad_accum > 1:
            raise ValueError("graphs: a captured step holds one batch; use grad_accum=1 with graphs")
        if self.tensorboard and self.out_dir is None:
            raise ValueError("tensorboard: needs out_dir (the event files go into out_dir/tensorboard)")

    def check_world(self, world: int) -> None:
        """The global batch must split evenly over `world` ranks × grad_accum micro-batches."""
        if self.batch_size % (world * self.grad_accum):
            raise ValueError(f"batch_size must be a multiple of world size × grad_accum = {world} × {self.grad_accum}, "
                             f"got {self.batch_size}")
        if self.graphs and world > 1:
            raise ValueError("graphs: CUDA graphs are single-process; drop graphs under torchrun")


def check_resume(saved: dict, step: int, cfg: TrainConfig) -> None:
    """Refuse a resume that would misdescribe the finished steps: the flags in FIXED_ON_RESUME must match the
    checkpoint's config (`saved`), and `steps` cannot fall below the `step` already trained. Everything else is
    honoured from the resume step on (the schedule is planned for the new `steps`, warmup and min_lr_ratio)."""
    for name in FIXED_ON_RESUME:
        if name in saved and saved[name] != getattr(cfg, name):
            raise ValueError(f"{name}: the checkpoint was trained with {saved[name]!r}, got {getattr(cfg, name)!r}; "
                             "pass the same value to resume, or start over (--no-resume / resume=False)")
    if cfg.steps < step:
        raise ValueError(f"steps: the checkpoint has already trained {step} steps; expected steps >= {step} to resume, "
                         "or start over (--no-resume / resume=False)")


def read_checkpoint(path: Path) -> dict:
    """checkpoint.pt as saved (tensors memory-mapped, not read), loaded with weights_only=True; one-line ValueError
    if it is not a readable checkpoint."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # a truncated zip, a foreign pickle: torch raises several types
        raise ValueError(f"checkpoint: {path} is not a readable checkpoint ({first_line(e)}); "
                         "delete it to start over") from None


@dataclass
class TrainResult:
    steps_done: int
    best_val_accuracy: float
    final_val_loss: float
    final_val_accuracy: float
    wall_seconds: float  # this session's (a resumed run's earlier sessions: total_seconds)
    history: list[dict] = field(default_factory=list)  # one dict per evaluation
    stopped_early: bool = False
    interrupted: bool = False  # stopped at cfg.stop_at before the end; the checkpoint resumes it
    diverged_at: int | None = None  # the step whose logged training loss was not finite; the run stopped there
    total_seconds: float = 0.0  # wall seconds over every session of the run (each checkpoint's segments say theirs)


class WarmupCosine:
    """lr multiplier for optimizer step s: linear warmup over `warmup` steps, then cosine to `min_ratio`."""

    def __init__(self, steps: int, warmup: int, min_ratio: float) -> None:
        self.steps, self.warmup, self.min_ratio = steps, warmup, min_ratio

    def __call__(self, s: int) -> float:
        if s < self.warmup:
            return (s + 1) / self.warmup
        progress = min(1.0, (s - self.warmup) / max(1, self.steps - self.warmup))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (ndim >= 2) only; norms, biases and gains (ndim < 2) get none."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def _logits(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return out[0]
    return out.logits


def _aux_loss(model: nn.Module) -> torch.Tensor | None:
    hook = getattr(distributed.unwrap(model), "aux_loss", None)
    return hook() if callable(hook) else None


def _takes(model: nn.Module, name: str) -> bool:
    """Whether the (unwrapped) model's forward has a parameter `name`."""
    return name in inspect.signature(distributed.unwrap(model).forward).parameters


def _labels_per_row(model: nn.Module, task: Task, cfg: TrainConfig) -> int | None:
    """The task's fixed number of labelled positions per row, when the model can compute logits at given positions."""
    n = getattr(task, "labels_per_row", None) if cfg.select_labels else None
    return n if n is not None and _takes(model, "positions") else None


def _rows(task: Task, split: str, index: int, cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of batch `index` of `split`, as grad_accum micro-batches: [A, B / (world A), T] each."""
    rank, world = distributed.world()
    x, y = task.get_batch(split, index, cfg.batch_size)  # [B, T]: the global batch, the same on every rank
    per_rank = cfg.batch_size // world
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    return (x[rows].reshape(cfg.grad_accum, per_rank // cfg.grad_accum, -1),
            y[rows].reshape(cfg.grad_accum, per_rank // cfg.grad_accum, -1))


def evaluate(model: nn.Module, task: Task, cfg: TrainConfig, device: torch.device, autocast) -> dict:
    """Loss and accuracy over labelled positions of the fixed val set (eval_batches global batches), summed over ranks."""
    per_row = _labels_per_row(model, task, cfg)
    world = distributed.world()[1]
    was_training = model.training
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, labelled
    with torch.no_grad():
        for i in range(cfg.eval_batches):
            xs, ys = _rows(task, "val", i, cfg)
            for x, y in zip(xs.to(device), ys.to(device)):  # [b, T] each
                with autocast():
                    out = _loss(model, x, y, per_row)
                sums += torch.stack([out.loss.double() * out.labelled, out.correct.double(), out.labelled.double()])
    if world > 1:
        dist.all_reduce(sums)
    model.train(was_training)
    loss, correct, n = sums.tolist()
    return {"loss": loss / max(n, 1.0), "accuracy": correct / max(n, 1.0)}


def _rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def save_checkpoint(path: Path, state: dict) -> None:
    """Atomic: write a temporary file beside `path`, then os.replace it into place. A failed write (a full disk:
    torch raises RuntimeError) leaves the previous checkpoint and no temporary, and is an OSError naming `path`."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        tmp.unlink(missing_ok=True)
        raise OSError(getattr(e, "errno", None) or errno.EIO, f"cannot write the checkpoint ({first_line(e)})",
                      str(path)) from None


def write_json(path: Path, obj: dict) -> None:
    """Atomic, as save_checkpoint."""
    replace_text(path, json.dumps(obj, indent=2))


class _Prefetch:
    """Batches `first`, `first + 1`, ... (`make(step)`), prepared `depth` ahead by a thread in pinned memory.

    The batch for a step is the same as `make` would give inline; only when it is made differs."""

    def __init__(self, make, first: int, depth: int) -> None:
        import queue
        import threading

        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()

        def work() -> None:
            s = first
            while not self.stop.is_set():
                x, y = make(s)
                item = (s, x.pin_memory(), y.pin_memory())
                while not self.stop.is_set():
                    try:
                        self.q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                s += 1

        self.thread = threading.Thread(target=work, daemon=True)
        self.thread.start()

    def get(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        s, x, y = self.q.get()
        assert s == step, (s, step)
        return x, y

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def label_positions(y: torch.Tensor, n: int) -> torch.Tensor:
    """[B, T] targets with n labelled positions per row -> their positions [B, n], ascending; no host sync."""
    return torch.argsort((y == -100).to(torch.int8), dim=1, stable=True)[:, :n]


# one training step's mean loss, mean aux loss (None without MoE), last micro-batch's correct and labelled counts,
# grad norm
_StepOut = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, per_row: int | None) -> LossOut:
    """The mean loss over labelled targets of one micro-batch, with its correct and labelled counts: the model's own
    (`targets=`: evict's LM, the chunked linear cross-entropy) when its forward takes one, else the cross-entropy of
    its float32 logits. With `per_row` labels per row, at those positions only ([B, P] instead of [B, T])."""
    kw = {}
    if per_row is not None:
        pos = label_positions(y, per_row)  # [B, P]
        y, kw = y.gather(1, pos), {"positions": pos}
    if _takes(model, "targets"):
        return model(x, targets=y, **kw)
    logits = _logits(model(x, **kw)).float()  # [B, T or P, V]
    mask = y != -100
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
    return LossOut(loss, ((logits.argmax(-1) == y) & mask).sum(), mask.sum())


def _make_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW; on one CUDA device the fused kernel with the learning rate as a device tensor (set each step,
    graph-safe); under torch.distributed on CUDA the foreach kernel (DTensor parameters)."""
    groups = param_groups(model, cfg.weight_decay)
    if device.type != "cuda" or distributed.active():
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, foreach=device.type == "cuda" or None)
    return torch.optim.AdamW(groups, lr=torch.tensor(cfg.lr, device=device), betas=cfg.betas, fused=True,
                             capturable=cfg.graphs)


def _restore_optimizer_placement(opt: torch.optim.Optimizer, cfg: TrainConfig, device: torch.device) -> None:
    """After loading a checkpoint (read on the CPU): this run's betas and weight decay (a changed flag is honoured),
    learning-rate holder and graph flag, device steps."""
    fused = device.type == "cuda" and not distributed.active()
    for g, wd in zip(opt.param_groups, (cfg.weight_decay, 0.0)):
        g["betas"], g["weight_decay"] = cfg.betas, wd
        lr = float(g["lr"])
        g["lr"] = torch.tensor(lr, device=device) if fused else lr
        if fused:
            g["fused"], g["capturable"] = True, cfg.graphs
    if fused:
        for st in opt.state.values():
            if isinstance(st.get("step"), torch.Tensor):
                st["step"] = st["step"].to(device, torch.float32)


def _set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        if isinstance(g["lr"], torch.Tensor):
            g["lr"].fill_(lr)
        else:
            g["lr"] = lr


def train(model: nn.Module, task: Task, cfg: TrainConfig, record: dict | None = None) -> TrainResult:
    """Train `model` on `task` for cfg.steps optimizer steps (or until val accuracy >= target_accuracy).

    Under torch.distributed (torchrun) the model is sharded (FSDP2) or replicated (DDP) here, after per-block
    torch.compile when cfg.compile (the lean form with cfg.compile_lean); `model` is then the trained model on every rank (FSDP2: sharded in place — take
    `distributed.full_model_state(model)` on every rank for its full weights).

    `record` (JSON-able, e.g. the model and task configs): with out_dir, out_dir/run.json is rewritten after each
    checkpoint as the record plus what has been trained (steps done, world size, per-rank batch, and one segment of
    training flags per session), so it only ever describes training that happened.

    Fast path for small models on CUDA (each part measured in BENCHMARKS.md): the head and loss only at labelled
    positions when the task fixes their number per row (`task.labels_per_row`, e.g. MQAR) and the model takes
    `positions=`; batches made ahead by a thread; `graphs=True` captures the whole step in one CUDA graph after
    three eager warm-up steps (the step has no host sync: the learning rate is a device tensor, AdamW is fused and
    capturable, clipping is on the device). Every step is the same computation on the same batch either way.
    """
    if cfg.out_dir is None or int(os.environ.get("RANK", "0")) != 0:
        return Trainer(model, task, cfg, record).run()
    with run_lock(cfg.out_dir):  # one run at a time in a folder (re-entrant: `evict train` holds it already)
        return Trainer(model, task, cfg, record).run()


class Trainer:
    """One run of `train` as named steps: setup (device, resume, build, restore, outputs), then per step
    `train_step` → `log_train` → `evaluate` → `checkpoint`, then `result`. Its fields are the run's state."""

    def __init__(self, model: nn.Module, task: Task, cfg: TrainConfig, record: dict | None) -> None:
        self.t0 = time.perf_counter()
        self.task, self.cfg, self.record = task, cfg, record
        self.setup_device()
        out = Path(cfg.out_dir) if cfg.out_dir is not None else None
        self.out, self.ckpt_path = out, (out / "checkpoint.pt" if out is not None else None)
        self.metrics_path = out / "metrics.jsonl" if out is not None else None
        resume = self.ckpt_path is not None and cfg.resume and self.ckpt_path.exists()
        ck = read_checkpoint(self.ckpt_path) if resume and self.ckpt_path is not None else None
        if ck is not None:
            check_resume(ck["config"], ck["step"], cfg)
        self.build(model)
        self.restore(ck)
        del ck
        self.open_outputs()

    # ---- setup ----

    def setup_device(self) -> None:
        """The device, the process group (torchrun), threads and autocast; refuse what this world cannot run."""
        cfg = self.cfg
        self.device = device = distributed.resolve_device(cfg.device)
        if cfg.graphs and device.type != "cuda":
            raise ValueError(f"graphs: CUDA graphs need a CUDA device, got {device}")
        distributed.init_from_env(device)
        self.rank, self.world = distributed.world()
        cfg.check_world(self.world)
        if distributed.active() and cfg.dist == "fsdp":
            distributed.check_fsdp_available()
        if cfg.graphs and distributed.active():
            raise ValueError("graphs: CUDA graphs are single-process; drop graphs under torch.distributed")
        self.lead = self.rank == 0
        if cfg.threads is not None:
            torch.set_num_threads(cfg.threads)
        self.use_amp = cfg.amp == "bf16" or (cfg.amp == "auto" and device.type == "cuda")

    def autocast(self):
        # no weight-cast cache: a captured graph must recompute the casts from the live weights on each replay
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.use_amp,
                              cache_enabled=not self.cfg.graphs)

    def build(self, model: nn.Module) -> None:
        """Seed, place, parallelize (FSDP2 / DDP, compile) and make the optimizer and schedule."""
        cfg = self.cfg
        torch.manual_seed(cfg.seed + self.rank)
        random.seed(cfg.seed + self.rank)
        if cfg.checkpoint_blocks:
            if not isinstance(getattr(model, "gradient_checkpointing", None), bool):
                raise ValueError(f"checkpoint_blocks: {type(model).__name__} has no per-block activation checkpointing "
                                 "(evict's LM has: its gradient_checkpointing)")
            setattr(model, "gradient_checkpointing", True)
        model.to(self.device)
        model.train()
        self.core = model
        self.model = distributed.parallelize(model, kind=cfg.dist, compile=cfg.compile,
                                                lean=cfg.compile_lean, device=self.device)
        self.opt = _make_optimizer(self.model, cfg, self.device)
        self.schedule = WarmupCosine(cfg.steps, cfg.warmup_steps, cfg.min_lr_ratio)
        self.per_row = _labels_per_row(self.model, self.task, cfg)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if self.out is not None and self.lead:
            self.out.mkdir(parents=True, exist_ok=True)

    def restore(self, ck: dict | None) -> None:
        """The run's state: from the checkpoint (weights, optimizer, RNG, history) or fresh (old metrics removed)."""
        cfg, metrics_path = self.cfg, self.metrics_path
        self.step, self.best = 0, 0.0
        self.history: list[dict] = []
        self.stopped_early = self.interrupted = False
        self.segments: list[dict] = []
        self.diverged: int | None = None
        if ck is not None:
            if "sharded" in ck:
                assert self.out is not None  # a checkpoint was read, so there is an out_dir
                distributed.load_sharded(self.out / ck["sharded"], self.model, self.opt)
            else:
                distributed.load_full(self.model, self.opt, ck["model"], ck["optimizer"])
            _restore_optimizer_placement(self.opt, cfg, self.device)
            rngs = ck["rng"]
            _set_rng_state(rngs[self.rank] if self.rank < len(rngs) else rngs[0], self.device)
            self.step, self.history, self.best = ck["step"], ck["history"], ck["best_val_accuracy"]
            self.segments = ck.get("segments", [])
            self.diverged = ck.get("diverged")  # a run that diverged stays stopped: its weights are not finite
            # a run that reached its target stays stopped unless the target changed; one that ran out of steps goes on
            self.stopped_early = (ck["stopped_early"] and cfg.target_accuracy is not None
                                  and self.best >= cfg.target_accuracy)
            if self.lead and metrics_path is not None:
                trim_metrics(metrics_path, self.step)  # a torn last line is dropped, and said
        elif metrics_path is not None and self.lead and metrics_path.exists():
            metrics_path.unlink()
        self.done = self.stopped_early or self.diverged is not None or self.step >= cfg.steps

    def open_outputs(self) -> None:
        """This session's segment, TensorBoard, the batch prefetcher, the CUDA-graph slots and the progress bar."""
        cfg, world, step = self.cfg, self.world, self.step
        self.session: dict[str, Any] = {"steps": [step, step], "world_size": world,
                                        "per_rank_batch": cfg.batch_size // world,
                                        "micro_batch": cfg.batch_size // world // cfg.grad_accum,
                                        "train": dataclasses.asdict(cfg)}
        self.segments.append(self.session)
        self.writer = None
        if cfg.tensorboard and self.lead and not self.done:
            from torch.utils.tensorboard import SummaryWriter

            assert self.out is not None  # TrainConfig.validate: tensorboard needs out_dir
            self.writer = SummaryWriter(str(self.out / "tensorboard"))
        self.prefetch = None
        if self.device.type == "cuda" and cfg.prefetch > 0 and not self.done:
            self.prefetch = _Prefetch(lambda s: _rows(self.task, "train", s, cfg), step, cfg.prefetch)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: tuple[torch.Tensor, torch.Tensor, _StepOut] | None = None  # the captured step's inputs, outputs
        self.side = torch.cuda.Stream(self.device) if cfg.graphs else None
        self.warmup_until = step + 3  # eager steps (on a side stream) before capture
        self.bar = tqdm(total=cfg.steps, initial=step, disable=not (cfg.progress and self.lead), desc=self.task.name,
                        dynamic_ncols=True)
        self.window_loss = torch.zeros((), device=self.device)
        self.window_steps, self.window_t = 0, time.perf_counter()
        self.last_val = self.history[-1] if self.history else None

    # ---- the loop ----

    def run(self) -> TrainResult:
        """Steps until done (cfg.steps, the target, a stop file, a diverged loss) or interrupted (cfg.stop_at)."""
        try:
            while not self.done:
                lr, x, out = self.train_step()
                if self.step % self.cfg.log_every == 0 or self.step == self.cfg.steps:
                    self.log_train(lr, x, out)
                if not self.done and (self.step % self.cfg.eval_every == 0 or self.step == self.cfg.steps):
                    self.evaluate()
                self.maybe_checkpoint()
                if self.interrupted:
                    break
        finally:
            if self.prefetch is not None:
                self.prefetch.close()
            self.bar.close()
            if self.writer is not None:
                self.writer.close()
        return self.result()

    def batch(self, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.prefetch.get(s) if self.prefetch is not None else _rows(self.task, "train", s, self.cfg)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)  # [A, b, T]

    def train_step(self) -> tuple[float, torch.Tensor, _StepOut]:
        """One optimizer step at this step's learning rate and batch: eager, on the side stream, captured into the
        CUDA graph (the 4th step with graphs) or replayed from it; then the model's after_step hook."""
        lr = self.cfg.lr * self.schedule(self.step)
        _set_lr(self.opt, lr)
        x, y = self.batch(self.step)
        side, dev = self.side, self.device
        if self.graph is not None and self.static is not None:
            self.static[0].copy_(x)
            self.static[1].copy_(y)
            self.graph.replay()
            out = self.static[2]
        elif side is not None and self.step >= self.warmup_until:  # side: cfg.graphs
            xs_in, ys_in = x.clone(), y.clone()
            self.opt.zero_grad(set_to_none=True)
            side.wait_stream(torch.cuda.current_stream(dev))
            self.graph = torch.cuda.CUDAGraph()
            # thread_local: the prefetch thread's pinned allocations are not part of (and must not abort) the capture
            with torch.cuda.graph(self.graph, stream=side, capture_error_mode="thread_local"):
                self.static = (xs_in, ys_in, self.forward_backward(xs_in, ys_in))
            torch.cuda.current_stream(dev).wait_stream(side)
            self.graph.replay()
            out = self.static[2]
        else:
            self.opt.zero_grad(set_to_none=True)
            if side is not None:
                side.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(side):
                    out = self.forward_backward(x, y)
                torch.cuda.current_stream(dev).wait_stream(side)
            else:
                out = self.forward_backward(x, y)
        hook = getattr(self.core, "after_step", None)
        if callable(hook):
            hook()
        self.step += 1
        self.bar.update(1)
        self.window_loss += out[0]
        self.window_steps += 1
        return lr, x, out

    def forward_backward(self, xs: torch.Tensor, ys: torch.Tensor) -> _StepOut:
        """Forward and backward of each micro-batch, clip, AdamW (gradients must be None on entry); no host sync.
        Returns the mean loss and aux loss over the micro-batches, the last one's correct and labelled counts, the grad
        norm."""
        model, A = self.model, xs.shape[0]
        loss_sum = aux_sum = None
        for m in range(A):
            with distributed.grad_sync(model, m == A - 1):
                with self.autocast():
                    loss, correct, labelled = _loss(model, xs[m], ys[m], self.per_row)
                aux = _aux_loss(model)
                ((loss if aux is None else loss + aux) / A).backward()
            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
            if aux is not None:
                aux_sum = aux.detach() if aux_sum is None else aux_sum + aux.detach()
        if loss_sum is None:
            raise ValueError(f"xs: expected at least one micro-batch, got shape {tuple(xs.shape)}")
        # always measured (logged); max_norm inf scales by exactly 1
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip or math.inf,
                                              foreach=self.device.type == "cuda" or None)
        self.opt.step()
        return loss_sum / A, None if aux_sum is None else aux_sum / A, correct, labelled, norm.detach()

    def log_train(self, lr: float, x: torch.Tensor, out: _StepOut) -> None:
        """A train row over the steps since the last one (mean loss; the last step's accuracy, grad norm; tokens/s),
        averaged over ranks; a loss that is not finite ends the run (diverged)."""
        _, aux, correct, labelled, norm = out
        acc_loss = torch.stack([correct / labelled.clamp_min(1),
                                self.window_loss / self.window_steps]).float()
        if self.world > 1:
            dist.all_reduce(acc_loss)
            acc_loss /= self.world
        acc, mean_loss = acc_loss.tolist()
        dt = time.perf_counter() - self.window_t
        row = {"split": "train", "step": self.step, "loss": mean_loss, "accuracy": acc, "lr": lr,
               "grad_norm": float(distributed.local(norm)),
               "tokens_per_s": self.window_steps * x.numel() * self.world / max(dt, 1e-9)}
        if aux is not None:
            row["aux_loss"] = float(aux)
        self.log(row)
        post = {"loss": f"{mean_loss:.4f}", "acc": f"{acc:.3f}"}
        if self.last_val is not None:
            post["val_acc"] = f"{self.last_val['accuracy']:.3f}"
        self.bar.set_postfix(post)
        self.window_loss.zero_()
        self.window_steps, self.window_t = 0, time.perf_counter()
        if not math.isfinite(mean_loss):  # every rank sees the same all-reduced mean
            self.diverged, self.done = self.step, True
            if self.lead:
                logger.warning(f"train: the training loss is not finite by step {self.step} (lr {self.cfg.lr:g}, "
                               f"weight_decay {self.cfg.weight_decay:g}); "
                               f"stopped there, best validation accuracy so far {self.best:.4f}")

    def log(self, row: dict) -> None:
        """One metrics row: a line of metrics.jsonl and TensorBoard scalars (rank 0, with an out_dir)."""
        if self.metrics_path is not None and self.lead:
            try:
                with self.metrics_path.open("a") as f:
                    f.write(json.dumps(row) + "\n")
            except OSError as e:  # a full or read-only disk: the file is named (the checkpoint before stays good)
                raise OSError(e.errno, e.strerror or str(e), str(self.metrics_path)) from None
            if self.writer is not None:
                for k, v in row.items():
                    if k not in ("split", "step") and isinstance(v, (int, float)):
                        self.writer.add_scalar(f"{row['split']}/{k}", v, row["step"])

    def evaluate(self) -> None:
        """A val row; the run stops once it reaches the target accuracy or rank 0 sees the stop file."""
        cfg = self.cfg
        self.last_val = {"split": "val", "step": self.step,
                         **evaluate(self.model, self.task, cfg, self.device, self.autocast),
                         "seconds": time.perf_counter() - self.t0}
        self.history.append(self.last_val)
        self.best = max(self.best, self.last_val["accuracy"])
        self.log(self.last_val)
        if cfg.target_accuracy is not None and self.last_val["accuracy"] >= cfg.target_accuracy:
            self.stopped_early = self.step < cfg.steps
            self.done = True
        elif (cfg.stop_file is not None and self.step < cfg.steps
              and self.rank0_says(self.lead and os.path.exists(cfg.stop_file))):
            self.stopped_early = self.done = True

    def rank0_says(self, flag: bool) -> bool:
        """Rank 0's flag on every rank (each must take the same branch: rank 0's clock or view of a file decides)."""
        if self.world == 1:
            return flag
        t = torch.tensor([float(flag)], device=self.device)
        dist.broadcast(t, 0)
        return bool(t.item())

    # ---- checkpoint and result ----

    def maybe_checkpoint(self) -> None:
        """Decide done / interrupted (cfg.stop_at, rank 0's clock) and checkpoint at the end, on interruption and
        every cfg.checkpoint_every steps."""
        cfg = self.cfg
        self.done = self.done or self.step == cfg.steps
        self.interrupted = cfg.stop_at is not None and self.rank0_says(not self.done and time.time() >= cfg.stop_at)
        if self.out is not None and self.ckpt_path is not None and (
                self.done or self.interrupted or (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0)):
            self.checkpoint(self.out, self.ckpt_path)

    def checkpoint(self, out: Path, ckpt_path: Path) -> None:
        """Every rank calls this (collectives under torch.distributed); rank 0 writes checkpoint.pt, then run.json."""
        cfg, world, step, model, opt = self.cfg, self.world, self.step, self.model, self.opt
        self.session["steps"][1] = step
        self.session["seconds"] = round(time.perf_counter() - self.t0, 3)
        rng = _rng_state(self.device)
        rngs: list[Any] = [None] * world
        if world > 1:
            dist.all_gather_object(rngs, rng)
        else:
            rngs = [rng]
        state: dict[str, Any] = {"step": step, "rng": rngs, "history": self.history, "best_val_accuracy": self.best,
                                 "done": self.done, "stopped_early": self.stopped_early, "diverged": self.diverged,
                                 "config": dataclasses.asdict(cfg),
                                 "segments": self.segments, "record": self.record}
        if distributed.active():  # each rank its shards, into a folder named by the step; checkpoint.pt points at it
            state["sharded"] = f"checkpoint-{step}.dcp"
            distributed.save_sharded(out / state["sharded"], model, opt)
            dist.barrier()
        else:
            state["model"], state["optimizer"] = model.state_dict(), opt.state_dict()
        if self.lead:
            save_checkpoint(ckpt_path, state)
            for old in out.glob("checkpoint-*.dcp"):
                if old.name != state.get("sharded"):
                    shutil.rmtree(old, ignore_errors=True)
            if self.record is not None:
                write_json(out / "run.json", {**self.record, "train": dataclasses.asdict(cfg), "steps_done": step,
                                              "world_size": world, "per_rank_batch": cfg.batch_size // world,
                                              "segments": self.segments,
                                              **({} if self.diverged is None else {"diverged_at": self.diverged})})
        if distributed.active():
            dist.barrier()

    def result(self) -> TrainResult:
        wall, last_val = time.perf_counter() - self.t0, self.last_val
        return TrainResult(
            steps_done=self.step, best_val_accuracy=self.best,
            final_val_loss=last_val["loss"] if last_val else math.nan,
            final_val_accuracy=last_val["accuracy"] if last_val else math.nan, wall_seconds=wall,
            history=self.history, stopped_early=self.stopped_early, interrupted=self.interrupted,
            diverged_at=self.diverged,
            total_seconds=wall + sum(s.get("seconds", 0.0) for s in self.segments[:-1]),  # older ones lack "seconds"
        )
