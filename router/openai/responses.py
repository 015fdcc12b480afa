"""Router outputs → OpenAI's Responses objects: the whole `response`, or its server-sent events.

The request is parsed by `router.openai.responses_parse` (a chat request underneath); each output's text
goes through chat's split (`router.openai.tool_stream.ChatOutput`: reasoning, content, tool calls) and
becomes output items in the order they appear: a `reasoning` item (with `--reasoning-parser`), a
`message` item with one `output_text` part, a `function_call` item per call. An item is finished when
the next one starts or the response ends. The whole response is built by the same steps as the stream
(one step per router output), so a stream's events reassemble to exactly the whole response.

A stream is `event: TYPE` / `data: JSON` pairs, each with a rising `sequence_number`:
`response.created`, `response.in_progress`, then per item `response.output_item.added`, its parts
(`response.content_part.added`, `response.output_text.delta` ... `.done`, `response.content_part.done`;
`response.reasoning_text.*` for reasoning; `response.function_call_arguments.delta` ... `.done` for
calls) and `response.output_item.done`, and last `response.completed` carrying the whole response. A
response cut by `max_output_tokens` has status `incomplete` (`incomplete_details.reason`
`max_output_tokens`) and still ends with `response.completed`, as vLLM sends it (the SDK's stream helper
reads the final response from that event). A failure after the 200 is an `error` event, then
`response.failed`.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from router.openai.errors import HttpError
from router.openai.responses_parse import ResponsesApiRequest
from router.openai.tool_stream import ChatOutput
from router.service_types import RouterOutput

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
_ITEM_PREFIXES = {"reasoning": "rs_", "message": "msg_", "function_call": "fc_"}
# The error table's code → the one a failed response's `error.code` may carry (OpenAI's fixed set).
_FAILED_CODES = {"overloaded": "rate_limit_exceeded", "invalid_value": "invalid_prompt"}


@dataclass
class _Item:
    """One output item while it is produced."""

    kind: str  # "reasoning", "message" or "function_call"
    id: str
    index: int  # in the response's output
    text: str = ""  # reasoning or message text; a call's arguments
    name: str = ""  # a call's function
    call_id: str = ""
    status: str = "in_progress"  # "completed" or "incomplete" once finished

    @property
    def done(self) -> bool:
        return self.status != "in_progress"

    def json(self, status: str) -> dict[str, Any]:
        if self.kind == "function_call":
            return {
                "type": "function_call",
                "id": self.id,
                "call_id": self.call_id,
                "name": self.name,
                "arguments": self.text,
                "status": status,
            }
        if self.kind == "reasoning":
            content = [_part("reasoning", self.text)] if status != "in_progress" else []
            return {"type": "reasoning", "id": self.id, "summary": [], "content": content, "status": status}
        content = [_part("message", self.text)] if status != "in_progress" else []
        return {"type": "message", "id": self.id, "role": "assistant", "status": status, "content": content}


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponsesRenderer:
    """Follows one response (the request has one choice) and writes its JSON or its events."""

    def __init__(self, api: ResponsesApiRequest, tokenizer, created_s: float | None = None):
        self.api = api
        self.id = "resp_" + api.request_id
        self._created_s = time.time() if created_s is None else created_s
        self._parsed = None if api.output is None else ChatOutput(api.output)
        self._items: list[_Item] = []
        self._calls: dict[int, _Item] = {}  # chat's call index → its item
        self._sequence = 0
        self._started = False
        self._finish_reason: str | None = None
        self._output_tokens = self._reasoning_tokens = self._cached_tokens = 0

    # ---- the front's renderer interface ----

    def chunk(self, position: int, output: RouterOutput) -> bytes:
        """The events one router output brings (the opening ones before the first, the closing ones after
        the last)."""
        events: list[dict] = []
        if not self._started:
            self._started = True
            events += [self._lifecycle("response.created"), self._lifecycle("response.in_progress")]
        events += self._step(output)
        if output.finish_reason:
            events.append(self._lifecycle("response.completed"))
        return b"".join(self._encode(event) for event in events)

    def add(self, position: int, output: RouterOutput) -> None:
        """Accounts one output of a response answered whole."""
        self._step(output)

    def response(self) -> bytes:
        return _dumps(self._response()).encode()

    def closing(self) -> bytes:
        """What ends a stream after its last output: nothing more once `response.completed` is out."""
        if self._finish_reason is not None:
            return b""
        events = self._finish("stop")
        return b"".join(self._encode(e) for e in [*events, self._lifecycle("response.completed")])

    def failure(self, error: HttpError) -> bytes:
        """A failure after the 200: OpenAI's `error` event, then `response.failed`."""
        detail = json.loads(error.body)["error"]
        code, message = detail["code"], detail["message"]
        events = [
            {"type": "error", "code": code, "message": message, "param": detail["param"]},
            self._lifecycle(
                "response.failed", error={"code": _FAILED_CODES.get(code, "server_error"), "message": message}
            ),
        ]
        return b"".join(self._encode(event) for event in events)

    # ---- steps ----

    def _step(self, output: RouterOutput) -> list[dict]:
        self._output_tokens += len(output.token_ids)
        text, final = output.text, bool(output.finish_reason)
        delta: dict = {"content": text} if text else {}
        if self._parsed is not None:
            delta = self._parsed.delta(text, final)
        events = self._delta(delta)
        if self._open("reasoning") is not None:  # tokens after which the model is still reasoning
            self._reasoning_tokens += len(output.token_ids)
        if final:
            events += self._finish(output.finish_reason)
            if output.usage is not None:
                self._cached_tokens = output.usage.cached_prompt_tokens
        return events

    def _delta(self, delta: dict) -> list[dict]:
        events: list[dict] = []
        if delta.get("reasoning_content"):
            item = self._open("reasoning") or self._start("reasoning", events)
            events.append(self._text_delta(item, delta["reasoning_content"]))
        if delta.get("content"):
            item = self._open("message") or self._start("message", events)
            events.append(self._text_delta(item, delta["content"]))
        for call in delta.get("tool_calls", []):
            function = call.get("function", {})
            if call["index"] not in self._calls:
                item = self._start("function_call", events, name=function.get("name", ""), call_id=call.get("id", ""))
                self._calls[call["index"]] = item
            item = self._calls[call["index"]]
            if function.get("arguments"):
                item.text += function["arguments"]
                events.append(self._event("response.function_call_arguments.delta", item, delta=function["arguments"]))
        return events

    def _open(self, kind: str) -> _Item | None:
        """The last item if it is of this kind and still open."""
        last = self._items[-1] if self._items else None
        return last if last is not None and last.kind == kind and not last.done else None

    def _start(self, kind: str, events: list[dict], **fields) -> _Item:
        """Finishes the open item and starts a new one."""
        if self._items and not self._items[-1].done:
            events += self._close(self._items[-1], "completed")
        item = _Item(kind, _ITEM_PREFIXES[kind] + uuid.uuid4().hex[:24], len(self._items), **fields)
        self._items.append(item)
        events.append(
            {"type": "response.output_item.added", "output_index": item.index, "item": item.json("in_progress")}
        )
        if kind != "function_call":
            events.append(self._event("response.content_part.added", item, content_index=0, part=_part(kind, "")))
        return item

    def _text_delta(self, item: _Item, text: str) -> dict:
        item.text += text
        kind = "reasoning_text" if item.kind == "reasoning" else "output_text"
        extra: dict = {} if item.kind == "reasoning" else {"logprobs": []}
        return self._event(f"response.{kind}.delta", item, content_index=0, delta=text, **extra)

    def _close(self, item: _Item, status: str) -> list[dict]:
        item.status = status
        if item.kind == "function_call":
            events = [self._event("response.function_call_arguments.done", item, name=item.name, arguments=item.text)]
        else:
            kind = "reasoning_text" if item.kind == "reasoning" else "output_text"
            extra: dict = {} if item.kind == "reasoning" else {"logprobs": []}
            events = [
                self._event(f"response.{kind}.done", item, content_index=0, text=item.text, **extra),
                self._event("response.content_part.done", item, content_index=0, part=_part(item.kind, item.text)),
            ]
        events.append({"type": "response.output_item.done", "output_index": item.index, "item": item.json(status)})
        return events

    def _finish(self, finish_reason: str | None) -> list[dict]:
        self._finish_reason = finish_reason or "stop"
        events: list[dict] = []
        if not self._items:  # nothing generated: an empty message, so output_text is ""
            self._start("message", events)
        status = "incomplete" if self._finish_reason == "length" else "completed"
        for item in self._items:
            if not item.done:
                events += self._close(item, status)
        return events

    # ---- objects ----

    def _response(self, error: dict | None = None) -> dict:
        if error is not None:
            status = "failed"
        elif self._finish_reason is None:
            status = "in_progress"
        else:
            status = "incomplete" if self._finish_reason == "length" else "completed"
        done = status in ("completed", "incomplete")
        prompt_tokens = len(self.api.choices[0].request.prompt_token_ids)
        return {
            "id": self.id,
            "object": "response",
            "created_at": int(self._created_s),
            "status": status,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.api.model,
            # The opening events carry no items yet (each comes with its own added event).
            "output": [item.json(item.status) for item in self._items] if done or error is not None else [],
            **self.api.echo.to_json(),
            "previous_response_id": None,
            "store": False,
            "background": False,
            "truncation": "disabled",
            "usage": self._usage(prompt_tokens) if done else None,
        }

    def _usage(self, prompt_tokens: int) -> dict:
        return {
            "input_tokens": prompt_tokens,
            # cache_write_tokens is OpenAI's explicit prompt caching, which has no counterpart here.
            "input_tokens_details": {"cached_tokens": self._cached_tokens, "cache_write_tokens": 0},
            "output_tokens": self._output_tokens,
            "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens},
            "total_tokens": prompt_tokens + self._output_tokens,
        }

    def _lifecycle(self, kind: str, error: dict | None = None) -> dict:
        return {"type": kind, "response": self._response(error)}

    @staticmethod
    def _event(kind: str, item: _Item, **fields) -> dict:
        return {"type": kind, "item_id": item.id, "output_index": item.index, **fields}

    def _encode(self, event: dict) -> bytes:
        event["sequence_number"] = self._sequence
        self._sequence += 1
        return f"event: {event['type']}\ndata: {_dumps(event)}\n\n".encode()
