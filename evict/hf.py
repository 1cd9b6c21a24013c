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

from dataclasses import fields
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

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


class EvictCache(Cache):
    """evict's HybridCache behind transformers' Cache interface; it grows (doubling) when a call needs more room."""

    def __init__(self, model: LM, batch_size: int, max_len: int = 64):
        try:
            super().__init__(layers=[])
        except TypeError:  # transformers < 4.56: Cache() takes no layers
            super().__init__()
        self.model = model
        self.hybrid: HybridCache = model.new_cache(batch_size, max_len)

    def __len__(self) -> int:
        return len(self.hybrid)

    def reserve(self, n: int) -> None:
        """Make room for n more tokens, copying the positional states into larger buffers when needed."""
        h = self.hybrid
        if h.pos + n <= h.max_len:
            return
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
        bigger.pos = h.pos
        self.hybrid = bigger

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self.hybrid.pos

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

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Beam search: take rows `beam_idx` of every state."""
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices])
        self.hybrid.batch_size = len(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))
        self.hybrid.batch_size *= repeats

    def crop(self, max_length: int) -> None:
        raise ValueError("cache: evict's recurrent states cannot be cropped (assisted decoding is not supported)")

    def _map(self, fn) -> None:
        for st in self.hybrid.states:
            for f in fields(st):
                t = getattr(st, f.name)
                if isinstance(t, torch.Tensor):
                    setattr(st, f.name, fn(t))


def _device(h: HybridCache) -> torch.device | None:
    ts = [t for st in h.states for f in fields(st) if isinstance(t := getattr(st, f.name), torch.Tensor)]
    return ts[0].device if ts else None


def _dtype(h: HybridCache) -> torch.dtype | None:
    ts = [t for st in h.states if isinstance(st, tuple(_POSITIONAL)) for t in (getattr(st, _POSITIONAL[type(st)][0]),)]
    return ts[0].dtype if ts else None


class EvictForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = EvictConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
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

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.model.head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values: Cache | None = None, cache: Cache | None = None, labels: torch.Tensor | None = None,
                use_cache: bool | None = None, return_dict: bool | None = None, **kwargs: Any) -> CausalLMOutputWithPast:
        """input_ids [B, T] -> logits [B, T, vocab]. With a cache (either keyword; None with use_cache=True makes one),
        only the tokens after the cache's position are fed. `attention_mask` must be all ones (no padding)."""
        c = cache if cache is not None else past_key_values
        if c is not None and not isinstance(c, EvictCache):
            if c.get_seq_length() > 0:
                raise ValueError(f"cache: expected an EvictCache, got a filled {type(c).__name__}")
            c = None
        if c is None and use_cache:
            c = EvictCache(self.model, input_ids.shape[0], max_len=max(64, input_ids.shape[1]))
        if attention_mask is not None and (c is None or c.get_seq_length() == 0) and not bool(attention_mask.all()):
            raise ValueError("attention_mask: evict models take no padding; expected all ones")
        if c is not None:
            c.reserve(input_ids.shape[1])
        logits = self.model(input_ids, cache=None if c is None else c.hybrid)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        out = CausalLMOutputWithPast(loss=loss, logits=logits)
        out[_CACHE_FIELD] = c
        return out

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, past_key_values: Cache | None = None,
                                      cache: Cache | None = None, attention_mask: torch.Tensor | None = None,
                                      use_cache: bool = True, **kwargs: Any) -> dict:
        """Only the tokens the cache has not seen: the whole prompt first, then one token per step."""
        c = cache if cache is not None else past_key_values
        if isinstance(c, EvictCache):
            input_ids = input_ids[:, c.get_seq_length():]
        return {"input_ids": input_ids, "cache": c, "attention_mask": attention_mask, "use_cache": use_cache}


def to_hf(lm: LM) -> EvictForCausalLM:
    """A transformers model around `lm` (its parameters, not a copy), ready for generate() and save_pretrained()."""
    if not isinstance(lm, LM):
        raise ValueError(f"lm: expected an evict LM, got {type(lm).__name__}")
    return EvictForCausalLM(EvictConfig(evict=lm.cfg.to_dict()), lm=lm)


AutoConfig.register("evict", EvictConfig, exist_ok=True)
AutoModelForCausalLM.register(EvictConfig, EvictForCausalLM, exist_ok=True)
