"""One request's progress while it streams: token counts, text, timings, and the figures it ends with."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

from engine.stop_checker import hides_stop_token
from router.migration import Migrations
from router.text_stream import TextStream
from router.validation import RouterRequest


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


class StreamState:
    def __init__(self, request: RouterRequest, tokenizer, started_s: float, migration_limit: int):
        self.request, self.started_s = request, started_s
        params = request.params
        self.text = TextStream(tokenizer, params.stop, params.skip_special_tokens) if request.return_text else None
        self.token_ids: list[int] = []  # every token streamed so far (a migration resumes after them)
        self.migrations = Migrations(migration_limit)  # attempts after the first (router/migration.py)
        self.call_tag = secrets.token_hex(3)  # this router call's, in every attempt id (see attempt_id)
        self.upstream_s = 0.0  # time spent waiting on the cluster, over the attempts that ended
        self.cached_tokens = 0
        self.finished = False  # the last chunk (with its finish reason) arrived
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None

    @property
    def attempt_id(self) -> str:
        """The current attempt's id on the workers, unique to this router call and attempt: a worker refuses
        an id it cancelled for a while (a hand-off that arrives after its cancel), so a client's retry of the
        request id, or a migration, must never reuse an earlier attempt's."""
        moved = self.migrations.total
        return f"{self.request.request_id}~{self.call_tag}" + (f"m{moved}" if moved else "")

    @property
    def started(self) -> bool:
        return self.first_token_s is not None

    def add(self, chunk) -> tuple[str, Usage | None]:
        """Accounts one cluster chunk; returns its text delta and, on the last chunk, the usage."""
        now_s = time.perf_counter()
        if self.first_token_s is None:
            self.first_token_s = now_s
            self.cached_tokens = chunk.num_cached_tokens
        self.last_token_s = now_s
        self.token_ids.extend(chunk.token_ids)
        delta = ""
        if self.text is not None:
            if chunk.finish_reason:
                hide_last = hides_stop_token(
                    chunk.finish_reason, chunk.text_end_chars, self.request.params.include_stop_str_in_output
                )
                delta = self.text.finish(chunk.token_ids, chunk.text_end_chars, hide_last)
            else:
                delta = self.text.push(chunk.token_ids)
        usage = None
        if chunk.finish_reason:
            self.finished = True
            usage = Usage(len(self.request.prompt_token_ids), self.num_tokens, self.cached_tokens)
        return delta, usage

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.started_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None with fewer than two tokens)."""
        if self.num_tokens < 2 or self.first_token_s is None or self.last_token_s is None:
            return None
        return (self.last_token_s - self.first_token_s) / (self.num_tokens - 1)

    @property
    def duration_s(self) -> float:
        return (self.last_token_s or time.perf_counter()) - self.started_s
