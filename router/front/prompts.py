"""A request's prompts as token ids, as the client sent them, and the room they leave for output."""

from __future__ import annotations

import json
from typing import Any

from pdfabric import structure
from pdfabric.engine.tokenizer import Tokenizer
from pdfabric.router.errors import ApiError, bad
from pdfabric.router.front import openai_api as api
from pdfabric.structure import Tool


def tokenize(tokenizer: Tokenizer, parsed: api.ParsedRequest) -> list[tuple[int, ...]]:
    """Each prompt's token ids (a chat request's one prompt, rendered by the chat template); a
    structured request's grammar is checked against the tokenizer first (a 400 naming the field)."""
    if parsed.grammar:
        param = "tools" if parsed.tools else "response_format"
        try:
            structure.check_for_tokenizer(parsed.grammar, tokenizer.grammar_tokenizer, param)
        except structure.StructureError as exc:
            raise bad(str(exc), exc.param) from None
    if parsed.chat:
        try:
            if parsed.tools and tokenizer.renders_tool_calls:  # the template writes the tool format itself
                messages, tools = for_template(parsed.messages or ()), offered(parsed.tools)
            else:
                messages, tools = with_tools(parsed.messages or (), parsed.tools), None
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
        except ValueError as exc:
            raise bad(str(exc), "messages") from None
        ids = tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise bad("the prompt encodes to no tokens", "messages")
        return [tuple(ids)]
    out = []
    for prompt in parsed.prompts:
        if isinstance(prompt, tuple):
            out.append(prompt)
            continue
        ids = tokenizer.encode(prompt, add_special_tokens=True)
        if not ids:
            raise bad("the prompt encodes to no tokens", "prompt")
        out.append(tuple(ids))
    return out


def with_tools(messages: tuple[dict[str, Any], ...], tools: tuple[Tool, ...]) -> list[dict[str, str]]:
    """The messages as the chat template reads them (role and content), in the default tool format
    (``pdfabric.structure``): the tools offered at the end of the system message (one is added
    when there is none), an assistant's calls after its text, a tool's result as a user message
    inside ``<tool_response>`` tags."""
    out: list[dict[str, str]] = []
    for m in messages:
        role, content = m["role"], m["content"]
        if role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        calls = [structure.render_call(name, arguments) for name, arguments in m.get("tool_calls", ())]
        if calls:
            content = "\n".join([content, *calls] if content else calls)
        out.append({"role": role, "content": content})
    if tools:
        offer = structure.render_tools(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{offer}"}
        else:
            out.insert(0, {"role": "system", "content": offer})
    return out


def for_template(messages: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    """The messages for a chat template that renders tool calls itself: an assistant's calls as
    ``tool_calls`` with their arguments as objects (as Hugging Face templates read them), a tool's
    result as a ``tool`` message."""
    out: list[dict[str, Any]] = []
    for m in messages:
        message: dict[str, Any] = {"role": m["role"], "content": m["content"]}
        if m.get("tool_calls"):
            message["tool_calls"] = [
                {"type": "function", "function": {"name": name, "arguments": json.loads(arguments)}}
                for name, arguments in m["tool_calls"]
            ]
        out.append(message)
    return out


def offered(tools: tuple[Tool, ...]) -> list[dict[str, Any]]:
    """The tools as OpenAI's objects, for a chat template that renders them."""
    return [
        {"type": "function", "function": {"name": t.name, "description": t.description,
                                          "parameters": json.loads(t.parameters)}}
        for t in tools
    ]  # fmt: skip


def prompt_text(tokenizer: Tokenizer, parsed: api.ParsedRequest, i: int, ids: tuple[int, ...]) -> str:
    """Prompt ``i`` as the client sent it (text), or decoded from its token ids (``echo``)."""
    prompt = parsed.prompts[i]
    return prompt if isinstance(prompt, str) else tokenizer.decode(list(ids), skip_special_tokens=False)


def max_tokens(parsed: api.ParsedRequest, prompt_len: int, max_model_len: int) -> int:
    """The request's ``max_tokens`` for a prompt of ``prompt_len``: what it asked for, or the room
    left in the context window; a 400 naming the field when they do not fit (503: no worker yet)."""
    if max_model_len == 0:
        raise ApiError(503, "no worker is registered yet", kind="server_error", retry_after_s=1.0)
    field = "messages" if parsed.chat else "prompt"
    if prompt_len >= max_model_len:
        raise bad(f"the prompt has {prompt_len} tokens; the context window is {max_model_len}", field)
    room = max_model_len - prompt_len
    if parsed.max_tokens is None:
        return room
    if parsed.max_tokens > room:
        name = "max_completion_tokens" if parsed.chat else "max_tokens"
        raise bad(
            f"'{name}' is {parsed.max_tokens}, but the prompt ({prompt_len} tokens) leaves room for "
            f"{room} in the {max_model_len}-token context window",
            name,
        )
    return parsed.max_tokens
