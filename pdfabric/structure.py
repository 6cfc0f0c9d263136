"""What an output must look like: ``response_format`` and tool calls as one grammar.

The router turns a request's ``response_format`` (a JSON schema, any JSON object, or the extensions: a
regular expression, a Lark grammar) and its ``tools`` / ``tool_choice`` into one grammar, checks it
here before any worker is touched (a ``StructureError`` naming the field), and sends it with the
request in ``SamplingParams.grammar``. The worker that samples masks each next token to what the
grammar allows (``pdfabric.engine.grammar``); a resumed request's grammar state is rebuilt from the
grammar and the tokens already streamed, so a failover never restarts a structure.

The grammar engine is llguidance: it reads a Hugging Face ``tokenizer.json`` as it is (our byte
tokenizer's included), compiles a JSON schema in about a millisecond and computes a mask in about
10 us on SmolLM2's 49,152 tokens (``docs/structured-outputs.md``), and has no dependencies. A grammar
is llguidance's own serialized form; nothing outside this module and ``engine/grammar.py`` reads it.

JSON is written in one shape: no free whitespace, ``", "`` between items and ``": "`` after keys (as
``json.dumps`` writes it). Flexible whitespace lets a small model pad an object with newlines until it
runs out of tokens.

The default tool format, for chat templates that do not render tools themselves: each call is
``<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`` (the Hermes format that Qwen2.5
and many fine-tunes use), calls one after another on their own lines.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any

MAX_SCHEMA_BYTES = 64 * 1024  # a schema, regular expression or grammar, as sent
MAX_TOOLS = 128
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

# How every JSON value is written (llguidance's JSON options; see the module docstring).
_JSON_SHAPE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class StructureError(ValueError):
    """A response format, tool or grammar that cannot be served; ``param`` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, description and parameters' JSON schema."""

    name: str
    description: str = ""
    parameters: str = '{"type": "object"}'  # JSON text


@dataclass(frozen=True)
class ToolChoice:
    """``tool_choice``: ``mode`` is ``none``, ``auto`` or ``required``; ``name`` a function it must call."""

    mode: str = "auto"
    name: str = ""


def response_format_grammar(value: Any) -> str:
    """The grammar of an OpenAI ``response_format`` ("" for ``text`` or none). Besides ``text``,
    ``json_object`` and ``json_schema`` (``strict``: unknown schema keywords are an error, else
    ignored), two extensions: ``{"type": "regex", "regex": R}`` and ``{"type": "grammar", "grammar":
    LARK}`` (llguidance's Lark dialect)."""
    param = "response_format"
    if value is None:
        return ""
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise StructureError("'response_format' must be an object with a string 'type'", param)
    kind = value["type"]
    allowed = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"},
               "regex": {"type", "regex"}, "grammar": {"type", "grammar"}}  # fmt: skip
    if kind not in allowed:
        raise StructureError(
            f"'response_format.type' must be one of {', '.join(allowed)}, got {kind!r}", param
        )
    extra = set(value) - allowed[kind]
    if extra:
        raise StructureError(f"'response_format' of type {kind!r} has no field {sorted(extra)[0]!r}", param)
    if kind == "text":
        return ""
    if kind == "json_object":
        return _checked(_json_grammar('{"type": "object"}', strict=False), param)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise StructureError("'response_format.json_schema' must be an object", param)
        name, schema, strict = spec.get("name"), spec.get("schema", {}), spec.get("strict", False)
        if name is not None and not isinstance(name, str):
            raise StructureError("'response_format.json_schema.name' must be a string", param)
        if not isinstance(schema, dict) or not isinstance(strict, bool | None):
            raise StructureError(
                "'response_format.json_schema.schema' must be an object and 'strict' a boolean", param
            )
        return _checked(_json_grammar(_source(schema, param), bool(strict)), param)
    source = value.get(kind)
    if not isinstance(source, str) or not source:
        raise StructureError(f"'response_format.{kind}' must be a non-empty string", param)
    if len(source.encode()) > MAX_SCHEMA_BYTES:
        raise StructureError(f"'response_format.{kind}' is over {MAX_SCHEMA_BYTES} bytes", param)
    return _checked(_regex_grammar(source) if kind == "regex" else _lark_grammar(source), param)


