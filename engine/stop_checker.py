"""Decides, after each sampled token, whether a sequence is done and why."""

from __future__ import annotations

from engine.sequence import FinishReason, Sequence
from engine.tokenizer import IncrementalDetokenizer, find_stop_string, load_tokenizer


def hides_stop_token(finish_reason: str | None, text_end_chars: int | None, include_stop_str_in_output: bool) -> bool:
    """Whether the output text leaves out the last token: the EOS or stop token id that ended the request
    (a stop string ends the text at `text_end_chars` instead). Its id stays in the token ids; its text
    shows only with `include_stop_str_in_output`, as vLLM renders it, so `skip_special_tokens: false`
    never ends a completion with the EOS token's text (which would read as content to a tool-call parser)."""
    return finish_reason == FinishReason.STOP.value and text_end_chars is None and not include_stop_str_in_output


class StopChecker:
    """EOS (unless ignore_eos), stop token ids, stop strings (after min_tokens), max_tokens, and the
    model's length limit. The tokenizer is loaded only when a request uses stop strings."""

    def __init__(self, model_dir: str, eos_token_ids: tuple[int, ...], max_model_len: int):
        self.model_dir = model_dir
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self._tokenizer = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.model_dir)
        return self._tokenizer

    def check(self, seq: Sequence, token: int) -> FinishReason | None:
        params = seq.params
        if not params.ignore_eos and token in self.eos_token_ids:
            return FinishReason.STOP
        if token in params.stop_token_ids:
            return FinishReason.STOP
        if params.stop and self._hit_stop_string(seq, token):
            return FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _hit_stop_string(self, seq: Sequence, token: int) -> bool:
        if seq.detokenizer is None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.params.skip_special_tokens)
            for earlier in seq.output_token_ids[:-1]:  # adopted sequences arrive with a first token
                seq.detokenizer.append(earlier)
        delta = seq.detokenizer.append(token)
        if not delta or seq.num_output_tokens <= seq.params.min_tokens:
            return False
        hit = find_stop_string(seq.detokenizer.text, len(delta), seq.params.stop)
        if hit is None:
            return False
        index, stop = hit
        # The stop string itself is not part of the output unless the request asked for it.
        seq.stop_text = seq.detokenizer.text[: index + len(stop) * seq.params.include_stop_str_in_output]
        return True
