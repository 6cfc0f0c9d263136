"""A request's prompts as token ids, as the client sent them, and the room they leave for output."""

from __future__ import annotations

from pdfabric.engine.tokenizer import Tokenizer
from pdfabric.router.errors import ApiError, bad
from pdfabric.router.front import openai_api as api


def tokenize(tokenizer: Tokenizer, parsed: api.ParsedRequest) -> list[tuple[int, ...]]:
    """Each prompt's token ids (a chat request's one prompt, rendered by the chat template)."""
    if parsed.chat:
        try:
            text = tokenizer.apply_chat_template(list(parsed.messages or ()), add_generation_prompt=True)
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
