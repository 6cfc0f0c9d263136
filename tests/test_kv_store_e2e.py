"""The host KV store through the whole fabric: a disaggregated deployment stopped and started again
reads the prompts it served from the store (the usage's cached tokens say so), token-exact against
the single-process reference, with every block back in the pools."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp

from pdfabric.engine.generate import ReferenceEngine
from pdfabric.sampling_params import SamplingParams
from tests.fabric import metric_values, serve_process, wait_blocks_free, wait_healthy


async def _complete(url: str, prompt: list[int]) -> tuple[list[int], int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        out = await r.json()
    details = out["usage"].get("prompt_tokens_details") or {}
    return out["choices"][0]["token_ids"], details.get("cached_tokens", 0)


def test_a_restarted_deployment_reads_what_it_served_from_the_host_store(tmp_path: Path) -> None:
    config = tmp_path / "store.toml"
    config.write_text(f'[kv_store]\nram_mb = 64\nram_dir = "{tmp_path / "ram"}"\n')
    flags = ("--model", "tiny", "--prefill", "1", "--decode", "1", "--num-blocks", "64",
             "--config", str(config))  # fmt: skip
    prompts = [[(7 * i + j) % 200 + 3 for j in range(100)] for i in range(3)]  # 6 full blocks each
    reference = ReferenceEngine("tiny")
    want = [reference.generate(p, SamplingParams(12, ignore_eos=True)).token_ids for p in prompts]
    with serve_process(*flags) as (router, url):
        wait_healthy(url, router)
        for prompt, tokens in zip(prompts, want, strict=True):
            assert asyncio.run(asyncio.wait_for(_complete(url, prompt), 60)) == (tokens, 0)
        wait_blocks_free(url)
    assert len(list((tmp_path / "ram").glob("*.kv"))) >= 3 * 6  # the workers kept their blocks on stopping
    with serve_process(*flags) as (router, url):
        wait_healthy(url, router)
        for prompt, tokens in zip(prompts, want, strict=True):
            got, cached = asyncio.run(asyncio.wait_for(_complete(url, prompt), 60))
            assert got == tokens and cached == 96
        wait_blocks_free(url)
        time.sleep(0.5)  # a heartbeat or two after the last request
        hit_tokens = metric_values(url, "pdfabric_kv_store_hit_tokens_total")
        hits = metric_values(url, "pdfabric_kv_store_hits_total")
        assert sum(hit_tokens.values()) >= 3 * 96, hit_tokens  # the prefill worker's, and the decode's
        assert sum(v for k, v in hits.items() if 'tier="ram"' in k) * 16 == sum(hit_tokens.values())
