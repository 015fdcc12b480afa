"""Router outputs → OpenAI's response JSON: whole responses, and the server-sent events of a stream.

Streamed chunks are on every token's path, so each is one string join around the parts that change
(the text, JSON-escaped by the C encoder); everything constant per stream is encoded once. A chunk
goes out per router output (one decode step of one choice), even when its text is empty (text held
back at a stop-string prefix or an incomplete character): clients and load testers then see every
step. `return_token_ids` (vLLM's extra field) adds each chunk's token ids. Completions with `echo` and
`logprobs` list the prompt's tokens first (what evaluation harnesses score: loglikelihood requests).
A chat request with tools or a reasoning parser has each choice's text split by
`router.openai.tool_stream.ChatOutput` (`reasoning_content`, `content`, `tool_calls`); with
`stream_options.continuous_usage_stats` every chunk carries the usage so far.
"""

from __future__ import annotations

import json
import time
from typing import Any

from router.openai.errors import HttpError
from router.openai.parse import ApiRequest, Choice
from router.openai.tool_stream import ChatOutput
from router.service_types import RouterOutput
from router.stream_state import Usage

DONE_EVENT = b"data: [DONE]\n\n"
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


class ChoiceState:
    """What one choice has produced so far (for the final response, logprobs offsets and usage)."""

    def __init__(self, choice: Choice):
        self.choice = choice
        self.texts: list[str] = [choice.echo] if choice.echo else []  # a whole response's text parts
        self.token_ids: list[int] = []
        self.logprobs: list = []  # rendered entries
        self.text_offset = len(choice.echo or "")
        self.finish_reason: str | None = None
        self.usage: Usage | None = None  # from the last output
        self.started = False


