"""Stop strings over streamed text.

`StopStringMatcher.feed(delta)` returns the text that is safe to emit now and whether a
stop string was hit. Text that could still be the start of a stop string is held back
until the next delta decides it; the stop string itself is never emitted.
"""
from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stop: list[str]):
        self.stop = [s for s in stop if s]
        self._held = ""
        self.stopped_by: str | None = None

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.stopped_by is not None:
            return "", True
        if not self.stop:
            return delta, False
        text = self._held + delta
        hits = [(text.find(s), s) for s in self.stop if s in text]
        if hits:
            cut, self.stopped_by = min(hits)
            self._held = ""
            return text[:cut], True
        keep = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), keep, -1):
                if text.endswith(s[:n]):
                    keep = n
                    break
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def flush(self) -> str:
        """Text held back when the stream ends without a stop string."""
        held, self._held = self._held, ""
        return held
