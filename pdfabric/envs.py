"""Every environment variable pdfabric reads, in one place; a bad value fails loudly at import."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(value: str) -> str:
        if value not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}, got {value!r}")
        return value

    return parse


# name -> (default, parser, meaning)
REGISTRY: dict[str, tuple[str, Callable[[str], object], str]] = {
    "PDFABRIC_KERNEL_BACKEND": (
        "auto",
        _choice("auto", "torch", "cpu", "triton"),
        "attention / KV-pack kernels: auto (Triton on CUDA, the C kernel on CPUs, torch elsewhere), "
        "torch, cpu or triton",
    ),
    "PDFABRIC_CPU_AMX": (
        "on",
        _choice("on", "off"),
        "bfloat16 linear layers and attention on AMX tiles where the CPU has them (Intel since Sapphire "
        "Rapids): on, or off for the AVX512-BF16 path (docs/kernels.md); either keeps a row's result the "
        "same in any batch",
    ),
    "PDFABRIC_CACHE_DIR": (
        str(Path.home() / ".cache" / "pdfabric"),
        lambda v: str(Path(v).expanduser()),
        "where the built-in default models, the compiled CPU kernels and weights quantized at start are "
        "written",
    ),
    "PDFABRIC_CLUSTER_SECRET": (
        "",
        lambda v: v.strip(),
        "the cluster secret (when no file names it): what workers need to join a router and push KV; "
        "pdfabric serve sets it for the workers it starts (docs/security.md)",
    ),
    "CC": (
        "cc",
        lambda v: v,
        "the C compiler that builds the CPU kernels on first use (none found: the torch reference serves)",
    ),
}


def get(name: str):  # noqa: ANN201 - the type is the parser's
    """The parsed value of ``name``; raises ``ValueError`` naming the variable on a bad value."""
    default, parse, _ = REGISTRY[name]
    raw = os.environ.get(name, default)
    try:
        return parse(raw)
    except ValueError as exc:
        raise ValueError(f"environment variable {name}: {exc}") from None
