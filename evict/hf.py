"""transformers interop (extra `[hf]`): evict's LM as a `PreTrainedModel` that `generate()` drives with evict's own cache.

    EvictConfig        PretrainedConfig, model_type "evict": the whole ModelConfig under the key `evict`
    EvictForCausalLM   PreTrainedModel + GenerationMixin around one `LM` (`.model`); save_pretrained / from_pretrained
    EvictCache         a transformers `Cache` that carries evict's HybridCache, so generate() feeds only new tokens
    to_hf(lm)          wrap a trained LM (weights shared, not copied)

Importing this module registers both classes with AutoConfig and AutoModelForCausalLM. Written against the Cache
API of transformers 5 (the `cache` keyword) and 4.5x (`past_key_values`): the forward takes either name, the output
carries the cache under the name of the installed version, and `prepare_inputs_for_generation` slices the inputs by the cache's own position, so the generation
loop's bookkeeping of either version agrees with evict's.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from evict.cache import HybridCache, KVState, LatentState
from evict.models.config import ModelConfig
from evict.models.lm import LM

_V5 = int(__import__("transformers").__version__.split(".")[0]) >= 5
# the output field generate() reads the cache from: `cache` in transformers 5, `past_key_values` before
_CACHE_FIELD = "cache" if "cache" in {f.name for f in fields(CausalLMOutputWithPast)} else "past_key_values"


class EvictConfig(PretrainedConfig):
    """`evict`: the ModelConfig as a dict (validated here); the usual HF names mirror its sizes for tools that read them."""

    model_type = "evict"

    def __init__(self, evict: dict | None = None, **kwargs: Any):
        cfg = ModelConfig() if evict is None else ModelConfig.from_dict(dict(evict))
        self.evict = cfg.to_dict()
        kwargs["tie_word_embeddings"] = cfg.tie_embeddings
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            kwargs.pop(name, None)  # derived from `evict` below; a saved copy is never read back
        super().__init__(**kwargs)
        self.vocab_size, self.hidden_size = cfg.vocab_size, cfg.d_model
        self.num_hidden_layers, self.num_attention_heads = cfg.n_layers, cfg.n_heads

    def model_config(self) -> ModelConfig:
        return ModelConfig.from_dict(dict(self.evict))


_POSITIONAL = {KVState: ("k", "v"), LatentState: ("c", "k_rope")}  # tensors laid out [B, L_max, ...]


_NO_ASSIST = "cache: evict's recurrent states cannot be cropped (assisted decoding is not supported)"


class EvictCache(Cache):
    """evict's HybridCache behind transformers' Cache interface; it grows (doubling) when a call needs more room.

    `seen` counts the input columns fed so far, pads included (what generate() slices its inputs by); a left-padded
    batch's pads are the HybridCache's `pad` (see _EvictPreTrained)."""

    def __init__(self, model: LM, batch_size: int, max_len: int = 64):
        try:
            super().__init__(layers=[])
        except TypeError:  # transformers < 4.56: Cache() takes no layers
            super().__init__()
        self.model = model
        self.hybrid: HybridCache = model.new_cache(batch_size, max_len)
        self.seen = 0

    def __len__(self) -> int:
        return len(self.hybrid)

    def reserve(self, n: int) -> None:
        """Make room for n more tokens, copying the positional states into larger buffers when needed."""
        self.hybrid = self.grown(self.hybrid, n)

    def grown(self, h: HybridCache, n: int) -> HybridCache:
        """h, or a larger copy of it with room for n more tokens."""
        if h.pos + n <= h.max_len:
            return h
        limit = self.model.cfg.max_seq_len if self.model.cfg.pos == "learned" else None
        new_len = max(2 * h.max_len, h.pos + n) if limit is None else max(min(2 * h.max_len, limit), h.pos + n)
        bigger = self.model.new_cache(h.batch_size, new_len, device=_device(h), dtype=_dtype(h))
        for old, new in zip(h.states, bigger.states):
            for f in fields(old):
                t = getattr(old, f.name)
                if f.name in _POSITIONAL.get(type(old), ()):
                    getattr(new, f.name)[:, : h.pos] = t[:, : h.pos]
                else:
                    setattr(new, f.name, t)
        bigger.pos, bigger.pad = h.pos, h.pad
        return bigger

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self.seen

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1  # grows on demand

    def get_max_cache_shape(self, layer_idx: int | None = 0) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return True

    def reset(self) -> None:
        self.hybrid.reset()
        self.seen = 0

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Beam search: take rows `beam_idx` of every state."""
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def crop(self, max_length: int) -> None:
        raise ValueError(_NO_ASSIST)

    def _map(self, fn) -> None:
        """fn on the batch dim of every state (and of the pads): the batch size follows."""
        h = self.hybrid
        for st in h.states:
            for f in fields(st):
                t = getattr(st, f.name)
                if isinstance(t, torch.Tensor):
                    setattr(st, f.name, fn(t))
        rows = fn(torch.arange(h.batch_size))
        h.batch_size = len(rows)
        if h.pad is not None:
            h.pad = [h.pad[i] for i in rows.tolist()]


