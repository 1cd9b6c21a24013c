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
    counts = torch.bincount(index.reshape(-1), minlength=n_experts)  # [E]
    return counts.to(dtype) / max(index.numel(), 1)


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


DISPATCH = ("auto", "sort", "gather", "dense")


def experts(x, weights, index, w1, w3, w2, act: Callable, dispatch: str = "auto") -> torch.Tensor:
    """sum_j weights[n, j] * E_index[n, j](x_n) for every token. x [N, D]; weights, index [N, k]; returns [N, D].

    E_e(x) = w2[e] act(w1[e] x, w3[e] x). Three equal dispatches:
        sort    assignments sorted by expert, each expert runs once on its contiguous slice of gathered tokens (the
                slice sizes are read on the host: one sync). Training and long prefills.
        gather  each assignment multiplies its own expert's weights (gathered, [N k, H, D]): reads only the chosen
                experts, no sync. Decode, when N k <= E.
        dense   every expert on every token, mixed by a [N, E] matrix that is zero off the chosen experts: no sync,
                fixed shapes. Small batches under CUDA-graph capture, when N k > E.
    "auto": sort when gradients are being recorded; else gather when N k <= E; else dense while a CUDA graph is being
    captured; else sort.
    """
    if dispatch not in DISPATCH:
        raise ValueError(f"dispatch: expected one of {DISPATCH}, got {dispatch!r}")
    N, k = index.shape
    E = w1.shape[0]
    if dispatch == "auto":
        recording = torch.is_grad_enabled() and any(t.requires_grad for t in (x, weights, w1, w3, w2))
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        dispatch = "sort" if recording else "gather" if N * k <= E else "dense" if capturing else "sort"
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
    counts = torch.bincount(flat, minlength=E).tolist()  # E ints
    xs = x[order // k]  # [N k, D] the token of each sorted assignment
    ys = []
    for e, part in zip(range(E), xs.split(counts)):
        if part.shape[0]:
            ys.append(act(part @ w1[e].T, part @ w3[e].T) @ w2[e].T)  # [n_e, D]
    y_sorted = torch.cat(ys) if ys else x.new_zeros(0, w2.shape[1])  # [N k, D]
    y = torch.empty_like(y_sorted).index_copy(0, order, y_sorted)  # [N k, D] back in (token, slot) order
    return torch.einsum("nk,nkd->nd", weights.to(x.dtype), y.view(N, k, -1))  # [N, D]


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
