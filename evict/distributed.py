"""Training past one process (torchrun): the process group from the environment, FSDP2 / DDP wrapping, per-block
torch.compile, gradient-sync control for accumulation, and full or sharded (torch.distributed.checkpoint) state.

    torchrun --nproc_per_node 2 -m evict.cli train ...    (WORLD_SIZE, RANK, LOCAL_RANK come from torchrun)

FSDP2 shards each `Block` (the model's `blocks`) and then the root (embeddings, final norm, head); DDP replicates.
The model object stays the one the caller built: FSDP2 changes it in place, DDP wraps it (`unwrap` gives it back),
so its hooks (`aux_loss`, `after_step`, `positions=`) are reached either way.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

DIST = ("fsdp", "ddp")


def resolve_device(device: str) -> torch.device:
    """"auto" → cuda (this rank's LOCAL_RANK device under torchrun) if available, else cpu."""
    if device != "auto":
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def world() -> tuple[int, int]:
    """(rank, world size) of the initialised process group, else (0, 1)."""
    if active():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def active() -> bool:
    """Whether a process group is initialised (the model is then wrapped, even in a world of one)."""
    return dist.is_available() and dist.is_initialized()


def env_world_size() -> int:
    """The world size torchrun announces in the environment (1 when not launched by it)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        raise ValueError(f"WORLD_SIZE: expected an integer (set by torchrun), got {os.environ['WORLD_SIZE']!r}") from None


def init_from_env(device: torch.device) -> None:
    """Under torchrun (WORLD_SIZE > 1) initialise the default process group once: nccl on CUDA, gloo on the CPU."""
    if env_world_size() == 1 or dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None)


def check_fsdp_available() -> None:
    """FSDP2 (torch.distributed.fsdp.fully_shard) is in torch >= 2.6; a one-line error otherwise."""
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        raise ValueError(f"dist: FSDP2 needs torch >= 2.6 (this is torch {torch.__version__}); use --dist ddp") from None


def parallelize(model: nn.Module, *, kind: str, compile: bool, device: torch.device,
                lean: bool | None = None) -> nn.Module:
    """Per-block torch.compile (when `compile`: the model's own `compile_blocks(lean=lean)`, an LM's one dynamo cache
    per block form, lean=True its lean form, False its keep-all form and None the model's default; else each block), then, when a process group
    is initialised, FSDP2 per block and at the root (`kind="fsdp"`) or DDP (`kind="ddp"`). Returns the module to call
    (the model itself, or its DDP). A model without `compile_blocks` has no lean form: lean=True is a ValueError."""
    blocks = list(getattr(model, "blocks", []))
    own = callable(getattr(model, "compile_blocks", None))  # the model's own method (no import of a higher layer here)
    if compile and lean and not own:
        raise ValueError(f"compile_lean: {type(model).__name__} has no lean compiled form (evict's LM has: its "
                         "compile_blocks(lean=True)); drop compile_lean")
    if compile:
        if own:
            model.compile_blocks(lean=lean)  # type: ignore[operator]
        else:
            for blk in blocks or [model]:
                blk.compile()
    if not active():
        return model
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    check_fsdp_available()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world()[1],))
    for blk in blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The model the caller built (DDP's `.module`; FSDP2 and plain modules are themselves)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def grad_sync(model: nn.Module, sync: bool):
    """A context for one micro-batch's backward: gradients are reduced across ranks only when `sync` (the last
    micro-batch of a step); the others accumulate locally."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return contextlib.nullcontext() if sync else model.no_sync()
    set_sync = getattr(model, "set_requires_gradient_sync", None)
    if callable(set_sync):  # an FSDP2 module
        set_sync(sync)
    return contextlib.nullcontext()


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (e.g. the gradient norm under FSDP2); a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def full_model_state(model: nn.Module) -> dict:
    """The full (unsharded) model state dict on the CPU; a collective under torch.distributed (every rank calls it)."""
    model = unwrap(model)
    if not active():
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_sharded(path, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Each rank writes its shards of the model and optimizer state into the folder `path` (torch.distributed.checkpoint)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    ms, os_ = get_state_dict(unwrap(model), opt)
    dcp.save({"model": ms, "optim": os_}, checkpoint_id=str(path))


def load_sharded(path, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Read the state `save_sharded` wrote into this (sharded or whole) model and optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    ms, os_ = get_state_dict(unwrap(model), opt)
    state: dict[str, Any] = {"model": ms, "optim": os_}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(unwrap(model), opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def load_full(model: nn.Module, opt: torch.optim.Optimizer, ms: dict, os_: dict) -> None:
    """Load full (unsharded) state dicts, as a single-process run saves them, into this model and optimizer."""
    if not active():
        unwrap(model).load_state_dict(ms)
        opt.load_state_dict(os_)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(unwrap(model), opt, model_state_dict=ms, optim_state_dict=os_,
                   options=StateDictOptions(full_state_dict=True))
