"""Incremental detokenization and stop strings.

Text is released only once it can no longer change. A byte-level BPE token may hold
part of a multi-byte character; the window decode then ends in U+FFFD and the text is
withheld until a later token completes it, so a character is never split across two
stream chunks. Text that could be the start of a stop string is withheld too, until
the stop string is matched (and cut off) or ruled out.
"""

from __future__ import annotations

from shared.tokenizer.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.stop = stop
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # decoded text that is final
        self._prefix = 0  # decode window start (token index)
        self._read = 0  # tokens before this are reflected in self.text
        self._sent = 0  # characters of self.text already released
        self.stopped = False  # a stop string was found; nothing more is released

    def add(self, new_ids: list[int]) -> str:
        """Feed tokens; returns the text that became final (possibly empty)."""
        if self.stopped:
            return ""
        self.ids += new_ids
        # Decoding a short window that starts a little before the new tokens gives the
        # same characters as decoding everything, at a constant cost per token.
        before = self.tok.decode(self.ids[self._prefix : self._read], self.skip)
        after = self.tok.decode(self.ids[self._prefix :], self.skip)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)
        return self._release(final=False)

    def flush(self) -> str:
        """At the end of a request: release whatever was held back, minus any stop string."""
        if not self.stopped and self._read < len(self.ids):
            before = self.tok.decode(self.ids[self._prefix : self._read], self.skip)
            after = self.tok.decode(self.ids[self._prefix :], self.skip)
            self.text += after[len(before) :]
            self._prefix = self._read = len(self.ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        end = len(self.text)
        if self.stop:
            start = max(0, self._sent - max(len(s) for s in self.stop) + 1)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                end = len(self.text)
            elif not final:
                end -= max(_partial_suffix(self.text, s) for s in self.stop)
        out = self.text[self._sent : end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return out


def _partial_suffix(text: str, stop: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of stop."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