class Renderer:
    def __init__(self, api: ApiRequest, tokenizer, created_s: int | None = None):
        self.api, self.tokenizer = api, tokenizer
        self.chat = api.kind == "chat"
        created = int(time.time()) if created_s is None else created_s
        object_name = "chat.completion.chunk" if self.chat else "text_completion"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + api.request_id
        self._head = (
            f'data: {{"id":{_dumps(self.id)},"object":"{object_name}","created":{created},'
            f'"model":{_dumps(api.model)},"choices":[{{"index":'
        )
        self._tail = ',"usage":null}\n\n' if api.include_usage else "}\n\n"
        self._created = created
        self._token_texts: dict[int, str] = {}
        self.states = [ChoiceState(choice) for choice in api.choices]  # by position in api.choices
        parsing = api.output if self.chat else None
        self.outputs = None if parsing is None else [ChatOutput(parsing) for _ in api.choices]

    # ---- streaming ----

    def chunk(self, position: int, output: RouterOutput) -> bytes:
        """The event for one router output of the choice at `position` (and accounts it)."""
        state = self.states[position]
        text = self._account(state, output)
        if not state.started and state.choice.echo:
            text = state.choice.echo + text
        finish_reason = output.finish_reason
        if self.chat and self.outputs is not None:
            parsed = self.outputs[position]
            delta = _dumps(parsed.delta(text, bool(finish_reason)))[1:-1]
            role = '"role":"assistant"' if not state.started else ""
            body = f'"delta":{{{role}{"," if role and delta else ""}{delta}}}'
            finish_reason = parsed.finish_reason(finish_reason)
        elif self.chat:
            role = '"role":"assistant",' if not state.started else ""
            body = f'"delta":{{{role}"content":{_dumps(text)}}}'
        else:
            body = f'"text":{_dumps(text)}'
        state.started = True
        logprobs = self._logprobs_json(state, output) if self.api.logprobs is not None else "null"
        finish = f'"{finish_reason}"' if finish_reason else "null"
        ids = f',"token_ids":{_dumps(_shown(state, output.token_ids))}' if self.api.return_token_ids else ""
        tail = f',"usage":{_dumps(usage(self.states))}}}\n\n' if self.api.continuous_usage else self._tail
        return (
            f'{self._head}{state.choice.index},{body},"logprobs":{logprobs},"finish_reason":{finish}{ids}}}]{tail}'
        ).encode()

    def closing(self) -> bytes:
        """What ends a stream after its last output: the usage event (with include_usage), then [DONE]."""
        return (self.usage_event() if self.api.include_usage else b"") + DONE_EVENT

    def failure(self, error: HttpError) -> bytes:
        """A failure after the 200: the error as an event, then the usual end."""
        return error.event + DONE_EVENT

    def usage_event(self) -> bytes:
        """The last event with `stream_options.include_usage`: no choices, the whole request's usage."""
        return (f'{self._head[: self._head.rindex("[")]}[],"usage":{_dumps(usage(self.states))}}}\n\n').encode()

    # ---- whole responses ----

    def response(self) -> bytes:
        choices = []
        for position, state in enumerate(self.states):
            text = "".join(state.texts)
            choice: dict[str, Any] = {"index": state.choice.index}
            finish_reason = state.finish_reason
            if self.chat and self.outputs is not None:
                choice["message"] = self.outputs[position].message(text)
                finish_reason = self.outputs[position].finish_reason(finish_reason)
            elif self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choice["logprobs"] = self._logprobs_object(state) if self.api.logprobs is not None else None
            choice["finish_reason"] = finish_reason
            if self.api.return_token_ids:
                choice["token_ids"] = state.token_ids
                choice["prompt_token_ids"] = list(state.choice.request.prompt_token_ids)
            choices.append(choice)
        return _dumps(
            {
                "id": self.id,
                "object": "chat.completion" if self.chat else "text_completion",
                "created": self._created,
                "model": self.api.model,
                "choices": choices,
                "usage": usage(self.states),
            }
        ).encode()

    def add(self, position: int, output: RouterOutput) -> None:
        """Accounts one output of a request that is answered as a whole."""
        state = self.states[position]
        state.texts.append(self._account(state, output))
        if self.api.logprobs is not None:
            self._logprob_entries(state, output)

    # ---- shared ----

    def _account(self, state: ChoiceState, output: RouterOutput) -> str:
        state.token_ids.extend(_shown(state, output.token_ids))
        if output.finish_reason:
            state.finish_reason, state.usage = output.finish_reason, output.usage
        return "" if state.choice.echo_only else output.text

    def _logprobs_json(self, state: ChoiceState, output: RouterOutput) -> str:
        entries = self._logprob_entries(state, output)
        if self.chat:
            return _dumps({"content": entries})
        return _dumps(_completion_logprobs(entries))

    def _logprobs_object(self, state: ChoiceState):
        return {"content": state.logprobs} if self.chat else _completion_logprobs(state.logprobs)

    def _logprob_entries(self, state: ChoiceState, output: RouterOutput) -> list:
        entries: list[Any] = []  # chat: dicts; completions: tuples, folded later
        if output.prompt_logprobs is not None and state.choice.echo is not None:
            entries.extend(self._echo_entries(state.choice, output.prompt_logprobs))
        for token_id, lp in zip(_shown(state, output.token_ids), output.logprobs, strict=False):
            if lp is None:
                continue
            token = self._token_text(token_id)
            top = [(self._token_text(t), value) for t, value in lp.top]
            if self.chat:
                entries.append(
                    {
                        "token": token,
                        "logprob": lp.sampled_logprob,
                        "bytes": list(token.encode()),
                        "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in top],
                    }
                )
            else:
                entries.append((token, lp.sampled_logprob, dict(top), state.text_offset))
                state.text_offset += len(token)
        state.logprobs.extend(entries)
        return entries

    def _echo_entries(self, choice: Choice, prompt_logprobs: tuple) -> list:
        """Completions with echo and logprobs: the echoed prompt's entries, as OpenAI gives them (the first
        token has no logprob); their offsets run over the prompt's token texts."""
        first = self._token_text(choice.request.prompt_token_ids[0])
        entries: list[Any] = [(first, None, None, 0)]
        offset = len(first)
        for token_id, lp in prompt_logprobs:
            token = self._token_text(token_id)
            entries.append((token, lp.sampled_logprob, {self._token_text(t): v for t, v in lp.top}, offset))
            offset += len(token)
        return entries

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id]) if self.tokenizer else ""
        return text


def _shown(state: ChoiceState, token_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The generated tokens a choice shows: none for echo with max_tokens 0 (its one sampled token is
    not part of the answer)."""
    return () if state.choice.echo_only else token_ids


def _completion_logprobs(entries: list) -> dict:
    return {
        "tokens": [e[0] for e in entries],
        "token_logprobs": [e[1] for e in entries],
        "top_logprobs": [e[2] for e in entries],
        "text_offset": [e[3] for e in entries],
    }


def usage(states: list[ChoiceState]) -> dict:
    """OpenAI's usage: each prompt counted once (its first choice's figures), every choice's output."""
    prompt_tokens = cached = completion = 0
    seen_prompts = set()
    for state in states:
        completion += len(state.token_ids)
        if state.choice.prompt_index not in seen_prompts:
            seen_prompts.add(state.choice.prompt_index)
            prompt_tokens += len(state.choice.request.prompt_token_ids)
            cached += state.usage.cached_prompt_tokens if state.usage is not None else 0
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
