"""OpenAI's response shapes: a streamed chunk, a non-streaming choice and body, the usage object."""

from __future__ import annotations

import time
from typing import Any

from pdfabric.router.front import openai_api as api
from pdfabric.router.front import tool_calls


def chunk(
    req: api.ParsedRequest,
    request_id: str,
    created: int,
    text: str | None,
    finish_reason: str | None,
    first: bool = False,
    token_ids: tuple[int, ...] = (),
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One streamed chunk of choice ``index``; ``logprobs``: its tokens' block (``front/logprobs.py``);
    ``tool_calls``: its ``delta.tool_calls`` entries (``front/tool_calls.py``)."""
    if req.chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice: dict[str, Any] = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    if req.return_token_ids:
        choice["token_ids"] = list(token_ids)
    return {"id": request_id, "object": obj, "created": created, "model": req.model, "choices": [choice]}


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens whose KV came from the prefix cache."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if extra:
        out.update(extra)
    return out


def choice_body(
    req: api.ParsedRequest,
    index: int,
    text: str,
    finish_reason: str,
    token_ids: list[int],
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One choice of a non-streaming response (a chat reply's tool calls in its ``message``, when the
    request offered tools)."""
    if req.chat:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if req.tools:
            message, calls = tool_calls.message(text)
            finish_reason = tool_calls.finish_reason(finish_reason, calls)
        choice: dict[str, Any] = {
            "index": index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
    else:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if req.return_token_ids:
        choice["token_ids"] = token_ids
    return choice


def full_response(
    req: api.ParsedRequest,
    request_id: str,
    created: int,
    choices: list[dict[str, Any]],
    usage_: dict[str, Any],
) -> dict[str, Any]:
    """The body of a non-streaming response."""
    return {
        "id": request_id,
        "object": "chat.completion" if req.chat else "text_completion",
        "created": created,
        "model": req.model,
        "choices": choices,
        "usage": usage_,
    }


def now() -> int:
    return int(time.time())
