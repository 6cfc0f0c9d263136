"""The router's OpenAPI 3.1 description, served at ``/openapi.json``.

It states what ``router/openai_api.py`` accepts (types and ranges of every field; any other field is
rejected) and what each endpoint answers, so that clients and API fuzzers such as schemathesis can
work from it. ``tests/test_openapi.py`` holds the two together: the request fields listed here are
the ones the parser accepts, and a bounded schemathesis run finds no server error.
"""

from __future__ import annotations

from typing import Any

from pdfabric.router import openai_api as api
from pdfabric.router.openai_api import MAX_LOGPROBS, MAX_STOP_STRINGS, MAX_TIMEOUT_S


def _number(low: float, high: float, exclusive_low: bool = False) -> dict[str, Any]:
    bound = {"exclusiveMinimum": low} if exclusive_low else {"minimum": low}
    return {"type": "number", **bound, "maximum": high}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_STOP = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOP_STRINGS},
        {"type": "null"},
    ]
}
_COMMON: dict[str, Any] = {
    "model": {"type": "string", "description": "the served model's name (GET /v1/models)"},
    "max_tokens": _nullable({"type": "integer", "minimum": 1}),
    "temperature": _nullable(_number(0, 2)),
    "top_p": _nullable(_number(0, 1, exclusive_low=True)),
    "top_k": _nullable({"type": "integer", "minimum": -1, "description": "0 or -1: no limit"}),
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
    "presence_penalty": _nullable(_number(-2, 2)),
    "frequency_penalty": _nullable(_number(-2, 2)),
    "repetition_penalty": _nullable(_number(0, 10, exclusive_low=True)),
    "logit_bias": _nullable(
        {
            "type": "object",
            "additionalProperties": _number(-100, 100),
            "description": "token id (as a string) to a bias added to its logit",
        }
    ),
    "min_tokens": _nullable({"type": "integer", "minimum": 0, "description": "at most max_tokens"}),
    "stop_token_ids": _nullable({"type": "array", "items": {"type": "integer", "minimum": 0}}),
    "ignore_eos": _nullable({"type": "boolean"}),
    "return_token_ids": _nullable({"type": "boolean"}),
    "timeout": _nullable(_number(0, MAX_TIMEOUT_S, exclusive_low=True)),
    "slo": _nullable(
        {
            "type": "object",
            "properties": {
                "ttft_ms": _number(0, 1e9, exclusive_low=True),
                "itl_ms": _number(0, 1e9, exclusive_low=True),
            },
            "additionalProperties": False,
        }
    ),
    "metadata": _nullable({"type": "object"}),
    "store": _nullable({"type": "boolean"}),
    "service_tier": _nullable({"type": "string"}),
}
_COMPLETION = {
    **_COMMON,
    "prompt": {
        "anyOf": [
            {"type": "string", "minLength": 1},
            _TOKEN_IDS,
            {
                "type": "array",
                "items": {"anyOf": [{"type": "string", "minLength": 1}, _TOKEN_IDS]},
                "minItems": 1,
                "maxItems": api.MAX_PROMPTS,
                "description": "a batch: choice index = prompt index * n + output index",
            },
        ]
    },
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
_MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"type": "string"},
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
_CHAT = {
    **_COMMON,
    "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
    "max_completion_tokens": _nullable({"type": "integer", "minimum": 1}),
    "logprobs": _nullable({"type": "boolean"}),
    "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS}),
    "parallel_tool_calls": _nullable({"type": "boolean"}),
}

_ERROR = {
    "description": "an OpenAI-style error",
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "required": ["error"],
                "properties": {
                    "error": {
                        "type": "object",
                        "properties": {
                            "message": {"type": "string"},
                            "type": {"type": "string"},
                            "param": {"type": ["string", "null"]},
                            "code": {"type": "integer"},
                        },
                    }
                },
            }
        }
    },
}
_OBJECT = {"type": "object"}


def _generation(summary: str, fields: dict[str, Any], required: list[str], model: str) -> dict[str, Any]:
    fields = {**fields, "model": {**fields["model"], "enum": [model]}}
    return {
        "post": {
            "summary": summary,
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "required": required,
                            "properties": fields,
                            "additionalProperties": False,
                        }
                    }
                },
            },
            "parameters": [
                {"name": "X-Tenant", "in": "header", "schema": {"type": "string"}},
                {
                    "name": "X-Request-Timeout",
                    "in": "header",
                    "schema": {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$"},
                    "description": "seconds, in (0, 86400]",
                },
                {
                    "name": "Idempotency-Key",
                    "in": "header",
                    "schema": {"type": "string", "minLength": 1, "maxLength": 255},
                },
            ],
            "responses": {
                "200": {
                    "description": "the answer, or with stream: true a stream of server-sent events",
                    "content": {"application/json": {"schema": _OBJECT}, "text/event-stream": {}},
                },
                "400": _ERROR,
                "422": _ERROR,
                "429": _ERROR,
                "503": _ERROR,
                "504": _ERROR,
            },
        }
    }


def openapi_document(model: str) -> dict[str, Any]:
    """The OpenAPI description of a router serving ``model``."""
    json_ok = {"description": "ok", "content": {"application/json": {"schema": _OBJECT}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "pdfabric", "version": "1", "description": f"serving model {model!r}"},
        "paths": {
            "/v1/completions": _generation("text completion", _COMPLETION, ["model", "prompt"], model),
            "/v1/chat/completions": _generation("chat completion", _CHAT, ["model", "messages"], model),
            "/v1/models": {"get": {"summary": "the served models", "responses": {"200": json_ok}}},
            "/health": {
                "get": {
                    "summary": "workers and whether a request can be served",
                    "responses": {"200": json_ok, "503": json_ok},
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "responses": {"200": {"description": "ok", "content": {"text/plain": {}}}},
                }
            },
            "/admin/workers/{worker_id}/drain": {
                "post": {
                    "summary": "drain a worker (needs the admin key when one is set)",
                    "parameters": [
                        {"name": "worker_id", "in": "path", "required": True, "schema": {"type": "string"}}
                    ],
                    "responses": {"202": json_ok, "401": _ERROR, "404": _ERROR},
                }
            },
        },
    }
