"""Token ids -> text for a stream: pieces as they become decodable, stop strings cut out (OpenAI: the stop text is
not returned), text that could still begin a stop string held back until it cannot."""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: list[str]):
        self.tok, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already returned
        self.hold = max((len(s) for s in stop), default=1) - 1

    def feed(self, token: int) -> tuple[str, bool]:
        """Add one token; returns (new text to send, whether a stop string was reached)."""
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        hits = [i for i in (text.find(s, self.sent) for s in self.stop) if i >= 0]
        if hits:
            end = min(hits)
            piece, self.sent = text[self.sent : end], max(end, self.sent)
            return piece, True
        end = len(text) - self.hold
        if text.endswith("\ufffd"):  # an incomplete UTF-8 character: wait for its other bytes
            end = min(end, len(text) - 1)
        if end <= self.sent:
            return "", False
        piece, self.sent = text[self.sent : end], end
        return piece, False

    def flush(self) -> str:
        """The text held back, at the end of the generation."""
        text = self.tok.decode(self.ids)
        piece, self.sent = text[self.sent :], len(text)
        return piece
