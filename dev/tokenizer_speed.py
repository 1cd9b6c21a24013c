"""Corpus encoding speed: evict's BPETokenizer.encode_many vs HF's encode and tiktoken on the same merges.

    .venv/bin/python dev/tokenizer_speed.py [--vocab 2048]
Trains a byte-level BPE on Shakespeare, builds a tiktoken Encoding from the same vocabulary (ranks = ids, GPT-2's
pattern), checks that all three give identical ids, and prints M chars/s for each (best of 3).
"""

import argparse
import time

import numpy as np
import tiktoken

from evict.tasks.text import corpus_files, iter_chunks
from evict.tasks.tokenizers import GPT2_PATTERN, BPETokenizer, byte_alphabet


def main() -> None:
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--vocab", type=int, default=2048)
    args = p.parse_args()
    chunks = list(iter_chunks(corpus_files(None)[1]))
    chars = sum(map(len, chunks))
    tok = BPETokenizer.train(iter(chunks), args.vocab)
    byte_of = {ch: b for b, ch in enumerate(byte_alphabet())}
    ranks = {bytes(byte_of[c] for c in piece): i for piece, i in tok._tok.get_vocab().items()}
    enc = tiktoken.Encoding("evict-bpe", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={})
    runs = {
        "HF encode, per 1M-char chunk": lambda: np.concatenate([tok.encode(c) for c in chunks]),
        "evict encode_many": lambda: tok.encode_many(chunks),
        "tiktoken encode_ordinary_batch": lambda: np.concatenate(
            [np.asarray(x, dtype=np.int64) for x in enc.encode_ordinary_batch(chunks)]),
    }
    ids = {}
    for name, fn in runs.items():
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            ids[name] = fn()
            best = min(best, time.perf_counter() - t)
        print(f"{name:34s} {chars / best / 1e6:6.2f} M chars/s  ({best:.2f} s, {len(ids[name]):,} tokens)")
    first = next(iter(ids.values()))
    print("identical ids:", all(np.array_equal(first, v) for v in ids.values()))


if __name__ == "__main__":
    main()
