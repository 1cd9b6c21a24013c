"""Sampling: prefill the prompt in chunks (chunked ops / SDPA), then decode one token at a time (step ops)."""

from __future__ import annotations

import torch


def sample_next(logits: torch.Tensor, *, temperature: float, top_k: int | None, top_p: float | None,
                generator: torch.Generator | None) -> torch.Tensor:
    """logits [B, V] -> next tokens [B]. temperature 0 = greedy; top_k / top_p filter before sampling."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        logits = logits.scatter(-1, idx, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


@torch.no_grad()
def generate(model, prompt: torch.Tensor, *, max_new_tokens: int = 64, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, seed: int | None = None, stop_tokens=(), prefill_chunk: int = 512,
             on_token=None) -> torch.Tensor:
    """prompt [B, T0] int64 -> [B, T0 + n] with n <= max_new_tokens (stops early when every row hit a stop token).

    Rows that stopped keep emitting their stop token. `on_token(tokens [B])` is called for each new token (streaming).
    """
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise ValueError(f"prompt: expected a non-empty int64 tensor [B, T], got {tuple(prompt.shape)}")
    if temperature < 0:
        raise ValueError(f"temperature: expected >= 0, got {temperature}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p: expected a value in (0, 1], got {top_p}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k: expected a positive integer, got {top_k}")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    prompt = prompt.to(device)
    B, T0 = prompt.shape
    gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    cache = model.new_cache(B, T0 + max_new_tokens)
    for s in range(0, T0, prefill_chunk):
        logits = model(prompt[:, s : s + prefill_chunk], cache=cache)
    stops = torch.tensor(list(stop_tokens), device=device, dtype=torch.int64)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    out = [prompt]
    for _ in range(max_new_tokens):
        nxt = sample_next(logits[:, -1], temperature=temperature, top_k=top_k, top_p=top_p, generator=gen)
        if len(stops):
            nxt = torch.where(done, out[-1][:, -1], nxt)  # a finished row repeats its stop token
            done = done | torch.isin(nxt, stops)
        out.append(nxt[:, None])
        if on_token is not None:
            on_token(nxt)
        if len(stops) and bool(done.all()):
            break
        logits = model(nxt[:, None], cache=cache)
    model.train(was_training)
    return torch.cat(out, dim=1)
