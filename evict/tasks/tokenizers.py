"""Tokenizers for text tasks: characters, bytes, and byte-level BPE (trained locally with HF `tokenizers`).

One interface: `encode(str) -> np.ndarray [N] int64`, `encode_many(chunks)` (their ids concatenated), `decode(ids)
-> str`, `vocab_size`, `save(path)`, and `load_tokenizer(path)` to read any of them back. Every tokenizer is a pure
function of what `save` wrote, and `save` writes a Hugging Face `tokenizer.json` that `PreTrainedTokenizerFast`
(transformers) and `tokenizers.Tokenizer.from_file` load with the same ids: char = a WordLevel model over single
characters, byte = byte-level BPE with the 256 bytes and no merges (id = byte value). `load_tokenizer` also reads the
older {"kind": ...} files, and any other HF tokenizer.json (a pretrained tokenizer, e.g. GPT-2's BPE) as `BPETokenizer`.

- char: vocabulary = the sorted set of characters of the corpus (id = rank of the code point); a character
  outside it is an error, not a silent <unk>.
- byte: the 256 UTF-8 byte values; decode replaces invalid byte sequences (a window may cut a character).
- bpe: byte-level BPE (GPT-2 pre-tokenisation, 256-byte base alphabet), so every string round-trips. Trained from an iterator of text chunks, so a corpus never has to be in memory at once.
  `encode_many` on such a tokenizer splits with GPT-2's pattern (the `regex` module) and runs the HF model
  once per distinct piece, then gathers: the same ids as HF's encode (tested), several times faster on a corpus.

End of text. Every tokenizer a text task builds has one special token, EOT = "<|endoftext|>" (GPT-2's), after the
ordinary ids: char = len(chars), byte = 256, bpe = the last id (trained with one id fewer). `eos_token_id` names it
(None for a tokenizer saved before it existed, so old model folders load unchanged); it is also the pad id where
batching needs one (`pad_token_id`). `encode` never produces it from text (a document containing the literal string
"<|endoftext|>" is encoded as its characters by char/byte; HF's encoder, used by bpe, maps it to the token); `decode`
writes it as EOT. In the saved tokenizer.json it is an added special token, so HF loads it with the same id.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from evict.cli_args import first_line
from evict.jsonfile import read_json_object

KINDS = ("char", "byte", "bpe")
EOT = "<|endoftext|>"


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

    def __init__(self, chars: str, eos: bool = False):
        if not chars:
            raise ValueError("chars: a character vocabulary needs at least one character")
        self.chars = "".join(sorted(set(chars)))
        self._points = np.array([ord(c) for c in self.chars], dtype=np.uint32)  # [V] sorted code points
        self.eos_token_id: int | None = len(self.chars) if eos else None
        self.vocab_size = len(self.chars) + bool(eos)

    @property
    def pad_token_id(self) -> int | None:
        return self.eos_token_id

    @classmethod
    def from_chunks(cls, chunks: Iterable[str], eos: bool = True) -> CharTokenizer:
        seen: set[str] = set()
        for chunk in chunks:
            seen.update(chunk)
        return cls("".join(seen), eos=eos)

    def encode(self, text: str) -> np.ndarray:
        points = np.frombuffer(_as_text(text).encode("utf-32-le"), dtype=np.uint32)  # [N] code points
        ids = np.searchsorted(self._points, points)  # [N]
        n = len(self.chars)
        bad = (ids >= n) | (self._points[np.minimum(ids, n - 1)] != points)
        if bad.any():
            raise ValueError(f"text: character {chr(points[bad.argmax()])!r} is not in the vocabulary")
        return ids.astype(np.int64)

    def decode(self, ids) -> str:
        return _decode_eos(_as_ids(ids, self.vocab_size), self.eos_token_id, lambda a: "".join(self.chars[i] for i in a))

    def encode_many(self, chunks: Iterable[str]) -> np.ndarray:
        return _concat([self.encode(c) for c in chunks])

    def save(self, path: str | Path) -> None:
        """An HF tokenizer.json: WordLevel over the characters (id = rank), every character its own piece, no unk."""
        hf = _hf()
        tok = hf.Tokenizer(hf.models.WordLevel({c: i for i, c in enumerate(self.chars)}, unk_token=None))
        tok.pre_tokenizer = hf.pre_tokenizers.Split(hf.Regex(r"[\s\S]"), behavior="isolated")
        tok.decoder = hf.decoders.Fuse()
        _save_hf(tok, self.eos_token_id, path)


class ByteTokenizer:
    kind = "byte"

    def __init__(self, eos: bool = False):
        self.eos_token_id: int | None = 256 if eos else None
        self.vocab_size = 256 + bool(eos)

    @property
    def pad_token_id(self) -> int | None:
        return self.eos_token_id

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(_as_text(text).encode("utf-8"), dtype=np.uint8).astype(np.int64)  # [N bytes]

    def decode(self, ids) -> str:
        return _decode_eos(_as_ids(ids, self.vocab_size), self.eos_token_id,
                           lambda a: a.astype(np.uint8).tobytes().decode("utf-8", errors="replace"))

    def encode_many(self, chunks: Iterable[str]) -> np.ndarray:
        return _concat([self.encode(c) for c in chunks])

    def save(self, path: str | Path) -> None:
        """An HF tokenizer.json: byte-level BPE whose vocabulary is the 256 bytes (id = byte value) and no merges."""
        hf = _hf()
        vocab = {ch: b for b, ch in enumerate(byte_alphabet())}
        tok = hf.Tokenizer(hf.models.BPE(vocab, []))
        tok.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = hf.decoders.ByteLevel()
        _save_hf(tok, self.eos_token_id, path)


def _decode_eos(ids: np.ndarray, eos: int | None, decode) -> str:
    """decode(ids) with each EOS id written as EOT (the text between two EOS ids decoded on its own)."""
    if eos is None or not (ids == eos).any():
        return decode(ids)
    cuts = np.flatnonzero(ids == eos)
    parts = np.split(ids, cuts)  # every part after the first starts with an EOS id
    return decode(parts[0]) + "".join(EOT + decode(p[1:]) for p in parts[1:])


def _save_hf(tok, eos: int | None, path: str | Path) -> None:
    """Save an HF tokenizer, EOT added as a special token (its id the next one: the one evict gives it)."""
    if eos is not None:
        tok.add_special_tokens([_hf().AddedToken(EOT, special=True, normalized=False)])
    tok.save(str(path))


def _hf():
    try:
        import tokenizers
    except ImportError as e:
        raise ModuleNotFoundError("tokenizer='bpe' needs the `tokenizers` package: pip install tokenizers",
                                  name="tokenizers") from e
    return tokenizers


class BPETokenizer:
    """Byte-level BPE trained here, or any HF tokenizer.json (`load_tokenizer`): ids are what HF's encode gives."""

    kind = "bpe"

    def __init__(self, hf_tokenizer):
        self._tok = hf_tokenizer
        self.vocab_size = hf_tokenizer.get_vocab_size()
        self._split, self._guards = _fast_split(json.loads(hf_tokenizer.to_str()))
        self.eos_token_id: int | None = hf_tokenizer.token_to_id(EOT)  # None when the file has no EOT token

    @property
    def pad_token_id(self) -> int | None:
        return self.eos_token_id

    @classmethod
    def train(cls, chunks: Iterator[str], vocab_size: int) -> BPETokenizer:
        """Byte-level BPE with at most `vocab_size` tokens (fewer if the corpus runs out of pairs to merge), the last
        of them EOT."""
        if vocab_size <= 256:
            raise ValueError(f"bpe_vocab_size must be > 256 (the byte alphabet), got {vocab_size}")
        hf = _hf()
        tok = hf.Tokenizer(hf.models.BPE())
        tok.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = hf.decoders.ByteLevel()
        trainer = hf.trainers.BpeTrainer(
            vocab_size=vocab_size - 1, initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet(), show_progress=False
        )
        tok.train_from_iterator(chunks, trainer=trainer)
        tok.add_special_tokens([hf.AddedToken(EOT, special=True, normalized=False)])
        return cls(tok)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(_as_text(text), add_special_tokens=False).ids, dtype=np.int64)

    def encode_many(self, chunks: Iterable[str]) -> np.ndarray:
        """The ids of the chunks, concatenated. For a plain byte-level BPE (no normalizer, GPT-2 pre-tokenisation, no
        added tokens in the text): split each chunk into pre-tokens with GPT-2's pattern, encode each distinct
        pre-token once with the HF model, gather. Pre-tokens are encoded independently by HF too, so ids are equal."""
        texts = [_as_text(c) for c in chunks]
        if self._split is None or any(g in t for t in texts for g in self._guards):
            return _concat([np.asarray(e.ids, dtype=np.int64) for e in self._tok.encode_batch_fast(texts,
                                                                                                     add_special_tokens=False)])
        pieces = [w for t in texts for w in self._split.findall(t)]
        index: dict[str, int] = {}
        order = np.fromiter((index.setdefault(w, len(index)) for w in pieces), dtype=np.int64, count=len(pieces))
        encoded = self._tok.encode_batch_fast(list(index), add_special_tokens=False)  # one per distinct piece
        lens = np.fromiter((len(e.ids) for e in encoded), dtype=np.int64, count=len(encoded))  # [U]
        flat = np.fromiter((i for e in encoded for i in e.ids), dtype=np.int64, count=int(lens.sum()))
        starts = np.cumsum(lens) - lens  # [U] where each piece's ids begin in flat
        n = lens[order]  # [P] ids per piece, in text order
        offsets = np.repeat(starts[order] - (np.cumsum(n) - n), n)  # [N] flat index minus output index
        return flat[offsets + np.arange(int(n.sum()))]

    def decode(self, ids) -> str:
        return self._tok.decode(_as_ids(ids, self.vocab_size).tolist(), skip_special_tokens=False)

    def save(self, path: str | Path) -> None:
        self._tok.save(str(path))


GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _fast_split(spec: dict) -> tuple[Any, list[str]]:
    """(compiled GPT-2 split pattern, added tokens' texts) when `spec` (a tokenizer.json) is a plain byte-level BPE
    whose pieces HF encodes independently, else (None, [])."""
    pre = spec.get("pre_tokenizer") or {}
    post = spec.get("post_processor")
    plain = (spec.get("normalizer") is None and (spec.get("model") or {}).get("type") == "BPE"
             and pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space")
             and (post is None or post.get("type") == "ByteLevel"))
    if not plain:
        return None, []
    try:
        import regex
    except ImportError:
        return None, []
    return regex.compile(GPT2_PATTERN), [t["content"] for t in spec.get("added_tokens") or []]


def byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character map, as a list indexed by byte value: printable Latin-1 bytes stand for
    themselves, the other 68 take the code points 256, 257, ... in byte order (so no piece holds whitespace)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    out, extra = [""] * 256, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b], extra = chr(256 + extra), extra + 1
    return out


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _from_hf_json(data: dict, path: Path) -> CharTokenizer | ByteTokenizer | None:
    """The char or byte tokenizer that `save` wrote as this HF JSON, or None for any other tokenizer."""
    model, pre = data.get("model") or {}, data.get("pre_tokenizer") or {}
    vocab = model.get("vocab")
    added = [(t.get("id"), t.get("content")) for t in data.get("added_tokens") or [] if isinstance(t, dict)]
    if added not in ([], [(len(vocab) if isinstance(vocab, dict) else None, EOT)]):
        return None  # other added tokens: read as a BPE/HF tokenizer
    eos = bool(added)
    if model.get("type") == "WordLevel" and pre.get("type") == "Split" and isinstance(vocab, dict) and vocab:
        chars = sorted(vocab, key=lambda c: vocab[c])
        if all(isinstance(c, str) and len(c) == 1 for c in chars) and [vocab[c] for c in chars] == list(range(len(chars))):
            tok = CharTokenizer("".join(chars), eos=eos)
            if tok.chars == "".join(chars):  # ids are the sorted ranks, as CharTokenizer assigns them
                return tok
    if (model.get("type") == "BPE" and not model.get("merges") and pre.get("type") == "ByteLevel"
            and vocab == {ch: b for b, ch in enumerate(byte_alphabet())}):
        return ByteTokenizer(eos=eos)
    return None


