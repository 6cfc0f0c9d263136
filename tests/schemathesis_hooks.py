"""Schemathesis hooks for ``tests/test_openapi.py``: the rules between fields of a generation request
that JSON Schema cannot state (router/front/openapi.py states them in the fields' descriptions), written out
here on their own. Before a request the fuzzer generated as valid is sent, the fields that break one of
these rules are brought back inside it (the smallest change: ``best_of`` to ``n``, ``min_tokens`` to
``max_tokens``, a prompt cut, ``max_tokens`` to the room left); everything else is sent as generated,
so any other refusal of a request the description allows still fails the run. Invalid requests are
sent untouched.

Loaded by ``SCHEMATHESIS_HOOKS=tests.schemathesis_hooks``; the fabric under test serves ``tiny`` (one
token per UTF-8 byte, and a bos) with a context window of ``CONTEXT`` tokens.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import schemathesis

from pdfabric import structure
from pdfabric.router.front.openai_api import MAX_BEST_OF, MAX_OUTPUTS

CONTEXT = 1024  # 64 blocks of 16 tokens: room for a prompt and the tools it offers
LONGEST_PROMPT = 256  # tokens (chat: bytes of text); a longer one is cut
MESSAGES, ROLE_BYTES = 8, 16  # a chat request's messages and each one's role, cut to these
TEMPLATE_TOKENS = 8  # a bound on what tiny's chat template adds around a message (about 4)


def _cut(text: str, budget: int) -> str:
    """``text`` cut to at most ``budget`` UTF-8 bytes (never inside a character)."""
    return text.encode()[:budget].decode(errors="ignore")


def _completion_prompts(body: dict[str, Any]) -> list[int]:
    """Cuts each completion prompt to ``LONGEST_PROMPT`` tokens and a batch to ``MAX_OUTPUTS`` outputs;
    each prompt's length in tokens (at most)."""
    prompt = body["prompt"]
    batch = isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)
    prompts = prompt if batch else [prompt]
    best_of = int(body.get("best_of") or body.get("n") or 1)
    prompts = [
        _cut(p, LONGEST_PROMPT - 2) or "a" if isinstance(p, str) else p[:LONGEST_PROMPT] for p in prompts
    ]
    prompts = prompts[: max(1, MAX_OUTPUTS // best_of)]
    body["prompt"] = prompts if batch else prompts[0]
    return [len(p.encode()) + 2 if isinstance(p, str) else len(p) for p in prompts]


def _chat_prompt(body: dict[str, Any]) -> int:
    """Cuts a chat request to ``MESSAGES`` messages, each role to ``ROLE_BYTES`` and their text to
    ``LONGEST_PROMPT`` bytes in all; the rendered prompt's length in tokens (at most)."""
    body["messages"] = body["messages"][:MESSAGES]
    budget = LONGEST_PROMPT
    for m in body["messages"]:
        m["role"] = _cut(m["role"], ROLE_BYTES)
        parts = m["content"] if isinstance(m["content"], list) else [m]
        for part in parts:
            key = "text" if part is not m else "content"
            part[key] = _cut(part[key], budget)
            budget -= len(part[key].encode())
    return TEMPLATE_TOKENS * (len(body["messages"]) + 1) + ROLE_BYTES * len(body["messages"]) + LONGEST_PROMPT


@functools.cache
def _tiny_grammar_tokenizer() -> object:
    """The served model's tokenizer as the grammar engine reads it (a grammar must compile for it)."""
    from pdfabric.engine.default_model import resolve_model
    from pdfabric.engine.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(resolve_model("tiny")).grammar_tokenizer


def _structure_rules(body: dict[str, Any], chat: bool) -> None:
    """A schema, expression or grammar that does not compile is replaced by one that does; tool names
    made distinct; ``tool_choice`` brought to the tools there are; tools dropped (``tool_choice``
    none) beside a response format; ``ignore_eos`` off beside either; a call's arguments JSON text."""
    fmt = body.get("response_format")
    if isinstance(fmt, dict):
        try:
            grammar = structure.response_format_grammar(fmt)
            if grammar:
                structure.check_for_tokenizer(grammar, _tiny_grammar_tokenizer(), "response_format")
        except structure.StructureError:
            kind = fmt["type"]
            if kind == "json_schema":
                fmt["json_schema"]["schema"] = {"type": "object"}
            else:
                fmt[kind] = {"regex": "[a-z]{1,8}", "grammar": 'start: "yes" | "no"'}[kind]
    structured = isinstance(fmt, dict) and fmt.get("type") != "text"
    if not chat:
        if structured:
            body["ignore_eos"] = False
        return
    for m in body["messages"]:  # any role's calls: the router checks them all
        for call in m.get("tool_calls") or []:
            try:
                json.loads(call["function"]["arguments"])
            except ValueError:
                call["function"]["arguments"] = "{}"
    tools = body.get("tools") or []
    names: set[str] = set()
    for i, tool in enumerate(tools):
        fn = tool["function"]
        if fn["name"] in names or not fn["name"].strip("\n") == fn["name"]:  # "$" lets a newline end it
            fn["name"] = f"f{i}"
        names.add(fn["name"])
        try:
            structure.parse_tools([tool])
        except structure.StructureError:
            fn["parameters"] = {"type": "object"}
    choice = body.get("tool_choice")
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if (choice in ("auto", "required") and not tools) or (isinstance(choice, dict) and named not in names):
        body["tool_choice"] = "auto" if tools else "none"
    if structured and tools:
        body["tool_choice"] = "none"
    if structured or (tools and body.get("tool_choice") != "none"):
        body["ignore_eos"] = False
    if tools and body.get("tool_choice") != "none":  # offered tools are part of the prompt: keep it short
        kept = next((t for t in tools if t["function"]["name"] == named), tools[0])
        fn = kept["function"]
        fn["description"] = _cut(fn.get("description") or "", 16)
        if len(json.dumps(fn.get("parameters", {}))) > 64:
            fn["parameters"] = {"type": "object"}
        body["tools"] = [kept]


def _tool_prompt(body: dict[str, Any]) -> int:
    """The tokens (bytes) the offered tools add to a chat prompt (``structure.render_tools``)."""
    if not body.get("tools") or body.get("tool_choice") == "none":
        return 0
    return len(structure.render_tools(structure.parse_tools(body["tools"])).encode()) + 4


def keep_the_rules(body: dict[str, Any], chat: bool) -> None:
    """Brings ``body`` (valid by the description) inside the rules between its fields: ``best_of`` at
    least ``n`` and not streamed when greater, at most ``MAX_OUTPUTS`` outputs, ``min_tokens`` at most
    ``max_tokens``, each prompt and its ``max_tokens`` inside the context window, and a structure that
    can be served (``_structure_rules``)."""
    _structure_rules(body, chat)
    n = body.get("n") or 1
    if not chat and body.get("best_of") is not None:
        if body["best_of"] < n or (body["best_of"] > n and body.get("stream") is True):
            body["best_of"] = n if n <= MAX_BEST_OF else None  # null: n
    longest = _chat_prompt(body) + _tool_prompt(body) if chat else max(_completion_prompts(body))
    name = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    if body.get(name) is not None:
        body[name] = min(body[name], CONTEXT - longest)
    limit = body.get(name) if body.get(name) is not None else (None if chat else 16)
    if limit is not None and (body.get("min_tokens") or 0) > limit:
        body["min_tokens"] = limit


EMBEDDING_INPUTS = 16  # inputs of one embeddings request, cut to these


def keep_the_embedding_rules(body: dict[str, Any]) -> None:
    """An embeddings request: each input cut as a prompt, at most ``EMBEDDING_INPUTS`` of them, and
    no ``dimensions`` (``tiny`` declares no sizes to cut its vectors to)."""
    body.pop("dimensions", None)
    if isinstance(body.get("input"), list) and body["input"] and isinstance(body["input"][0], (str, list)):
        body["input"] = body["input"][:EMBEDDING_INPUTS]
    body["prompt"] = body.pop("input")
    _completion_prompts(body)
    body["input"] = body.pop("prompt")


@schemathesis.hook
def before_call(context: schemathesis.HookContext, case: schemathesis.Case, kwargs: dict[str, Any]) -> None:
    generation = case.meta.generation if case.meta is not None else None
    if generation is None or not generation.mode.is_positive or not isinstance(case.body, dict):
        return
    path = case.operation.path
    if path.endswith("/embeddings"):
        keep_the_embedding_rules(case.body)
    elif path.endswith("/completions"):
        keep_the_rules(case.body, chat=path.endswith("/chat/completions"))
