"""Export to flash-linear-attention's (fla) Hugging Face models where the architectures coincide.

    to_fla(lm, out, dtype=None) -> Path      out/config.json + out/model.safetensors, loadable with fla's
                                             AutoModelForCausalLM (model_type "kda" or "gated_deltanet")
    fla_config(cfg) -> dict                  the config.json (a ValueError names the first field that does not map)
    fla_state_dict(lm) -> {name: tensor}     fla's parameter names

What maps (docs/convert.md has the table): a stack of one memory kind — KDA ("K") or Gated DeltaNet ("G") — with
optional softmax-attention layers ("A", RoPE, no biases) at any positions (fla's `attn` layer list), SwiGLU FFNs,
RMSNorm, tied or untied head. Per mixer: evict's fused `wqkv` and its one short conv over the 3·H·D channels split
into fla's q/k/v projections and q/k/v convs (same causal kernel, w[k-1] on the current token); KDA's low-rank
decay f_gate -> f_proj and low-rank output gate f_out -> g_proj (rank = head dim, as fla has it); Gated DeltaNet's
scalar gate f_gate -> a_proj, full-rank output gate f_out -> g_proj with a sigmoid (`output_gate_activation`);
A_log and dt_bias as they are, both gate forms (softplus; bounded = fla's `safe_gate` with lower_bound -5).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from evict.models.config import MIXERS, ModelConfig
from evict.models.lm import LM

from .folder import write_folder

_MODEL_TYPES = {"K": ("kda", "KDAForCausalLM"), "G": ("gated_deltanet", "GatedDeltaNetForCausalLM")}


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _memory_letter(cfg: ModelConfig) -> str:
    letters = cfg.layer_mixers()
    kinds = sorted(set(letters) - {"A"})
    _need(len(kinds) == 1 and kinds[0] in _MODEL_TYPES,
          f"pattern: fla's models hold one memory kind, KDA (K) or Gated DeltaNet (G), plus optional attention (A); "
          f"got layers {''.join(letters)} ({', '.join(f'{c}={MIXERS[c]}' for c in sorted(set(letters)))})")
    return kinds[0]


def fla_config(cfg: ModelConfig) -> dict:
    """fla's config.json for `cfg`, or a ValueError naming the first field fla's model has no form of."""
    letter = _memory_letter(cfg)
    _need(cfg.moe is None, "moe: fla's KDA / Gated DeltaNet models have dense FFNs only; got an MoE config")
    _need(not cfg.attn_res, "attn_res: evict's Attention Residuals do not map onto fla's (per-sublayer projections)")
    _need(cfg.ffn == "swiglu", f"ffn: fla's models use SwiGLU; got {cfg.ffn!r}")
    _need(cfg.norm == "rmsnorm", f"norm: fla's models use RMSNorm; got {cfg.norm!r}")
    _need(cfg.pos != "learned", "pos: fla's models have no learned position table; got 'learned'")
    if letter == "K":
        _need(cfg.out_gate_rank == 0, f"out_gate_rank: fla's KDA has a low-rank output gate of rank head_dim "
                                      f"(out_gate_rank=0); got {cfg.out_gate_rank!r}")
    else:
        _need(cfg.out_gate_rank is None, f"out_gate_rank: fla's Gated DeltaNet has a full-rank output gate "
                                         f"(out_gate_rank=None); got {cfg.out_gate_rank!r}")
        _need(cfg.gate_form == "softplus", f"gate_form: fla's Gated DeltaNet has the softplus gate; got {cfg.gate_form!r}")
    attn_layers = [i for i, c in enumerate(cfg.layer_mixers()) if c == "A"]
    if attn_layers:
        _need(cfg.pos == "rope", f"pos: fla's attention layers use RoPE; got {cfg.pos!r}")
        _need(cfg.head_size * cfg.n_heads == cfg.d_model,
              f"head_dim: fla's attention layers have head_dim = d_model / n_heads = {cfg.d_model // cfg.n_heads}; "
              f"got {cfg.head_size}")
        _need(not cfg.bias, "bias: fla's attention output projection has no bias; got bias=True")
        _need(not cfg.short_conv, "short_conv: fla's attention layers have no short convolution; got short_conv=True")
    model_type, arch = _MODEL_TYPES[letter]
    out = {
        "model_type": model_type, "architectures": [arch],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers,
        "num_heads": cfg.n_heads, "num_v_heads": cfg.n_heads, "head_dim": cfg.head_size, "expand_v": 1.0,
        "use_short_conv": True, "conv_size": cfg.conv_size, "allow_neg_eigval": cfg.neg_eigval,
        "hidden_ratio": None, "intermediate_size": cfg.ffn_hidden, "hidden_act": "swish", "norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len, "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
        "attn": None if not attn_layers else {
            "layers": attn_layers, "num_heads": cfg.n_heads, "num_kv_heads": cfg.kv_heads, "qkv_bias": False,
            "window_size": None, "rope_theta": cfg.rope_theta},
    }
    if letter == "K":
        out.update(safe_gate=cfg.gate_form == "bounded", lower_bound=-5.0 if cfg.gate_form == "bounded" else None)
    else:
        out.update(use_gate=True, output_gate_activation="sigmoid")
    return out


def fla_state_dict(lm: LM) -> dict[str, torch.Tensor]:
    """fla's names -> lm's tensors (fused q/k/v projections and convs split; tied head left out)."""
    cfg = lm.cfg
    fla_config(cfg)
    sd = {k: v.detach() for k, v in lm.state_dict().items()}
    out = {"model.embeddings.weight": sd["embed.weight"], "model.norm.weight": sd["norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["head.weight"]
    hd = cfg.n_heads * cfg.head_size
    for i, letter in enumerate(cfg.layer_mixers()):
        src, dst = f"blocks.{i}.", f"model.layers.{i}."
        out[dst + "attn_norm.weight"] = sd[src + "norm1.weight"]
        out[dst + "mlp_norm.weight"] = sd[src + "norm2.weight"]
        for theirs, ours in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
            out[f"{dst}mlp.{theirs}.weight"] = sd[f"{src}ffn.{ours}.weight"]
        m, a = src + "mixer.", dst + "attn."
        out[a + "o_proj.weight"] = sd[m + "wo.weight"]
        if letter == "A":
            kv = cfg.kv_heads * cfg.head_size
            q, k, v = sd[m + "wqkv.weight"].split([hd, kv, kv])
            out.update({a + "q_proj.weight": q, a + "k_proj.weight": k, a + "v_proj.weight": v})
            continue
        for name, w, c in zip("qkv", sd[m + "wqkv.weight"].split(hd), sd[m + "conv.weight"].split(hd)):
            out[f"{a}{name}_proj.weight"], out[f"{a}{name}_conv1d.weight"] = w, c
        out[a + "b_proj.weight"] = sd[m + "wb.weight"]
        out[a + "A_log"], out[a + "dt_bias"] = sd[m + "A_log"], sd[m + "dt_bias"]
        out[a + "o_norm.weight"] = sd[m + "o_norm.weight"]
        if letter == "K":
            out.update({a + "f_proj.0.weight": sd[m + "f_gate.0.weight"], a + "f_proj.1.weight": sd[m + "f_gate.1.weight"],
                        a + "g_proj.0.weight": sd[m + "f_out.0.weight"], a + "g_proj.1.weight": sd[m + "f_out.1.weight"],
                        a + "g_proj.1.bias": sd[m + "f_out.1.bias"]})
        else:
            out[a + "a_proj.weight"] = sd[m + "f_gate.weight"]
            out[a + "g_proj.weight"] = sd[m + "f_out.weight"]
    return out


def to_fla(lm: LM, out: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write `out`/config.json and `out`/model.safetensors for fla (A_log and dt_bias stay float32, as fla keeps
    them; the rest in `dtype`, default the model's). Nothing is written when the model does not map."""
    from safetensors.torch import save_file

    if not isinstance(lm, LM):
        raise ValueError(f"lm: expected an evict LM, got {type(lm).__name__}")
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ValueError(f"dtype: expected a floating torch dtype or None, got {dtype!r}")
    config = fla_config(lm.cfg)
    keep32 = ("A_log", "dt_bias")
    tensors = {k: (v.float() if k.endswith(keep32) else v.to(dtype or v.dtype)).cpu().contiguous()
               for k, v in fla_state_dict(lm).items()}
    config["torch_dtype"] = str(dtype or next(lm.parameters()).dtype).removeprefix("torch.")

    def write(folder: Path) -> None:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))

    return write_folder(out, write)