def parse_tools(value: Any) -> tuple[Tool, ...]:
    """OpenAI's ``tools``: an array of ``{"type": "function", "function": {name, description,
    parameters, strict}}``; each function's parameters compiled once here to find a bad schema."""
    param = "tools"
    if value is None:
        return ()
    if not isinstance(value, list) or not value:
        raise StructureError("'tools' must be a non-empty array", param)
    if len(value) > MAX_TOOLS:
        raise StructureError(f"'tools' holds at most {MAX_TOOLS} functions", param)
    tools: list[Tool] = []
    for i, item in enumerate(value):
        where = f"tools[{i}]"
        if (
            not isinstance(item, dict)
            or item.get("type") != "function"
            or not isinstance(item.get("function"), dict)
        ):
            raise StructureError(f'\'{where}\' must be {{"type": "function", "function": {{...}}}}', param)
        fn = item["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 64 or not _is_name(name):
            raise StructureError(
                f"'{where}.function.name' must be 1-64 letters, digits, '_' or '-', got {name!r}", param
            )
        if name in {t.name for t in tools}:
            raise StructureError(f"'{where}.function.name': {name!r} is named twice", param)
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise StructureError(f"'{where}.function.description' must be a string", param)
        schema = fn.get("parameters", {"type": "object"})
        if not isinstance(schema, dict):
            raise StructureError(f"'{where}.function.parameters' must be a JSON schema object", param)
        source = _source(schema, param)
        _checked(
            _json_grammar(source, strict=bool(fn.get("strict"))), param, f"'{where}.function.parameters'"
        )
        tools.append(Tool(name, description, source))
    return tuple(tools)


def parse_tool_choice(value: Any, tools: tuple[Tool, ...]) -> ToolChoice:
    """OpenAI's ``tool_choice``: ``"none"``, ``"auto"`` (the default with tools), ``"required"`` or
    ``{"type": "function", "function": {"name": N}}`` for a function of ``tools``."""
    param = "tool_choice"
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if value in ("none", "auto", "required"):
        if value != "none" and not tools:
            raise StructureError(f"'tool_choice' {value!r} needs 'tools'", param)
        return ToolChoice(value)
    name = value.get("function", {}).get("name") if isinstance(value, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(name, str):
        raise StructureError(
            "'tool_choice' must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}',
            param,
        )
    if name not in {t.name for t in tools}:
        raise StructureError(f"'tool_choice' names {name!r}, which is not in 'tools'", param)
    return ToolChoice("required", name)


def tool_grammar(tools: tuple[Tool, ...], choice: ToolChoice, parallel: bool) -> str:
    """The grammar of a reply that may (``auto``) or must (``required``, a named function) call
    ``tools`` in the default tool format; "" when ``choice`` is ``none``. Each call's JSON is
    constrained from the call's first token: its name to the functions offered, its arguments to
    that function's schema. With ``auto`` the reply is plain text that never opens a call, or text
    and then calls; with ``parallel`` false or a named function, one call."""
    if choice.mode == "none" or not tools:
        return ""
    offered = [t for t in tools if not choice.name or t.name == choice.name]
    call_schema = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, "arguments": json.loads(t.parameters)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in offered
        ],
        "x-guidance": _JSON_SHAPE,
    }
    calls = "call+" if parallel and not choice.name else "call"  # a named function: called once
    text_first = choice.mode == "auto"
    lines = [
        "%llguidance {}",
        f"start: {calls} | NO_CALL" if text_first else f"start: {calls}",
        # lazy: the text before a call ends at the first "<tool_call>" (auto only: required starts
        # with the call)
        f"call_open[lazy]: TEXT {json.dumps(CALL_OPEN)}"
        if text_first
        else f"call_open: {json.dumps(CALL_OPEN)}",
        f'call: call_open "\\n" call_json "\\n{CALL_CLOSE}" {"SEP" if calls == "call+" else ""}'.rstrip(),
        f"call_json: %json {json.dumps(call_schema)}",
        r"TEXT: /(.|\n)*/",
        r"NO_CALL: /(.|\n)*/ & ~/(.|\n)*<tool_call>(.|\n)*/",
    ]
    if calls == "call+":
        lines.append(r"SEP: /\n?/")
    return _checked(_lark_grammar("\n".join(lines) + "\n"), "tools")


def render_tools(tools: tuple[Tool, ...]) -> str:
    """The system prompt text that offers ``tools`` in the default tool format (for chat templates
    that do not render tools themselves)."""
    specs = "\n".join(
        json.dumps({"type": "function", "function": {"name": t.name, "description": t.description,
                                                      "parameters": json.loads(t.parameters)}})
        for t in tools
    )  # fmt: skip
    return (
        "You may call one or more functions to answer. The functions are listed in <tools></tools>:\n"
        f"<tools>\n{specs}\n</tools>\n"
        f"To call a function, write a JSON object with its name and arguments inside "
        f'{CALL_OPEN}{CALL_CLOSE} tags:\n{CALL_OPEN}\n{{"name": <function-name>, "arguments": '
        f"<args-json-object>}}\n{CALL_CLOSE}"
    )


