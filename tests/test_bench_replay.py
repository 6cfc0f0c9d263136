"""The replay client and the bench commands end to end against a fake OpenAI-compatible streaming server.

The fake server runs on 127.0.0.1 (a free port chosen at run time) in its own thread and event loop, and
is stopped when the test ends, whether it passed or not. Timing checks use generous bounds.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from pdfabric.bench.client import ClientConfig, replay
from pdfabric.bench.metrics import SLO
from pdfabric.bench.prompts import PromptBuilder, PromptConfig
from pdfabric.bench.records import CANCELLED, ERROR, OK, REJECTED, TIMEOUT, read_jsonl
from pdfabric.bench.report import build_report
from pdfabric.bench.synthetic import LengthSpec, SyntheticConfig, generate
from pdfabric.cli import main as cli


@dataclass
class FakeServer:
    """Streams ``max_tokens`` tokens: the first after ``ttft_s``, then ``tokens_per_chunk`` per chunk
    every ``tokens_per_chunk * itl_s``; every ``reject_every``-th request gets a 429; at most
    ``concurrency`` requests are served at once (others queue, which makes TTFT grow with load); with
    ``cut_after`` the stream breaks off after that many tokens, with no finish reason. Token ids (when
    asked for with ``return_token_ids``) are the tokens' output indices."""

    ttft_s: float = 0.03
    itl_s: float = 0.01
    tokens_per_chunk: int = 1
    reject_every: int = 0
    usage: bool = True
    concurrency: int = 1000
    cut_after: int = 0
    cached: int | None = None  # prompt tokens it says came from its prefix cache (None: it does not say)
    models: tuple[str, ...] = ("fake",)  # what GET /v1/models lists
    token_text: str = "ab"  # what each token decodes to ("": a special token, no text)
    seen: list[dict[str, Any]] = field(default_factory=list)

    async def list_models(self, request: web.Request) -> web.Response:
        data = [{"id": m, "object": "model"} for m in self.models]
        return web.json_response({"object": "list", "data": data})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(body)
        if self.reject_every and len(self.seen) % self.reject_every == 0:
            return web.json_response({"error": {"message": "overloaded"}}, status=429,
                                     headers={"Retry-After": "1"})
        async with self._slots():
            return await self._stream(request, body)

    def _slots(self) -> asyncio.Semaphore:
        if not hasattr(self, "_sem"):
            self._sem = asyncio.Semaphore(self.concurrency)
        return self._sem

    async def _stream(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(self.ttft_s)
        total, sent = int(body["max_tokens"]), 0
        while sent < total:
            if self.cut_after and sent >= self.cut_after:
                await resp.write_eof()
                return resp
            k = 1 if sent == 0 else min(self.tokens_per_chunk, total - sent)
            if sent:
                await asyncio.sleep(self.itl_s * k)
            sent += k
            choice: dict[str, Any] = {"index": 0, "text": self.token_text * k,
                                      "finish_reason": "length" if sent == total else None}
            if body.get("return_token_ids"):
                choice["token_ids"] = list(range(sent - k, sent))
            chunk = {"object": "text_completion", "choices": [choice]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if self.usage:
            usage: dict[str, Any] = {"prompt_tokens": len(body["prompt"]), "completion_tokens": sent}
            if self.cached is not None:
                usage["prompt_tokens_details"] = {"cached_tokens": self.cached}
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@contextmanager
def serving(fake: FakeServer) -> Iterator[str]:
    """Run ``fake`` on a free loopback port in a thread; yields its base URL; always stops it."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    state: dict[str, Any] = {}

    def main() -> None:
        asyncio.set_event_loop(loop)
        try:
            app = web.Application()
            app.router.add_post("/v1/completions", fake.handle)
            app.router.add_get("/v1/models", fake.list_models)
            runner = web.AppRunner(app, shutdown_timeout=0.5)
            loop.run_until_complete(runner.setup())
            loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
            state["port"] = runner.addresses[0][1]
        except Exception as exc:  # reported to the test thread below
            state["error"] = exc
            ready.set()
            return
        ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    assert ready.wait(10), "fake server did not start"
    if "error" in state:
        raise state["error"]
    try:
        yield f"http://127.0.0.1:{state['port']}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def _workload(n: int, rate: float, n_in: int = 40, n_out: int = 8):
    cfg = SyntheticConfig(rate=rate, num_requests=n, input_len=LengthSpec("fixed", n_in),
                          output_len=LengthSpec("fixed", n_out), burstiness=0.0)
    return generate(cfg)


def test_replay_records_ttft_itl_and_statuses() -> None:
    fake = FakeServer(ttft_s=0.05, itl_s=0.01, tokens_per_chunk=2, reject_every=4, cached=10)
    wl = _workload(12, rate=60.0)
    with serving(fake) as url:
        cfg = ClientConfig(url=url, model="fake", request_timeout_s=10, max_run_s=20)
        res = asyncio.run(replay(wl, cfg, PromptBuilder(PromptConfig(vocab_size=100, seed=3))))
    statuses = [r.status for r in res.records]
    assert statuses.count(REJECTED) == 3 and statuses.count(OK) == 9
    assert res.not_sent == 0 and res.stopped is None
    for r in (r for r in res.records if r.status == OK):
        assert r.output_tokens == 8 and r.token_count_source == "usage" and r.cached_tokens == 10
        assert len(r.itl_ms) == 7  # 4 chunks (1 + 2 + 2 + 2 tokens + 1) spread over 7 gaps
        assert 30 < r.ttft_ms < 1000
        assert 3 < sorted(r.itl_ms)[3] < 200  # the server's 10 ms per token, generously
        assert r.e2e_ms >= r.ttft_ms
    # the server saw exactly the requested prompts, as token ids within the vocabulary
    for body in fake.seen:
        assert len(body["prompt"]) == 40 and all(0 <= t < 100 for t in body["prompt"])
        assert body["max_tokens"] == 8 and body["ignore_eos"] is True and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}


def test_timeouts_and_stop_give_partial_results() -> None:
    fake = FakeServer(ttft_s=5.0)
    with serving(fake) as url:
        cfg = ClientConfig(url=url, model="fake", request_timeout_s=0.3, max_run_s=10)
        res = asyncio.run(replay(_workload(2, rate=20.0), cfg, PromptBuilder(PromptConfig())))
        assert [r.status for r in res.records] == [TIMEOUT, TIMEOUT]

        async def stopped_early() -> Any:
            stop = asyncio.Event()
            asyncio.get_running_loop().call_later(0.4, stop.set)
            cfg = ClientConfig(url=url, model="fake", request_timeout_s=30, max_run_s=10)
            return await replay(_workload(20, rate=10.0), cfg, PromptBuilder(PromptConfig()), stop)

        res = asyncio.run(stopped_early())
    assert res.stopped == "interrupted"
    assert 0 < len(res.records) < 20 and res.not_sent == 20 - len(res.records)
    assert all(r.status == CANCELLED for r in res.records)
    report = build_report(res.records, SLO(1000, 100), target=0.9, not_sent=res.not_sent, meta={},
                          stopped=res.stopped)
    assert report["partial"] is True and report["attainment"] is None


def test_kept_output_and_a_stream_cut_without_a_finish_reason() -> None:
    wl = _workload(2, rate=50.0)
    with serving(FakeServer(itl_s=0.001, tokens_per_chunk=3)) as url:
        cfg = ClientConfig(url=url, model="fake", max_run_s=10, keep_output=True,
                           extra_body={"return_token_ids": True})
        res = asyncio.run(replay(wl, cfg, PromptBuilder(PromptConfig())))
    for r in res.records:
        assert r.status == OK and r.terminal is True
        assert r.text == "ab" * 8 and r.token_ids == list(range(8))
    with serving(FakeServer(itl_s=0.001, cut_after=3)) as url:
        cfg = ClientConfig(url=url, model="fake", max_run_s=10)
        res = asyncio.run(replay(wl, cfg, PromptBuilder(PromptConfig())))
    for r in res.records:
        assert r.status == ERROR and r.terminal is False and r.output_tokens == 3
        assert r.error == "stream ended without a finish reason" and r.text is None
        assert "text" not in r.to_json() and r.to_json()["terminal"] is False


def test_a_token_without_text_still_arrives_when_the_usage_counts_it() -> None:
    """A one-token answer whose token decodes to no text (a special token) is a first token, timed
    when its chunk came; without a usage count nothing says a token came, and it is an error."""
    wl = _workload(2, rate=50.0, n_out=1)
    for usage, status in ((True, OK), (False, ERROR)):
        with serving(FakeServer(ttft_s=0.05, token_text="", usage=usage)) as url:
            cfg = ClientConfig(url=url, model="fake", max_run_s=10)
            res = asyncio.run(replay(wl, cfg, PromptBuilder(PromptConfig())))
        assert [r.status for r in res.records] == [status, status]
        if status == OK:
            assert all(r.output_tokens == 1 and 30 < r.ttft_ms < 1000 for r in res.records)


def test_replay_command_writes_report(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with serving(FakeServer(ttft_s=0.02, itl_s=0.005, reject_every=5, usage=False)) as url:
        rc = cli.main(["bench", "replay", "--url", url, "--model", "fake", "--trace", "synthetic",
                       "--rate", "50", "--num-requests", "10", "--input-len", "16:32", "--output-len", "6",
                       "--ttft-slo-ms", "5000", "--itl-slo-ms", "1000", "--no-progress", "--out", str(out)])
    assert rc == 0
    files = ("report.json", "requests.jsonl", "summary.md", "ttft_cdf.png", "itl_cdf.png", "slo_scale.png")
    for name in files:
        assert (out / name).stat().st_size > 0, name
    report = json.loads((out / "report.json").read_text())
    assert report["requests"]["total"] == 10
    assert report["requests"]["ok"] == 8 and report["requests"]["rejected"] == 2
    assert report["requests"]["error"] == 0
    assert {"p50", "p90", "p99"} <= set(report["ttft_ms"]) and {"p50", "p90", "p99"} <= set(report["itl_ms"])
    assert report["attainment"] == pytest.approx(0.8)  # the 2 rejected requests miss, the rest meet
    assert report["slo"]["ttft_ms"] == 5000 and report["workload"]["scaling"]["time_scale"] == 1.0
    assert any("no usage" in w for w in report["warnings"])  # counted one token per chunk
    records = read_jsonl(out / "requests.jsonl")
    assert len(records) == 10 and all(r.output_tokens == 6 for r in records if r.status == OK)


def test_replay_reports_the_servers_prefix_cache_hits(tmp_path: Path) -> None:
    """A trace with hash ids: the report states how much of the input repeats (the most any cache
    could reuse) and how much the server said it took from its cache."""
    trace = tmp_path / "conversation.jsonl"
    rows = [(0, 600, [0, 1]), (100, 700, [0, 1]), (200, 300, [2])]
    trace.write_text("".join(
        json.dumps({"timestamp": t, "input_length": n, "output_length": 3, "hash_ids": ids}) + "\n"
        for t, n, ids in rows
    ))
    out = tmp_path / "run"
    with serving(FakeServer(ttft_s=0.01, itl_s=0.002, cached=64)) as url:
        rc = cli.main(["bench", "replay", "--url", url, "--model", "fake", "--trace", str(trace),
                       "--no-progress", "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    assert report["workload"]["shared_prefix_tokens"] == 600
    assert report["prefix_cache"] == {
        "requests": 3, "prompt_tokens": 1600, "cached_tokens": 192, "hit_rate": round(192 / 1600, 4)
    }
    summary = (out / "summary.md").read_text()
    assert "hit rate **12.0%** over 3 requests" in summary and "600 input tokens (37.5%)" in summary


def test_goodput_command_finds_a_bracketed_rate(tmp_path: Path) -> None:
    out = tmp_path / "goodput"
    # one request at a time, ~35 ms each: queueing makes TTFT grow once the rate passes ~25 req/s
    fake = FakeServer(ttft_s=0.015, itl_s=0.005, concurrency=1)
    with serving(fake) as url:
        rc = cli.main(["bench", "goodput", "--url", url, "--model", "fake", "--trace", "synthetic",
                       "--rate", "10", "--num-requests", "8", "--arrival", "gamma", "--burstiness", "0",
                       "--output-len", "4", "--rates", "5,400", "--max-trials", "4", "--rel-tol", "0.5",
                       "--ttft-slo-ms", "120", "--itl-slo-ms", "1000", "--no-progress", "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    g = report["goodput"]
    assert g["goodput_rps"] is not None and 5 <= g["goodput_rps"] < 400
    assert g["first_failing_rps"] is not None and g["first_failing_rps"] > g["goodput_rps"]
    assert 2 <= len(report["trials"]) <= 4
    assert report["at_goodput"]["attainment"] >= 0.9
    assert (out / "attainment_vs_rate.png").stat().st_size > 0
    assert (out / "trials" / "rate-5" / "requests.jsonl").exists()


def test_compare_command_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cmp"
    with serving(FakeServer(ttft_s=0.01)) as fast, serving(FakeServer(ttft_s=0.3)) as slow:
        rc = cli.main(["bench", "compare", "--deployment", f"fast={fast}", "--deployment", f"slow={slow}",
                       "--model", "fake", "--trace", "synthetic", "--rate", "40", "--num-requests", "6",
                       "--output-len", "3", "--ttft-slo-ms", "150", "--no-progress", "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    deps = report["deployments"]
    assert list(deps) == ["fast", "slow"]
    assert deps["fast"]["attainment"] == 1.0 and deps["slow"]["attainment"] == 0.0
    assert deps["fast"]["ttft_ms"]["p50"] < deps["slow"]["ttft_ms"]["p50"]
    for name in ("summary.md", "ttft_cdf.png", "itl_cdf.png", "slo_scale.png", "fast/report.json"):
        assert (out / name).exists(), name
    assert "| fast |" in capsys.readouterr().out


def test_ctrl_c_writes_a_partial_report(tmp_path: Path) -> None:
    out = tmp_path / "partial"
    with serving(FakeServer(ttft_s=0.01)) as url:
        timer = threading.Timer(0.8, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        try:
            rc = cli.main(["bench", "replay", "--url", url, "--model", "fake", "--trace", "synthetic",
                           "--rate", "5", "--num-requests", "40", "--no-progress", "--out", str(out)])
        finally:
            timer.cancel()
    assert rc == 130
    report = json.loads((out / "report.json").read_text())
    assert report["partial"] is True and report["stopped"] == "interrupted"
    assert report["requests"]["not_sent"] > 0 and report["requests"]["total"] < 40


def test_without_model_the_servers_one_model_is_used(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    fake = FakeServer(ttft_s=0.01, itl_s=0.001, models=("served-name",))
    with serving(fake) as url:
        rc = cli.main(["bench", "replay", "--url", url, "--trace", "synthetic", "--rate", "50",
                       "--num-requests", "3", "--input-len", "8", "--output-len", "2", "--no-progress",
                       "--out", str(tmp_path / "run")])  # fmt: skip
    assert rc == 0 and {b["model"] for b in fake.seen} == {"served-name"}
    with serving(FakeServer(models=("a", "b"))) as url:
        rc = cli.main(["bench", "replay", "--url", url, "--trace", "synthetic", "--rate", "50",
                       "--num-requests", "3", "--no-progress", "--out", str(tmp_path / "two")])  # fmt: skip
    assert rc == 2 and "serves 2 models ('a', 'b'): name one with --model" in capsys.readouterr().err
