"""Command-line options shared by ``pdfabric bench replay / goodput / compare``, and the one place that
turns them into config objects (workload, scaling, prompts, client, SLO)."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from pdfabric.bench.metrics import ITL_STATS, SLO

if TYPE_CHECKING:  # the builders import these when called, so that --help stays quick
    from pdfabric.bench.client import ClientConfig
    from pdfabric.bench.prompts import PromptConfig
    from pdfabric.bench.workload import Workload

T = TypeVar("T")


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument(
        "--trace",
        required=True,
        metavar="FILE|synthetic",
        help="an Azure 2023 .csv or Mooncake .jsonl trace, or 'synthetic'",
    )
    g.add_argument("--rate", type=float, help="synthetic: mean arrival rate, req/s")
    g.add_argument("--num-requests", type=int, default=100, help="synthetic: request count (default 100)")
    g.add_argument(
        "--arrival",
        choices=("poisson", "gamma"),
        default="poisson",
        help="synthetic: poisson (gap CV 1) or gamma (gap CV from --burstiness)",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="synthetic gamma: coefficient of variation of inter-arrival gaps (1 = Poisson, "
        ">1 burstier, 0 = fixed interval)",
    )
    g.add_argument(
        "--input-len", default="512", help="synthetic: N (fixed), LO:HI (uniform) or 'trace' (default 512)"
    )
    g.add_argument("--output-len", default="64", help="synthetic: N, LO:HI or 'trace' (default 64)")
    g.add_argument("--lengths-from", metavar="FILE", help="synthetic: trace to sample 'trace' lengths from")
    g.add_argument("--seed", type=int, default=0, help="seed for synthetic arrivals, lengths and prompt ids")
    g.add_argument(
        "--vocab-size",
        type=int,
        default=256,
        help="prompt ids are drawn from [0, N); keep N <= the model's vocabulary (default 256)",
    )
    g.add_argument(
        "--prompt-format",
        choices=("ids", "text", "edit", "chat"),
        default="ids",
        help="send prompts as token id lists (default), as text of the exact token count, as "
        "edit: chat prompts asking to copy standard-library code with its mistakes fixed (the "
        "editing workload of speculative decoding), or as chat: chat prompts asking to explain "
        "such code (answers in the model's own words); text, edit and chat need --tokenizer",
    )
    g.add_argument(
        "--tokenizer",
        metavar="DIR|PRESET",
        default="",
        help="text prompts: the served model's directory (or a built-in preset such as tiny)",
    )
    s = p.add_argument_group("scaling (applied in this order; the report states it)")
    s.add_argument(
        "--time-scale", type=float, default=1.0, help="divide arrival times by X (X > 1 replays faster)"
    )
    s.add_argument("--duration", type=float, metavar="S", help="keep requests arriving in the first S s")
    s.add_argument("--max-requests", type=int, metavar="N", help="keep the first N requests")
    s.add_argument(
        "--hash-block-tokens",
        type=int,
        metavar="B",
        help="Mooncake traces: each hash id names B tokens instead of 512 and prompts shrink by B/512, "
        "keeping every shared prefix of the trace",
    )
    s.add_argument("--length-ratio", type=float, default=1.0, help="multiply input and output lengths by R")
    s.add_argument("--max-input-len", type=int, metavar="N", help="cap prompt lengths at N tokens")
    s.add_argument("--max-output-len", type=int, metavar="N", help="cap output lengths at N tokens")


def add_client_arguments(p: argparse.ArgumentParser, url: bool = True) -> None:
    g = p.add_argument_group("server and client")
    if url:
        g.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    g.add_argument(
        "--model",
        help="model name sent in each request (default: the one model the server lists at /v1/models)"
        if url
        else "model name sent to URL deployments (started ones use the name they announce)",
    )
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request (default 600)")
    g.add_argument(
        "--max-run-time",
        type=float,
        metavar="S",
        help="bound on one replay's wall time (default: last arrival + request timeout)",
    )
    g.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="do not send ignore_eos (for servers that reject unknown fields)",
    )
    g.add_argument("--no-usage", action="store_true", help="do not ask for stream_options.include_usage")
    g.add_argument(
        "--extra-body",
        type=json.loads,
        default={},
        metavar="JSON",
        help="extra JSON fields merged into every request body",
    )
    g.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    g.add_argument(
        "--lateness-warn-ms",
        type=float,
        default=20.0,
        help="warn when p99 send lateness exceeds this (default 20 ms)",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def add_slo_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("SLO")
    g.add_argument("--ttft-slo-ms", type=float, default=2000.0, help="TTFT SLO in ms (default 2000)")
    g.add_argument("--itl-slo-ms", type=float, default=200.0, help="ITL SLO in ms (default 200)")
    g.add_argument(
        "--itl-stat",
        choices=ITL_STATS,
        default="mean",
        help="per-request ITL statistic judged against the ITL SLO (default mean = TPOT)",
    )
    g.add_argument(
        "--target",
        type=float,
        default=0.9,
        help="attainment target for goodput and the SLO-scale sweep (default 0.9)",
    )


def workload_from_args(args: argparse.Namespace) -> Workload:
    """The workload named by ``--trace`` (or built by the synthetic flags), with scaling applied."""
    from pdfabric.bench.scaling import Scaling
    from pdfabric.bench.synthetic import LengthSpec, SyntheticConfig, generate
    from pdfabric.bench.traces import load_trace

    if args.trace == "synthetic":
        if args.rate is None:
            raise ValueError("--trace synthetic needs --rate")
        cv = 1.0 if args.arrival == "poisson" else args.burstiness
        lengths = load_trace(args.lengths_from) if args.lengths_from else None
        cfg = SyntheticConfig(
            rate=args.rate,
            num_requests=args.num_requests,
            input_len=LengthSpec.parse(args.input_len),
            output_len=LengthSpec.parse(args.output_len),
            burstiness=cv,
            seed=args.seed,
        )
        base = generate(cfg, lengths)
    else:
        base = load_trace(args.trace)
    scaling = Scaling(
        time_scale=args.time_scale,
        duration_s=args.duration,
        max_requests=args.max_requests,
        length_ratio=args.length_ratio,
        max_input_len=args.max_input_len,
        max_output_len=args.max_output_len,
        hash_block_tokens=args.hash_block_tokens,
    )
    workload = scaling.apply(base)
    if not workload.requests:
        raise ValueError("the scaled workload has no requests (check --duration and --max-requests)")
    return workload


def prompt_config(args: argparse.Namespace) -> PromptConfig:
    """The prompt settings; raises ``ValueError`` now if text prompts cannot be built."""
    from pdfabric.bench.prompts import PromptBuilder, PromptConfig

    cfg = PromptConfig(
        vocab_size=args.vocab_size, seed=args.seed, format=args.prompt_format, tokenizer=args.tokenizer
    )
    PromptBuilder(cfg).check()
    return cfg


def served_model(url: str, api_key: str | None = None, timeout_s: float = 10.0) -> str:
    """The model a server lists at ``GET /v1/models``; ``ValueError`` when it cannot be read or lists
    no model or several (then ``--model`` must choose)."""
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url.rstrip("/") + "/v1/models")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            listed = [m["id"] for m in json.load(r)["data"]]
    except (OSError, urllib.error.URLError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"no --model given and {url}/v1/models could not be read: {exc}") from None
    if len(listed) != 1:
        raise ValueError(
            f"no --model given and {url} serves {len(listed)} models "
            f"({', '.join(map(repr, listed)) or 'none'}): name one with --model"
        )
    return listed[0]


def client_from_args(args: argparse.Namespace, url: str, model: str | None = None) -> ClientConfig:
    """The client settings for ``url``; the model is ``model``, else ``--model``, else the one the
    server lists (``served_model``)."""
    from pdfabric.bench.client import ClientConfig

    model = model or args.model or served_model(url, args.api_key)
    return ClientConfig(
        url=url,
        model=model,
        request_timeout_s=args.request_timeout,
        max_run_s=args.max_run_time,
        ignore_eos=not args.no_ignore_eos,
        include_usage=not args.no_usage,
        extra_body=dict(args.extra_body),
        api_key=args.api_key,
        lateness_warn_ms=args.lateness_warn_ms,
    )


def slo_from_args(args: argparse.Namespace) -> SLO:
    if not 0 < args.target <= 1:
        raise ValueError(f"--target must be in (0, 1], got {args.target}")
    return SLO(ttft_ms=args.ttft_slo_ms, itl_ms=args.itl_slo_ms, itl_stat=args.itl_stat)


def client_meta(cfg: ClientConfig) -> dict[str, Any]:
    """What the report says about the target (never the API key)."""
    return {
        "url": cfg.url,
        "endpoint": cfg.endpoint,
        "model": cfg.model,
        "ignore_eos": cfg.ignore_eos,
        "include_usage": cfg.include_usage,
        "extra_body": cfg.extra_body,
        "request_timeout_s": cfg.request_timeout_s,
    }


def run_with_sigint(main: Callable[[asyncio.Event], Awaitable[T]]) -> T:
    """Run ``main(stop)`` on a fresh event loop; the first Ctrl-C sets ``stop``, a second one kills."""

    async def wrapper() -> T:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_sigint() -> None:
            print("\ninterrupted: stopping; writing a partial report (Ctrl-C again aborts)", file=sys.stderr)
            stop.set()
            loop.remove_signal_handler(signal.SIGINT)

        try:
            loop.add_signal_handler(signal.SIGINT, on_sigint)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
            pass
        try:
            return await main(stop)
        finally:
            try:
                loop.remove_signal_handler(signal.SIGINT)
            except (NotImplementedError, RuntimeError, ValueError):
                pass

    return asyncio.run(wrapper())


def fail(message: str) -> int:
    """Print a usage-style error and return the exit status for bad input."""
    print(f"error: {message}", file=sys.stderr)
    return 2
