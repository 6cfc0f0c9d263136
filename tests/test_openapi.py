"""The router's OpenAPI description: it lists exactly the fields the parser accepts, and a bounded
schemathesis run against a live fabric, driven by it and every check schemathesis has, finds no
failure: no server error or hang, no response outside the description, no valid request refused and
no invalid one accepted."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pdfabric.router.front import embeddings
from pdfabric.router.front import openai_api as api
from pdfabric.router.front.openapi import openapi_document
from tests.fabric import get_json, running_fabric


def _fields(document: dict, path: str) -> set[str]:
    body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["additionalProperties"] is False
    return set(body["properties"])


def test_the_description_lists_the_fields_the_parser_accepts() -> None:
    document = openapi_document(("tiny",), 260)
    assert _fields(document, "/v1/completions") == api.COMPLETION_FIELDS
    assert _fields(document, "/v1/chat/completions") == api.CHAT_FIELDS
    assert _fields(document, "/v1/embeddings") == embeddings.FIELDS


def test_schemathesis_finds_no_failure_of_any_check(tmp_path: Path) -> None:
    """Every schemathesis check: no server error or hang, responses as described, schema-valid requests
    accepted (the rules between fields kept by ``tests/schemathesis_hooks.py``) and invalid ones
    refused; its coverage phase sends each field's bounds."""
    pytest.importorskip("schemathesis")
    cli = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    assert cli is not None, "schemathesis is installed without its command"
    root = Path(__file__).resolve().parent.parent
    env = {
        **os.environ,
        "SCHEMATHESIS_HOOKS": "tests.schemathesis_hooks",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
    }
    # 64 blocks of 16: a 1024-token context (CONTEXT in the hooks): room for a prompt and offered tools.
    with running_fabric("--model", "tiny", "--num-blocks", "64", "--prefill", "1", "--decode", "1") as url:
        assert get_json(url + "/openapi.json")[1]["openapi"].startswith("3.1")
        run = subprocess.run(
            [
                cli, "--config-file", str(root / "tests" / "schemathesis.toml"),
                "run", url + "/openapi.json",
                "--checks", "all",
                "--exclude-path-regex", "^/admin",  # would drain the workers under test
                "--max-examples", "100",
                "--request-timeout", "30",  # a hang is a failure
                "--seed", "1",
                "--generation-database", "none",
                "--no-color",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tmp_path,
            env=env,
        )  # fmt: skip
        assert run.returncode == 0, _failures(run.stdout) + run.stderr[-2000:]
        assert "No issues found" in run.stdout, run.stdout[-3000:]
        assert get_json(url + "/health")[0] == 200  # and the fabric still serves


def test_the_hooks_keep_only_the_rules_between_fields() -> None:
    """The hooks change a schema-valid body only where it breaks a rule between fields."""
    pytest.importorskip("schemathesis")
    from tests.schemathesis_hooks import CONTEXT, keep_the_rules

    kept = {"model": "tiny", "prompt": "hi", "n": 2, "best_of": 3, "max_tokens": 9, "min_tokens": 4}
    body = dict(kept)
    keep_the_rules(body, chat=False)
    assert body == kept
    body = {"model": "tiny", "prompt": "hi", "n": 3, "best_of": 2, "max_tokens": 10_000, "min_tokens": 20_000}
    keep_the_rules(body, chat=False)
    assert body["best_of"] == 3 and body["max_tokens"] < CONTEXT and body["min_tokens"] == body["max_tokens"]


def _failures(stdout: str) -> str:
    """What a failed run said of each failure (the status and body it got, cut short: a generated body
    can be long) and its summary."""
    lines = stdout.splitlines()
    said = [
        "\n".join(line[:800] for line in lines[i : i + 3])
        for i, line in enumerate(lines)
        if line.strip().startswith("[") and line.strip()[1:4].isdigit()
    ]
    return "\n".join(said) + "\n" + stdout[-3000:]
