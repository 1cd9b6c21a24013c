"""`evict data prepare DATA --out X.bin`: tokenise a corpus once, in parallel, into nanoGPT's flat layout.

Writes X.bin (every document's ids, each followed by the end-of-text id; uint16, or uint32 past 65,536 tokens),
X.json (dtype, vocab_size, eos_token_id, documents, tokens, tokenizer file, source) and X.tokenizer.json; all three
are written under temporary names and renamed, the .bin last-but-one and the meta last, so a crash leaves no
meta that points at a half-written .bin. `evict train --data X.bin` then memory-maps it (evict.tasks.text).

Parallel: documents go to a `multiprocessing` pool in batches of about 1 M characters (each worker loads the
tokenizer from its saved file once); the ids come back in order, a tqdm bar counts documents. A char or bpe tokenizer
is first built (trained) on the corpus in this process; byte needs no pass.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from evict.data import BIN_DTYPES, bin_dtype, bin_meta_path, open_corpus
from evict.tasks.tokenizers import KINDS, Tokenizer, load_tokenizer

_BATCH_CHARS = 1 << 20
_worker_tok: Tokenizer | None = None


def _init_worker(tok_file: str) -> None:
    global _worker_tok
    _worker_tok = load_tokenizer(tok_file)


def _encode_batch(docs: list[str]) -> list[np.ndarray]:
    tok = _worker_tok
    assert tok is not None  # set by _init_worker
    return [tok.encode_many([d]) for d in docs]


def _batches(docs: Iterator[Iterator[str]]) -> Iterator[list[str]]:
    batch, size = [], 0
    for doc in docs:
        text = "".join(doc)
        batch.append(text)
        size += len(text)
        if size >= _BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _tmp(path: Path) -> Path:
    return path.with_name(f".{os.getpid()}.{path.name}")


def prepare(data: str | None, out: str | Path, *, tokenizer: str = "bpe", bpe_vocab_size: int = 2048,
            text_field: str = "text", workers: int | None = None, progress: bool = True) -> dict:
    """Tokenise `data` (anything `--data` reads as text) into `out` (.bin) + its meta and tokenizer; returns the meta."""
    from tqdm import tqdm

    from evict.tasks.text import build_tokenizer

    out = Path(out).expanduser()
    if out.suffix != ".bin":
        raise ValueError(f"out: expected a path ending in .bin, got {out}")
    if tokenizer not in KINDS and not Path(tokenizer).expanduser().is_file():
        raise ValueError(f"tokenizer: expected char, byte, bpe or a tokenizer.json file, got {tokenizer!r}")
    if workers is not None and workers < 1:
        raise ValueError(f"workers: expected a positive integer, got {workers}")
    corpus = open_corpus(data, text_field)
    tok = load_tokenizer(Path(tokenizer).expanduser()) if tokenizer not in KINDS else \
        build_tokenizer(tokenizer, corpus, bpe_vocab_size)
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer: {tokenizer} has no end-of-text token <|endoftext|> to separate documents")
    dtype = bin_dtype(tok.vocab_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok_file, meta_file = out.with_name(out.stem + ".tokenizer.json"), bin_meta_path(out)
    tmp_tok, tmp_bin, tmp_meta = _tmp(tok_file), _tmp(out), _tmp(meta_file)
    tok.save(tmp_tok)
    eos = np.array([tok.eos_token_id], dtype=BIN_DTYPES[dtype])
    n_docs = n_tokens = 0
    workers = workers or min(8, os.cpu_count() or 1)
    try:
        with open(tmp_bin, "wb") as fh, tqdm(desc=f"tokenising {corpus.name}", unit="doc", disable=not progress) as bar, \
                contextlib.ExitStack() as stack:
            if workers == 1:  # in this process: no pool to start
                _init_worker(str(tmp_tok))
                encode_all: Iterator[list[np.ndarray]] = map(_encode_batch, _batches(corpus.documents()))
            else:
                ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold threads (torch, HF)
                pool = stack.enter_context(ctx.Pool(workers, initializer=_init_worker, initargs=(str(tmp_tok),)))
                encode_all = pool.imap(_encode_batch, _batches(corpus.documents()))
            for encoded in encode_all:
                for ids in encoded:
                    fh.write(ids.astype(BIN_DTYPES[dtype]).tobytes())
                    fh.write(eos.tobytes())
                    n_tokens += len(ids) + 1
                n_docs += len(encoded)
                bar.update(len(encoded))
        if n_docs == 0:
            raise ValueError(f"data: {data} holds no documents")
        meta = {"format": "evict-tokens-1", "dtype": dtype, "vocab_size": tok.vocab_size,
                "eos_token_id": tok.eos_token_id, "documents": n_docs, "tokens": n_tokens,
                "tokenizer": tok_file.name, "source": str(data) if data is not None else "shakespeare",
                "text_field": text_field}
        tmp_meta.write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(tmp_tok, tok_file)
        os.replace(tmp_bin, out)
        os.replace(tmp_meta, meta_file)
    finally:
        for t in (tmp_tok, tmp_bin, tmp_meta):
            t.unlink(missing_ok=True)
    return meta
