"""The one language model: embeddings -> n_layers x (mixer, FFN) from the config's pattern -> norm -> head.

Residual stream: pre-norm `h += mixer(norm(h)); h += ffn(norm(h))`, or, with AttnRes, every sublayer input
(and the final norm's input) is a learned softmax mix over depth sources (embedding, completed blocks, current block).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import math
import operator
import os
import shutil
import stat
from pathlib import Path
from typing import cast

import torch
from torch import nn

from evict.cache import HybridCache, PackedBatch, PaddedBatch, SlotBatch
from evict.cli_args import first_line
from evict.jsonfile import read_json_object
from evict.layers.attention import Attention
from evict.layers.attn_res import AttnResRead
from evict.layers.ffn import SiTU, SwiGLU
from evict.layers.init import reset_children
from evict.layers.memory_mixer import MemoryMixer
from evict.layers.mla import MLA
from evict.layers.mlp import GeluMLP
from evict.layers.moe import MoE
from evict.layers.norms import build_norm
from evict.ops.loss import LossOut, linear_cross_entropy

from .compile_blocks import compile_blocks
from .config import MIXERS, ModelConfig
from .generate import generate

log = logging.getLogger(__name__)


def build_mixer(cfg: ModelConfig, letter: str) -> Attention | MLA | MemoryMixer:
    kind = MIXERS[letter]
    if kind == "attention":
        return Attention(cfg)
    if kind == "mla":
        return MLA(cfg)
    return MemoryMixer(cfg, kind)


def build_ffn(cfg: ModelConfig, kind: str) -> nn.Module:
    d, hidden = cfg.d_model, cfg.ffn_hidden
    if kind == "gelu":
        return GeluMLP(d, hidden, bias=cfg.bias)
    if kind == "swiglu":
        return SwiGLU(d, hidden)
    if kind == "situ":
        return SiTU(d, hidden)
    m = cfg.moe
    if kind != "moe" or m is None:
        raise ValueError(f"ffn: expected gelu, swiglu, situ, or moe with a MoE config; got {kind!r}")
    return MoE(d, m.n_routed, m.top_k, m.d_expert, n_shared=m.n_shared, latent_dim=m.latent_dim,
               routed_scaling=m.routed_scaling, bias_update_rate=m.bias_update_rate, aux_loss_coef=m.aux_loss_coef,
               expert="situ" if cfg.ffn == "situ" else "swiglu", dispatch=m.dispatch)


class Block(nn.Module):
    """One residual block: mixer then FFN, each pre-normed; with AttnRes, also the read points of its two inputs.

    The unit that FSDP2 shards, activation checkpointing recomputes and torch.compile compiles, one block at a time."""

    def __init__(self, cfg: ModelConfig, letter: str, ffn_kind: str, first: bool = False):
        super().__init__()
        self.letter, self.ffn_kind = letter, ffn_kind
        self.init_std, self.out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.norm1 = build_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.mixer = build_mixer(cfg, letter)
        self.norm2 = build_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.ffn = build_ffn(cfg, ffn_kind)
        if cfg.attn_res:
            # the first mixer's only source is the embedding: a read over one source is the identity, so none is built
            self.read_mixer: AttnResRead | None = None if first else AttnResRead(cfg.d_model, cfg.norm_eps)
            self.read_ffn = AttnResRead(cfg.d_model, cfg.norm_eps)
        self.attn_res = cfg.attn_res

    def reset_parameters(self) -> None:
        """Every submodule its own init (norms 1, conv kernels, decay gates, MLA's W_uk / W_uv, MoE experts, AttnRes
        queries 0), then every nn.Linear ~ N(0, init_std) with zero biases, except the projections that write into the
        residual stream (`wo`, `w2`, each MoE's `output_weights()`) ~ N(0, init_std / sqrt(2 n_layers))."""
        reset_children(self)
        for name, mod in self.named_modules():
            if isinstance(mod, nn.Linear):
                nn.init.normal_(mod.weight, std=self.out_std if name.split(".")[-1] in ("wo", "w2") else self.init_std)
                if mod.bias is not None:
                    nn.init.zeros_(mod.bias)
        if isinstance(self.ffn, MoE):
            for w in self.ffn.output_weights():
                nn.init.normal_(w, std=self.out_std)

    def forward(self, h: torch.Tensor | None, state=None, pos: int | SlotBatch | PackedBatch | PaddedBatch = 0,
                completed: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Pre-norm: h [B, T, D] is the residual stream; returns h + mixer(norm(h)), then + ffn(norm(.)).

        AttnRes: `completed` is the list of closed depth sources (the embedding, then one sum per closed block) and h
        the running sum of the current block's sublayer outputs (None right after a block closes); returns that sum
        with this block's two outputs added. `state` is this layer's cache state (decode), `pos` its position."""
        if not self.attn_res:
            if h is None:
                raise ValueError("h: a block without AttnRes needs the residual stream, got None")
            h = h + self.mixer(self.norm1(h), state, pos)
            return h + self.ffn(self.norm2(h))
        if completed is None:
            raise ValueError("completed: an AttnRes block needs the closed depth sources, got None")
        sources = completed if h is None else completed + [h]
        x = completed[0] if self.read_mixer is None else self.read_mixer(sources)
        out = self.mixer(self.norm1(x), state, pos)
        h = out.to(completed[0].dtype) if h is None else h + out  # a block's sum in the stream's dtype (float32)
        return h + self.ffn(self.norm2(self.read_ffn(completed + [h])))


class LM(nn.Module):
    """`checkpoint_blocks` (or the `gradient_checkpointing` attribute, transformers' name, which
    `evict train --checkpoint-blocks` and transformers' gradient_checkpointing_enable set): activation checkpointing
    per block while training with gradients (each block keeps only its input; its activations are recomputed in the
    backward — `torch.utils.checkpoint`, non-reentrant). A training setting, not part of the architecture (not in the
    config). The recompute repeats a MoE block's load count, which leaves the averaged load that balances its bias
    unchanged."""

    def __init__(self, cfg: ModelConfig, *, checkpoint_blocks: bool = False):
        super().__init__()
        cfg.validate()
        if not isinstance(checkpoint_blocks, bool):
            raise ValueError(f"checkpoint_blocks: expected True or False, got {checkpoint_blocks!r}")
        self.cfg = cfg
        self.gradient_checkpointing = checkpoint_blocks
        rng = torch.get_rng_state()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.pos == "learned" else None
        self.blocks = nn.ModuleList(
            Block(cfg, m, f, first=i == 0) for i, (m, f) in enumerate(zip(cfg.layer_mixers(), cfg.layer_ffns()))
        )
        self.final_read = AttnResRead(cfg.d_model, cfg.norm_eps) if cfg.attn_res else None
        self.norm = build_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        if not any(p.is_meta for p in self.parameters()):
            # The weights are init_weights' draws from the RNG state LM() was called with; the draws the submodules
            # made while being built are discarded. So meta-built + to_empty + init_weights() gives the same weights.
            torch.set_rng_state(rng)
            self.init_weights()
        log.debug("LM %s", " ".join(f"{b.letter}{'/moe' if b.ffn_kind == 'moe' else ''}" for b in self.blocks))

    def init_weights(self) -> None:
        """Initialise every parameter and buffer (also after building on the meta device and `to_empty`):
        - embeddings (token, learned positions) ~ N(0, init_std); the head ~ N(0, init_std) unless tied; norm
          weights 1 (LayerNorm biases 0); the final AttnRes read's query 0 (a uniform mix over depth at start)
        - each block (Block.reset_parameters): nn.Linear weights ~ N(0, init_std), biases 0; the projections that
          write into the residual stream (`wo`, `w2`, each MoE's `output_weights()`) ~ N(0, init_std / sqrt(2 n_layers));
          short-conv kernels U(±k^-1/2); decay A_log = log U(1, 16) and dt_bias (dt log-uniform in [1e-3, 1e-1]);
          MLA W_uk, W_uv ~ N(0, init_std); MoE expert stacks N(0, 0.02) and selection bias 0; AttnRes queries 0
        """
        if self.cfg.tie_embeddings:  # to_empty makes one new tensor per module: tie them again
            self.head.weight = self.embed.weight
        std = self.cfg.init_std
        nn.init.normal_(self.embed.weight, std=std)
        if self.wpe is not None:
            nn.init.normal_(self.wpe.weight, std=std)
        for blk in self.layers():
            blk.reset_parameters()
        if self.final_read is not None:
            self.final_read.reset_parameters()
        self.norm.reset_parameters()
        if not self.cfg.tie_embeddings:
            nn.init.normal_(self.head.weight, std=std)

    def reset_parameters(self) -> None:
        self.init_weights()

    # -- forward ----------------------------------------------------------------------------------------------
    gradient_checkpointing = False  # recompute each block in the backward (set by transformers' gradient_checkpointing_enable)

    def forward(self, tokens: torch.Tensor | None, cache: HybridCache | None = None, *,
                positions: torch.Tensor | None = None, embeds: torch.Tensor | None = None,
                hidden_states: list | None = None, head: bool = True,
                targets: torch.Tensor | None = None, pad: list[int] | None = None) -> torch.Tensor | LossOut:
        """tokens [B, T] int64 -> logits [B, T, vocab]. With a cache: continue from cache.pos, then advance it.

        `positions` [B, P] int64 (indices into T): logits only there, [B, P, vocab] — the head and the loss of a task
        whose labels sit at a few positions (MQAR) then cost P, not T, rows.
        `embeds` [B, T, D] in place of tokens: the token embeddings (transformers' inputs_embeds).
        `hidden_states`: a list that receives the residual stream [B, T, D] after the embedding and after each block,
        the last one final-normed (transformers' convention); not for AttnRes models (their stream is a depth mix).
        head=False: the final-normed stream [B, T, D] (or [B, P, D]) instead of logits.
        `targets` [B, T] (or [B, P] with positions) int64, -100 = unlabelled: instead of logits, the training loss
        (`evict.ops.loss.linear_cross_entropy`: LossOut(mean loss, correct, labelled)), computed in row chunks so the
        float32 logits of the whole batch never exist.
        `pad` [B] ints: left padding, row b's first pad[b] columns are pads (a PaddedBatch: every row's outputs at its
        tokens are what it gives alone; those at pads are finite and meaningless). With a cache, give it with the first
        tokens (position 0): the cache keeps it for every later call."""
        if embeds is not None:
            if tokens is not None:
                raise ValueError("tokens: give tokens or embeds, not both")
            if not isinstance(embeds, torch.Tensor) or embeds.dim() != 3 or embeds.shape[-1] != self.cfg.d_model:
                shape = str(tuple(embeds.shape)) if isinstance(embeds, torch.Tensor) else type(embeds).__name__
                raise ValueError(f"embeds: expected a tensor [B, T, d_model={self.cfg.d_model}], got {shape}")
            return self._run(embeds, cache, positions, hidden_states, head, targets, pad)
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype != torch.int64:
            got = f"{tuple(tokens.shape)} {tokens.dtype}" if isinstance(tokens, torch.Tensor) else type(tokens).__name__
            raise ValueError(f"tokens: expected an int64 tensor [B, T], got {got}")
        B, T = tokens.shape
        if B == 0 or T == 0:
            raise ValueError(f"tokens: expected at least one sequence of at least one token, got shape {tuple(tokens.shape)}")
        if tokens.device != self.embed.weight.device:
            raise ValueError(f"tokens: expected a tensor on the model's device {self.embed.weight.device}, got {tokens.device}")
        # Values are checked where that costs no device sync: CPU tensors (one cheap pass), outside torch.compile.
        # CUDA callers check once at their entry (generate, the CLI); tasks produce ids in range by construction.
        if tokens.device.type == "cpu" and tokens.numel() and not torch.compiler.is_compiling():
            lo, hi = int(tokens.min()), int(tokens.max())
            if lo < 0 or hi >= self.cfg.vocab_size:
                raise ValueError(f"tokens: expected ids in [0, vocab_size={self.cfg.vocab_size}), got range [{lo}, {hi}]")
        return self._run(self.embed(tokens), cache, positions, hidden_states, head, targets, pad)

    def _run(self, h: torch.Tensor, cache: HybridCache | None, positions: torch.Tensor | None,
             hidden_states: list | None, head: bool, targets: torch.Tensor | None = None,
             pad: list[int] | None = None) -> torch.Tensor | LossOut:
        """The embedded tokens h [B, T, D] through positions, blocks, final norm and head (see forward)."""
        B, T = h.shape[:2]
        if B == 0 or T == 0:
            raise ValueError(f"embeds: expected at least one sequence of at least one token, got shape {tuple(h.shape)}")
        if hidden_states is not None and self.final_read is not None:
            raise ValueError("hidden_states: an AttnRes model has no single residual stream per layer")
        if positions is not None:
            self._check_positions(positions, B, T)
        if pad is not None and (not isinstance(pad, (list, tuple)) or len(pad) != B
                                or any(type(p) is not int or not 0 <= p < T for p in pad)):
            raise ValueError(f"pad: expected {B} ints in [0, T={T}) (each row's leading pad columns, one token at least), "
                             f"got {pad!r}")
        pos: int | SlotBatch | PackedBatch | PaddedBatch = 0
        states: list = [None] * len(self.blocks)
        slots = False
        if cache is not None:
            if not isinstance(cache, HybridCache) or len(cache) != len(self.blocks):
                raise ValueError(f"cache: expected a HybridCache from this model's new_cache, got {type(cache).__name__}")
            if cache.owner is not None and cache.owner != self._cache_owner():
                raise ValueError("cache: built by another model's new_cache (another config); make one with this model's")
            if cache.device is not None and cache.device != h.device:
                raise ValueError(f"cache: expected states on the model's device {h.device}, got {cache.device}")
            slots = cache.block_size is not None  # a slot pool: rows at their own positions
            if slots:
                if pad is not None:
                    raise ValueError("pad: a slot pool's rows carry their own positions; pad is for a batch cache")
                if cache.batch is None or tuple(cache.batch.positions.shape) != (B, T):
                    got = "none" if cache.batch is None else str(list(cache.batch.positions.shape))
                    raise ValueError(f"cache: a slot pool needs select(rows, starts, T) for these [B, T] = [{B}, {T}] tokens, got {got}")
                pos, states = cache.batch, cache.slot_states()
            else:
                if cache.batch_size != B:
                    raise ValueError(f"cache: built for batch {cache.batch_size}, got tokens for batch {B}")
                cache.reserve(T)
                if pad is not None:
                    if cache.pos != 0:
                        raise ValueError(f"pad: give it with a cache's first tokens (position 0), the cache is at {cache.pos}")
                    cache.pad = list(pad)
                pos, states, pad = cache.pos, cache.states, cache.pad
        last = pos + T if isinstance(pos, int) else 0  # the largest position + 1 (a pool checks its max_len once)
        if pad is not None:  # rows at their own positions, from each row's first token
            assert isinstance(pos, int)
            last = pos + T - min(pad)
            pos = PaddedBatch.build(list(pad), pos, T, h.device)
        if self.wpe is not None:
            at = pos.positions if not isinstance(pos, int) else torch.arange(pos, pos + T, device=h.device)  # [B, T] or [T]
            if last > self.cfg.max_seq_len:
                raise ValueError(f"tokens: learned positions cover {self.cfg.max_seq_len} tokens, got up to {last}")
            h = h + self.wpe(at)
        recompute = self.gradient_checkpointing and self.training and cache is None and torch.is_grad_enabled()
        if self.final_read is None:
            if hidden_states is not None:
                hidden_states.append(h)
            for blk, st in zip(self.layers(), states):
                h = self._checkpoint(blk, h, st, pos) if recompute else blk(h, st, pos)
                if hidden_states is not None:
                    hidden_states.append(h)
        else:
            completed, partial = [h], None  # AttnRes depth sources: closed ones, and the current block's running sum
            for i, (blk, st) in enumerate(zip(self.layers(), states)):
                partial = (self._checkpoint(blk, partial, st, pos, completed=completed) if recompute
                           else blk(partial, st, pos, completed=completed))
                if (i + 1) % self.cfg.attn_res_block == 0:
                    completed, partial = completed + [partial], None
            h = self.final_read(completed if partial is None else completed + [partial])
        if cache is not None:
            if slots:
                cache.write_back(states)  # the caller advances each slot's length
            else:
                cache.advance(T)
        if positions is not None:
            h = h.gather(1, positions[..., None].expand(-1, -1, h.shape[-1]))  # [B, P, D]
        h = self.norm(h)
        if hidden_states is not None:
            hidden_states[-1] = h if positions is None else self.norm(hidden_states[-1])
        if targets is None:
            return self.head(h) if head else h
        if not (isinstance(targets, torch.Tensor) and targets.shape == h.shape[:2] and targets.dtype == torch.int64):
            got = f"{tuple(targets.shape)} {targets.dtype}" if isinstance(targets, torch.Tensor) else type(targets).__name__
            raise ValueError(f"targets: expected an int64 tensor {list(h.shape[:2])} (ids or -100), got {got}")
        return linear_cross_entropy(h.flatten(0, 1), self.head.weight, targets.flatten())

    def _checkpoint(self, blk: Block, h: torch.Tensor | None, st, pos, **kw) -> torch.Tensor:
        """blk(h, st, pos, **kw), its activations recomputed in the backward (transformers may set the function)."""
        fn = getattr(self, "_gradient_checkpointing_func", None)
        if fn is None:
            from torch.utils.checkpoint import checkpoint

            return checkpoint(blk, h, st, pos, use_reentrant=False, **kw)
        return fn(blk.__call__, h, st, pos, **kw)

    def _check_positions(self, positions, B: int, T: int) -> None:
        if not (isinstance(positions, torch.Tensor) and positions.dim() == 2 and positions.shape[0] == B
                and positions.dtype == torch.int64):
            got = f"{tuple(positions.shape)} {positions.dtype}" if isinstance(positions, torch.Tensor) else type(positions).__name__
            raise ValueError(f"positions: expected an int64 tensor [B={B}, P], got {got}")
        if positions.device != self.embed.weight.device:
            raise ValueError(f"positions: expected a tensor on the model's device {self.embed.weight.device}, "
                             f"got {positions.device}")
        if positions.device.type == "cpu" and positions.numel() and not torch.compiler.is_compiling():
            lo, hi = int(positions.min()), int(positions.max())
            if lo < 0 or hi >= T:
                raise ValueError(f"positions: expected indices into the T={T} tokens, in [0, {T}), got range [{lo}, {hi}]")

    # -- training hooks ---------------------------------------------------------------------------------------
    def layers(self) -> list[Block]:
        """The blocks, typed (an nn.ModuleList iterates as plain Modules)."""
        return cast("list[Block]", list(self.blocks))

    def moe_layers(self) -> list[MoE]:
        return [b.ffn for b in self.layers() if isinstance(b.ffn, MoE)]

    def compile_blocks(self, **kwargs) -> None:
        """torch.compile each block in place, one dynamo cache per block form (evict.models.compile_blocks; lean=True:
        the blocks keep less for the backward, recomputing elementwise values and the short conv there)."""
        compile_blocks(self, **kwargs)

    def aux_loss(self) -> torch.Tensor | None:
        """Sum of the MoE auxiliary losses of the last forward (None when no layer has one)."""
        losses = [m.aux_loss for m in self.moe_layers() if m.aux_loss is not None]
        return functools.reduce(operator.add, losses) if losses else None

    def after_step(self) -> None:
        """Called by the training loop after each optimizer step: MoE selection-bias balancing."""
        for m in self.moe_layers():
            m.update_bias()

    # -- inference --------------------------------------------------------------------------------------------
    def new_cache(self, batch_size: int, max_len: int, device=None, dtype=None) -> HybridCache:
        """States for `batch_size` sequences of up to `max_len` tokens, on the model's device and dtype by default."""
        for name, value in (("batch_size", batch_size), ("max_len", max_len)):
            if type(value) is not int or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise ValueError(f"dtype: expected a floating torch dtype (or None for the model's), got {dtype!r}")
        device = _torch_device(device)
        p = next(self.parameters())
        device = p.device if device is None else device
        dtype = p.dtype if dtype is None else dtype
        return HybridCache([b.mixer.new_state(batch_size, max_len, device, dtype) for b in self.layers()], batch_size,
                           max_len, owner=self._cache_owner())

    def new_pool(self, n_slots: int, n_blocks: int, block_size: int, max_len: int, device=None, dtype=None) -> HybridCache:
        """A slot pool for serving: `n_slots` sequences of up to `max_len` tokens each, their KV / latent positions
        in `n_blocks` shared blocks of `block_size` tokens (see evict.cache). Select rows before each forward."""
        for name, value in (("n_slots", n_slots), ("n_blocks", n_blocks), ("block_size", block_size), ("max_len", max_len)):
            if type(value) is not int or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        if self.cfg.pos == "learned" and max_len > self.cfg.max_seq_len:
            raise ValueError(f"max_len: the model's learned positions cover {self.cfg.max_seq_len} tokens, got {max_len}")
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise ValueError(f"dtype: expected a floating torch dtype (or None for the model's), got {dtype!r}")
        p = next(self.parameters())
        device = _torch_device(device) or p.device
        dtype = p.dtype if dtype is None else dtype
        states = [b.mixer.new_state(n_slots, block_size, device, dtype, blocks=n_blocks) for b in self.layers()]
        table = torch.zeros(n_slots, -(-max_len // block_size), dtype=torch.int64, device=device)
        return HybridCache(states, n_slots, max_len, block_size=block_size, table=table, owner=self._cache_owner())

    def _cache_owner(self) -> str:
        """What a cache must have been built for: this config (a cache of another model, even with as many layers,
        holds states of other shapes or kinds). Hashed once per config object: every forward with a cache asks, and
        hashing the config's JSON took ~0.18 ms on a CPU, a tenth of a decode step on a GPU."""
        cfg = self.cfg  # replaced whole where the architecture changes (resize_token_embeddings), never edited in place
        if self.__dict__.get("_owner_cfg") is not cfg:
            self.__dict__["_owner_cfg"], self.__dict__["_owner"] = cfg, hashlib.sha256(cfg.to_json().encode()).hexdigest()[:16]
        return self.__dict__["_owner"]

    def state_size(self, context_len: int) -> int:
        """Numbers of memory held per sequence at this context length (KV, latents, recurrent states)."""
        return sum(b.mixer.state_size(context_len) for b in self.layers())

    def generate(self, prompt: torch.Tensor, **kw) -> torch.Tensor:
        """Sample a continuation of `prompt` [B, T0] (evict.models.generate.generate: its keywords and checks)."""
        if isinstance(prompt, torch.Tensor) and prompt.device != self.embed.weight.device:
            raise ValueError(f"prompt: expected a tensor on the model's device {self.embed.weight.device}, got {prompt.device}")
        return generate(self, prompt, **kw)

    # -- persistence ------------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        """Write `model.safetensors` and `config.json` into the folder `path` as one unit.

        The tensors' metadata carries a sha256 of the tensor data and one of the config, both checked at load, so a
        config edited after the save, or a pair from two different saves, is refused there. Each file is written to a
        temporary name and renamed (none is half-written); concurrent saves into one folder are serialised by an flock
        on the folder. Both files get the mode a new file gets under the process's umask."""
        from safetensors.torch import save_model

        path = _folder(path)
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"path: cannot create the model folder {path} ({e.strerror or first_line(e)})") from None
        text = self.cfg.to_json()
        state = self.state_dict()
        meta = {"evict_sha256": _digest(_by_storage(state, state)), "evict_config_sha256": _config_digest(json.loads(text))}
        # the tensors are written inside a folder of this save's own (safetensors writes through a temporary file of
        # its own naming beside its target: a save killed mid-write leaves it there, and only this folder's name is ours)
        work = path / f".evict-save-{os.getpid()}"
        tmp_cfg, tmp_st = path / f".config.json.tmp-{os.getpid()}", work / "model.safetensors"
        try:
            with _folder_lock(path, exclusive=True):
                for stale in (*path.glob(".config.json.tmp-*"), *path.glob(".model.safetensors.tmp-*")):
                    stale.unlink(missing_ok=True)  # temporaries exist only under this lock: these are a killed save's
                for old in path.glob(".evict-save-*"):
                    shutil.rmtree(old, ignore_errors=True)
                work.mkdir()
                tmp_cfg.write_text(text)
                save_model(self, str(tmp_st), metadata=meta)
                os.chmod(tmp_st, stat.S_IMODE(tmp_cfg.stat().st_mode))  # safetensors creates 0600; match the config
                os.replace(tmp_st, path / "model.safetensors")
                os.replace(tmp_cfg, path / "config.json")
        except OSError as e:
            raise ValueError(f"path: cannot write the model into {path} ({e.strerror or first_line(e)})") from None
        finally:
            tmp_cfg.unlink(missing_ok=True)
            shutil.rmtree(work, ignore_errors=True)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, device=None) -> "LM":
        """Build the model from `config.json` and load `model.safetensors` (checked: see `load_weights`).

        `device` is checked before anything is read ('cuda' without CUDA is a ValueError naming it)."""
        dev = _torch_device(device)
        path = _folder(path)
        if not (path / "config.json").is_file():
            raise ValueError(f"path: expected a folder with config.json and model.safetensors, got {path}")
        with _folder_lock(path, exclusive=False):
            raw = _saved_config(path)
            try:
                cfg = ModelConfig.from_dict(dict(raw))
            except ValueError as e:
                msg = str(e)
                raise ValueError(msg if msg.startswith("checkpoint: ") else f"checkpoint: {path / 'config.json'}: {msg}") from None
            model = cls(cfg)
            model._load_checked(path, raw, dev)
        return model

    def load_weights(self, path: str | os.PathLike, device=None) -> None:
        """Load weights saved by `save`, checked before any is copied: the config must equal this model's (else the
        differing fields are named) and be the one saved with the tensors, and every tensor must be present, of the
        model's shape, floating where the model's is (any float dtype converts), and finite. Each failure is one
        ValueError naming the file."""
        dev = _torch_device(device)
        path = _folder(path)
        with _folder_lock(path, exclusive=False):
            self._load_checked(path, _saved_config(path), dev)

    def _load_checked(self, path: Path, raw: dict, device: torch.device | None) -> None:
        from safetensors import safe_open

        saved = raw
        try:  # fields added since the file was written take their defaults (what that model was built with)
            saved = json.loads(ModelConfig.from_dict(dict(raw)).to_json())
        except (ValueError, TypeError):
            pass  # compared as written: the differing fields are named below
        mine = json.loads(self.cfg.to_json())
        diff = sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k))
        if diff:
            shown = ", ".join(f"{k}: checkpoint {saved.get(k)!r} vs model {mine.get(k)!r}" for k in diff[:4])
            raise ValueError(f"checkpoint: {path} was saved from another config ({shown})")
        file = path / "model.safetensors"
        if not file.is_file():
            raise ValueError(f"checkpoint: no such file: {file}")
        try:  # one open: the metadata and the tensors are those of one file, whatever is renamed meanwhile
            with safe_open(str(file), "pt", device="cpu") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:  # safetensors raises its own error type (truncated file, bad header, bad offsets)
            raise ValueError(f"checkpoint: {file} is not a readable safetensors file ({first_line(e)})") from None
        want_cfg = meta.get("evict_config_sha256")
        if want_cfg is not None and _config_digest(raw) != want_cfg:
            raise ValueError(f"checkpoint: {path / 'config.json'} is not the config saved with {file.name} "
                             "(edited after the save, or from another save); save the model again")
        expected = self.state_dict()
        _check_tensors(file, tensors, expected)
        want = meta.get("evict_sha256")  # files without one (older saves) are accepted as they are
        if want is not None and _digest(_by_storage(tensors, expected)) != want:
            raise ValueError(f"checkpoint: {file}: the tensor data does not match the checksum written at save (corrupted)")
        self.load_state_dict(tensors, strict=False)  # every name was checked above; tied copies are one tensor
        if device is not None:
            self.to(device)


def _folder(path) -> Path:
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ValueError(f"path: expected a folder path, got {path!r}")
    return Path(path).expanduser()


@contextlib.contextmanager
def _folder_lock(path: Path, *, exclusive: bool):
    """An flock on the folder itself: saves hold it exclusively, loads shared, so a load never sees half of a save.
    Where the folder cannot be opened for a lock, the load goes on unlocked: the config digest still refuses a mixed
    pair."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def _saved_config(path: Path) -> dict:
    """config.json, or, where a save was killed between its two renames (the tensors renamed, the config not yet),
    the config that save wrote for the tensors now in place: its temporary, found by digest. Called under the folder
    lock, so a temporary seen here is a dead save's. A mismatch that remains is refused by `_load_checked`."""
    from safetensors import safe_open

    raw = _read_config(path / "config.json")
    try:
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            want = (f.metadata() or {}).get("evict_config_sha256")
    except Exception:  # no file, or not a safetensors file: `_load_checked` says which, naming it
        return raw
    if want is None or _config_digest(raw) == want:
        return raw
    for tmp in sorted(path.glob(".config.json.tmp-*")):
        try:
            candidate = read_json_object(tmp, "checkpoint")
        except ValueError:
            continue
        if _config_digest(candidate) == want:
            log.warning("checkpoint: %s: a save was cut off between its two files; loading its config from %s",
                        path, tmp.name)
            return candidate
    return raw


def _config_digest(raw: dict) -> str:
    """sha256 of the config as saved (keys sorted, no whitespace): what the weights were saved with."""
    return hashlib.sha256(json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _torch_device(device) -> torch.device | None:
    """`device` as a torch.device that exists on this machine (None stays None), else one ValueError naming it."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device: expected a torch device such as 'cpu' or 'cuda', got {device!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: {device!r}: CUDA is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device: {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type not in ("cpu", "meta"):
        backend = getattr(torch, dev.type, None)
        if backend is None or not getattr(backend, "is_available", lambda: False)():
            raise ValueError(f"device: {device!r}: no such device on this machine")
    return dev


def _storage_groups(expected: dict) -> list[list[str]]:
    """The model's state-dict names grouped by the storage they share (tied embeddings are one group)."""
    groups: dict = {}
    for name, t in expected.items():
        groups.setdefault((t.device, t.untyped_storage().data_ptr()) if t.numel() else name, []).append(name)
    return list(groups.values())


def _by_storage(tensors: dict, expected: dict) -> dict:
    """{the first name (sorted) of each of the model's storage groups: tensor}: tied weights once, whichever alias the
    file kept."""
    first = {name: min(names) for names in _storage_groups(expected) for name in names}
    return {first[name]: t for name, t in tensors.items()}


def _digest(tensors: dict) -> str:
    """sha256 over names, dtypes, shapes and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _read_config(file: Path) -> dict:
    return read_json_object(file, "checkpoint")


def _check_tensors(file: Path, tensors: dict, expected: dict) -> None:
    """Names, shapes, dtypes and finiteness of a loaded state dict against the model's; tied tensors count once."""
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise ValueError(f"checkpoint: {file} holds tensors this model does not have: {unexpected[:4]}")
    # names sharing one storage (tied embeddings): the file holds one of them
    missing = sorted(names[0] for names in _storage_groups(expected) if not any(n in tensors for n in names))
    if missing:
        raise ValueError(f"checkpoint: {file} lacks tensors of this model: {missing[:4]}")
    for name, t in tensors.items():
        want = expected[name]
        if t.shape != want.shape:
            raise ValueError(f"checkpoint: {file}: {name} has shape {list(t.shape)}, the config gives {list(want.shape)}")
        if t.is_floating_point() != want.is_floating_point() or (not want.is_floating_point() and t.dtype != want.dtype):
            raise ValueError(f"checkpoint: {file}: {name} has dtype {t.dtype}, expected {want.dtype}")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"checkpoint: {file}: {name} holds NaN or Inf")
