"""Tokenizer loading and incremental detokenization (for streaming text and stop strings)."""
from __future__ import annotations

from pathlib import Path

from engine.errors import UnsupportedModelError

REPLACEMENT_CHAR = "\ufffd"


def load_tokenizer(model_dir: str | Path):
    """The checkpoint's fast tokenizer (`tokenizer.json`), loaded offline."""
    model_dir = Path(model_dir)
    if not (model_dir / "tokenizer.json").is_file():
        raise UnsupportedModelError(f"checkpoint directory {model_dir} has no tokenizer.json")
    from transformers import AutoTokenizer  # heavy import, only where text is needed

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    Decoding one token at a time breaks multi-byte characters and merges that depend on neighbours, so
    each delta is the difference between decoding a short window that ends at the newest token and the
    same window without the newest tokens; text is held back while it ends in an incomplete character.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, token_id: int) -> str:
        """Adds one token; returns the newly completed text (possibly empty)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self.token_ids[self._prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = full_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self.text += delta
        return delta


def find_stop_string(text: str, delta_len: int, stops: tuple[str, ...]) -> int | None:
    """Index in `text` where the earliest stop string that the last `delta_len` characters completed
    begins, or None. Only the tail is searched: earlier text was checked on earlier tokens."""
    best = None
    for stop in stops:
        window_start = max(0, len(text) - delta_len - len(stop) + 1)
        index = text.find(stop, window_start)
        if index != -1 and (best is None or index < best):
            best = index
    return best
