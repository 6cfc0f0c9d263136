"""A request's input: completion prompts (text or token ids, one or a batch) and chat messages (text
content, an assistant's tool calls, tool results), each checked with a 400 naming the field."""

from __future__ import annotations

import json
from typing import Any

from pdfabric.router.errors import bad
from pdfabric.router.front.fields import token_ids

MAX_PROMPTS = 64  # prompts in one completions request


def prompts(
    body: dict[str, Any], vocab_size: int, name: str = "prompt", most: int = MAX_PROMPTS
) -> tuple[str | tuple[int, ...], ...]:
    """The completion prompts (or another field of that shape, ``name``: the embedding ``input``): a
    string, an array of token ids, or an array of at most ``most`` of either (a batch)."""
    if name not in body or body[name] is None:
        raise bad(f"'{name}' is required", name)
    prompt = body[name]
    batch = isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)
    if not batch:
        return (_one_prompt(prompt, name, vocab_size, name),)
    if len(prompt) > most:
        raise bad(f"'{name}' holds {len(prompt)} items; at most {most} are allowed", name)
    return tuple(_one_prompt(p, f"{name}[{i}]", vocab_size, name) for i, p in enumerate(prompt))


def _one_prompt(prompt: Any, where: str, vocab_size: int, name: str) -> str | tuple[int, ...]:
    if isinstance(prompt, str):
        if not prompt:
            raise bad(f"'{where}' must not be empty", name)
        return prompt
    ids = token_ids(prompt) if isinstance(prompt, list) else None
    if ids is not None and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        if not ids:
            raise bad(f"'{where}' must not be empty", name)
        out_of_range = [t for t in ids if not 0 <= t < vocab_size]
        if out_of_range:
            raise bad(
                f"'{where}' holds token id {out_of_range[0]} outside the vocabulary (0..{vocab_size - 1})",
                name,
            )
        return tuple(ids)
    raise bad(f"'{where}' must be a string or an array of token ids (or '{name}' an array of those)", name)


def messages(body: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    """Each message's ``role`` and ``content`` (text, or text parts joined); an assistant message's
    ``tool_calls`` as (name, arguments JSON text) pairs, its content then optional."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"'{where}' must be an object with a string 'role'", where)
        calls = _tool_calls(m, where)  # checked whatever the role; only an assistant's are used
        calls = calls if m["role"] == "assistant" else ()
        content = m.get("content")
        if content is None and calls:
            content = ""
        if isinstance(content, list):  # content parts: text only
            parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(parts) != len(content) or not all(isinstance(p, str) for p in parts):
                raise bad(f"'{where}.content' parts must all be text", f"{where}.content")
            content = "".join(parts)
        if not isinstance(content, str):
            raise bad(f"'{where}.content' must be a string", f"{where}.content")
        message: dict[str, Any] = {"role": m["role"], "content": content}
        if calls:
            message["tool_calls"] = calls
        out.append(message)
    return tuple(out)


def _tool_calls(message: dict[str, Any], where: str) -> tuple[tuple[str, str], ...]:
    """An assistant message's ``tool_calls``: (function name, arguments as JSON text) each."""
    calls = message.get("tool_calls")
    if calls is None:
        return ()
    param = f"{where}.tool_calls"
    if not isinstance(calls, list):
        raise bad(f"'{param}' must be an array", param)
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        arguments = fn.get("arguments", "{}") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name or not isinstance(arguments, str):
            raise bad(
                f'\'{param}[{j}]\' must be {{"type": "function", "function": {{"name": string, '
                f'"arguments": string}}}}',
                param,
            )
        try:
            parsed = json.loads(arguments)
        except ValueError:
            raise bad(f"'{param}[{j}].function.arguments' must be JSON text", param) from None
        out.append((name, json.dumps(parsed)))
    return tuple(out)
