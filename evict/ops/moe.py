"""Mixture of experts as pure functions: sigmoid routing with a selection bias, load, aux loss, dispatch.

Legend: N tokens, E routed experts, k experts chosen per token, D expert input/output width (d_model, or
the latent width in a latent MoE), H expert hidden width. Stacked expert weights follow nn.Linear's
[out, in] layout: w1, w3 [E, H, D] (gate, up), w2 [E, D, H] (down).
"""

from __future__ import annotations

from typing import Callable

import torch


def _check_route(logits, bias, top_k) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        got = list(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits: expected shape [N, E], got {got}")
    E = logits.shape[1]
    if bias is not None and (not isinstance(bias, torch.Tensor) or list(bias.shape) != [E]):
        got = list(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"bias: expected shape [{E}] (E), got {got}")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= E:
        raise ValueError(f"top_k: expected an int in [1, {E}] (E), got {top_k!r}")


def route(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, routed_scaling: float = 1.0):
    """Sigmoid routing (DeepSeek-V3 / Kimi). logits [N, E]; bias [E] or None.

    s = sigmoid(logits); the k experts with the largest s + bias are chosen (the bias steers selection only,
    and no gradient flows through the choice); weights = the chosen s renormalised to sum 1, times
    routed_scaling, so they carry gradient to the router. Computed in float32 (float64 stays float64).
    Returns weights [N, k], index [N, k] (int64), scores s [N, E].
    """
    _check_route(logits, bias, top_k)
    cd = torch.float64 if logits.dtype == torch.float64 else torch.float32
    scores = torch.sigmoid(logits.to(cd))  # [N, E]
    with torch.no_grad():
        key = scores if bias is None else scores + bias.to(cd)  # [N, E]
        index = key.topk(top_k, dim=-1).indices  # [N, k]
    chosen = scores.gather(-1, index)  # [N, k]
    weights = chosen / chosen.sum(-1, keepdim=True) * routed_scaling  # [N, k]
    return weights, index, scores


def expert_load(index: torch.Tensor, n_experts: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Fraction of the N*k routed assignments that went to each expert: [E] in dtype, sums to 1."""
    return expert_counts(index, n_experts).to(dtype) / max(index.numel(), 1)


def switch_aux_loss(scores: torch.Tensor, index: torch.Tensor, n_experts: int, top_k: int) -> torch.Tensor:
    """Switch-style balance loss without its coefficient: E * sum_i f_i P_i (the caller multiplies by alpha).

    f_i = count_i / (N k), the fraction of assignments to expert i (no gradient); P_i = mean over tokens of
    the normalised sigmoid scores s_i / sum_j s_j. Equals 1 at perfect balance. scores [N, E], index [N, k].
    """
    if list(index.shape) != [scores.shape[0], top_k]:
        raise ValueError(f"index: expected shape [{scores.shape[0]}, {top_k}] ([N, top_k]), got {list(index.shape)}")
    f = expert_load(index, n_experts, scores.dtype)  # [E]
    P = (scores / scores.sum(-1, keepdim=True)).mean(0)  # [E]
    return n_experts * (f * P).sum()


@torch.no_grad()
def balance_bias_update(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """Aux-loss-free balancing, in place: b_i += rate * sign(mean(load) - load_i). Returns bias."""
    bias.add_(rate * torch.sign(load.mean() - load).to(bias.dtype))
    return bias


DISPATCH = ("auto", "sort", "padded", "grouped", "gather", "dense")


def expert_counts(index: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Assignments per expert, [E] int64 on index's device, with no host sync (torch.bincount reads its input's
    maximum on the host on CUDA)."""
    flat = index.reshape(-1)  # [N k]
    return torch.zeros(n_experts, dtype=torch.int64, device=index.device).scatter_add_(0, flat, torch.ones_like(flat))


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the expert matmuls run in: autocast's when it is on for x's device, else x's."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def grouped_mm_support(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> str | None:
    """None when torch._grouped_mm can run these experts, else why not. It needs torch >= 2.9 (the op, and its CPU
    kernel), bfloat16 or float32 operands (the compute dtype), rows of D and H in whole 16-byte units, and weights
    that start on a 16-byte boundary (a cast to the compute dtype makes fresh, aligned copies)."""
    cd = _compute_dtype(x)
    H, D = w1.shape[1:]
    if not hasattr(torch, "_grouped_mm") or tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 9):
        return f"torch >= 2.9 (this is torch {torch.__version__})"
    if cd not in (torch.bfloat16, torch.float32):
        return f"bfloat16 or float32 inputs (got {cd})"
    unit = 16 // cd.itemsize
    if D % unit or H % unit:
        return f"D and H multiples of {unit} for {cd} (got D={D}, H={H})"
    if not torch.compiler.is_compiling() and any(w.dtype == cd and w.data_ptr() % 16 for w in (w1, w3, w2)):
        return "w1, w3, w2 starting on 16-byte boundaries"
    return None


def grouped_mm_fast(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether torch._grouped_mm runs as one fused kernel per matmul with no host sync: CUDA compute capability 9 or
    10, bfloat16. Other cards and float32 get its fallback, which loops over the groups after reading the offsets
    on the host."""
    return (x.is_cuda and _compute_dtype(x) == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0]
            in (9, 10) and grouped_mm_support(x, w1, w3, w2) is None)


def auto_dispatch(x, weights, index, w1, w3, w2) -> str:
    """The dispatch "auto" stands for with these inputs, here (grad mode, autocast, graph capture, device)."""
    recording = torch.is_grad_enabled() and any(t.requires_grad for t in (x, weights, w1, w3, w2))
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if not recording and index.numel() <= w1.shape[0]:
        return "gather"
    if x.is_cuda:  # one fused kernel per matmul where torch has it (H200: 1.7 ms vs sort's 11.7, dev/LOG.md session 6)
        return "dense" if capturing and not recording else "grouped" if grouped_mm_fast(x, w1, w3, w2) else "sort"
    return "grouped" if grouped_mm_support(x, w1, w3, w2) is None else "sort"


def experts(x, weights, index, w1, w3, w2, act: Callable, dispatch: str = "auto") -> torch.Tensor:
    """sum_j weights[n, j] * E_index[n, j](x_n) for every token. x [N, D]; weights, index [N, k]; returns [N, D].

    E_e(x) = w2[e] act(w1[e] x, w3[e] x). Equal dispatches:
        sort     assignments sorted by expert; a Python loop runs each expert on its contiguous slice of the sorted
                 tokens (slice sizes read on the host: one sync; ~5 kernels per expert forward, more backward).
        padded   the sorted tokens scattered into an [E, cap, D] buffer (cap = the largest expert batch, read on the
                 host: one sync), three batched matmuls, gathered back: a fixed number of kernels, whatever E;
                 the padding costs (E cap / N k - 1) of the work, i.e. grows with the load imbalance.
        grouped  the sorted tokens through torch._grouped_mm (offsets stay on the device: no sync, a fixed number of
                 kernels, no padding); see `grouped_mm_support`, `grouped_mm_fast`.
        gather   each assignment multiplies its own expert's weights (gathered, [N k, H, D]): reads only the chosen
                 experts, no sync. Decode, when N k <= E.
        dense    every expert on every token, mixed by a [N, E] matrix that is zero off the chosen experts: no sync,
                 fixed shapes. Small batches under CUDA-graph capture, when N k > E.
    "auto" (`auto_dispatch`): gather when N k <= E and no gradient is recorded; on CUDA dense while a CUDA graph is
    captured without gradients, else grouped where it is one fused kernel (sm90 / sm100, bfloat16;
    `grouped_mm_fast`; one H200 MoE layer forward + backward 1.7 ms against sort's 11.7) and sort elsewhere;
    on a CPU grouped where torch can run it (its C++ loop over the groups: as fast as sort or faster, never padded's
    waste when the load is skewed) and sort otherwise (float64, unaligned widths). Measured in dev/LOG.md (issue 16).
    """
    if dispatch not in DISPATCH:
        raise ValueError(f"dispatch: expected one of {DISPATCH}, got {dispatch!r}")
    N, k = index.shape
    E = w1.shape[0]
    if dispatch == "auto":
        dispatch = auto_dispatch(x, weights, index, w1, w3, w2)
    if dispatch == "grouped" and (why := grouped_mm_support(x, w1, w3, w2)) is not None:
        raise ValueError(f"dispatch: 'grouped' needs {why}")
    if dispatch == "gather":
        flat = index.reshape(-1)  # [N k]
        xs = x[:, None].expand(N, k, x.shape[1]).reshape(N * k, -1, 1)  # [N k, D, 1]
        h = act(torch.bmm(w1[flat], xs)[..., 0], torch.bmm(w3[flat], xs)[..., 0])  # [N k, H]
        y = torch.bmm(w2[flat], h[..., None])[..., 0]  # [N k, D]
        return torch.einsum("nk,nkd->nd", weights.to(x.dtype), y.view(N, k, -1))
    if dispatch == "dense":
        mix = torch.zeros(N, E, dtype=x.dtype, device=x.device).scatter_add_(1, index, weights.to(x.dtype))  # [N, E]
        h = act(torch.einsum("nd,ehd->neh", x, w1), torch.einsum("nd,ehd->neh", x, w3))  # [N, E, H]
        return torch.einsum("ne,ned->nd", mix, torch.einsum("neh,edh->ned", h, w2))
    flat = index.reshape(-1)  # [N k]
    order = torch.argsort(flat, stable=True)  # [N k] assignment ids sorted by expert
    counts = expert_counts(flat, E)  # [E]
    xs = x.index_select(0, order // k)  # [N k, D] the token of each sorted assignment (backward: index_add_)
    y_sorted = _SORTED[dispatch](xs, flat[order], counts, w1, w3, w2, act)  # [N k, D]
    y = torch.empty_like(y_sorted).index_copy(0, order, y_sorted)  # [N k, D] back in (token, slot) order
    return torch.einsum("nk,nkd->nd", weights.to(y.dtype), y.view(N, k, -1))  # [N, D]


# The sorted forms: xs [N k, D] sorted by expert, e [N k] its experts (ascending), counts [E] -> y [N k, D].

def _sorted_loop(xs, e, counts, w1, w3, w2, act):
    ys = []
    for i, part in enumerate(xs.split(counts.tolist())):  # one host sync
        if part.shape[0]:
            ys.append(act(part @ w1[i].T, part @ w3[i].T) @ w2[i].T)  # [n_i, D]
    return torch.cat(ys) if ys else xs.new_zeros(0, w2.shape[1])


def _sorted_padded(xs, e, counts, w1, w3, w2, act):
    E, cap = w1.shape[0], int(counts.max())  # one host sync: the largest expert batch
    starts = torch.cumsum(counts, 0) - counts  # [E] first sorted row of each expert
    row = e * cap + torch.arange(e.shape[0], device=e.device) - starts[e]  # [N k] row in the [E cap] buffer
    buf = xs.new_zeros(E * cap, xs.shape[1]).index_copy(0, row, xs).view(E, cap, -1)  # [E, cap, D], zero padding
    h = act(torch.bmm(buf, w1.mT), torch.bmm(buf, w3.mT))  # [E, cap, H]
    return torch.bmm(h, w2.mT).reshape(E * cap, -1).index_select(0, row)  # [N k, D]


def _sorted_grouped(xs, e, counts, w1, w3, w2, act):
    offs = torch.cumsum(counts, 0).to(torch.int32)  # [E] end row of each expert's group
    cd = _compute_dtype(xs)
    xs, w1, w3, w2 = (t.to(cd) for t in (xs, w1, w3, w2))
    h = act(torch._grouped_mm(xs, w1.mT, offs), torch._grouped_mm(xs, w3.mT, offs))  # [N k, H]
    return torch._grouped_mm(h, w2.mT, offs)  # [N k, D]


_SORTED = {"sort": _sorted_loop, "padded": _sorted_padded, "grouped": _sorted_grouped}


def experts_reference(x, weights, index, w1, w3, w2, act: Callable) -> torch.Tensor:
    """The same mixture, token by token and slot by slot: the obviously-correct form `experts` is tested against."""
    N, k = index.shape
    out = []
    for n in range(N):
        acc = x.new_zeros(w2.shape[1])  # [D]
        for j in range(k):
            e = int(index[n, j])
            acc = acc + weights[n, j].to(x.dtype) * (w2[e] @ act(w1[e] @ x[n], w3[e] @ x[n]))
        out.append(acc)
    return torch.stack(out) if out else x.new_zeros(0, w2.shape[1])
