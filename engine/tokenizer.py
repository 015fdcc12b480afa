"""Tokenizer loading and incremental detokenization (for streaming text and stop strings)."""

from __future__ import annotations

from pathlib import Path

from engine.errors import UnsupportedModelError


def load_tokenizer(model_dir: str | Path):
    """The checkpoint's fast tokenizer (`tokenizer.json`), loaded offline."""
    model_dir = Path(model_dir)
    if not (model_dir / "tokenizer.json").is_file():
        raise UnsupportedModelError(f"checkpoint directory {model_dir} has no tokenizer.json")
    from transformers import AutoTokenizer  # heavy import, only where text is needed

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas, with the tokenizers library's
    streaming decoder (`DecodeStream`): it decodes a short window ending at the newest token and holds
    text back while it ends in an incomplete character. Measured ~6x faster per token than the
    hand-written window decoder it replaced (benchmarks/detokenize.py)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def append(self, token_id: int) -> str:
        """Adds one token; returns the newly completed text (possibly empty)."""
        self.token_ids.append(token_id)
        delta = self._stream.step(self._backend, token_id)
        if not delta:
            return ""
        self.text += delta
        return delta


def find_stop_string(text: str, delta_len: int, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """(index in `text`, the stop string) of the earliest stop string that the last `delta_len`
    characters completed, or None. Only the tail is searched: earlier text was checked on earlier tokens."""
    best = None
    for stop in stops:
        window_start = max(0, len(text) - delta_len - len(stop) + 1)
        index = text.find(stop, window_start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best
