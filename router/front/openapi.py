"""The router's OpenAPI 3.1 description, served at ``/openapi.json``.

It states what ``router/front/openai_api.py`` accepts (types and ranges of every field; any other
field is rejected) and what each endpoint answers, so that clients and API fuzzers such as
schemathesis can work from it. The request bodies' fields are in ``openapi_bodies.py``, the files
and batches endpoints in ``openapi_jobs.py``. ``tests/test_openapi.py`` holds the two together: the
request fields listed here are the ones the parser accepts, and a bounded schemathesis run finds no
server error.
"""

from __future__ import annotations

from typing import Any

from pdfabric.router.front import embeddings
from pdfabric.router.front.openai_api import MAX_TIMEOUT_S
from pdfabric.router.front.openapi_bodies import (
    CHAT,
    CHAT_RULES,
    COMPLETION,
    COMPLETION_RULES,
    EMBEDDINGS,
    number,
    token_fields,
)
from pdfabric.router.front.openapi_jobs import job_paths

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


def _generation(
    summary: str,
    fields: dict[str, Any],
    rules: list[dict[str, Any]],
    required: list[str],
    models: tuple[str, ...],
    vocab_size: int,
) -> dict[str, Any]:
    tokens = token_fields(vocab_size)
    fields = {
        **fields,
        **{name: tokens[name] for name in ("prompt", "logit_bias", "stop_token_ids") if name in fields},
        **({"input": _inputs(tokens["prompt"])} if "input" in required else {}),
        "model": {**fields["model"], "enum": list(models)},
    }
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
                            **({"allOf": rules} if rules else {}),
                        }
                    }
                },
            },
            "parameters": [
                {"name": "X-Tenant", "in": "header", "schema": {"type": "string"}},
                {
                    "name": "X-Request-Timeout",
                    "in": "header",
                    "schema": number(0, MAX_TIMEOUT_S, exclusive_low=True),
                    "description": "the request's deadline in seconds from arrival (the earlier of this and "
                    "the body's timeout applies)",
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


def _inputs(prompt: dict[str, Any]) -> dict[str, Any]:
    """The embedding ``input``: a completion prompt's shapes, with more of them in one request."""
    one, ids, batch = prompt["anyOf"]
    batch = {**batch, "maxItems": embeddings.MAX_INPUTS, "description": "one vector per item, in order"}
    return {"anyOf": [one, ids, batch]}


def openapi_document(models: tuple[str, ...], vocab_size: int) -> dict[str, Any]:
    """The OpenAPI description of a router serving ``models`` (every name a request may use): token
    ids are below ``vocab_size`` (the largest of the models' vocabularies)."""
    json_ok = {"description": "ok", "content": {"application/json": {"schema": _OBJECT}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "pdfabric", "version": "1", "description": f"serving {', '.join(models)}"},
        "paths": {
            "/v1/completions": _generation(
                "text completion", COMPLETION, COMPLETION_RULES, ["model", "prompt"], models, vocab_size
            ),
            "/v1/chat/completions": _generation(
                "chat completion", CHAT, CHAT_RULES, ["model", "messages"], models, vocab_size
            ),
            "/v1/embeddings": _generation(
                "embeddings (one vector per input)", EMBEDDINGS, [], ["model", "input"], models, vocab_size
            ),
            **job_paths(),
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
