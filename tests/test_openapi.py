"""The router's OpenAPI description: it lists exactly the fields the parser accepts, and a bounded
schemathesis run against a live fabric, driven by it, finds no server error, no hang and no response
outside the description."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pdfabric.router import openai_api as api
from pdfabric.router.openapi import openapi_document
from tests.fabric import get_json, running_fabric


def _fields(document: dict, path: str) -> set[str]:
    body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["additionalProperties"] is False
    return set(body["properties"])


def test_the_description_lists_the_fields_the_parser_accepts() -> None:
    document = openapi_document("tiny")
    assert _fields(document, "/v1/completions") == api.COMPLETION_FIELDS
    assert _fields(document, "/v1/chat/completions") == api.CHAT_FIELDS


def test_schemathesis_finds_no_server_error_and_no_hang(tmp_path: Path) -> None:
    pytest.importorskip("schemathesis")
    cli = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    assert cli is not None, "schemathesis is installed without its command"
    # 32 blocks of 16: a 512-token context keeps the longest generation short.
    with running_fabric("--model", "tiny", "--num-blocks", "32", "--prefill", "1", "--decode", "1") as url:
        assert get_json(url + "/openapi.json")[1]["openapi"].startswith("3.1")
        checks = (
            "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"
        )
        run = subprocess.run(
            [
                cli, "run", url + "/openapi.json",
                "--checks", checks,
                "--exclude-path-regex", "^/admin",  # would drain the workers under test
                "--max-examples", "25",
                "--request-timeout", "30",  # a hang is a failure
                "--seed", "1",
                "--generation-database", "none",
                "--no-color",
            ],
            capture_output=True,
            text=True,
            timeout=400,
            cwd=tmp_path,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
        assert get_json(url + "/health")[0] == 200  # and the fabric still serves
