"""`evict generate`: load a model saved by `evict train` (+ its tokenizer), stream a continuation, report speed.

Timing: prefill = from the call until the first new token exists (the prompt's forward pass + one sample);
decode = from then until the last token (each further token is one cached one-token forward + one sample).
"""

from __future__ import annotations

import sys
import time

import torch

from evict.cli_args import described, device, nonneg_float, positive_int, seed, unit_interval
from evict.serve.load import load_model


class _StopText(Exception):
    """Raised from the streaming callback once the generated text contains the multi-token --stop text."""


class Streamer:
    """Collects token ids and writes the newly decodable text (held back while a UTF-8 character is incomplete)."""

    def __init__(self, tokenizer, out=None, stop_text: str | None = None):
        self.tok, self.out, self.stop_text = tokenizer, out or sys.stdout, stop_text
        self.ids: list[int] = []
        self.shown = 0
        self.first_token_time: float | None = None

    def __call__(self, tokens: torch.Tensor) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        if int(tokens[0]) == getattr(self.tok, "eos_token_id", None):
            return  # end of text: generation stops here; it is not part of the text
        self.ids.append(int(tokens[0]))
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return
        self.out.write(text[self.shown :])
        self.out.flush()
        self.shown = len(text)
        if self.stop_text and self.stop_text in text:
            raise _StopText


def run_generate(args) -> dict:
    from evict.distributed import resolve_device

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    model, tok = load_model(args.model, device)
    try:
        prompt_ids = tok.encode(args.prompt)
    except ValueError as e:
        raise SystemExit(f"--prompt: {e}") from None
    if len(prompt_ids) == 0:
        raise SystemExit("--prompt: expected a non-empty prompt")
    eos = getattr(tok, "eos_token_id", None)
    stop_tokens: tuple[int, ...] = () if eos is None else (eos,)  # a model trained with end-of-text stops there
    stop_text = None
    if args.stop:
        try:
            stop_ids = tok.encode(args.stop)
        except ValueError as e:
            raise SystemExit(f"--stop: {e}") from None
        if len(stop_ids) == 1:
            stop_tokens = (*stop_tokens, int(stop_ids[0]))
        else:
            stop_text = args.stop
    prompt = torch.as_tensor(prompt_ids, dtype=torch.int64)[None]  # [1, T0]
    stream = Streamer(tok, stop_text=stop_text)
    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    t0 = time.perf_counter()
    try:
        model.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                       top_p=args.top_p, seed=args.seed, stop_tokens=stop_tokens, on_token=stream)
    except _StopText:
        pass
    except ValueError as e:
        raise SystemExit(f"generate: {e}") from None
    t_end = time.perf_counter()
    n = len(stream.ids)
    first = stream.first_token_time if stream.first_token_time is not None else t_end  # None: no token came
    prefill_s = first - t0
    decode_s = t_end - first
    stats = {"prompt_tokens": prompt.shape[1], "new_tokens": n, "prefill_s": prefill_s, "decode_s": decode_s,
             "prefill_tok_s": prompt.shape[1] / max(prefill_s, 1e-9),
             "decode_tok_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else float("nan"),
             "text": tok.decode(stream.ids)}
    print(f"\n\n[prefill {stats['prompt_tokens']} tokens in {prefill_s * 1e3:.1f} ms ({stats['prefill_tok_s']:.0f} tok/s); "
          f"decode {n - 1} tokens in {decode_s * 1e3:.1f} ms ({stats['decode_tok_s']:.1f} tok/s); device {device}]",
          file=sys.stderr)
    return stats


def add_parser(sub) -> None:
    """Register `evict generate` (calling fn(args)) on the argparse subparsers object."""
    g = sub.add_parser("generate", **described(
        "stream a continuation from a model saved by `evict train`",
        "Load a model saved by `evict train` (its run folder or model/ folder, with its tokenizer.json), stream a\n"
        "continuation of --prompt to stdout, and report prefill and decode speed on stderr.",
        "evict generate --model runs/kda --prompt 'ROMEO:' --max-new-tokens 100",
        "evict generate --model runs/kda --temperature 0 --stop 'JULIET:'"))
    g.add_argument("--model", required=True, help="the run folder of `evict train` (or its model/ folder)")
    g.add_argument("--prompt", default="\n")
    g.add_argument("--max-new-tokens", type=positive_int, default=200)
    g.add_argument("--temperature", type=nonneg_float, default=0.8, help="0 = greedy")
    g.add_argument("--top-k", type=positive_int, default=50)
    g.add_argument("--top-p", type=unit_interval, default=0.95)
    g.add_argument("--seed", type=seed, default=None)
    g.add_argument("--stop", default=None, help="stop once this text is generated")
    g.add_argument("--device", type=device, default="cpu", help="cpu, cuda or auto")
    g.add_argument("--threads", type=positive_int)
    g.set_defaults(fn=run_generate)