def _device(h: HybridCache) -> torch.device | None:
    ts = [t for st in h.states for f in fields(st) if isinstance(t := getattr(st, f.name), torch.Tensor)]
    return ts[0].device if ts else None


def _dtype(h: HybridCache) -> torch.dtype | None:
    ts = [t for st in h.states if isinstance(st, tuple(_POSITIONAL)) for t in (getattr(st, _POSITIONAL[type(st)][0]),)]
    return ts[0].dtype if ts else None


class _EvictPreTrained(PreTrainedModel):
    """What the base model and the causal LM share: the config, the LM at `.model`, and the forward over it.

    Padding: a batch whose attention_mask holds zeros must be left-padded (zeros, then ones, per row). It runs as one
    batch (LM's `pad`, evict.cache.PaddedBatch): pads leave every recurrent state and conv tail as the row alone has
    them, attention masks pad keys, positions count from each row's first token; the cache keeps the pads for the
    rest of generate(). So each row's outputs at its tokens are what it gives alone; those at pads are zeros."""

    config_class = EvictConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _tied_weights_keys: Any = {"model.head.weight": "model.embed.weight"} if _V5 else ["model.head.weight"]

    def __init__(self, config: EvictConfig, lm: LM | None = None):
        super().__init__(config)
        self.model = lm if lm is not None else LM(config.model_config())
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Nothing: LM's constructor initialises every parameter (LM.init_weights) and loading replaces them all."""

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # generate() must not build a DynamicCache: the model brings its own (EvictCache)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True) -> torch.nn.Embedding:
        """A vocabulary of new_num_tokens (rounded up to pad_to_multiple_of): old rows kept, new rows of the embedding
        (and an untied head) set to the mean of the old ones (mean_resizing) or N(0, init_std). Checked first: a bad
        value changes nothing."""
        for name, v in (("new_num_tokens", new_num_tokens), ("pad_to_multiple_of", pad_to_multiple_of)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name}: expected None or a positive integer, got {v!r}")
        lm, cfg = self.model, self.model.cfg
        n = cfg.vocab_size if new_num_tokens is None else new_num_tokens
        if pad_to_multiple_of is not None:
            n = -(-n // pad_to_multiple_of) * pad_to_multiple_of
        if n == cfg.vocab_size:
            return lm.embed
        new_cfg = replace(cfg, vocab_size=n)
        new_cfg.validate()  # raises before anything changes
        keep = min(n, cfg.vocab_size)

        def grown(old: torch.Tensor) -> torch.nn.Parameter:
            w = old.new_empty(n, old.shape[1])
            with torch.no_grad():
                w[:keep] = old[:keep]
                if n > keep:
                    if mean_resizing:
                        w[keep:] = old.float().mean(0).to(old.dtype)
                    else:
                        w[keep:].normal_(0.0, cfg.init_std)
            return torch.nn.Parameter(w, requires_grad=old.requires_grad)

        embed = torch.nn.Embedding(n, cfg.d_model, device=lm.embed.weight.device, dtype=lm.embed.weight.dtype)
        embed.weight = grown(lm.embed.weight)
        head = torch.nn.Linear(cfg.d_model, n, bias=False, device=lm.head.weight.device, dtype=lm.head.weight.dtype)
        head.weight = embed.weight if cfg.tie_embeddings else grown(lm.head.weight)
        lm.embed, lm.head, lm.cfg = embed, head, new_cfg
        self.config.evict = new_cfg.to_dict()
        self.config.vocab_size = n
        return embed

    def _run(self, input_ids, inputs_embeds, attention_mask, cache_in, use_cache, hidden: list | None,
             head: bool, keep) -> tuple[torch.Tensor, EvictCache | None]:
        """(logits [B, T', V] or final-normed states [B, T', D], the cache): T' = T, or the kept positions."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("input_ids: give exactly one of input_ids and inputs_embeds")
        x = input_ids if input_ids is not None else inputs_embeds
        B, T = x.shape[0], x.shape[1]
        c = cache_in
        if c is not None and not isinstance(c, EvictCache):
            if c.get_seq_length() > 0:
                raise ValueError(f"cache: expected an EvictCache, got a filled {type(c).__name__}")
            c = None
        if c is None and use_cache:
            c = EvictCache(self.model, B, max_len=max(64, T))
        fresh = c is None or c.get_seq_length() == 0
        lengths = _left_padded(attention_mask, B, T) if fresh else None
        pad = None if lengths is None else [T - n for n in lengths]
        if c is not None:
            c.reserve(T)
        kw = {"embeds": x} if input_ids is None else {}
        out = self.model(None if input_ids is None else x, cache=None if c is None else c.hybrid, positions=keep,
                         hidden_states=hidden, head=head, pad=pad, **kw)
        if c is not None:
            c.seen += T
        if pad is not None:  # zeros at the pads (outputs, hidden states): nothing there depends on the pad tokens
            real = torch.arange(T, device=out.device) >= torch.tensor(pad, device=out.device)[:, None]  # [B, T]
            out = out.masked_fill(~(real if keep is None else real.gather(1, keep))[..., None], 0)
            if hidden is not None:
                hidden[:] = [h.masked_fill(~real[..., None], 0) for h in hidden]
        return out, c


def _left_padded(mask: torch.Tensor | None, B: int, T: int) -> list[int] | None:
    """Each row's count of real tokens when `mask` [B, T] pads some row on the left; None when nothing is padded."""
    if mask is None:
        return None
    if mask.shape != (B, T):
        raise ValueError(f"attention_mask: expected shape {(B, T)}, got {tuple(mask.shape)}")
    m = mask.bool()
    if bool(m.all()):
        return None
    if bool((m[:, 1:] < m[:, :-1]).any()):
        raise ValueError("attention_mask: expected left padding (zeros, then ones, in each row); "
                         "set tokenizer.padding_side = 'left'")
    lengths = m.sum(1).tolist()
    if min(lengths) == 0:
        raise ValueError("attention_mask: a row has no tokens (all zeros)")
    return lengths


def _keep(logits_to_keep, B: int, T: int, device) -> torch.Tensor | None:
    """transformers' logits_to_keep (int k: the last k positions, 0 = all; or a 1-D tensor of indices) -> [B, P]."""
    if isinstance(logits_to_keep, torch.Tensor):
        if logits_to_keep.dim() != 1 or logits_to_keep.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"logits_to_keep: expected an int or a 1-D integer tensor, got {tuple(logits_to_keep.shape)}")
        return logits_to_keep.to(device, torch.int64)[None].expand(B, -1)
    if not isinstance(logits_to_keep, int) or isinstance(logits_to_keep, bool) or logits_to_keep < 0:
        raise ValueError(f"logits_to_keep: expected an int >= 0, got {logits_to_keep!r}")
    if logits_to_keep == 0 or logits_to_keep >= T:
        return None
    return torch.arange(T - logits_to_keep, T, device=device)[None].expand(B, -1)


