"""Streamed text for one request: incremental detokenization that never shows a stop string.

Stop strings have one owner, the engine's stop checker (engine/stop_checker.py): it decides that one
ended the request and where the output text ends, and that position arrives with the last chunk
(`text_end_chars`). This module only renders. Text is held back by (longest stop string − 1)
characters while streaming, so a stop string that completes in a later delta has not been sent; at the
end the held-back text is released up to where the engine cut it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from engine.tokenizer import IncrementalDetokenizer


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True):
        self._detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self._holdback_chars = max((len(s) for s in stop), default=1) - 1
        self._sent_chars = 0

    def push(self, token_ids: Iterable[int]) -> str:
        """Adds tokens; returns the text that may be shown now."""
        for token_id in token_ids:
            self._detokenizer.append(token_id)
        visible = max(len(self._detokenizer.text) - self._holdback_chars, self._sent_chars)
        return self._take(visible)

    def finish(self, token_ids: Sequence[int] = (), text_end_chars: int | None = None, hide_last: bool = False) -> str:
        """The rest of the text, with the last chunk's `token_ids`, ending where the engine cut it when a stop
        string ended the request (`text_end_chars`). The last tokens must come here, not through `push`: the
        token that completes a stop string may carry more characters after it, which `push` would release.
        `hide_last`: the last token is the stop token that ended the request, not rendered
        (engine.stop_checker.hides_stop_token)."""
        for token_id in token_ids[:-1] if hide_last else token_ids:
            self._detokenizer.append(token_id)
        text = self._final_text()
        end = len(text) if text_end_chars is None else text_end_chars
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
