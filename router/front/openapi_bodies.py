"""What each generation endpoint's request body may hold, as JSON Schema for the router's OpenAPI
description (``openapi.openapi_document``): every field's type and range, and the rules between
fields that JSON Schema can state. ``router/front/openai_api.py`` is the parser these describe."""

from __future__ import annotations

from typing import Any

from pdfabric.router.front import inputs
from pdfabric.router.front import openai_api as api
from pdfabric.router.front.openai_api import MAX_LOGPROBS, MAX_STOP_STRINGS, MAX_TIMEOUT_S
from pdfabric.routing_config import MAX_BUDGET_MS
from pdfabric.structure import MAX_TOOLS


def number(low: float, high: float, exclusive_low: bool = False) -> dict[str, Any]:
    bound = {"exclusiveMinimum": low} if exclusive_low else {"minimum": low}
    return {"type": "number", **bound, "maximum": high}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _kind(kind: str, **fields: dict[str, Any]) -> dict[str, Any]:
    """One ``response_format`` shape: its ``type`` and its other (required) fields."""
    return {
        "type": "object",
        "required": ["type", *fields],
        "properties": {"type": {"const": kind}, **fields},
        "additionalProperties": False,
    }


def _below(limit: int) -> str:
    """A regular expression for the decimal numbers 0 to ``limit`` - 1 (leading zeros allowed)."""
    top = str(limit - 1)
    alternatives = ["0"] + [f"[1-9][0-9]{{{k - 1}}}" for k in range(1, len(top))]
    for i, digit in enumerate(top):
        low = 1 if i == 0 else 0
        if int(digit) > low:
            alternatives.append(f"{top[:i]}[{low}-{int(digit) - 1}][0-9]{{{len(top) - i - 1}}}")
    alternatives.append(top)
    return f"^0*({'|'.join(alternatives)})$"


def token_fields(vocab_size: int) -> dict[str, Any]:
    """The fields that carry token ids: each below the vocabulary size."""
    token_id = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
    token_ids = {"type": "array", "items": token_id, "minItems": 1}
    return {
        "logit_bias": _nullable(
            {
                "type": "object",
                "propertyNames": {"pattern": _below(vocab_size)},
                "additionalProperties": number(-100, 100),
                "description": "token id (as a string) to a bias added to its logit",
            }
        ),
        "stop_token_ids": _nullable({"type": "array", "items": token_id}),
        "prompt": {
            "anyOf": [
                {"type": "string", "minLength": 1},
                token_ids,
                {
                    "type": "array",
                    "items": {"anyOf": [{"type": "string", "minLength": 1}, token_ids]},
                    "minItems": 1,
                    "maxItems": inputs.MAX_PROMPTS,
                    "description": "a batch: choice index = prompt index * n + output index",
                },
            ]
        },
    }


