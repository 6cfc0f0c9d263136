"""The platform end to end on one fabric: two models (``tiny``; ``chat`` with versions on the tiny and
tiny-b presets), tenants with API keys, limits and usage, the admin API (weights, a version added
at run time, a canary rollout whose guardrail rolls it back) and the audit log."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdfabric.engine.generate import ReferenceEngine
from pdfabric.sampling_params import SamplingParams
from tests.fabric import get_json, metric_values, post_json, running_fabric, sse_chunks

ADMIN = {"Authorization": "Bearer admin-secret"}
ACME = {"Authorization": "Bearer key-acme"}
FREE = {"Authorization": "Bearer key-free"}
TIGHT = {"Authorization": "Bearer key-tight"}
PROMPT = [5, 17, 99, 3, 42, 8, 150, 61]


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


CONFIG = f"""
[serve]
admin_key_sha256 = "{_sha("admin-secret")}"
audit_log = "AUDIT"

[worker]
num_blocks = 128
profile_seconds = 1

[[models]]
name = "tiny"
[[models.versions]]
name = "v1"
model = "tiny"
colocated = 1

[[models]]
name = "chat"
[[models.versions]]
name = "v1"
model = "tiny"
weight = 70
colocated = 1
[[models.versions]]
name = "v2"
model = "tiny-b"
weight = 30
colocated = 1

[routing]
[[routing.tenants]]
name = "acme"
weight = 3
api_keys_sha256 = ["{_sha("key-acme")}"]

[[routing.tenants]]
name = "free"
models = ["tiny"]
api_keys_sha256 = ["{_sha("key-free")}"]
requests_per_min = 5
max_context = 64

