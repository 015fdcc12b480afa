"""Incremental detokenization: the tokenizers library's `DecodeStream` vs the hand-written window decoder
(two `tokenizer.decode` calls per token), on the same token streams, same run.

    .venv/bin/python -m benchmarks.detokenize [--model DIR] [--streams 200] [--tokens 256]

Streams are random ids of the checkpoint's vocabulary (special tokens included, so skipping them is
exercised, and byte tokens that split UTF-8 characters), plus the tokenization of real text. Each
decoder's deltas are joined and checked against `tokenizer.decode(all ids)`; the time per token is
the best of `--repeats` passes. The hand-written decoder is re-implemented here as it was, as the baseline.
"""

from __future__ import annotations

import argparse
import random
import time

from engine.tokenizer import IncrementalDetokenizer, load_tokenizer

REPLACEMENT_CHAR = "\ufffd"


class WindowDetokenizer:
    """The former hand-written decoder: decode a short window with and without the newest token."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = self._read_offset = 0

    def append(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        decode = self.tokenizer.decode
        prefix_text = decode(self.token_ids[self._prefix_offset : self._read_offset], skip_special_tokens=self.skip)
        full_text = decode(self.token_ids[self._prefix_offset :], skip_special_tokens=self.skip)
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = full_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        self.text += delta
        return delta


def _streams(tokenizer, count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = len(tokenizer)
    streams = [[rng.randrange(vocab) for _ in range(length)] for _ in range(count - 1)]
    text = "Streaming text, with accents (é, ü), CJK 漢字 and emoji 🚀, detokenized one token at a time. " * 8
    streams.append(tokenizer.encode(text, add_special_tokens=False)[:length])
    return streams


def _time_per_token_us(make, streams, repeats: int) -> float:
    best = float("inf")
    tokens = sum(len(s) for s in streams)
    for _ in range(repeats):
        started = time.perf_counter()
        for stream in streams:
            decoder = make()
            for token_id in stream:
                decoder.append(token_id)
        best = min(best, time.perf_counter() - started)
    return best / tokens * 1e6


def _mismatches(make, tokenizer, streams) -> int:
    """Streams whose joined deltas (plus what `finish` flushes) differ from decoding all ids at once."""
    bad = 0
    for stream in streams:
        decoder = make()
        text = "".join(decoder.append(t) for t in stream)
        full = tokenizer.decode(stream, skip_special_tokens=True)
        bad += not full.startswith(text)
    return bad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint directory (default: the demo model)")
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.model is None:
        from engine.demo_model import ensure_demo_model

        args.model = str(ensure_demo_model())
    tokenizer = load_tokenizer(args.model)
    streams = _streams(tokenizer, args.streams, args.tokens, seed=0)
    arms = {
        "hand-written window decoder": lambda: WindowDetokenizer(tokenizer),
        "DecodeStream (engine.tokenizer)": lambda: IncrementalDetokenizer(tokenizer),
    }
    base = None
    print(f"{args.streams} streams x {args.tokens} tokens, {args.model}")
    for name, make in arms.items():
        us = _time_per_token_us(make, streams, args.repeats)
        base = base or us
        print(
            f"{name:<34}{us:>8.2f} µs/token  x{us / base:.2f}  prefix mismatches: "
            f"{_mismatches(make, tokenizer, streams)}/{len(streams)}"
        )


if __name__ == "__main__":
    main()
