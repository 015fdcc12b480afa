"""splitserve's own schemathesis checks, loaded by `st run` as its hooks module (see `http_fuzz.run_fuzz`).

They replace the built-in positive-data check (a valid body may still be refused for a rule the schema
cannot state, and only for one the document lists) and add what the built-in ones do not hold the HTTP
front to: every 400 names a documented field (or, in a body that admits no other field, the unknown one
it got), a 504 comes only from the body's own `timeout_ms`, and no
response carries JSON that only Python reads (NaN, Infinity).
"""

from __future__ import annotations

import json
import re

import schemathesis

from router.openai.openapi import SERVER_RULES_KEY

_FIELD_HEAD = re.compile(r"[.\[]")


def _head(param: str) -> str:
    """The top-level field a param names: `messages[0].role` → `messages`."""
    return _FIELD_HEAD.split(param, maxsplit=1)[0]


def _documented(case) -> set[str]:
    raw = case.operation.definition.raw
    body = raw.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
    fields = {name for branch in [body, *body.get("anyOf", [])] for name in branch.get("properties", {})}
    if body.get("additionalProperties") is False and isinstance(case.body, dict):
        fields |= set(case.body)  # a body that admits no other field: a 400 names the unknown one it got
    return fields | {p["name"] for p in raw.get("parameters", [])} | {"body"}


def _media_type(response) -> str:
    values = response.headers.get("content-type") or [""]
    return values[0].split(";")[0].strip().lower()


@schemathesis.check
def bad_requests_name_a_documented_field(ctx, response, case):
    if response.status_code != 400:
        return None
    error = json.loads(response.content)["error"]
    param = error["param"]
    assert param is not None, f"a 400 that names no field: {error['message']!r}"
    assert _head(param) in _documented(case), f"a 400 naming {param!r}, which the document does not describe"
    assert error["message"].startswith(f"{param}:"), f"the message does not lead with {param!r}: {error['message']!r}"
    if case.meta is not None and case.meta.generation.mode.is_positive:
        rules = case.operation.definition.raw.get(SERVER_RULES_KEY, {})
        assert _head(param) in rules, (
            f"a body the document accepts was refused for {param!r} ({error['message']!r}), and the document lists "
            f"no rule for that field under {SERVER_RULES_KEY}"
        )
    return True


@schemathesis.check
def deadline_only_when_asked(ctx, response, case):
    if response.status_code != 504:
        return None
    asked = isinstance(case.body, dict) and case.body.get("timeout_ms") is not None
    assert asked, "a 504 for a request that set no timeout_ms"
    return True


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


@schemathesis.check
def strict_json(ctx, response, case):
    media_type = _media_type(response)
    if media_type == "application/json":
        json.loads(response.content, parse_constant=_no_constant)
    elif media_type == "text/event-stream":
        for line in response.content.splitlines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                json.loads(line[len(b"data: ") :], parse_constant=_no_constant)
    else:
        return None
    return True
