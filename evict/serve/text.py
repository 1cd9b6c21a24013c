"""Token ids -> text for a stream, O(1) per token: pieces as they become decodable (equal, joined, to the tokenizer's
decode of all the ids), stop strings cut out (OpenAI: the stop text is not returned), text that could still begin a
stop string held back until it cannot."""

from __future__ import annotations

import codecs

HOLD_AT_MOST = 32  # tokens a window may hold back for an incomplete character before its text goes out anyway


class IncrementalDecoder:
    """`step(id) -> new text`, `flush() -> the rest`. Byte tokenizer: an incremental UTF-8 decoder (the same
    replacements as decoding all bytes at once); char tokenizer: one character per id; any other (BPE, HF): decode a
    short window of ids (from the last point where text went out, one token of context before it) and send what it
    adds, unless it ends in an incomplete character (U+FFFD), so each step decodes a few tokens whatever the length."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        kind = getattr(tokenizer, "kind", None)
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace") if kind == "byte" else None
        self.chars: str | None = tokenizer.chars if kind == "char" else None
        self.ids: list[int] = []
        self.prefix = self.read = 0  # window: ids[prefix:read] is context already sent, ids[read:] not yet

    def step(self, token: int) -> str:
        if self.utf8 is not None:
            return self.utf8.decode(bytes((token,)))
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
        return self._out(self.decoder.step(token), final=False)

    def flush(self) -> str:
        """The text held back, at the end of the generation (cut at a stop string it holds)."""
        return self._out(self.decoder.flush(), final=True)[0]

    def _out(self, piece: str, *, final: bool) -> tuple[str, bool]:
        text = self.held + piece  # the held text is shorter than any stop string: the search is O(piece)
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.held = ""
            return text[: min(hits)], True
        end = len(text) if final else max(len(text) - self.hold, 0)
        self.held = text[end:]
        return text[:end], False
