"""``/v1/files`` and ``/v1/batches`` over the file store and batch jobs (``router/platform``): the
HTTP shapes of OpenAI's Files and Batch APIs, each call as the tenant its key (or ``X-Tenant``) names.

- ``POST /v1/files`` (multipart: ``file``, ``purpose`` = ``batch``), ``GET /v1/files[?purpose=]``,
  ``GET /v1/files/{id}``, ``GET /v1/files/{id}/content``, ``DELETE /v1/files/{id}``;
- ``POST /v1/batches`` (``input_file_id``, ``endpoint``, ``completion_window`` = ``24h``, ``metadata``),
  ``GET /v1/batches[?limit=&after=]``, ``GET /v1/batches/{id}``, ``POST /v1/batches/{id}/cancel``.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from pdfabric import envs
from pdfabric.config import ServeConfig
from pdfabric.router.errors import ApiError, bad
from pdfabric.router.front import access, responses
from pdfabric.router.front.keys import CONFIG
from pdfabric.router.json_body import parse_json_body
from pdfabric.router.platform.batch_jobs import BatchStore
from pdfabric.router.platform.batch_runner import BatchRunner
from pdfabric.router.platform.files import FileStore
from pdfabric.router.platform.jobs_db import open_jobs_db
from pdfabric.routing_config import AdmissionConfig

BATCHES = web.AppKey("batches", BatchStore)
RUNNER = web.AppKey("batch_runner", BatchRunner)


def add_batch_api(app: web.Application, cfg: ServeConfig, waiting) -> BatchRunner:  # noqa: ANN001
    """Adds the routes; the runner starts once the router serves (``BatchRunner.start``) and stops
    with the app. ``waiting``: the requests waiting in the router's admission queue."""
    root = Path(cfg.batches.dir or Path(envs.get("PDFABRIC_CACHE_DIR")) / "batches")
    db = open_jobs_db(root)
    store = BatchStore(db, FileStore(db, root))
    app[BATCHES] = store
    app[RUNNER] = runner = BatchRunner(store, cfg.batches, waiting)
    app.on_cleanup.append(lambda _: runner.close())
    app.on_cleanup.append(lambda _: _close(db))
    for method, path, handler in (
        ("POST", "/v1/files", upload), ("GET", "/v1/files", list_files), ("GET", "/v1/files/{id}", get_file),
        ("GET", "/v1/files/{id}/content", file_content), ("DELETE", "/v1/files/{id}", delete_file),
        ("POST", "/v1/batches", create_batch), ("GET", "/v1/batches", list_batches),
        ("GET", "/v1/batches/{id}", get_batch), ("POST", "/v1/batches/{id}/cancel", cancel_batch),
    ):  # fmt: skip
        app.router.add_route(method, path, _answering(handler))
    return runner


async def _close(db: sqlite3.Connection) -> None:
    db.close()


def batch_class(routing: AdmissionConfig, wanted: str) -> str:
    """The class batch lines are admitted in: ``wanted`` if declared, else the lowest-priority class."""
    names = [c.name for c in routing.classes]
    if wanted in names:
        return wanted
    return min(routing.classes, key=lambda c: c.priority).name


def _answering(handler):  # noqa: ANN001, ANN202
    async def answer(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as err:
            return responses.error_response(err)

    return answer


def _tenant(request: web.Request) -> str:
    return request.get(access.TENANT, "default")


async def upload(request: web.Request) -> web.Response:
    if not request.content_type.startswith("multipart/"):
        raise bad("upload a file as multipart/form-data with the fields 'file' and 'purpose'", "file")
    try:
        purpose, filename, data = await _form(request, request.app[CONFIG].batches.max_file_mb * 2**20)
    except (ValueError, AssertionError, LookupError, HttpProcessingError) as exc:  # a malformed form
        raise bad(f"the multipart form cannot be read: {exc}", "file") from None
    if purpose != "batch":
        raise bad(f"'purpose' must be 'batch', got {purpose!r}", "purpose")
    if data is None:
        raise bad("'file' is required", "file")
    limit = request.app[CONFIG].batches.tenant_storage_mb * 2**20
    obj = request.app[BATCHES].files.create(_tenant(request), filename, purpose, data, limit)
    return web.json_response(obj.public())


async def _form(request: web.Request, limit: int) -> tuple[str | None, str, bytes | None]:
    """The upload's ``purpose``, file name and bytes (a 413 past ``limit`` bytes)."""
    purpose, filename, data = None, "", None
    reader = await request.multipart()
    while (part := await reader.next()) is not None:
        if part.name == "purpose":
            purpose = (await part.text()).strip()
        elif part.name == "file":
            filename = part.filename or "upload.jsonl"
            data = bytearray()
            while chunk := await part.read_chunk():
                data += chunk
                if len(data) > limit:
                    raise ApiError(413, f"the file is larger than {limit // 2**20} MB", "file")
        else:
            raise bad(f"form field {part.name!r} is not supported by this server (file, purpose)", "file")
    return purpose, filename, None if data is None else bytes(data)


async def list_files(request: web.Request) -> web.Response:
    files = request.app[BATCHES].files.list(_tenant(request), request.query.get("purpose"))
    return web.json_response({"object": "list", "data": [f.public() for f in files], "has_more": False})


async def get_file(request: web.Request) -> web.Response:
    return web.json_response(
        request.app[BATCHES].files.get(_tenant(request), request.match_info["id"]).public()
    )


async def file_content(request: web.Request) -> web.Response:
    data = request.app[BATCHES].files.content(_tenant(request), request.match_info["id"])
    return web.Response(body=data, content_type="application/jsonl")


async def delete_file(request: web.Request) -> web.Response:
    file_id = request.match_info["id"]
    request.app[BATCHES].files.delete(_tenant(request), file_id)
    return web.json_response({"id": file_id, "object": "file", "deleted": True})


async def create_batch(request: web.Request) -> web.Response:
    body = parse_json_body(await request.read())
    batch = request.app[BATCHES].create(_tenant(request), body)
    request.app[RUNNER].run(batch["id"])
    return web.json_response(batch)


async def list_batches(request: web.Request) -> web.Response:
    batches = request.app[BATCHES].list(_tenant(request))
    after = request.query.get("after")
    if after is not None:
        ids = [b["id"] for b in batches]
        batches = batches[ids.index(after) + 1 :] if after in ids else []
    try:
        limit = int(request.query.get("limit", "20"))
    except ValueError:
        raise bad("'limit' must be an integer from 1 to 100", "limit") from None
    if not 1 <= limit <= 100:
        raise bad("'limit' must be an integer from 1 to 100", "limit")
    page = batches[:limit]
    return web.json_response(
        {
            "object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(batches) > limit,
        }
    )  # fmt: skip


async def get_batch(request: web.Request) -> web.Response:
    return web.json_response(request.app[BATCHES].get(_tenant(request), request.match_info["id"]))


async def cancel_batch(request: web.Request) -> web.Response:
    return web.json_response(request.app[BATCHES].cancel(_tenant(request), request.match_info["id"]))
