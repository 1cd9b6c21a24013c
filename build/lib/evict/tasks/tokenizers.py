"""Tokenizers for text tasks: characters, bytes, and byte-level BPE (trained locally with HF `tokenizers`).

One interface: `encode(str) -> np.ndarray [N] int64`, `decode(ids) -> str`, `vocab_size`, `save(path)`,
and `load_tokenizer(path)` to read any of them back. Every tokenizer is a pure function of what `save` wrote.

- char: vocabulary = the sorted set of characters of the corpus (id = rank of the code point); a character
  outside it is an error, not a silent <unk>.
- byte: the 256 UTF-8 byte values; decode replaces invalid byte sequences (a window may cut a character).
- bpe: byte-level BPE (GPT-2 pre-tokenisation, 256-byte base alphabet, no special tokens), so every string
  round-trips. Trained from an iterator of text chunks, so a corpus never has to be in memory at once.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from evict.jsonfile import read_json_object

KINDS = ("char", "byte", "bpe")


def _as_text(text) -> str:
    if not isinstance(text, str):
        raise ValueError(f"text: expected a str, got {type(text).__name__}")
    return text


def _as_ids(ids, vocab_size: int) -> np.ndarray:
    """List, numpy array or torch tensor of integer token ids in [0, vocab_size) -> np.ndarray [N] int64.

    Anything else is a ValueError: a float would truncate, a negative id wrap, an id past the vocabulary alias another.
    """
    if hasattr(ids, "detach"):
        ids = ids.detach().cpu().numpy()
    try:
        arr = np.asarray(ids)
    except (ValueError, TypeError):
        raise ValueError(f"ids: expected a sequence of integer token ids, got {type(ids).__name__}") from None
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"ids: expected integer token ids, got dtype {arr.dtype}")
    arr = arr.astype(np.int64).reshape(-1)
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"ids: expected token ids in [0, {vocab_size}), got range [{lo}, {hi}]")
    return arr


class CharTokenizer:
    kind = "char"

    def __init__(self, chars: str):
        if not chars:
            raise ValueError("chars: a character vocabulary needs at least one character")
        self.chars = "".join(sorted(set(chars)))
        self._points = np.array([ord(c) for c in self.chars], dtype=np.uint32)  # [V] sorted code points
        self.vocab_size = len(self.chars)

    @classmethod
    def from_chunks(cls, chunks: Iterable[str]) -> CharTokenizer:
        seen: set[str] = set()
        for chunk in chunks:
            seen.update(chunk)
        return cls("".join(seen))

    def encode(self, text: str) -> np.ndarray:
        points = np.frombuffer(_as_text(text).encode("utf-32-le"), dtype=np.uint32)  # [N] code points
        ids = np.searchsorted(self._points, points)  # [N]
        bad = (ids >= self.vocab_size) | (self._points[np.minimum(ids, self.vocab_size - 1)] != points)
        if bad.any():
            raise ValueError(f"text: character {chr(points[bad.argmax()])!r} is not in the vocabulary")
        return ids.astype(np.int64)

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in _as_ids(ids, self.vocab_size))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"kind": "char", "chars": self.chars}))


class ByteTokenizer:
    kind = "byte"
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(_as_text(text).encode("utf-8"), dtype=np.uint8).astype(np.int64)  # [N bytes]

    def decode(self, ids) -> str:
        return _as_ids(ids, 256).astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"kind": "byte"}))


def _hf():
    try:
        import tokenizers
    except ImportError as e:
        raise ImportError("tokenizer='bpe' needs the `tokenizers` package: pip install tokenizers") from e
    return tokenizers


class BPETokenizer:
    kind = "bpe"

    def __init__(self, hf_tokenizer):
        self._tok = hf_tokenizer
        self.vocab_size = hf_tokenizer.get_vocab_size()

    @classmethod
    def train(cls, chunks: Iterator[str], vocab_size: int) -> BPETokenizer:
        """Byte-level BPE with at most `vocab_size` tokens (fewer if the corpus runs out of pairs to merge)."""
        if vocab_size <= 256:
            raise ValueError(f"bpe_vocab_size must be > 256 (the byte alphabet), got {vocab_size}")
        hf = _hf()
        tok = hf.Tokenizer(hf.models.BPE())
        tok.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = hf.decoders.ByteLevel()
        trainer = hf.trainers.BpeTrainer(
            vocab_size=vocab_size, initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet(), show_progress=False
        )
        tok.train_from_iterator(chunks, trainer=trainer)
        return cls(tok)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(_as_text(text)).ids, dtype=np.int64)

    def decode(self, ids) -> str:
        return self._tok.decode(_as_ids(ids, self.vocab_size).tolist())

    def save(self, path: str | Path) -> None:
        self._tok.save(str(path))


def load_tokenizer(path: str | Path) -> CharTokenizer | ByteTokenizer | BPETokenizer:
    """Read back what any tokenizer's `save` wrote (an HF tokenizer JSON is a BPE tokenizer).

    A missing, unreadable or malformed file is a one-line ValueError naming it."""
    path = Path(path)
    data = read_json_object(path, "tokenizer")
    if data.get("kind") == "char":
        if not isinstance(data.get("chars"), str) or not data["chars"]:
            raise ValueError(f"tokenizer: {path} is a char tokenizer without a non-empty 'chars' string")
        return CharTokenizer(data["chars"])
    if data.get("kind") == "byte":
        return ByteTokenizer()
    if "model" not in data:
        raise ValueError(f"tokenizer: {path} is neither a char/byte tokenizer nor a HF tokenizer JSON")
    hf = _hf()
    try:
        return BPETokenizer(hf.Tokenizer.from_file(str(path)))
    except Exception as e:  # the HF loader raises its own exception type for any malformed field
        raise ValueError(f"tokenizer: {path} is not a valid BPE tokenizer ({str(e).splitlines()[0][:200]})") from None


def token_dtype(vocab_size: int) -> type:
    """Smallest numpy dtype that holds ids 0 … vocab_size-1 (for token arrays on disk)."""
    if vocab_size <= 1 << 8:
        return np.uint8
    if vocab_size <= 1 << 16:
        return np.uint16
    return np.int32
