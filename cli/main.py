"""The ``pdfabric`` command line: one table of commands, each a module imported only when used.

Each command module provides ``add_arguments(parser)`` and ``run(args) -> int`` and keeps heavy
imports (torch) inside ``run`` so that ``pdfabric --help`` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (words, module, one-line help)
COMMANDS: list[tuple[tuple[str, ...], str, str]] = [
    (("serve",), "pdfabric.cli.launcher", "start a router and its prefill / decode / colocated workers"),
    (("worker",), "pdfabric.cli.worker_cli", "run one worker that joins a router"),
    (
        ("admin",),
        "pdfabric.cli.admin_cli",
        "a router's admin API: models, weights, rollouts, versions, usage",
    ),
    (
        ("profile",),
        "pdfabric.cli.profile_cmd",
        "measure a worker's step times and KV transfer rates into a file",
    ),
    (("plan",), "pdfabric.bench.plan_cmd", "the prefill:decode split and batch caps by simulated goodput"),
    (
        ("generate",),
        "pdfabric.engine.generate",
        "single-process reference generation through the paged cache",
    ),
    (
        ("bench", "engine"),
        "pdfabric.bench.engine_bench",
        "prefill and decode speed beside the machine's floors",
    ),
    (
        ("bench", "embeddings"),
        "pdfabric.bench.embed_bench",
        "/v1/embeddings at saturation beside the engine's prefill rate; latency under Poisson load",
    ),
    (
        ("bench", "batch-impact"),
        "pdfabric.bench.batch_impact",
        "online latency alone and beside a running /v1/batches job",
    ),
    (
        ("bench", "batch-faults"),
        "pdfabric.bench.batch_faults",
        "a batch job run to its end through a kill -9 of a worker and of the router",
    ),
    (("bench", "transfer"), "pdfabric.bench.transfer", "KV transfer bandwidth per transport beside memcpy"),
    (
        ("bench", "store"),
        "pdfabric.bench.store_bench",
        "the host KV store's tiers beside memcpy and file I/O",
    ),
    (
        ("bench", "perplexity"),
        "pdfabric.bench.perplexity",
        "how well a model predicts a held text, per weight format",
    ),
    (("bench", "kernels"), "pdfabric.bench.kernels_bench", "attention, linears vs cuBLAS, KV pack on a GPU"),
    (("bench", "replay"), "pdfabric.bench.replay_cmd", "replay a trace open-loop: TTFT, ITL, SLO attainment"),
    (("bench", "goodput"), "pdfabric.bench.goodput_cmd", "highest rate meeting both SLOs (rate search)"),
    (("bench", "compare"), "pdfabric.bench.compare_cmd", "one workload against several servers side by side"),
    (("bench", "chaos"), "pdfabric.bench.chaos_cmd", "kill workers mid-replay: failovers, losses, delay"),
    (("bench", "rescore"), "pdfabric.bench.rescore_cmd", "goodput of saved rate searches under another SLO"),
    (("bench", "simulate"), "pdfabric.bench.simulate_cmd", "replay a workload on a simulated deployment"),
]


def _usage() -> str:
    width = max(len(" ".join(words)) for words, _, _ in COMMANDS)
    lines = ["usage: pdfabric COMMAND [options]   (pdfabric COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {' '.join(words):<{width}}  {help_}" for words, _, help_ in COMMANDS]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    for words, module, help_ in COMMANDS:
        if argv[: len(words)] == list(words):
            mod = importlib.import_module(module)
            parser = argparse.ArgumentParser(prog="pdfabric " + " ".join(words), description=help_)
            mod.add_arguments(parser)
            args = parser.parse_args(argv[len(words) :])
            return int(mod.run(args) or 0)
    if argv and argv[0] == "--version":
        from pdfabric import __version__

        print(__version__)
        return 0
    print(_usage(), file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
    return 0 if not argv or argv[0] in ("-h", "--help") else 2


if __name__ == "__main__":
    sys.exit(main())
