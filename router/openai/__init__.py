"""The OpenAI-compatible HTTP API of the router (`/v1/completions`, `/v1/chat/completions`, `/v1/responses`,
`/v1/models`, vLLM's `/tokenize`, `/detokenize` and `/version`, `/health`, `/metrics`): a thin front over
the same `RouterService` as gRPC. See `front`; chat's tools are `tools`, its reasoning split `reasoning`,
how a choice's text becomes message parts `tool_stream`, and the Responses API `responses_parse` (the body
into a chat request) and `responses` (its objects and events)."""

from router.openai.front import HttpFront

__all__ = ["HttpFront"]