class EvictModel(_EvictPreTrained):
    """The base model (transformers' AutoModel): the final-normed hidden states, no head."""

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                past_key_values: Cache | None = None, cache: Cache | None = None, inputs_embeds: torch.Tensor | None = None,
                use_cache: bool | None = None, output_hidden_states: bool | None = None, return_dict: bool | None = None,
                **kwargs: Any) -> BaseModelOutputWithPast:
        """input_ids [B, T] (or inputs_embeds [B, T, D]) -> last_hidden_state [B, T, D]."""
        want_hidden = output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        hidden: list | None = [] if want_hidden else None
        out, c = self._run(input_ids, inputs_embeds, attention_mask, cache if cache is not None else past_key_values,
                           use_cache, hidden, head=False, keep=None)
        res = BaseModelOutputWithPast(last_hidden_state=out, hidden_states=None if hidden is None else tuple(hidden))
        res[_CACHE_FIELD] = c
        return res


class EvictForCausalLM(_EvictPreTrained, GenerationMixin):

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.model.head

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                past_key_values: Cache | None = None, cache: Cache | None = None, labels: torch.Tensor | None = None,
                use_cache: bool | None = None, return_dict: bool | None = None, inputs_embeds: torch.Tensor | None = None,
                output_hidden_states: bool | None = None, logits_to_keep: int | torch.Tensor = 0,
                num_items_in_batch: int | torch.Tensor | None = None, **kwargs: Any) -> CausalLMOutputWithPast:
        """input_ids [B, T] (or inputs_embeds [B, T, D]) -> logits [B, T, vocab] (the kept positions only, with
        logits_to_keep). With a cache (either keyword; None with use_cache=True makes one), only the tokens after the
        cache's position are fed. `labels` [B, T]: next-token cross-entropy (ignore_index -100; summed and divided by
        num_items_in_batch when the Trainer passes it). A padded attention_mask: see _EvictPreTrained."""
        x = input_ids if input_ids is not None else inputs_embeds
        if x is None:
            raise ValueError("input_ids: give exactly one of input_ids and inputs_embeds")
        keep = _keep(logits_to_keep, x.shape[0], x.shape[1], x.device)
        if labels is not None and keep is not None:
            raise ValueError("logits_to_keep: the loss needs every position's logits; pass logits_to_keep=0 with labels")
        want_hidden = output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        hidden: list | None = [] if want_hidden else None
        logits, c = self._run(input_ids, inputs_embeds, attention_mask, cache if cache is not None else past_key_values,
                              use_cache, hidden, head=True, keep=keep)
        loss = None
        if labels is not None:
            flat, target = logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten().to(logits.device)
            if num_items_in_batch is None:
                loss = F.cross_entropy(flat, target, ignore_index=-100)
            else:
                loss = F.cross_entropy(flat, target, ignore_index=-100, reduction="sum") / num_items_in_batch
        out = CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=None if hidden is None else tuple(hidden))
        out[_CACHE_FIELD] = c
        return out

    def generate(self, *args: Any, **kwargs: Any):
        """transformers' generate(); assisted decoding (an assistant model, prompt lookup) is refused in one line: it
        rolls the cache back, which recurrent states cannot do."""
        gc = kwargs.get("generation_config")
        if (kwargs.get("assistant_model") is not None or kwargs.get("prompt_lookup_num_tokens")
                or kwargs.get("assistant_early_exit") or getattr(gc, "prompt_lookup_num_tokens", None)
                or getattr(gc, "assistant_early_exit", None)):
            raise ValueError(_NO_ASSIST)
        return super().generate(*args, **kwargs)

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, past_key_values: Cache | None = None,
                                      cache: Cache | None = None, attention_mask: torch.Tensor | None = None,
                                      use_cache: bool = True, inputs_embeds: torch.Tensor | None = None,
                                      **kwargs: Any) -> dict:
        """Only the tokens the cache has not seen: the whole prompt first (or its inputs_embeds), then one token per step."""
        c = cache if cache is not None else past_key_values
        seen = c.get_seq_length() if isinstance(c, EvictCache) else 0
        if inputs_embeds is not None and seen == 0:
            return {"inputs_embeds": inputs_embeds, "cache": c, "attention_mask": attention_mask, "use_cache": use_cache}
        if isinstance(c, EvictCache):
            input_ids = input_ids[:, seen:]
        return {"input_ids": input_ids, "cache": c, "attention_mask": attention_mask, "use_cache": use_cache}


def to_hf(lm: LM, eos_token_id: int | None = None) -> EvictForCausalLM:
    """A transformers model around `lm` (its parameters, not a copy), ready for generate() and save_pretrained().

    eos_token_id (the tokenizer's end-of-text): generate() stops there, and pads with it (config and generation
    config get it as eos, bos and pad id, GPT-2's convention)."""
    if not isinstance(lm, LM):
        raise ValueError(f"lm: expected an evict LM, got {type(lm).__name__}")
    if eos_token_id is not None and (not isinstance(eos_token_id, int) or not 0 <= eos_token_id < lm.cfg.vocab_size):
        raise ValueError(f"eos_token_id: expected an id in [0, {lm.cfg.vocab_size}), got {eos_token_id!r}")
    model = EvictForCausalLM(EvictConfig(evict=lm.cfg.to_dict()), lm=lm)
    if eos_token_id is not None:
        for c in (model.config, model.generation_config):
            c.eos_token_id = c.bos_token_id = c.pad_token_id = eos_token_id
    return model


AutoConfig.register("evict", EvictConfig, exist_ok=True)
AutoModel.register(EvictConfig, EvictModel, exist_ok=True)
AutoModelForCausalLM.register(EvictConfig, EvictForCausalLM, exist_ok=True)
