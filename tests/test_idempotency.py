"""The idempotency store on its own: no processes, no HTTP, a clock the tests move by hand."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest

from pdfabric.config import ServeConfig, load_serve_config
from pdfabric.router.errors import ApiError
from pdfabric.router.front.idempotency import HEADER, IdempotencyStore, Reply, check_key, fingerprint

SCOPE = ("default", "/v1/completions", "key-1")
OK = Reply(200, b'{"id":"cmpl-1"}', (("Content-Type", "application/json"),))
FAILED = Reply(503, b'{"error":{}}', (("Retry-After", "1"),))


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    """Runs a test coroutine, failing it if it takes more than 5 s (a waiter that never wakes)."""
    return asyncio.run(asyncio.wait_for(coro, 5.0))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Computer:
    """A ``compute`` that counts its calls and answers ``reply``, after ``gate`` opens if given."""

    def __init__(self, reply: Reply = OK, gate: asyncio.Event | None = None) -> None:
        self.reply, self.gate, self.calls = reply, gate, 0

    async def __call__(self) -> Reply:
        self.calls += 1
        if self.gate is not None:
            await self.gate.wait()
        return self.reply


def store(ttl_s: float = 60.0, max_entries: int = 100) -> tuple[IdempotencyStore, Clock]:
    clock = Clock()
    return IdempotencyStore(ttl_s, max_entries, clock), clock


def test_a_retry_is_replayed_not_computed() -> None:
    s, _ = store()
    compute = Computer()
    assert run(s.run(SCOPE, "f", compute)) == (OK, False)
    assert run(s.run(SCOPE, "f", compute)) == (OK, True)
    assert compute.calls == 1


def test_a_kept_reply_expires_after_ttl() -> None:
    s, clock = store(ttl_s=60.0)
    compute = Computer()
    run(s.run(SCOPE, "f", compute))
    clock.now += 59.9
    assert run(s.run(SCOPE, "f", compute)) == (OK, True)
    clock.now += 0.1
    assert run(s.run(SCOPE, "f", compute)) == (OK, False)
    assert compute.calls == 2


def test_ttl_counts_from_completion_not_arrival() -> None:
    s, clock = store(ttl_s=60.0)

    async def slow() -> Reply:
        clock.now += 100.0  # the request took longer than the TTL
        return OK

    run(s.run(SCOPE, "f", slow))
    clock.now += 30.0
    assert run(s.run(SCOPE, "f", Computer())) == (OK, True)


def test_the_store_keeps_at_most_max_entries_dropping_the_oldest() -> None:
    s, clock = store(max_entries=2)
    compute = Computer()
    scopes = [("default", "/v1/completions", f"k{i}") for i in range(3)]
    for scope in scopes:
        run(s.run(scope, "f", compute))
        clock.now += 1.0
    assert s.kept() == 2 and compute.calls == 3
    assert run(s.run(scopes[2], "f", compute))[1] is True
    assert run(s.run(scopes[1], "f", compute))[1] is True
    assert run(s.run(scopes[0], "f", compute))[1] is False  # forgotten: computed again
    assert compute.calls == 4 and s.kept() == 2


def test_scopes_are_apart_by_tenant_and_endpoint() -> None:
    s, _ = store()
    compute = Computer()
    for scope in [SCOPE, ("other", *SCOPE[1:]), (SCOPE[0], "/v1/chat/completions", SCOPE[2])]:
        assert run(s.run(scope, "f", compute))[1] is False
    assert compute.calls == 3


def test_a_duplicate_in_flight_waits_for_the_first_result() -> None:
    async def scenario() -> None:
        s, _ = store()
        gate = asyncio.Event()
        compute = Computer(gate=gate)
        first = asyncio.create_task(s.run(SCOPE, "f", compute))
        await asyncio.sleep(0)
        second = asyncio.create_task(s.run(SCOPE, "f", compute))
        await asyncio.sleep(0.01)
        assert compute.calls == 1 and not first.done() and not second.done()
        gate.set()
        assert await first == (OK, False)
        assert await second == (OK, True)
        assert compute.calls == 1

    run(scenario())


def test_the_same_key_with_another_body_is_a_422_naming_the_header() -> None:
    async def scenario() -> None:
        s, _ = store()
        gate = asyncio.Event()
        first = asyncio.create_task(s.run(SCOPE, "f", Computer(gate=gate)))
        await asyncio.sleep(0)
        with pytest.raises(ApiError) as in_flight:
            await s.run(SCOPE, "other body", Computer())
        gate.set()
        await first
        with pytest.raises(ApiError) as kept:
            await s.run(SCOPE, "other body", Computer())
        for err in (in_flight.value, kept.value):
            assert err.status == 422 and err.param == HEADER and HEADER in err.message

    run(scenario())


@pytest.mark.parametrize("status", [400, 429, 500, 503])
def test_a_failure_is_not_kept_but_reaches_the_duplicates_waiting_for_it(status: int) -> None:
    async def scenario() -> None:
        s, _ = store()
        gate = asyncio.Event()
        failing = Computer(Reply(status, b"{}"), gate=gate)
        first = asyncio.create_task(s.run(SCOPE, "f", failing))
        await asyncio.sleep(0)
        waiting = asyncio.create_task(s.run(SCOPE, "f", failing))
        await asyncio.sleep(0.01)
        gate.set()
        assert await first == (Reply(status, b"{}"), False)
        assert await waiting == (Reply(status, b"{}"), True)
        assert failing.calls == 1 and s.kept() == 0
        retry = Computer()
        assert await s.run(SCOPE, "f", retry) == (OK, False)  # the retry computes again
        assert retry.calls == 1

    run(scenario())


def test_a_first_request_that_goes_away_hands_the_key_to_a_waiting_duplicate() -> None:
    async def scenario() -> None:
        s, _ = store()
        first = asyncio.create_task(s.run(SCOPE, "f", Computer(gate=asyncio.Event())))
        await asyncio.sleep(0)
        compute = Computer()
        waiting = asyncio.create_task(s.run(SCOPE, "f", compute))
        await asyncio.sleep(0.01)
        first.cancel()  # its client disconnected
        assert await waiting == (OK, False)
        assert compute.calls == 1
        with pytest.raises(asyncio.CancelledError):
            await first
        assert await s.run(SCOPE, "f", Computer()) == (OK, True)

    run(scenario())


def test_a_cancelled_duplicate_leaves_the_others_waiting() -> None:
    async def scenario() -> None:
        s, _ = store()
        gate = asyncio.Event()
        compute = Computer(gate=gate)
        first = asyncio.create_task(s.run(SCOPE, "f", compute))
        await asyncio.sleep(0)
        dup1 = asyncio.create_task(s.run(SCOPE, "f", compute))
        dup2 = asyncio.create_task(s.run(SCOPE, "f", compute))
        await asyncio.sleep(0.01)
        dup1.cancel()
        await asyncio.sleep(0)
        gate.set()
        assert await first == (OK, False) and await dup2 == (OK, True)
        assert compute.calls == 1 and dup1.cancelled()

    run(scenario())


def test_keys_must_have_1_to_255_characters() -> None:
    check_key("k" * 255)
    for key in ("", "k" * 256):
        with pytest.raises(ApiError) as err:
            check_key(key)
        assert err.value.status == 400 and err.value.param == HEADER


def test_the_fingerprint_ignores_key_order_but_not_values() -> None:
    a = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
    assert fingerprint(a) == fingerprint(dict(reversed(a.items())))
    assert fingerprint(a) != fingerprint({**a, "max_tokens": 5})


def test_settings_are_checked_and_a_zero_ttl_turns_the_store_off(tmp_path: Path) -> None:
    assert not IdempotencyStore(0, 1).enabled and IdempotencyStore(1, 1).enabled
    for bad in (
        {"idempotency_ttl_s": -1.0},
        {"idempotency_ttl_s": float("nan")},
        {"idempotency_max_entries": 0},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ServeConfig(**bad)
    config = tmp_path / "idem.toml"
    config.write_text("[serve]\nidempotency_ttl_s = 30\nidempotency_max_entries = 5\n")
    cfg = load_serve_config(config, {})
    assert (cfg.idempotency_ttl_s, cfg.idempotency_max_entries) == (30, 5)
    assert (ServeConfig().idempotency_ttl_s, ServeConfig().idempotency_max_entries) == (600.0, 10000)
