"""The linear-memory mixers: linear attention, DeltaNet, Gated DeltaNet, KDA, GLA — one module, one op.

Each kind is a setting of the memory op (see ../shared/spec/MEMORY.md):
    kind            decay      delta  beta  q/k features                 output
    linear          none       no     1     elu+1, normalizer (v = [v,1])  W_o o
    deltanet        none       yes    σ     SiLU(conv) + L2               W_o(RMSNorm(o) ⊙ σ(gate))
    gated_deltanet  scalar     yes    σ     SiLU(conv) + L2               "
    kda             channel    yes    σ     SiLU(conv) + L2               "
    gla             channel    no     1     SiLU(conv)                    "
Legend: B batch, T time, H heads, D head dim (= d_k = d_v).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from evict.cache import PackedBatch, PaddedBatch, RecurrentState
from evict.ops import memory, memory_step
from evict.ops.memory.preact import Preact, beta_of, log_decay

from .conv import ShortConv
from .init import reset_children
from .norms import RMSNorm
from .recompute import compute_inputs, linear_of, recompute

KINDS = {  # kind -> (gate, delta, conv, features, normalizer, gated output)
    "linear": (None, False, False, "elu1", True, False),
    "deltanet": (None, True, True, "l2", False, True),
    "gated_deltanet": ("scalar", True, True, "l2", False, True),
    "kda": ("channel", True, True, "l2", False, True),
    "gla": ("channel", False, True, "none", False, True),
}


def _elu1(x: torch.Tensor) -> torch.Tensor:
    """ELU(x) + 1 = x + 1 (x > 0), e^x (x <= 0), from where / exp, not F.elu: the fake (meta) elu_backward gives a
    contiguous gradient where the real kernel follows a strided incoming gradient's layout, and aot_eager's backward
    then cannot view it (torch 2.13, CPU). The exp branch sees min(x, 0): no inf to multiply by a zero gradient."""
    return torch.where(x > 0, x + 1, x.clamp(max=0).exp())


class MemoryMixer(nn.Module):
    def __init__(self, cfg, kind: str):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"kind: expected one of {sorted(KINDS)}, got {kind!r}")
        self.kind = kind
        self.gate, self.delta, use_conv, self.features, self.normalizer, gated_out = KINDS[kind]
        use_conv = use_conv or cfg.short_conv
        H, D, d = cfg.n_heads, cfg.head_size, cfg.d_model
        self.H, self.D, self.chunk_size = H, D, cfg.chunk_size
        self.gate_form, self.neg_eigval = cfg.gate_form, cfg.neg_eigval
        self.gate_dt = (cfg.gate_dt_min, cfg.gate_dt_max)
        self.wqkv = nn.Linear(d, 3 * H * D, bias=False)
        self.conv = ShortConv(3 * H * D, cfg.conv_size) if use_conv else None
        self.wo = nn.Linear(H * D, d, bias=False)
        self.wb = nn.Linear(d, H, bias=False) if self.delta else None
        if self.gate is not None:
            width = H if self.gate == "scalar" else H * D
            self.f_gate: nn.Module
            if self.gate == "scalar":
                self.f_gate = nn.Linear(d, H, bias=False)
            else:  # low rank, rank = head dim
                self.f_gate = nn.Sequential(nn.Linear(d, D, bias=False), nn.Linear(D, width, bias=False))
            self.A_log = nn.Parameter(torch.empty(H))
            self.dt_bias = nn.Parameter(torch.empty(width))
            self.reset_gate()
        self.o_norm: RMSNorm | None
        self.f_out: nn.Module | None
        if gated_out:
            self.o_norm = RMSNorm(D, eps=cfg.norm_eps)
            rank = D if cfg.out_gate_rank == 0 else cfg.out_gate_rank
            if rank is None:
                self.f_out = nn.Linear(d, H * D, bias=False)
            else:
                self.f_out = nn.Sequential(nn.Linear(d, rank, bias=False), nn.Linear(rank, H * D, bias=True))
        else:
            self.o_norm = self.f_out = None

    def reset_parameters(self) -> None:
        """The decay gate (reset_gate), norms 1, the conv its own; Linears PyTorch's defaults (the LM overrides them)."""
        if self.gate is not None:
            self.reset_gate()
        reset_children(self)

    def reset_gate(self) -> None:
        """A_log = log U(1, 16); dt_bias so the initial per-step decay rate A·dt has dt log-uniform in cfg's
        [gate_dt_min, gate_dt_max] (default [1e-3, 1e-1], Mamba-2's and Gated DeltaNet's)."""
        with torch.no_grad():
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
            dt = torch.exp(torch.empty_like(self.dt_bias).uniform_(*map(math.log, self.gate_dt)))
            if self.gate_form == "softplus":
                self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
            else:  # bounded: -5 sigmoid(A (g + b)) = -A dt at g = 0
                A = self.A_log.exp().repeat_interleave(self.dt_bias.numel() // self.H)
                r = (A * dt / 5).clamp(1e-6, 0.5)
                self.dt_bias.copy_(torch.log(r / (1 - r)) / A)

    def log_alpha(self, x: torch.Tensor) -> torch.Tensor:
        """Per-step log decay, <= 0: [B, T, H] (scalar) or [B, T, H, D] (per channel), float32 (float64 in float64).
        Under autograd only the gate projection's output is kept; the float32 gate is recomputed in the backward."""
        return recompute(self._decay, self._gate_in(x), params=(self.A_log, self.dt_bias))

    def _decay(self, g: torch.Tensor) -> torch.Tensor:
        return log_decay(g, self.A_log, self.dt_bias, self.gate_form)

    def _gate_in(self, x: torch.Tensor) -> torch.Tensor:
        """The gate's projection, pre-activation: [B, T, H] or [B, T, H, D]."""
        g = self.f_gate(x)
        return g if self.gate == "scalar" else g.view(*x.shape[:2], self.H, self.D)

    def forward(self, x: torch.Tensor, state: RecurrentState | None = None, pos=0) -> torch.Tensor:
        """x [B, T, d]; the state carries all history, so `pos` (an int or a SlotBatch) is not needed here, except a
        PackedBatch: sequences of a slot pool packed along T (B = 1), each with its own state row and conv tail; and a
        PaddedBatch: left-padded rows, whose pads leave the state and the conv tail as a row alone has them."""
        B, T, _ = x.shape
        H, D = self.H, self.D
        x, xg, xb, xo = compute_inputs(x, 4)  # under autocast one bf16 copy of x kept for the four projections, not 4
        qkv = self.wqkv(x)  # [B, T, 3 H D]
        tail = None
        if state is None:  # a training / full-sequence forward: the conv, SiLU and feature maps recomputed in the
            # backward, only qkv (and the op's own q, k, v) kept
            q, k, v = recompute(self._conv_features, qkv, pos, params=() if self.conv is None else (self.conv.weight,))
            o, S = self._sequence(xg, xb, q, k, v, state, pos)
        else:
            if self.conv is not None and state.rows is not None and state.conv is not None:
                qkv, tail = self.conv.step(qkv, state.conv, state.rows)  # a slot pool's step: its tails shifted in place
            elif self.conv is not None:
                qkv, tail = self.conv.run(qkv, state.conv, pos)
            if self._fused_step(T, pos):  # features, gate and beta inside the step's one launch
                o, S = self._step(xg, xb, qkv, state)
            else:
                o, S = self._sequence(xg, xb, *self._features(qkv), state, pos)
            state.S = S
            if self.conv is not None:
                state.conv = tail
        if self.normalizer:
            o = o[..., :D] / (o[..., D:] + 1e-6)
        if self.o_norm is not None and self.f_out is not None:  # W_o (RMSNorm(o) ⊙ σ(gate)) keeps o and the gate only
            return linear_of(self.wo, self._gated_norm, o, self.f_out(xo), params=(self.o_norm.weight,))
        return self.wo(o.reshape(B, T, H * D))

    def _gated_norm(self, o: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """RMSNorm(o) ⊙ σ(g): o [B, T, H, D], g [B, T, H D] -> [B, T, H D]."""
        assert self.o_norm is not None
        return (self.o_norm(o) * torch.sigmoid(g).view(o.shape)).flatten(2)

    def _conv_features(self, qkv: torch.Tensor, pos) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [B, T, 3 H D] (the projection) -> q, k, v: the short conv from zeros (no cache), then `_features`."""
        return self._features(qkv if self.conv is None else self.conv.run(qkv, None, pos)[0])

    def _features(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [B, T, 3 H D] (the conv's output, not activated) -> q, k, v [B, T, H, D] in qkv's dtype: SiLU (with a
        conv), the q / k feature maps. One compute dtype at the op's boundary: the projection's (bf16 under autocast or
        in a bf16 model, else the parameters'); feature maps may come back in float32 (CUDA autocast runs F.normalize
        in float32). Gates and beta stay float32; the op keeps its state in float32 whatever the inputs."""
        B, T, _ = qkv.shape
        y = F.silu(qkv) if self.conv is not None else qkv
        # split, not a view + unbind: Inductor's partitioner recomputes a split (a view op) in the backward, not an
        # unbind, whose outputs it then keeps (the whole SiLU output, as one buffer: dev/train_memory.py --compiled)
        q, k, v = (t.view(B, T, self.H, self.D) for t in y.split(self.H * self.D, dim=-1))  # [B, T, H, D] each
        if self.features == "l2":
            q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        elif self.features == "elu1":
            q, k = _elu1(q), _elu1(k)
        # v contiguous: as a view it would keep the whole [B, T, 3 H D] SiLU output alive for the op's backward
        return q.to(qkv.dtype), k.to(qkv.dtype), v.to(qkv.dtype).contiguous()

    def _fused_step(self, T: int, pos) -> bool:
        """A one-token step of a state whose input maps the step op can run itself (memory_step's `pre`): conv +
        SiLU features (then L2 or none), not packed sequences or a left-padded batch."""
        return (T == 1 and self.conv is not None and self.features in ("l2", "none") and not self.normalizer
                and not isinstance(pos, PackedBatch) and not (isinstance(pos, PaddedBatch) and pos.padded))

    def _step(self, xg: torch.Tensor, xb: torch.Tensor, qkv: torch.Tensor, state: RecurrentState):
        """One token: qkv [B, 1, 3 H D] the conv's output (not activated) through memory_step(pre=...): o [B, 1, H, D]
        and the new state (a slot pool's rows updated in place: state.rows). xg, xb: the layer input for the gate and
        beta projections."""
        q, k, v = qkv[:, 0].view(qkv.shape[0], 3, self.H, self.D).unbind(1)  # [B, H, D] each, views
        gated = self.gate is not None
        pre = Preact(silu=True, l2=self.features == "l2", A_log=self.A_log if gated else None,
                     dt_bias=self.dt_bias if gated else None, form=self.gate_form,
                     beta_scale=2.0 if self.neg_eigval else 1.0)
        g = self._gate_in(xg)[:, 0] if gated else None
        b = None if self.wb is None else self.wb(xb)[:, 0]
        o, S = memory_step(q, k, v, state.S, log_alpha=g, beta=b, delta=self.delta, rows=state.rows,
                           out=None if state.rows is None else state.S, pre=pre)
        return o[:, None], S

    def _sequence(self, xg: torch.Tensor, xb: torch.Tensor, q, k, v, state: RecurrentState | None, pos):
        """q, k, v [B, T, H, D] (features applied) through the op, the gate and beta from the layer input (xg, xb):
        o [B, T, H, D (+1 normalizer)] and the new state (or None)."""
        T = q.shape[1]
        if self.normalizer:  # the normalizer z = sum phi(k) is the same op run on v = ones
            v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
        la = None if self.gate is None else self.log_alpha(xg)
        if isinstance(pos, PaddedBatch) and pos.padded:
            # S_t = exp(la_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T (delta), exp(la_t) S_{t-1} + k_t v_t^T
            # (not): with k_t = 0 and la_t = 0 both are S_t = S_{t-1}, for every kind (beta alone is not in all of them)
            k = pos.zero_pads(k)
            la = None if la is None else pos.zero_pads(la)
        beta = None if self.wb is None else beta_of(self.wb(xb), 2.0 if self.neg_eigval else 1.0)  # [B, T, H]
        if isinstance(pos, PackedBatch):
            if state is None or state.S is None:
                raise ValueError("state: packed sequences need this layer's RecurrentState rows, got None")
            return self._packed(q, k, v, la, beta, state.S, pos)
        if state is not None and T == 1:  # a slot pool's step (state.rows set): its rows of S updated in place
            o, S = memory_step(q[:, 0], k[:, 0], v[:, 0], state.S, log_alpha=None if la is None else la[:, 0],
                               beta=None if beta is None else beta[:, 0], delta=self.delta, rows=state.rows,
                               out=None if state.rows is None else state.S)
            return o[:, None], S
        return memory(q, k, v, log_alpha=la, beta=beta, delta=self.delta, initial_state=None if state is None else state.S,
                      output_final_state=state is not None, chunk_size=self.chunk_size, check=False)

    def _packed(self, q, k, v, la, beta, S0: torch.Tensor, pos: PackedBatch):
        """The packed sequences [1, T, H, D]: the D decode rows in one step op, the prompt chunks through the op's
        cu_seqlens, each from its own state row of S0 [N, H, K, V]. Returns o [1, T, H, V], states [N, H, K, V]."""
        D, outs, states = pos.n_decode, [], []
        if D:
            o, S = memory_step(q[0, :D], k[0, :D], v[0, :D], S0[:D], log_alpha=None if la is None else la[0, :D],
                               beta=None if beta is None else beta[0, :D], delta=self.delta)  # [D, H, V]
            outs.append(o[None])
            states.append(S)
        if pos.chunks:
            o, S = memory(q[:, D:], k[:, D:], v[:, D:], log_alpha=None if la is None else la[:, D:],
                          beta=None if beta is None else beta[:, D:], delta=self.delta, initial_state=S0[D:],
                          output_final_state=True, cu_seqlens=pos.cu_seqlens, chunk_size=self.chunk_size, check=False)
            outs.append(o)
            states.append(S)
        return torch.cat(outs, dim=1), torch.cat(states)

    def new_state(self, batch_size: int, max_len: int, device=None, dtype=torch.float32, *, blocks: int | None = None) -> RecurrentState:
        """S = 0 [batch_size, H, D, D (+1 normalizer)] float32 (float64 for a float64 cache) and a zero conv tail;
        the same for any max_len (and `blocks`: a memory holds no per-token buffer)."""
        sd = torch.float64 if dtype == torch.float64 else torch.float32
        S = torch.zeros(batch_size, self.H, self.D, self.D + (1 if self.normalizer else 0), device=device, dtype=sd)
        return RecurrentState(S=S, conv=None if self.conv is None else self.conv.new_tail(batch_size, device, dtype))

    def state_size(self, context_len: int) -> int:
        """Numbers held per sequence, whatever the context: S (+ normalizer column) and the conv tails."""
        s = self.H * self.D * (self.D + (1 if self.normalizer else 0))
        if self.conv is not None:
            s += 3 * self.H * self.D * (self.conv.kernel - 1)
        return s
