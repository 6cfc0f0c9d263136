"""The OpenAPI description of ``/v1/files`` and ``/v1/batches`` (``router/front/batch_api.py``), merged
into the router's document by ``openapi.openapi_document``."""

from __future__ import annotations

from typing import Any

from pdfabric.router.platform.batch_jobs import ENDPOINTS

_JSON_OK = {"description": "ok", "content": {"application/json": {"schema": {"type": "object"}}}}
_ID = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}


def _answers(*errors: str, ok: dict[str, Any] = _JSON_OK) -> dict[str, Any]:
    error = {
        "description": "an OpenAI-style error",
        "content": {"application/json": {"schema": {"type": "object"}}},
    }
    return {"200": ok, **{code: error for code in errors}}


_UPLOAD = {
    "required": True,
    "content": {
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "required": ["file", "purpose"],
                "properties": {
                    "file": {
                        "type": "string",
                        "format": "binary",
                        "description": "JSONL, one request a line",
                    },
                    "purpose": {"const": "batch"},
                },
                "additionalProperties": False,
            }
        }
    },
}

_CREATE = {
    "required": True,
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "required": ["input_file_id", "endpoint", "completion_window"],
                "properties": {
                    "input_file_id": {"type": "string"},
                    "endpoint": {"enum": list(ENDPOINTS)},
                    "completion_window": {"const": "24h"},
                    "metadata": {
                        "anyOf": [
                            {"type": "object", "additionalProperties": {"type": "string"}},
                            {"type": "null"},
                        ]
                    },
                },
                "additionalProperties": False,
            }
        }
    },
}


def _linked(*operations: str) -> dict[str, Any]:
    """A 200 whose body's ``id`` is what ``operations`` (by operationId) take as their ``id``."""
    links = {op: {"operationId": op, "parameters": {"id": "$response.body#/id"}} for op in operations}
    return {**_JSON_OK, "links": links}


def job_paths() -> dict[str, Any]:
    jsonl = {"description": "the file's bytes", "content": {"application/jsonl": {}}}
    file_ops, batch_ops = ("getFile", "getFileContent", "deleteFile"), ("getBatch", "cancelBatch")
    return {
        "/v1/files": {
            "post": {
                "summary": "upload a batch's input file",
                "requestBody": _UPLOAD,
                "responses": _answers("400", "413", ok=_linked(*file_ops)),
            },
            "get": {
                "summary": "the tenant's files",
                "parameters": [{"name": "purpose", "in": "query", "schema": {"type": "string"}}],
                "responses": _answers(),
            },
        },
        "/v1/files/{id}": {
            "get": {
                "operationId": "getFile", "summary": "a file", "parameters": [_ID],
                "responses": _answers("404"),
            },
            "delete": {
                "operationId": "deleteFile", "summary": "delete a file", "parameters": [_ID],
                "responses": _answers("404"),
            },
        },
        "/v1/files/{id}/content": {
            "get": {
                "operationId": "getFileContent", "summary": "a file's bytes", "parameters": [_ID],
                "responses": _answers("404", ok=jsonl),
            },
        },
        "/v1/batches": {
            "post": {
                "summary": "run a file of requests in the background",
                "requestBody": _CREATE,
                "responses": _answers("400", "404", ok=_linked(*batch_ops)),
            },
            "get": {
                "summary": "the tenant's batches, newest first",
                "parameters": [
                    {
                        "name": "limit", "in": "query",
                        "schema": {"type": "integer", "minimum": 1, "maximum": 100},
                    },
                    {"name": "after", "in": "query", "schema": {"type": "string"}},
                ],
                "responses": _answers("400"),
            },
        },
        "/v1/batches/{id}": {
            "get": {
                "operationId": "getBatch", "summary": "a batch", "parameters": [_ID],
                "responses": _answers("404"),
            },
        },
        "/v1/batches/{id}/cancel": {
            "post": {
                "operationId": "cancelBatch", "summary": "stop sending a batch's lines", "parameters": [_ID],
                "responses": _answers("404"),
            },
        },
    }  # fmt: skip