_STOP = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOP_STRINGS},
        {"type": "null"},
    ]
}
_COMMON: dict[str, Any] = {
    "model": {"type": "string", "description": "the served model's name (GET /v1/models)"},
    "max_tokens": _nullable(
        {"type": "integer", "minimum": 1, "description": "with the prompt, inside the model's context window"}
    ),
    "temperature": _nullable(number(0, 2)),
    "top_p": _nullable(number(0, 1, exclusive_low=True)),
    "top_k": _nullable(
        {"type": "integer", "minimum": -1, "description": "0, -1 or the vocabulary's size: no limit"}
    ),
    "n": _nullable(
        {"type": "integer", "minimum": 1, "maximum": api.MAX_N, "description": "outputs per prompt"}
    ),
    "stream": _nullable({"type": "boolean"}),
    "stream_options": _nullable(
        {
            "type": "object",
            "properties": {"include_usage": {"type": "boolean"}},
            "description": "only with stream: true",
        }
    ),
    "stop": _STOP,
    "seed": _nullable({"type": "integer", "minimum": 0, "maximum": 2**63 - 1}),
    "user": _nullable({"type": "string"}),
    "presence_penalty": _nullable(number(-2, 2)),
    "frequency_penalty": _nullable(number(-2, 2)),
    "repetition_penalty": _nullable(number(0, 10, exclusive_low=True)),
    "logit_bias": {},  # by the vocabulary: token_fields
    "stop_token_ids": {},
    "min_tokens": _nullable(
        {"type": "integer", "minimum": 0, "description": "at most max_tokens when that is given"}
    ),
    "ignore_eos": _nullable({"type": "boolean"}),
    "return_token_ids": _nullable({"type": "boolean"}),
    "timeout": _nullable(number(0, MAX_TIMEOUT_S, exclusive_low=True)),
    "slo": _nullable(
        {
            "type": "object",
            "properties": {
                "ttft_ms": number(0, MAX_BUDGET_MS, exclusive_low=True),
                "itl_ms": number(0, MAX_BUDGET_MS, exclusive_low=True),
            },
            "additionalProperties": False,
        }
    ),
    "response_format": _nullable(
        {
            "description": "text, json_object, json_schema (strict: unknown keywords are an error), and "
            "the extensions regex and grammar (llguidance's Lark); the schema, expression or grammar must "
            "compile, and it cannot be combined with tools or ignore_eos (docs/structured-outputs.md)",
            "anyOf": [
                _kind("text"),
                _kind("json_object"),
                _kind(
                    "json_schema",
                    json_schema={
                        "type": "object",
                        "properties": {
                            "name": {"type": "string"},
                            "description": {"type": "string"},
                            "schema": {"type": "object"},
                            "strict": _nullable({"type": "boolean"}),
                        },
                        "additionalProperties": False,
                    },
                ),
                _kind("regex", regex={"type": "string", "minLength": 1}),
                _kind("grammar", grammar={"type": "string", "minLength": 1}),
            ],
        }
    ),  # fmt: skip
    "speculative": _nullable(
        {
            "description": "extension: false turns speculative decoding off for this request, "
            '{"k": N} lowers the tokens a step proposes to N; the worker\'s setting is the most',
            "anyOf": [
                {"type": "boolean"},
                {
                    "type": "object",
                    "required": ["k"],
                    "properties": {"k": {"type": "integer", "minimum": 0, "maximum": api.MAX_SPECULATIVE_K}},
                    "additionalProperties": False,
                },
            ],
        }
    ),
    "metadata": _nullable({"type": "object"}),
    "store": _nullable({"type": "boolean"}),
    "service_tier": _nullable({"type": "string"}),
}
_FUNCTION = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
        "description": _nullable({"type": "string"}),
        "parameters": {"type": "object", "description": "a JSON schema that compiles"},
        "strict": _nullable({"type": "boolean"}),
    },
}
_TOOLS = {
    "type": "array",
    "minItems": 1,
    "maxItems": MAX_TOOLS,
    "description": "functions the model may call, with distinct names",
    "items": {
        "type": "object",
        "required": ["type", "function"],
        "properties": {"type": {"const": "function"}, "function": _FUNCTION},
    },
}
_TOOL_CHOICE = {
    "description": "auto and required need tools; a named function must be one of them",
    "anyOf": [
        {"enum": ["none", "auto", "required"]},
        {
            "type": "object",
            "required": ["type", "function"],
            "properties": {
                "type": {"const": "function"},
                "function": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {"name": {"type": "string"}},
                },
            },
        },
    ],
}
COMPLETION = {
    **_COMMON,
    "prompt": {},  # by the vocabulary: token_fields
    "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS}),
    "echo": _nullable(
        {"type": "boolean", "description": "each choice starts with its prompt (and its scores)"}
    ),
    "best_of": _nullable(
        {
            "type": "integer",
            "minimum": 1,
            "maximum": api.MAX_BEST_OF,
            "description": f"outputs generated per prompt, the n likeliest returned; at least n, not "
            f"streamed, prompts x best_of at most {api.MAX_OUTPUTS}",
        }
    ),
}


def _requires(field: str, when: dict[str, Any], then: Any, value: Any) -> dict[str, Any]:
    """A rule between two fields: when ``field`` is present and matches ``when``, ``then`` must be
    ``value``."""
    return {
        "if": {"required": [field], "properties": {field: when}},
        "then": {"required": [then], "properties": {then: {"const": value}}},
    }


# Rules between fields that JSON Schema can state; those it cannot (min_tokens <= max_tokens, best_of
# >= n, the prompt and max_tokens within the model's context) are in the fields' descriptions.
_STREAM_OPTIONS_NEED_STREAM = _requires(
    "stream_options", {"type": "object", "minProperties": 1}, "stream", True
)
COMPLETION_RULES = [_STREAM_OPTIONS_NEED_STREAM]
CHAT_RULES = [
    _STREAM_OPTIONS_NEED_STREAM,
    _requires("top_logprobs", {"type": "integer", "minimum": 1}, "logprobs", True),
]
_TOOL_CALL = {
    "type": "object",
    "required": ["function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name", "arguments"],
            "properties": {
                "name": {"type": "string", "minLength": 1},
                "arguments": {"type": "string", "description": "JSON text"},
            },
        },
    },
}
_MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "description": "content may be null in an assistant message with tool_calls",
    "properties": {
        "role": {"type": "string"},
        "tool_calls": {"type": "array", "items": _TOOL_CALL, "description": "an assistant's calls"},
        "tool_call_id": {"type": "string", "description": "a tool message's call"},
        "content": {
            "anyOf": [
                {"type": "string"},
                {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["type", "text"],
                        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                    },
                },
            ]
        },
    },
}
CHAT = {
    **_COMMON,
    "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
    "max_completion_tokens": _nullable({"type": "integer", "minimum": 1}),
    "logprobs": _nullable({"type": "boolean"}),
    "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS}),
    "tools": _nullable(_TOOLS),
    "tool_choice": _nullable(_TOOL_CHOICE),
    "parallel_tool_calls": _nullable({"type": "boolean"}),
}

EMBEDDINGS = {name: _COMMON[name] for name in ("model", "user", "timeout", "slo")} | {
    "encoding_format": _nullable({"enum": ["float", "base64"]}),
    "dimensions": _nullable(
        {
            "type": "integer",
            "minimum": 1,
            "description": "cut each vector to this size: one of the sizes the model declares "
            "(matryoshka_dimensions in its config.json; a model that declares none refuses it)",
        }
    ),
}
