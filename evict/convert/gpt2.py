"""From a `transformers` GPT-2 (`GPT2LMHeadModel`) to evict's LM: the config mapped field by field, every tensor copied.

GPT-2 stores its linears as `Conv1D` with weights [in, out] (x @ W + b); evict's `nn.Linear` holds [out, in], so
each of c_attn, c_proj (attention and MLP) and c_fc is transposed. c_attn's columns are q | k | v, heads laid out
[H, D] within each — evict's `wqkv` split. The head is tied to the token table (a GPT-2 whose `lm_head` differs is
converted untied). What GPT-2 computes and evict does too: learned positions, pre-norm LayerNorm with bias (eps from
the config), tanh-GELU MLP, attention scaled by 1/sqrt(head dim). Options evict has no form of are refused by name.
"""

from __future__ import annotations

from typing import Any

import torch

from evict.cli_args import first_line
from evict.jsonfile import read_json_object
from evict.models.config import ModelConfig
from evict.models.lm import LM

_GELUS = ("gelu_new", "gelu_pytorch_tanh")  # the tanh approximation; "gelu" (exact erf) is a different function


def gpt2_config(hf_config) -> ModelConfig:
    """The ModelConfig of a transformers `GPT2Config`; unsupported options are a ValueError naming them."""
    c = hf_config
    if getattr(c, "model_type", None) != "gpt2":
        raise ValueError(f"hf_model: expected a GPT-2 config (model_type 'gpt2'), got {getattr(c, 'model_type', None)!r}")
    unsupported = {
        "activation_function": (c.activation_function not in _GELUS, f"one of {_GELUS}"),
        "scale_attn_weights": (not c.scale_attn_weights, "True"),
        "scale_attn_by_inverse_layer_idx": (bool(getattr(c, "scale_attn_by_inverse_layer_idx", False)), "False"),
        "add_cross_attention": (bool(getattr(c, "add_cross_attention", False)), "False"),
    }
    for name, (bad, want) in unsupported.items():
        if bad:
            raise ValueError(f"hf_model: config.{name} must be {want} to map onto evict, got {getattr(c, name)!r}")
    return ModelConfig(vocab_size=c.vocab_size, d_model=c.n_embd, n_layers=c.n_layer, n_heads=c.n_head, pattern="A",
                       pos="learned", max_seq_len=c.n_positions, bias=True, norm="layernorm",
                       norm_eps=float(c.layer_norm_epsilon), ffn="gelu", d_ff=c.n_inner or 4 * c.n_embd,
                       tie_embeddings=True)


_BUFFERS = ("attn.bias", "attn.masked_bias")  # causal-mask buffers older GPT-2 files carry; not weights


def gpt2_state_dict(hf_state: dict, n_layers: int) -> dict:
    """evict LM names -> tensors from a GPT2LMHeadModel state dict (Conv1D weights transposed). Every weight is read:
    one missing, or one left over (a layer the config does not count), is a ValueError naming it."""
    src = {k.removeprefix("transformer."): v for k, v in hf_state.items()}
    read: set[str] = set()

    def take(name: str):
        if name not in src:
            raise ValueError(f"hf_model: lacks the weight transformer.{name} (config: n_layer={n_layers})")
        read.add(name)
        return src[name]

    out = {"embed.weight": take("wte.weight"), "wpe.weight": take("wpe.weight"),
           "norm.weight": take("ln_f.weight"), "norm.bias": take("ln_f.bias")}
    pairs = (("ln_1", "norm1", False), ("attn.c_attn", "mixer.wqkv", True), ("attn.c_proj", "mixer.wo", True),
             ("ln_2", "norm2", False), ("mlp.c_fc", "ffn.w1", True), ("mlp.c_proj", "ffn.w2", True))
    for i in range(n_layers):
        for theirs, ours, conv1d in pairs:
            w = take(f"h.{i}.{theirs}.weight")
            out[f"blocks.{i}.{ours}.weight"] = w.t() if conv1d else w
            out[f"blocks.{i}.{ours}.bias"] = take(f"h.{i}.{theirs}.bias")
    out["head.weight"] = hf_state["lm_head.weight"] if "lm_head.weight" in hf_state else src["wte.weight"]
    left = sorted(k for k in src if k not in read and k != "lm_head.weight" and not k.endswith(_BUFFERS))
    if left:
        raise ValueError(f"hf_model: holds weights evict would not read (config: n_layer={n_layers}): {left[:4]}")
    return out


def from_hf_gpt2(hf_model) -> LM:
    """An evict LM computing what `hf_model` (a transformers GPT2LMHeadModel) computes, in its dtype, on the CPU."""
    if type(hf_model).__name__ != "GPT2LMHeadModel" or not hasattr(hf_model, "state_dict"):
        raise ValueError(f"hf_model: expected a transformers GPT2LMHeadModel, got {type(hf_model).__name__}")
    cfg = gpt2_config(hf_model.config)
    hf_state = {k: v.detach().cpu() for k, v in hf_model.state_dict().items()}
    state = gpt2_state_dict(hf_state, cfg.n_layers)
    if not torch.equal(state["head.weight"], state["embed.weight"]):
        cfg.tie_embeddings = False
    dtype = state["embed.weight"].dtype
    model = LM(cfg).to(dtype)
    model.load_state_dict(state, strict=True)
    return model.eval()


def load_hf_gpt2(path: str):
    """A GPT2LMHeadModel from a local `save_pretrained` folder (never downloads), in the dtype its weights were saved
    in. A folder that is not a GPT-2 (config model_type), has a truncated or unreadable weight file, or whose weights
    do not cover the config exactly (a tensor missing, left over or of another shape) is a ValueError naming it."""
    from pathlib import Path

    try:
        from transformers import GPT2LMHeadModel
    except ImportError:
        raise ValueError("the GPT-2 converter needs transformers: pip install 'evict[hf]'") from None
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"path: expected a transformers GPT-2 folder with config.json, got {path}")
    kind = read_json_object(folder / "config.json", "path").get("model_type")
    if kind != "gpt2":
        raise ValueError(f"path: {folder / 'config.json'} is not a transformers GPT-2 config (model_type {kind!r}, "
                         "expected 'gpt2')")
    weights = folder / "model.safetensors"
    if weights.is_file():
        _check_safetensors(weights)
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # its load report would be a second account of what is refused below
    hf_logging.disable_progress_bar()
    try:
        loaded: Any = GPT2LMHeadModel.from_pretrained(path, local_files_only=True, output_loading_info=True,
                                                      dtype="auto", ignore_mismatched_sizes=True)  # refused below
        model, info = loaded
    except Exception as e:  # transformers and safetensors raise many types (OSError, SafetensorError, RuntimeError …)
        raise ValueError(f"path: {path} is not a loadable GPT-2 folder ({first_line(e)})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    for key, what in (("missing_keys", "lacks weights the config needs"), ("unexpected_keys", "holds weights the "
                      "config has no place for"), ("mismatched_keys", "holds weights of other shapes than the config's")):
        names = sorted(str(k) for k in info.get(key) or ())
        if names:
            raise ValueError(f"path: {path} {what} (config: n_layer={model.config.n_layer}): {names[:4]}")
    return model


def _check_safetensors(file) -> None:
    """Header and length of a safetensors file (a truncated one fails here), as one line naming it."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), "pt") as f:
            f.keys()
    except Exception as e:  # SafetensorError is safetensors' own type
        raise ValueError(f"path: {file} is not a readable safetensors file ({first_line(e)})") from None
