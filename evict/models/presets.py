"""Named model configurations: every architecture of the lesson in CPU-trainable sizes, plus the released shapes.

    presets.names()                          -> list of names
    presets.get("kimi_linear", size="tiny")  -> ModelConfig (keyword overrides allowed: vocab_size=..., n_layers=...)
Released shapes (`gpt2_124m`, `kimi_linear_48b`, `kimi_k3`) are for the accountant: build them on the meta device.
"""

from __future__ import annotations

from dataclasses import asdict, fields, replace
from typing import Any

from .config import ModelConfig, MoEConfig

SIZES: dict[str, dict[str, Any]] = {  # shared width settings per size; tiny trains on a laptop CPU
    "tiny": dict(d_model=128, n_heads=2, head_dim=64, n_layers=4, d_ff=256, kv_lora_rank=64, qk_nope_dim=32,
                 qk_rope_dim=16, v_head_dim=32),
    "small": dict(d_model=512, n_heads=4, head_dim=128, n_layers=8, d_ff=1408, kv_lora_rank=256, qk_nope_dim=64,
                  qk_rope_dim=32, v_head_dim=64),
}


def _moe(size: str, **kw) -> MoEConfig:
    base = dict(n_routed=8, top_k=2, d_expert=64, n_shared=1) if size == "tiny" else dict(n_routed=16, top_k=2, d_expert=256, n_shared=1)
    return MoEConfig(**{**base, **kw})


def _family(name: str, size: str) -> ModelConfig:
    s: dict[str, Any] = dict(SIZES[size])
    single = {"attention": "A", "linear": "L", "deltanet": "D", "gated_deltanet": "G", "kda": "K", "gla": "C", "mla": "M"}
    if name == "gpt2":
        return ModelConfig(pattern="A", pos="learned", bias=True, norm="layernorm", norm_eps=1e-5, ffn="gelu",
                           d_ff=4 * s["d_model"], **{k: v for k, v in s.items() if k != "d_ff"})
    if name in single:
        return ModelConfig(pattern=single[name], **s)
    if name == "kimi_linear":
        return ModelConfig(pattern="KKKM", final_mixer="M", moe=_moe(size), tie_embeddings=False, **s)
    if name == "k3_mini":
        return ModelConfig(pattern="KKKM", final_mixer="M", mla_gate=True, q_lora_rank=s["d_model"] // 2, ffn="situ",
                           moe=_moe(size, latent_dim=s["d_model"] // 2), attn_res=True, attn_res_block=2,
                           gate_form="bounded", out_gate_rank=None, tie_embeddings=False, **s)
    raise KeyError(name)


def _released(name: str) -> ModelConfig:
    if name == "gpt2_124m":
        return ModelConfig(vocab_size=50257, d_model=768, n_layers=12, n_heads=12, pattern="A", pos="learned",
                           max_seq_len=1024, bias=True, norm="layernorm", norm_eps=1e-5, ffn="gelu", d_ff=3072,
                           tie_embeddings=True, extra={"reported_params": 124e6})
    if name == "kimi_linear_48b":
        return ModelConfig(vocab_size=163840, d_model=2304, n_layers=27, pattern="KKKM", final_mixer="M", n_heads=32,
                           head_dim=128, kv_lora_rank=512, q_lora_rank=None, qk_nope_dim=128, qk_rope_dim=64,
                           v_head_dim=128, mla_rope=False, ffn="swiglu", d_ff=9216, tie_embeddings=False,
                           moe=MoEConfig(n_routed=256, top_k=8, d_expert=1024, n_shared=1, first_dense=1),
                           extra={"reported_total": 48e9, "reported_active": 3e9})
    if name == "kimi_k3":
        return ModelConfig(vocab_size=163840, d_model=7168, n_layers=93, pattern="KKKM", final_mixer="M", n_heads=96,
                           head_dim=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64,
                           v_head_dim=128, mla_rope=False, mla_gate=True, gate_form="bounded", out_gate_rank=None,
                           ffn="situ", d_ff=33792, attn_res=True, attn_res_block=12, tie_embeddings=False,
                           moe=MoEConfig(n_routed=896, top_k=16, d_expert=3072, n_shared=2, latent_dim=3584, first_dense=1),
                           extra={"reported_total": 2.78e12, "reported_active": 104e9,
                                  "seed_numbers": "2.8T total, 898 experts, 92 layers (rounded / off by one)"})
    raise KeyError(name)


FAMILIES = ("gpt2", "attention", "linear", "deltanet", "gated_deltanet", "kda", "gla", "mla", "kimi_linear", "k3_mini")
RELEASED = ("gpt2_124m", "kimi_linear_48b", "kimi_k3")


def names() -> list[str]:
    return list(FAMILIES) + list(RELEASED)


def hybrid(size: str = "tiny", **overrides) -> ModelConfig:
    """The kda preset in Kimi Linear's 3:1 pattern (KKKM, the last layer MLA) with dense FFNs: the width and depth of
    'attention' (the "hybrid" of `evict bench decode` and `evict serve --preset`)."""
    return get("kda", size=size, pattern="KKKM", final_mixer="M", **overrides)


def get(name: str, size: str = "tiny", **overrides) -> ModelConfig:
    """A fresh ModelConfig for `name` at `size` ("tiny" or "small"; released shapes ignore size)."""
    if name in RELEASED:
        cfg = _released(name)
    elif name in FAMILIES:
        if size not in SIZES:
            raise ValueError(f"size: expected one of {sorted(SIZES)}, got {size!r}")
        cfg = _family(name, size)
    else:
        raise ValueError(f"name: unknown preset {name!r}; expected one of {names()}")
    unknown = sorted(set(overrides) - {f.name for f in fields(ModelConfig)})
    if unknown:
        raise ValueError(f"overrides: unknown ModelConfig field(s) {unknown}")
    if isinstance(overrides.get("moe"), dict) and cfg.moe is not None:  # a partial MoE dict edits the preset's MoE
        overrides["moe"] = {**asdict(cfg.moe), **overrides["moe"]}
    return replace(cfg, **overrides) if overrides else cfg