def render_call(name: str, arguments: str) -> str:
    """One call in the default tool format (an assistant message's ``tool_calls`` in a prompt)."""
    return f'{CALL_OPEN}\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n{CALL_CLOSE}'


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text


def split_calls(text: str) -> tuple[str, tuple[Call, ...]]:
    """A reply in the default tool format as (its text, its calls): the calls are the complete ones
    from the first ``<tool_call>`` on, and a last one cut short (by ``max_tokens``) once its name is
    written, with its arguments as far as they go; the text is what comes before the calls and,
    after them, anything that is not a call."""
    start = text.find(CALL_OPEN)
    if start < 0:
        return text, ()
    calls: list[Call] = []
    rest = text[start:]
    while True:
        stripped = rest.lstrip("\n")
        end = stripped.find(CALL_CLOSE)
        if not stripped.startswith(CALL_OPEN):
            break
        if end < 0:  # cut short
            head = CALL_HEAD.match(stripped)
            if head:
                calls.append(Call(json.loads(head.group(1)), stripped[head.end() :]))
                rest = ""
            break
        try:
            body = json.loads(stripped[len(CALL_OPEN) : end])
        except ValueError:
            break
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            break
        arguments = _raw_arguments(stripped[:end]) or json.dumps(body.get("arguments", {}))
        calls.append(Call(body["name"], arguments))
        rest = stripped[end + len(CALL_CLOSE) :]
    if not calls:
        return text, ()
    return text[:start] + rest.lstrip("\n"), tuple(calls)


# The start of a call as the tool grammar writes it, up to its arguments: <tool_call>, a newline,
# {"name": "...", "arguments": (what follows is the arguments, then "}" and a newline).
CALL_HEAD = re.compile(re.escape(CALL_OPEN) + r'\n\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ')


def _raw_arguments(call: str) -> str:
    """The arguments of ``call`` (``<tool_call>`` up to before ``</tool_call>``) as the model wrote
    them, when it wrote the call in the grammar's shape ("" otherwise)."""
    head = CALL_HEAD.match(call)
    tail = call.rstrip()
    return tail[head.end() : -1] if head and tail.endswith("}") else ""


def check_for_tokenizer(grammar: str, tokenizer: object, param: str) -> None:
    """``StructureError`` unless ``grammar`` compiles against the served model's ``tokenizer`` (an
    ``llguidance.LLTokenizer``): special tokens it names must exist, token ranges fit the vocabulary.
    The workers compile it against the same tokenizer, so a request that passes never fails there."""
    error = _grammar_error_for(grammar, tokenizer)
    if error:
        raise StructureError(
            f"'{param}' does not compile for this model: {error.strip().splitlines()[0]}", param
        )


@functools.lru_cache(maxsize=512)
def _grammar_error_for(grammar: str, tokenizer: object) -> str:
    import llguidance

    return llguidance.LLMatcher.validate_grammar(grammar, tokenizer)  # type: ignore[arg-type]


def _is_name(name: str) -> bool:
    return all(c.isascii() and (c.isalnum() or c in "_-") for c in name)


def _source(schema: dict[str, Any], param: str) -> str:
    source = json.dumps(schema, separators=(",", ":"), sort_keys=False)
    if len(source.encode()) > MAX_SCHEMA_BYTES:
        raise StructureError(f"a schema in '{param}' is over {MAX_SCHEMA_BYTES} bytes", param)
    return source


def _json_grammar(schema: str, strict: bool) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(schema, {**_JSON_SHAPE, "lenient": not strict})


def _regex_grammar(regex: str) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_regex(regex)


def _lark_grammar(lark: str) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(lark)


def _checked(grammar: str, param: str, where: str = "") -> str:
    error = _grammar_error(grammar)
    if error:
        first = error.strip().splitlines()[0]
        raise StructureError(f"{where or repr(param)} does not compile: {first}", param)
    return grammar


@functools.lru_cache(maxsize=512)
def _grammar_error(grammar: str) -> str:
    """llguidance's complaint about ``grammar`` ("" none); cached, so a schema sent again costs a
    lookup."""
    import llguidance

    return llguidance.LLMatcher.validate_grammar(grammar)
