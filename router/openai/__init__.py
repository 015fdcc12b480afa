"""The OpenAI-compatible HTTP API of the router (`/v1/completions`, `/v1/chat/completions`, `/v1/models`,
`/health`, `/metrics`): a thin front over the same `RouterService` as gRPC. See `front`."""

from router.openai.front import HttpFront

__all__ = ["HttpFront"]
