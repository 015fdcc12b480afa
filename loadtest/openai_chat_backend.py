"""The `openai-chat` bench backend: streams `POST /v1/chat/completions`, each planned prompt as one user
message, with what `--chat-format` asks (`loadtest.chat_formats`: plain text, required tool calls, a JSON
schema). Timing and error handling are the `openai` backend's.

Chat takes text, not token ids. Before the run (`prepare`) a plan's token-id prompts become text through
the server's `POST /detokenize`, then every prompt gets its tokens through `POST /tokenize` with the
messages it is sent as, so the plan's prompt lengths are what the server will prefill, chat template
included (both routes are vLLM's; splitserve's front serves them too).
"""

from __future__ import annotations

import asyncio
import dataclasses

import aiohttp

from loadtest.backends import BackendError, RequestOptions
from loadtest.chat_formats import CHAT_FORMATS
from loadtest.openai_backend import OpenAIBackend
from loadtest.plan import Plan, PlannedRequest

_PREPARE_CONCURRENCY = 16


class OpenAIChatBackend(OpenAIBackend):
    path = "/v1/chat/completions"

    def __init__(self, *args, chat_format: str = "plain", **kwargs):
        super().__init__(*args, **kwargs)
        if chat_format not in CHAT_FORMATS:
            raise ValueError(f"--chat-format must be one of {', '.join(CHAT_FORMATS)}, got {chat_format!r}")
        self.format = CHAT_FORMATS[chat_format]

    async def prepare(self, plan: Plan) -> Plan:
        """The plan with every prompt as text and its length in tokens as the server counts it."""
        slots = asyncio.Semaphore(_PREPARE_CONCURRENCY)

        async def one(planned: PlannedRequest) -> PlannedRequest:
            async with slots:
                if planned.prompt_text is None:
                    tokens = list(planned.prompt_token_ids)
                    reply = await self._post("/detokenize", {"model": self.model, "tokens": tokens})
                    planned = dataclasses.replace(planned, prompt_text=reply["prompt"])
                reply = await self._post("/tokenize", {"model": self.model, "messages": _messages(planned)})
                return dataclasses.replace(planned, prompt_token_ids=tuple(reply["tokens"]))

        requests = await asyncio.gather(*(one(planned) for planned in plan.requests))
        return dataclasses.replace(plan, requests=tuple(requests))

    async def _post(self, path: str, body: dict) -> dict:
        try:
            timeout = aiohttp.ClientTimeout(total=60)
            async with self._open().post(f"{self.base}{path}", json=body, timeout=timeout) as reply:
                if reply.status != 200:
                    raise BackendError(f"POST {self.base}{path} answered {reply.status}: {await reply.text()}")
                return await reply.json()
        except (aiohttp.ClientError, TimeoutError, ValueError) as err:
            raise BackendError(f"POST {self.base}{path} failed: {type(err).__name__}: {err}") from None

    def _body(self, planned: PlannedRequest, options: RequestOptions) -> dict:
        body = super()._body(planned, options)
        del body["prompt"]
        body["messages"] = _messages(planned)
        body["max_completion_tokens"] = body.pop("max_tokens")
        if not self.format.ignore_eos:
            del body["ignore_eos"]
        return {**body, **self.format.extras}


def _messages(planned: PlannedRequest) -> list[dict]:
    return [{"role": "user", "content": planned.prompt_text or ""}]
