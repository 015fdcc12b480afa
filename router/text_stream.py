"""Streamed text for one request: incremental detokenization that never shows a stop string.

The decode worker stops a request on a stop string and the output text must end before it. Text is
therefore held back by (longest stop string − 1) characters while streaming: a stop string can only
complete in a later delta, and when it does, none of it has been sent yet. At the end the held-back
text is released, cut at the stop string when that is why the request finished (before it, or after
it when the request asked to include it).
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.tokenizer import IncrementalDetokenizer


class TextStream:
    def __init__(
        self, tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True, include_stop: bool = False
    ):
        self._detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self._stop, self._include_stop = stop, include_stop
        self._holdback_chars = max((len(s) for s in stop), default=1) - 1
        self._sent_chars = 0

    def push(self, token_ids: Iterable[int]) -> str:
        """Adds tokens; returns the text that may be shown now."""
        for token_id in token_ids:
            self._detokenizer.append(token_id)
        visible = max(len(self._detokenizer.text) - self._holdback_chars, self._sent_chars)
        return self._take(visible)

    def finish(self, finish_reason: str | None, token_ids: Iterable[int] = ()) -> str:
        """The rest of the text, with the last chunk's `token_ids`, ending before the stop string if one
        ended the request (after it with include_stop). The last tokens must come here, not through
        `push`: the token that completes a stop string may carry more characters after it, which `push`
        would already release."""
        for token_id in token_ids:
            self._detokenizer.append(token_id)
        text = self._final_text()
        end = len(text)
        if finish_reason == "stop" and self._stop:
            hits = [(i, len(s)) for s, i in ((s, text.find(s, self._sent_chars)) for s in self._stop) if i >= 0]
            if hits:
                index, length = min(hits)
                end = index + length * self._include_stop
        return self._take(end, text)

    def _final_text(self) -> str:
        """All text, including a trailing incomplete character the incremental decoder still holds."""
        detokenizer = self._detokenizer
        full = detokenizer.tokenizer.decode(detokenizer.token_ids, skip_special_tokens=detokenizer.skip_special_tokens)
        sent = detokenizer.text[: self._sent_chars]
        return full if full.startswith(sent) else detokenizer.text

    def _take(self, end: int, text: str | None = None) -> str:
        text = self._detokenizer.text if text is None else text
        delta = text[self._sent_chars : end]
        self._sent_chars = max(end, self._sent_chars)
        return delta
