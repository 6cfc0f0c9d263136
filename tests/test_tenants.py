"""Tenants without a server: API keys, per-tenant limits (requests and tokens per minute, concurrency,
context length) and usage counters, on a given clock."""

from __future__ import annotations

import pytest

from pdfabric.router.platform.tenants import OTHER, Keys, LimitError, Limits, UsageBook, sha256_hex
from pdfabric.routing_config import AdmissionConfig, Tenant


def test_a_key_names_its_tenant_and_only_hashes_are_kept() -> None:
    cfg = AdmissionConfig(
        tenants=(Tenant("acme", api_keys_sha256=(sha256_hex("k1"), sha256_hex("k2"))), Tenant("open"))
    )
    keys = Keys(cfg)
    assert keys.required
    assert keys.tenant_of("Bearer k1") == keys.tenant_of("bearer  k2") == "acme"
    assert keys.tenant_of("Bearer nope") is None
    assert keys.tenant_of("Basic k1") is None
    assert keys.tenant_of("") is None
    assert "k1" not in repr(cfg)
    assert not Keys(AdmissionConfig()).required


def test_tenant_config_is_checked() -> None:
    with pytest.raises(ValueError, match="64 hex digits"):
        Tenant("t", api_keys_sha256=("abc",))
    with pytest.raises(ValueError, match="requests_per_min must be an integer >= 0"):
        Tenant("t", requests_per_min=-1)
    with pytest.raises(ValueError, match="list of strings"):
        Tenant("t", models="chat")  # type: ignore[arg-type]
    digest = sha256_hex("k")
    with pytest.raises(ValueError, match="one API key is given to two tenants"):
        AdmissionConfig(
            tenants=(Tenant("a", api_keys_sha256=(digest,)), Tenant("b", api_keys_sha256=(digest,)))
        )
    t = AdmissionConfig.from_mapping({"tenants": [{"name": "t", "models": ["a", "b"]}]}).tenant("t")
    assert t.models == ("a", "b")


def test_requests_per_minute_refuses_with_the_wait_until_the_oldest_leaves_the_window() -> None:
    t = Tenant("t", requests_per_min=2)
    limits = Limits(AdmissionConfig(tenants=(t,)))
    limits.admit(t, 10, 20, now=100.0)
    limits.admit(t, 10, 20, now=130.0)
    limits.finish("t", 5, 131.0)
    limits.finish("t", 5, 131.0)
    with pytest.raises(LimitError) as err:
        limits.admit(t, 10, 20, now=145.0)
    assert (err.value.status, err.value.limit, err.value.retry_after_s) == (429, "requests_per_min", 15.0)
    limits.admit(t, 10, 20, now=160.5)  # the first has left the window


def test_tokens_per_minute_counts_prompts_at_admission_and_output_at_the_end() -> None:
    t = Tenant("t", tokens_per_min=100)
    limits = Limits(AdmissionConfig(tenants=(t,)))
    limits.admit(t, 30, 40, now=0.0)
    limits.finish("t", 40, now=10.0)  # 70 tokens in the window
    limits.admit(t, 30, 40, now=20.0)  # 100
    limits.finish("t", 0, now=20.0)
    with pytest.raises(LimitError) as err:
        limits.admit(t, 30, 40, now=30.0)
    # 30 of the 100 must leave: the first prompt (30 at t=0) leaves at 60 s, 30 s from now.
    assert (err.value.status, err.value.limit, err.value.retry_after_s) == (429, "tokens_per_min", 30.0)
    limits.admit(t, 30, 40, now=60.5)
    with pytest.raises(LimitError) as err:
        limits.admit(t, 101, 120, now=61.0)  # could never pass: 400, not a retry
    assert (err.value.status, err.value.limit) == (400, "tokens_per_min")


def test_concurrency_and_context_length() -> None:
    t = Tenant("t", max_concurrency=2, max_context=64)
    limits = Limits(AdmissionConfig(tenants=(t,)))
    limits.admit(t, 8, 64, now=0.0)
    limits.admit(t, 8, 16, now=0.0)
    with pytest.raises(LimitError) as err:
        limits.admit(t, 8, 16, now=0.0)
    assert (err.value.status, err.value.limit, err.value.retry_after_s) == (429, "max_concurrency", 1.0)
    assert limits.in_flight("t") == 2
    limits.finish("t", 3, now=1.0)
    limits.admit(t, 8, 16, now=1.0)
    with pytest.raises(LimitError) as err:
        limits.admit(t, 8, 65, now=1.0)
    assert (err.value.status, err.value.limit) == (400, "max_context")
    assert limits.in_flight("t") == 2  # a refusal takes nothing


def test_a_tenant_without_limits_is_never_refused() -> None:
    limits = Limits(AdmissionConfig())
    anyone = AdmissionConfig().tenant("walk-in")
    for i in range(1000):
        limits.admit(anyone, 10_000, 20_000, now=float(i) / 100)
    assert limits.in_flight("walk-in") == 1000


def test_usage_is_counted_per_tenant_and_model_and_undeclared_names_are_bounded(monkeypatch) -> None:
    book = UsageBook(AdmissionConfig(tenants=(Tenant("acme"),)))
    book.add("acme", "chat@v1", prompt=10, cached=4, completion=7, failed=False)
    book.add("acme", "chat@v1", prompt=5, cached=0, completion=2, failed=True)
    book.add("acme", "chat@v2", prompt=1, cached=0, completion=1, failed=False)
    report = book.report()
    assert report["acme"]["chat@v1"] == {
        "requests": 2, "failed": 1, "prompt_tokens": 15, "cached_tokens": 4, "completion_tokens": 9,
    }  # fmt: skip
    assert report["acme"]["chat@v2"]["requests"] == 1
    monkeypatch.setattr("pdfabric.router.platform.tenants.MAX_TENANTS", 3)
    for name in ("x", "y", "z", "w"):
        book.add(name, "m", 1, 0, 1, False)
    assert set(book.report()) == {"acme", "x", "y", OTHER}
    book.add("acme", "m", 1, 0, 1, False)  # a declared tenant always counts under its name
    assert "m" in book.report()["acme"]
