"""Token ids -> text for a stream, O(1) per token: pieces as they become decodable (equal, joined, to the tokenizer's
decode of all the ids), stop strings cut out (OpenAI: the stop text is not returned), text that could still begin a
stop string held back until it cannot."""

from __future__ import annotations

import codecs
import json
import weakref

HOLD_AT_MOST = 32  # tokens a window may hold back for an incomplete character before its text goes out anyway


class IncrementalDecoder:
    """`step(id) -> new text`, `flush() -> the rest`. Byte tokenizer and byte-level BPE: each id's bytes through an
    incremental UTF-8 decoder (the same replacements as decoding all bytes at once); char tokenizer: one character per
    id; any other (an HF tokenizer with another decoder): decode a short window of ids (from the last point where text
    went out, one token of context before it) and send what it adds, unless it ends in an incomplete character
    (U+FFFD), so each step decodes a few tokens whatever the length."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        kind = getattr(tokenizer, "kind", None)
        self.bytes = token_bytes(tokenizer)
        byte_level = kind == "byte" or self.bytes is not None
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace") if byte_level else None
        self.whole = token_texts(tokenizer, self.bytes) if byte_level else []
        self.chars: str | None = tokenizer.chars if kind == "char" else None
        self.ids: list[int] = []
        self.prefix = self.read = 0  # window: ids[prefix:read] is context already sent, ids[read:] not yet

    def step(self, token: int) -> str:
        if self.utf8 is not None:
            if not self.utf8.buffer and token < len(self.whole) and (s := self.whole[token]) is not None:
                return s  # no character begun: a token of whole characters is its text (what decode would give)
            return self.utf8.decode(self.bytes[token] if self.bytes is not None else bytes((token,)))
        if self.chars is not None:
            return self.chars[token]
        self.ids.append(token)
        old, new = self._window()
        if len(new) <= len(old) or (new.endswith("\ufffd") and len(self.ids) - self.read < HOLD_AT_MOST):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return new[len(old) :]

    def flush(self) -> str:
        if self.utf8 is not None:
            return self.utf8.decode(b"", final=True)
        if self.chars is not None:
            return ""
        old, new = self._window()
        self.prefix = self.read = len(self.ids)
        return new[len(old) :]

    def _window(self) -> tuple[str, str]:
        w = self.ids[self.prefix :]
        return self.tok.decode(w[: self.read - self.prefix]), self.tok.decode(w)


_BYTES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its token_bytes table, built once


def token_bytes(tokenizer) -> list[bytes] | None:
    """id -> the token's bytes for a byte-level BPE (an HF tokenizer whose decoder is ByteLevel and whose tokens are
    all spelled in GPT-2's byte alphabet), else None."""
    if tokenizer in _BYTES:
        return _BYTES[tokenizer]
    hf, table = getattr(tokenizer, "_tok", None), None
    if hf is not None and (json.loads(hf.to_str()).get("decoder") or {}).get("type") == "ByteLevel":
        from evict.tasks.tokenizers import byte_alphabet

        inverse = {c: b for b, c in enumerate(byte_alphabet())}
        spelled = [hf.id_to_token(i) for i in range(tokenizer.vocab_size)]
        if all(s is not None and all(c in inverse for c in s) for s in spelled):
            table = [bytes(inverse[c] for c in s) for s in spelled]
    _BYTES[tokenizer] = table
    return table


_TEXTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its token_texts table, built once


def token_texts(tokenizer, table: list[bytes] | None) -> list[str | None]:
    """id -> the token's text where its bytes are whole UTF-8 characters, else None (a byte-level tokenizer: `table`,
    its token_bytes, or None for the byte tokenizer, whose id is the byte). What the incremental UTF-8 decoder returns
    for that token when it holds no partial character."""
    if tokenizer not in _TEXTS:
        out: list[str | None] = []
        for b in table if table is not None else (bytes((i,)) for i in range(256)):
            try:
                out.append(b.decode("utf-8"))
            except UnicodeDecodeError:
                out.append(None)
        _TEXTS[tokenizer] = out
    return _TEXTS[tokenizer]


class TextStream:
    def __init__(self, tokenizer, stop: list[str]):
        self.decoder = IncrementalDecoder(tokenizer)
        self.stop = stop
        self.ids: list[int] = []
        self.held = ""  # decoded text not yet sent: it may begin a stop string
        self.hold = max((len(s) for s in stop), default=1) - 1

    def feed(self, token: int) -> tuple[str, bool]:
        """Add one token; returns (new text to send, whether a stop string was reached)."""
        self.ids.append(token)
        piece = self.decoder.step(token)
        return (piece, False) if not self.stop else self._out(piece, final=False)

    def flush(self) -> str:
        """The text held back, at the end of the generation (cut at a stop string it holds)."""
        return self._out(self.decoder.flush(), final=True)[0]

    def _out(self, piece: str, *, final: bool) -> tuple[str, bool]:
        if not self.stop:  # nothing to hold back or cut
            return piece, False
        text = self.held + piece  # the held text is shorter than any stop string: the search is O(piece)
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.held = ""
            return text[: min(hits)], True
        end = len(text) if final else max(len(text) - self.hold, 0)
        self.held = text[end:]
        return text[:end], False
