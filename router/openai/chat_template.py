"""Chat messages → prompt text, with the checkpoint's own chat template (Hugging Face's Jinja format).

A message is `{"role": str, "content": str | [{"type": "text", "text": str}, ...] | null}`; text parts
are joined with newlines (as vLLM does); any other part (images, audio) is refused, naming it. A role
is one of OpenAI's (`ROLES`, which the OpenAPI document lists as an enum); any other is a 400 naming
`messages[i].role`. Which roles may follow which is the template's business: a template that rejects a
conversation (raising in Jinja) gets a 400 naming `messages` with the template's own message. A
checkpoint without a template cannot chat.
"""

from __future__ import annotations

from typing import NoReturn

from engine.errors import InvalidRequestError

MAX_MESSAGES = 4096
# OpenAI's chat roles ("function" is the legacy form of "tool"); messages carry role and content only.
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def render_chat(messages, tokenizer, add_generation_prompt: bool = True) -> str:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        _fail("messages", "the served model has no chat template; use /v1/completions with a prompt")
    conversation = [_message(m, i) for i, m in enumerate(_messages(messages))]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as err:  # noqa: BLE001 - the template's own checks (e.g. roles must alternate) raise from Jinja
        _fail("messages", f"the model's chat template rejected the conversation: {err}")
    if not isinstance(text, str):
        _fail("messages", "the model's chat template did not render to text")
    return text


def _messages(messages) -> list:
    if not isinstance(messages, list) or not messages:
        _fail("messages", "must be a non-empty list of messages")
    if len(messages) > MAX_MESSAGES:
        _fail("messages", f"at most {MAX_MESSAGES} messages")
    return messages


def _message(message, index: int) -> dict:
    field = f"messages[{index}]"
    if not isinstance(message, dict):
        _fail(field, "must be an object with role and content")
    role = message.get("role")
    if role not in ROLES:  # a non-string too: JSON has no value equal to a role but the string itself
        _fail(f"{field}.role", f"must be one of {', '.join(ROLES)}")
    return {"role": role, "content": _content(message.get("content"), f"{field}.content")}


def _content(content, field: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        _fail(field, "must be a string or a list of content parts")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            _fail(f"{field}[{i}]", 'only text parts ({"type": "text", "text": ...}) are supported')
        texts.append(part["text"])
    return "\n".join(texts)


def _fail(field: str, message: str) -> NoReturn:
    raise InvalidRequestError(field, message)
