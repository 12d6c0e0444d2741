"""Incremental detokenization with stop strings: token ids in, text deltas out.

Each `push` decodes every id so far (a token's text may depend on its neighbours, as with byte-level
BPE) and returns only text that can no longer change: it holds back an incomplete UTF-8 character
(decoded as U+FFFD) and any tail that could still grow into a stop string. When a stop string
appears, the text ends just before it and `stopped` is set. The tokenizer's own stop ids end the
text too (`Tokenizer.decode` stops at them).
"""

from __future__ import annotations

from typing import Sequence

from meshrl.model.tokenizer import Tokenizer


class TextStream:
  """Text of a growing list of token ids, cut at the first of the `stop` strings."""

  def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()):
    self.tokenizer, self.stop = tokenizer, tuple(s for s in stop if s)
    self.ids: list[int] = []
    self.sent = 0  # characters of the text handed out so far
    self.stopped = False
    self.text = ""  # everything handed out so far

  def push(self, tokens: Sequence[int]) -> str:
    """Adds new ids; returns the text delta that is now final ("" if none)."""
    if self.stopped:
      return ""
    self.ids.extend(int(t) for t in tokens)
    text = self.tokenizer.decode(self.ids)
    hits = [i for i in (text.find(s, max(0, self.sent - len(s))) for s in self.stop) if i >= 0]
    if hits:
      self.stopped = True
      return self._take(text, min(hits))
    safe = len(text.rstrip("\ufffd"))
    for s in self.stop:
      for k in range(min(len(s) - 1, len(text)), 0, -1):
        if text.endswith(s[:k]):
          safe = min(safe, len(text) - k)
          break
    return self._take(text, safe)

  def flush(self) -> str:
    """The held-back tail at the end of generation (nothing after a stop string)."""
    if self.stopped:
      return ""
    return self._take(self.tokenizer.decode(self.ids), None)

  def _take(self, text: str, end: int | None) -> str:
    end = len(text) if end is None else end
    if end <= self.sent:
      return ""
    delta = text[self.sent:end]
    self.sent = end
    self.text += delta
    return delta