[[routing.tenants]]
name = "tight"
api_keys_sha256 = ["{_sha("key-tight")}"]
max_concurrency = 1
"""


@pytest.fixture(scope="module")
def fabric(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    tmp = tmp_path_factory.mktemp("platform")
    audit = tmp / "audit.jsonl"
    config = tmp / "platform.toml"
    config.write_text(CONFIG.replace("AUDIT", str(audit)))
    with running_fabric("--config", str(config)) as url:
        yield url, audit


def complete(url: str, body: dict, headers: dict = ACME) -> tuple[int, dict]:
    return post_json(url + "/v1/completions", {"max_tokens": 4, "temperature": 0, **body}, headers=headers)


def reference(preset: str, max_tokens: int) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return list(ReferenceEngine(preset).generate(PROMPT, params).token_ids)


def wait_for(predicate, timeout: float = 60.0, what: str = "") -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def models(url: str) -> dict[str, dict]:
    status, body = get_json(url + "/admin/models", headers=ADMIN)
    assert status == 200, body
    return {v["id"]: v | {"rollout": m["rollout"]} for m in body["models"] for v in m["versions"]}


def test_keys_are_required_and_tenants_see_only_their_models(fabric: tuple[str, Path]) -> None:
    url, _ = fabric
    assert complete(url, {"model": "tiny", "prompt": PROMPT}, headers={})[0] == 401
    assert (
        complete(url, {"model": "tiny", "prompt": PROMPT}, headers={"Authorization": "Bearer nope"})[0] == 401
    )
    assert get_json(url + "/v1/models")[0] == 401
    status, body = complete(url, {"model": "chat", "prompt": PROMPT}, headers=FREE)
    assert status == 403 and body["error"]["param"] == "model", body
    status, listed = get_json(url + "/v1/models", headers=ACME)
    assert status == 200
    assert {m["id"] for m in listed["data"]} == {"tiny", "tiny@v1", "chat", "chat@v1", "chat@v2"}
    assert get_json(url + "/health")[0] == 200  # operators' endpoints need no tenant key


def test_each_version_is_token_exact_and_named_in_the_response(fabric: tuple[str, Path]) -> None:
    url, _ = fabric
    for version, preset in (("chat@v1", "tiny"), ("chat@v2", "tiny-b")):
        status, body = complete(
            url,
            {
                "model": version,
                "prompt": PROMPT,
                "max_tokens": 12,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
        assert status == 200, body
        assert body["model"] == version
        assert body["choices"][0]["token_ids"] == reference(preset, 12)
    chunks = sse_chunks(
        url + "/v1/completions",
        {
            "model": "chat@v2",
            "prompt": PROMPT,
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
        headers=ACME,
    )
    assert {c["model"] for c in chunks} == {"chat@v2"}
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])] == reference(
        "tiny-b", 12
    )


def _version_of(url: str, user: str) -> str:
    status, body = complete(url, {"model": "chat", "prompt": PROMPT, "max_tokens": 1, "user": user})
    assert status == 200, body
    return body["model"]


def test_a_split_of_100_requests_follows_the_weights_and_a_user_keeps_its_version(
    fabric: tuple[str, Path],
) -> None:
    url, _ = fabric
    picks = {f"user-{i}": _version_of(url, f"user-{i}") for i in range(100)}
    counts = Counter(picks.values())
    # 30% to v2: within 12 points (2.6 standard deviations of a 100-request binomial split).
    assert abs(counts["chat@v2"] - 30) <= 12, counts
    for user in list(picks)[:10]:
        assert _version_of(url, user) == picks[user]


def test_quotas_answer_429_with_retry_after_and_context_400(fabric: tuple[str, Path]) -> None:
    url, _ = fabric
    status, body = complete(url, {"model": "tiny", "prompt": PROMPT, "max_tokens": 60}, headers=FREE)
    assert status == 400 and "at most 64" in body["error"]["message"], body  # 8 + 60 > 64
    for _ in range(5):
        assert complete(url, {"model": "tiny", "prompt": PROMPT}, headers=FREE)[0] == 200
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        url + "/v1/completions",
        json.dumps({"model": "tiny", "prompt": PROMPT}).encode(),
        {"Content-Type": "application/json", **FREE},
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 429
    assert 1 <= int(err.value.headers["Retry-After"]) <= 60
    assert "requests in the last minute" in json.loads(err.value.read())["error"]["message"]
    assert complete(url, {"model": "tiny", "prompt": PROMPT}, headers=ACME)[0] == 200  # other tenants go on


def test_concurrency_limit_holds_while_a_stream_runs(fabric: tuple[str, Path]) -> None:
    url, _ = fabric
    started, done = threading.Event(), {}

    def long_stream() -> None:
        import urllib.request

        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
        req = urllib.request.Request(
            url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json", **TIGHT}
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            for line in r:
                if line.startswith(b"data: {"):
                    started.set()
            done["status"] = r.status

    t = threading.Thread(target=long_stream)
    t.start()
    try:
        assert started.wait(60)
        status, body = complete(url, {"model": "tiny", "prompt": PROMPT}, headers=TIGHT)
        if not done:  # the stream is still running
            assert status == 429 and "in flight" in body["error"]["message"], body
    finally:
        t.join(120)
    assert done["status"] == 200
    assert complete(url, {"model": "tiny", "prompt": PROMPT}, headers=TIGHT)[0] == 200


def test_usage_is_counted_per_tenant_and_the_admin_api_is_audited(fabric: tuple[str, Path]) -> None:
    url, audit = fabric
    assert get_json(url + "/admin/usage")[0] == 401
    before = get_json(url + "/admin/usage", headers=ADMIN)[1]["tenants"].get("acme", {}).get("chat@v1", {})
    status, body = complete(url, {"model": "chat@v1", "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True})
    assert status == 200
    after = get_json(url + "/admin/usage", headers=ADMIN)[1]["tenants"]["acme"]["chat@v1"]
    assert after["requests"] - before.get("requests", 0) == 1
    assert after["prompt_tokens"] - before.get("prompt_tokens", 0) == body["usage"]["prompt_tokens"]
    assert after["completion_tokens"] - before.get("completion_tokens", 0) == 5
    tokens = metric_values(url, "pdfabric_tenant_tokens_total")
    assert tokens['{kind="completion",model="chat@v1",tenant="acme"}'] == after["completion_tokens"]
    entries = [json.loads(line) for line in audit.read_text().splitlines()]
    assert {"usage"} <= {e["audit"] for e in entries}
    assert {e["status"] for e in entries if e["audit"] == "usage"} == {200, 401}
    assert "150, 61" not in audit.read_text()  # prompts are never logged


def test_weights_change_live_and_a_stream_finishes_on_its_version(fabric: tuple[str, Path]) -> None:
    url, _ = fabric
    user = next(f"user-{i}" for i in range(100) if _version_of(url, f"user-{i}") == "chat@v1")
    first = threading.Event()
    chunks: list[dict] = []

    def stream() -> None:
        import urllib.request

        body = {
            "model": "chat",
            "user": user,
            "prompt": PROMPT,
            "max_tokens": 150,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": True,
        }
        req = urllib.request.Request(
            url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json", **ACME}
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            for line in r:
                if line.startswith(b"data: {"):
                    chunks.append(json.loads(line[6:]))
                    first.set()

    t = threading.Thread(target=stream)
    t.start()
    try:
        assert first.wait(60)
        status, body = post_json(
            url + "/admin/models/chat/weights", {"weights": {"v1": 0, "v2": 100}}, headers=ADMIN
        )
        assert status == 200, body
        assert _version_of(url, user) == "chat@v2"  # new requests move at once
    finally:
        t.join(120)
        post_json(url + "/admin/models/chat/weights", {"weights": {"v1": 70, "v2": 30}}, headers=ADMIN)
    assert {c["model"] for c in chunks} == {"chat@v1"}
    assert [x for c in chunks for ch in c["choices"] for x in ch.get("token_ids", [])] == reference(
        "tiny", 150
    )
    assert _version_of(url, user) == "chat@v1"


def test_a_new_version_warms_up_and_a_failing_canary_is_rolled_back(fabric: tuple[str, Path]) -> None:
    url, audit = fabric
    status, body = post_json(
        url + "/admin/models/chat/versions", {"name": "v3", "model": "tiny-b", "colocated": 1}, headers=ADMIN
    )
    assert status == 202 and body["state"] == "warming", body
    wait_for(lambda: models(url)["chat@v3"]["state"] == "ready", what="chat@v3 to warm up")
    v3 = models(url)["chat@v3"]
    assert v3["weight"] == 0 and v3["ready_s"] > 0 and v3["workers"] == ["colocated-chat-v3-0"]
    assert (
        complete(url, {"model": "chat@v3", "prompt": PROMPT})[1]["model"] == "chat@v3"
    )  # pinned: no traffic yet
    cold = metric_values(url, "pdfabric_version_cold_start_seconds")
    assert cold['{model="chat",version="v3"}'] == pytest.approx(
        models(url)["chat@v3"]["cold_start_s"], abs=1e-3
    )
    assert metric_values(url, "pdfabric_version_ready_seconds")['{model="chat",version="v3"}'] > 0
    spec = {
        "canary": "v3",
        "steps": [50, 100],
        "step_s": 60,
        "guardrails": {"max_error_rate": 0.2, "min_requests": 4},
    }
    status, body = post_json(url + "/admin/models/chat/rollout", spec, headers=ADMIN)
    assert status == 202 and body["weights"] == {"v1": 35.0, "v2": 15.0, "v3": 50.0}, body
    # Both sides are priced per token from their workers' profiles (the cost guardrail is off).
    wait_for(lambda: len(models(url)["chat@v3"]["rollout"]["cost_per_token_s"]) == 2, 10, "the costs")
    costs = models(url)["chat@v3"]["rollout"]["cost_per_token_s"]
    assert all(c > 0 for c in costs.values()), costs
    # The canary breaks: its worker leaves. Requests that land on it fail until the guardrail trips.
    assert post_json(url + "/admin/workers/colocated-chat-v3-0/drain", {}, headers=ADMIN)[0] == 202
    wait_for(lambda: models(url)["chat@v3"]["workers"] == [], what="the canary's worker to leave")
    statuses = Counter(
        complete(url, {"model": "chat", "prompt": PROMPT, "user": f"r{i}"})[0] for i in range(40)
    )
    assert statuses[503] >= 4, statuses
    wait_for(lambda: models(url)["chat@v3"]["rollout"]["state"] == "rolled_back", 10, "the rollback")
    state = models(url)
    assert "error rate" in state["chat@v3"]["rollout"]["reason"]
    assert (state["chat@v1"]["weight"], state["chat@v2"]["weight"], state["chat@v3"]["weight"]) == (70, 30, 0)
    assert all(
        complete(url, {"model": "chat", "prompt": PROMPT, "user": f"s{i}"})[0] == 200 for i in range(10)
    )
    status, body = post_json(url + "/admin/models/chat/weights", {"weights": {"v3": 5}}, headers=ADMIN)
    assert status == 200  # set by hand: allowed once the rollout has ended
    post_json(url + "/admin/models/chat/weights", {"weights": {"v3": 0}}, headers=ADMIN)
    import urllib.request

    req = urllib.request.Request(url + "/admin/models/chat/versions/v3", method="DELETE", headers=ADMIN)
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 202
    assert "chat@v3" not in {m["id"] for m in get_json(url + "/v1/models", headers=ACME)[1]["data"]}
    actions = [json.loads(line)["audit"] for line in audit.read_text().splitlines()]
    for action in ("add_version", "version_ready", "start_rollout", "rollout_rolled_back", "remove_version"):
        assert action in actions, actions
