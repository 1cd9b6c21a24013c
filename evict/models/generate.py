"""Sampling (LM.generate): prefill the prompt in chunks (chunked ops / SDPA), then decode one token at a time (step ops)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

# below float32's smallest normal number, logits / temperature leaves float32's range: such a temperature is greedy
GREEDY_BELOW = torch.finfo(torch.float32).tiny


@dataclass
class Penalties:
    """Logit adjustments from each row's history, applied before temperature (OpenAI / vLLM semantics):
    logit_bias is added; repetition_penalty r divides a positive logit by r and multiplies a negative one by r for every
    token in the prompt or the output; frequency_penalty f subtracts f * (times generated); presence_penalty p
    subtracts p from every token generated at least once. `record` adds a step's tokens (on device, no sync)."""

    counts: torch.Tensor  # [B, V] float32: times each token was generated
    seen: torch.Tensor  # [B, V] bool: in the prompt or generated
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    bias: torch.Tensor | None = None  # [V] float32, added to every row

    @classmethod
    def start(cls, prompt: torch.Tensor, vocab: int, *, presence: float = 0.0, frequency: float = 0.0,
              repetition: float = 1.0, logit_bias: dict[int, float] | None = None) -> Penalties:
        """prompt [B, T] int64 (the tokens repetition_penalty also counts)."""
        B, dev = prompt.shape[0], prompt.device
        seen = torch.zeros(B, vocab, dtype=torch.bool, device=dev).scatter_(1, prompt, True)
        bias = None
        if logit_bias:
            bias = torch.zeros(vocab, dtype=torch.float32, device=dev)
            bias[torch.tensor(list(logit_bias), device=dev)] = torch.tensor(list(logit_bias.values()), device=dev)
        return cls(torch.zeros(B, vocab, dtype=torch.float32, device=dev), seen, presence, frequency, repetition, bias)

    def record(self, tokens: torch.Tensor) -> None:
        """tokens [B] int64: one more generated token per row."""
        self.counts.scatter_add_(1, tokens[:, None], torch.ones_like(tokens[:, None], dtype=torch.float32))
        self.seen.scatter_(1, tokens[:, None], True)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] -> adjusted float32 logits [B, V]."""
        x = logits.float()
        if self.bias is not None:
            x = x + self.bias
        if self.repetition != 1.0:
            x = torch.where(self.seen, torch.where(x > 0, x / self.repetition, x * self.repetition), x)
        if self.frequency:
            x = x - self.frequency * self.counts
        if self.presence:
            x = x - self.presence * (self.counts > 0).float()
        return x


def sample_next(logits: torch.Tensor, *, temperature: float, top_k: int | None, top_p: float | None,
                generator: torch.Generator | None, min_p: float | None = None,
                penalties: Penalties | None = None) -> torch.Tensor:
    """logits [B, V] -> next tokens [B]. Penalties adjust the logits first; temperature 0 (or below GREEDY_BELOW) =
    greedy; then, scaled in log space (max subtracted first, so no temperature overflows), min_p keeps tokens whose
    probability is >= min_p x the largest, top_k / top_p filter, and one token is drawn."""
    if penalties is not None:
        logits = penalties.apply(logits)
    if temperature < GREEDY_BELOW:
        return logits.argmax(-1)
    logits = logits.float()
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature  # log-probabilities up to a constant; max 0
    if min_p is not None and min_p > 0:
        logits = logits.masked_fill(logits < math.log(min_p), float("-inf"))  # p / p_max < min_p
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
    if not _is_lm(model):
        raise ValueError(f"model: expected an evict LM, got {type(model).__name__}")
    vocab = model.cfg.vocab_size
    _check_args(prompt, vocab, max_new_tokens, temperature, top_k, top_p, seed, prefill_chunk, on_token)
    stop_list = _check_stop_tokens(stop_tokens, vocab)
    if model.cfg.pos == "learned" and prompt.shape[1] + max_new_tokens > model.cfg.max_seq_len:
        raise ValueError(f"max_new_tokens: prompt ({prompt.shape[1]}) + {max_new_tokens} new tokens exceed the model's "
                         f"{model.cfg.max_seq_len} learned positions")
    was_training = model.training
    model.eval()
    try:
        return _generate(model, prompt, max_new_tokens, temperature, top_k, top_p, seed, stop_list, prefill_chunk,
                         on_token)
    finally:  # an exception (or KeyboardInterrupt) in a forward or in on_token must not leave the model in eval mode
        model.train(was_training)


def _is_lm(model) -> bool:
    """An evict LM, by what this loop uses of it (LM imports this module, so this module does not import LM)."""
    return isinstance(model, nn.Module) and callable(getattr(model, "new_cache", None)) and hasattr(model, "cfg")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_args(prompt, vocab, max_new_tokens, temperature, top_k, top_p, seed, prefill_chunk, on_token) -> None:
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != 2 or prompt.shape[1] == 0 or prompt.dtype != torch.int64:
        got = f"{tuple(prompt.shape)} {prompt.dtype}" if isinstance(prompt, torch.Tensor) else type(prompt).__name__
        raise ValueError(f"prompt: expected a non-empty int64 tensor [B, T], got {got}")
    if prompt.shape[0] == 0:
        raise ValueError("prompt: expected at least one row, got batch 0")
    lo, hi = int(prompt.min()), int(prompt.max())  # one sync, before any work
    if lo < 0 or hi >= vocab:
        raise ValueError(f"prompt: expected token ids in [0, vocab_size={vocab}), got range [{lo}, {hi}]")
    if not _is_int(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens: expected an integer >= 0, got {max_new_tokens!r}")
    if not _is_real(temperature) or temperature < 0:
        raise ValueError(f"temperature: expected a finite number >= 0, got {temperature!r}")
    if top_p is not None and (not _is_real(top_p) or not 0 < top_p <= 1):
        raise ValueError(f"top_p: expected a value in (0, 1], got {top_p!r}")
    if top_k is not None and (not _is_int(top_k) or top_k < 1):
        raise ValueError(f"top_k: expected a positive integer, got {top_k!r}")
    if seed is not None and (not _is_int(seed) or not 0 <= seed < 2**63):
        raise ValueError(f"seed: expected None or an integer in [0, 2**63), got {seed!r}")
    if not _is_int(prefill_chunk) or prefill_chunk < 1:
        raise ValueError(f"prefill_chunk: expected a positive integer, got {prefill_chunk!r}")
    if on_token is not None and not callable(on_token):
        raise ValueError(f"on_token: expected None or a callable, got {type(on_token).__name__}")


def _check_stop_tokens(stop_tokens, vocab) -> list[int]:
    if isinstance(stop_tokens, (str, bytes)) or not isinstance(stop_tokens, Iterable):
        raise ValueError(f"stop_tokens: expected a sequence of token ids, got {type(stop_tokens).__name__}")
    stops = list(stop_tokens)
    bad = [t for t in stops if not _is_int(t) or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"stop_tokens: expected integer ids in [0, vocab_size={vocab}), got {bad[:4]!r}")
    return stops


def _generate(model, prompt, max_new_tokens, temperature, top_k, top_p, seed, stop_list, prefill_chunk, on_token):
    device = next(model.parameters()).device
    prompt = prompt.to(device)
    B, T0 = prompt.shape
    gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    cache = model.new_cache(B, T0 + max_new_tokens)
    for s in range(0, T0, prefill_chunk):
        logits = model(prompt[:, s : s + prefill_chunk], cache=cache)
    stops = torch.tensor(stop_list, device=device, dtype=torch.int64)
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
    return torch.cat(out, dim=1)
