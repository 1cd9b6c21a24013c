"""Model configuration: one dataclass, a layer pattern of mixer letters tiled over the depth, strict validation."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields

from evict.layers.norms import NORMS

MIXERS = {
    "A": "attention",  # softmax attention (MHA / GQA), KV cache
    "L": "linear",  # elu+1 linear attention with normalizer
    "D": "deltanet",  # delta rule, no decay
    "G": "gated_deltanet",  # delta rule + scalar decay
    "K": "kda",  # delta rule + per-channel decay (Kimi Delta Attention)
    "C": "gla",  # per-channel decay, no delta (gated linear attention)
    "M": "mla",  # multi-head latent attention, latent cache
}
FFNS = ("gelu", "swiglu", "situ")


def _int(name: str, value, low: int, *, none_ok: bool = False, why: str = "") -> None:
    if type(value) is not int or value < low:
        want = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise ValueError(f"{name}: expected {'None or ' if none_ok else ''}{want}{why}, got {value!r}")


def _real(name: str, value, *, positive: bool) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not (value > 0 if positive else value >= 0):
        raise ValueError(f"{name}: expected a finite number {'> 0' if positive else '>= 0'}, got {value!r}")


@dataclass
class MoEConfig:
    n_routed: int = 8
    top_k: int = 2
    d_expert: int = 64
    n_shared: int = 1
    latent_dim: int | None = None  # K3 latent MoE: routed experts work in this width
    routed_scaling: float = 1.0
    bias_update_rate: float = 1e-3
    aux_loss_coef: float = 0.0
    first_dense: int = 1  # the first layers keep a dense FFN (Kimi Linear, K3)
    dispatch: str = "auto"  # how the routed experts compute (evict.ops.moe.experts: auto, sort, padded, grouped, ...)


@dataclass
class ModelConfig:
    """Everything needed to build `LM`. `pattern` is tiled over `n_layers`; `final_mixer` overrides the last layer."""

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 2
    pattern: str = "A"
    final_mixer: str | None = None
    n_heads: int = 4
    head_dim: int | None = None  # default d_model // n_heads
    n_kv_heads: int | None = None  # GQA for "A"; default n_heads
    pos: str = "rope"  # "rope" | "learned" | "none" (for "A"; MLA has its own switch)
    max_seq_len: int = 2048  # learned positions only
    rope_theta: float = 10000.0
    bias: bool = False  # biases in attention / GELU MLP linears (GPT-2: True)
    norm: str = "rmsnorm"  # residual-stream norms: "rmsnorm" (no bias) | "layernorm" (weight + bias, GPT-2)
    norm_eps: float = 1e-6
    short_conv: bool = False  # also give attention ("A") and linear ("L") the delta family's short causal conv
    # linear / delta family
    conv_size: int = 4
    gate_form: str = "softplus"  # "softplus" (Kimi Linear) | "bounded" (K3: log alpha in [-5, 0])
    # the decay gate's initial per-step rate A dt (A ~ U(1, 16)): dt log-uniform in [gate_dt_min, gate_dt_max]
    gate_dt_min: float = 1e-3
    gate_dt_max: float = 1e-1
    neg_eigval: bool = False  # beta = 2 sigmoid(.) in (0, 2)
    out_gate_rank: int | None = 0  # sigmoid output gate: 0 = head dim (low rank), None = full rank
    chunk_size: int | None = None  # the memory op's chunk; None: each form's own (memory(): 64 on the CPU, auto_chunk on CUDA)
    # MLA
    q_lora_rank: int | None = None
    kv_lora_rank: int = 64
    qk_nope_dim: int = 32
    qk_rope_dim: int = 16
    v_head_dim: int = 32
    mla_rope: bool = False  # False = NoPE (Kimi Linear / K3)
    mla_gate: bool = False  # gated MLA (K3)
    # FFN
    ffn: str = "swiglu"
    d_ff: int | None = None  # default 4 d_model (gelu) or 8/3 d_model rounded (swiglu / situ)
    moe: MoEConfig | None = None
    # depth
    attn_res: bool = False
    attn_res_block: int = 2  # layers per AttnRes block
    tie_embeddings: bool = True
    init_std: float = 0.02
    extra: dict = field(default_factory=dict)  # free-form notes (e.g. the released model's reported numbers)

    def __post_init__(self):
        if isinstance(self.moe, dict):
            unknown = sorted(set(self.moe) - {f.name for f in fields(MoEConfig)})
            if unknown:
                raise ValueError(f"moe: unknown field(s) {unknown}")
            self.moe = MoEConfig(**self.moe)
        self.validate()

    # -- derived ----------------------------------------------------------------------------------------------
    @property
    def head_size(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def ffn_hidden(self) -> int:
        if self.d_ff is not None:
            return self.d_ff
        if self.ffn == "gelu":
            return 4 * self.d_model
        return 64 * ((8 * self.d_model // 3 + 63) // 64)

    def layer_mixers(self) -> list[str]:
        """The expanded per-layer list of mixer letters."""
        letters = [self.pattern[i % len(self.pattern)] for i in range(self.n_layers)]
        if self.final_mixer is not None:
            letters[-1] = self.final_mixer
        return letters

    def layer_ffns(self) -> list[str]:
        """Per-layer FFN kind: 'moe' after the first `moe.first_dense` layers when MoE is on, else `ffn`."""
        if self.moe is None:
            return [self.ffn] * self.n_layers
        return [self.ffn if i < self.moe.first_dense else "moe" for i in range(self.n_layers)]

    # -- validation -------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Reject every value that would crash later or silently give NaN: one ValueError naming the field."""
        def need(cond, msg):
            if not cond:
                raise ValueError(msg)

        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len", "kv_lora_rank", "qk_nope_dim",
                     "v_head_dim", "attn_res_block"):
            _int(name, getattr(self, name), 1)
        _int("qk_rope_dim", self.qk_rope_dim, 0)
        _int("conv_size", self.conv_size, 2, why=" (a kernel of 1 leaves no decode tail)")
        for name in ("head_dim", "n_kv_heads", "q_lora_rank", "d_ff"):
            if getattr(self, name) is not None:
                _int(name, getattr(self, name), 1, none_ok=True)
        if self.out_gate_rank is not None:
            _int("out_gate_rank", self.out_gate_rank, 0, none_ok=True)
        for name in ("bias", "short_conv", "neg_eigval", "mla_rope", "mla_gate", "attn_res", "tie_embeddings"):
            need(isinstance(getattr(self, name), bool), f"{name}: expected True or False, got {getattr(self, name)!r}")
        _real("rope_theta", self.rope_theta, positive=True)
        _real("gate_dt_min", self.gate_dt_min, positive=True)
        _real("gate_dt_max", self.gate_dt_max, positive=True)
        need(self.gate_dt_min <= self.gate_dt_max,
             f"gate_dt_max: expected >= gate_dt_min={self.gate_dt_min}, got {self.gate_dt_max!r}")
        _real("norm_eps", self.norm_eps, positive=True)
        _real("init_std", self.init_std, positive=False)
        need(isinstance(self.extra, dict), f"extra: expected a dict, got {type(self.extra).__name__}")
        need(isinstance(self.pattern, str) and len(self.pattern) > 0, "pattern: expected a non-empty string of mixer letters")
        need(self.final_mixer is None or (isinstance(self.final_mixer, str) and len(self.final_mixer) == 1),
             f"final_mixer: expected one letter or None, got {self.final_mixer!r}")
        bad = sorted({c for c in self.pattern + (self.final_mixer or "") if c not in MIXERS})
        need(not bad, f"pattern: unknown mixer letter(s) {bad}; expected letters from {''.join(MIXERS)} ({', '.join(f'{k}={v}' for k, v in MIXERS.items())})")
        if self.head_dim is None:
            need(self.d_model % self.n_heads == 0, f"n_heads: expected a divisor of d_model={self.d_model}, got {self.n_heads}")
        need(self.head_size > 0, f"head_dim: expected a positive integer, got {self.head_dim!r}")
        need(self.n_heads % self.kv_heads == 0, f"n_kv_heads: expected a divisor of n_heads={self.n_heads}, got {self.n_kv_heads}")
        need(self.norm in NORMS, f"norm: expected one of {NORMS}, got {self.norm!r}")
        need(self.pos in ("rope", "learned", "none"), f"pos: expected 'rope', 'learned' or 'none', got {self.pos!r}")
        uses_rope = ("A" in self.layer_mixers() and self.pos == "rope") or ("M" in self.layer_mixers() and self.mla_rope)
        need(not uses_rope or (self.head_size % 2 == 0 and self.qk_rope_dim % 2 == 0), "head_dim: expected even head dims for RoPE")
        need(self.gate_form in ("softplus", "bounded"), f"gate_form: expected 'softplus' or 'bounded', got {self.gate_form!r}")
        need(self.chunk_size is None or (type(self.chunk_size) is int and self.chunk_size in (16, 32, 64, 128)),
             f"chunk_size: expected None or one of (16, 32, 64, 128), got {self.chunk_size!r}")
        need(isinstance(self.ffn, str) and self.ffn in FFNS, f"ffn: expected one of {FFNS}, got {self.ffn!r}")
        need(self.moe is None or isinstance(self.moe, MoEConfig), f"moe: expected None, a dict or a MoEConfig, got {type(self.moe).__name__}")
        if self.moe is not None:
            m = self.moe
            for name in ("n_routed", "d_expert"):
                _int(f"moe.{name}", getattr(m, name), 1)
            _int("moe.n_shared", m.n_shared, 0)
            if m.latent_dim is not None:
                _int("moe.latent_dim", m.latent_dim, 1, none_ok=True)
            _real("moe.routed_scaling", m.routed_scaling, positive=True)
            _real("moe.bias_update_rate", m.bias_update_rate, positive=False)
            _real("moe.aux_loss_coef", m.aux_loss_coef, positive=False)
            need(type(m.top_k) is int and 1 <= m.top_k <= m.n_routed, f"moe.top_k: expected 1 <= top_k <= n_routed={m.n_routed}, got {m.top_k!r}")
            need(type(m.first_dense) is int and 0 <= m.first_dense <= self.n_layers,
                 f"moe.first_dense: expected 0..n_layers={self.n_layers}, got {m.first_dense!r}")
            from evict.ops.moe import DISPATCH

            need(m.dispatch in DISPATCH, f"moe.dispatch: expected one of {DISPATCH}, got {m.dispatch!r}")

    # -- serialization ----------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        if not isinstance(d, dict):
            raise ValueError(f"config: expected a JSON object of fields, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"config: unknown field(s) {unknown}")
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)
