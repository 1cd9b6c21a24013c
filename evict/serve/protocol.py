"""The OpenAI-compatible requests as pydantic models (strict types: "4" is not 4; unknown fields refused, so every
field is either honoured or a 400 naming it) and their conversion to the engine's SamplingParams. Ranges are checked
once, by the engine's door (Engine.check), whose one-line errors name the field."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from evict.serve.engine import SamplingParams


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(Strict):
    include_usage: bool = Field(False, description="a last chunk with no choices and the usage")


class Sampling(Strict):
    """The fields both endpoints share."""

    model: str | None = Field(None, description="the served model's name (GET /v1/models); omitted = it")
    max_tokens: int | None = Field(None, description="new tokens at most (default: completions 16, chat what fits)")
    temperature: float = Field(1.0, description="0 = greedy")
    top_p: float = Field(1.0, description="nucleus: the smallest set of tokens holding this probability mass")
    top_k: int | None = Field(None, description="the k most likely tokens only (-1 or null: off)")
    min_p: float = Field(0.0, description="tokens at least min_p x the most likely one's probability only")
    presence_penalty: float = Field(0.0, description="subtracted from tokens already generated, in [-2, 2]")
    frequency_penalty: float = Field(0.0, description="times (times generated) subtracted, in [-2, 2]")
    repetition_penalty: float = Field(1.0, description="> 1 discourages tokens of the prompt and the output")
    logit_bias: dict[str, float] | None = Field(None, description="token id -> bias in [-100, 100] added to its logit")
    n: int = Field(1, ge=1, le=16, description="choices (independent samples) per request")
    seed: int | None = Field(None, description="fixes the sampling; choice i uses seed + i")
    stop: str | list[str] | None = Field(None, description="up to 4 strings that end generation (not returned)")
    stop_token_ids: list[int] | None = Field(None, description="token ids that end generation (with the tokenizer's "
                                                               "end-of-text token)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = Field(False, description="extension: each choice's generated token ids")


class CompletionRequest(Sampling):
    prompt: str | list[int] = Field(description="text, or token ids (one prompt per request)")
    echo: bool = Field(False, description="the prompt's text before the completion (with logprobs: the prompt tokens' "
                                          "log-probabilities too, the first null; then max_tokens may be 0)")
    logprobs: int | None = Field(None, description="each token's log-probability and the N most likely, N in [0, 20]")
    best_of: int | None = Field(None, description="accepted only equal to n (no ranking of choices)")


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, description="the same as max_tokens")
    logprobs: bool = Field(False, description="each token's log-probability")
    top_logprobs: int | None = Field(None, description="with logprobs: the N most likely tokens too, N in [0, 20]")


class BadRequest(ValueError):
    """A request error: HTTP status, the field it names, one line."""

    def __init__(self, param: str | None, message: str, status: int = 400):
        super().__init__(f"{param}: {message}" if param else message)
        self.param, self.status = param, status


def sampling_params(r: Sampling, *, max_tokens: int, stop_tokens: tuple[int, ...], logprobs: int | None,
                    prompt_logprobs: int | None = None, index: int = 0) -> SamplingParams:
    """The engine's parameters for choice `index` of request r (logit_bias keys must be integers)."""
    bias = []
    for key, value in (r.logit_bias or {}).items():
        try:
            bias.append((int(key), value))
        except ValueError:
            raise BadRequest("logit_bias", f"expected token ids as keys, got {key[:40]!r}") from None
    if isinstance(r.stop, list) and (len(r.stop) > 4 or not all(r.stop)):
        raise BadRequest("stop", "expected a non-empty string or a list of at most 4 of them")
    if r.stop == "":
        raise BadRequest("stop", "expected a non-empty string or a list of at most 4 of them")
    return SamplingParams(max_tokens=max_tokens, temperature=r.temperature, top_p=r.top_p,
                          top_k=None if r.top_k == -1 else r.top_k, min_p=r.min_p or None,
                          seed=None if r.seed is None else r.seed + index,
                          stop_tokens=tuple(dict.fromkeys((*(r.stop_token_ids or ()), *stop_tokens))),
                          presence_penalty=r.presence_penalty, frequency_penalty=r.frequency_penalty,
                          repetition_penalty=r.repetition_penalty, logit_bias=tuple(bias), logprobs=logprobs,
                          prompt_logprobs=prompt_logprobs)


def stop_strings(r: Sampling) -> list[str]:
    return [r.stop] if isinstance(r.stop, str) else list(r.stop or [])