Tokenizer = CharTokenizer | ByteTokenizer | BPETokenizer


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Read back what any tokenizer's `save` wrote, or any HF tokenizer.json (as BPETokenizer: HF's ids).

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
        hf_tok = hf.Tokenizer.from_file(str(path))
    except Exception as e:  # the HF loader raises its own exception type for any malformed field
        raise ValueError(f"tokenizer: {path} is not a valid BPE tokenizer ({first_line(e)})") from None
    return _from_hf_json(data, path) or BPETokenizer(hf_tok)


def write_hf_tokenizer_config(folder: str | Path, tok: Tokenizer, model_max_length: int | None = None) -> None:
    """tokenizer_config.json + special_tokens_map.json beside a tokenizer.json, so transformers' AutoTokenizer loads
    the folder (PreTrainedTokenizerFast) with EOT as its eos, bos and pad token (GPT-2's convention; pad for batching)."""
    special = {} if tok.eos_token_id is None else {"eos_token": EOT, "bos_token": EOT, "pad_token": EOT}
    # model_input_names: GPT-2's; without it transformers 4.x adds token_type_ids, which generate(**batch) refuses
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                              "add_bos_token": False, "add_eos_token": False,
                              "model_input_names": ["input_ids", "attention_mask"], **special}
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    folder = Path(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=1) + "\n")


def token_dtype(vocab_size: int) -> type:
    """Smallest numpy dtype that holds ids 0 … vocab_size-1 (for token arrays on disk)."""
    if vocab_size <= 1 << 8:
        return np.uint8
    if vocab_size <= 1 << 16:
        return np.uint16
    return np.int32
