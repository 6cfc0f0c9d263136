"""What the machine can do at best, for ``pdfabric bench engine`` to set a model's points beside: the
rate of square matrix products in a dtype (the GEMM floor), the memory's read bandwidth (a sum over a
buffer far larger than the caches) and a large copy's traffic. Each is the best of several tries: a
floor is what the machine can do, and a busy moment only ever makes a try slower."""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable


def times(fn: Callable[[], object], repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn``, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def median_time(fn: Callable[[], object], repeats: int) -> float:
    return statistics.median(times(fn, repeats))


def best_time(fn: Callable[[], object], repeats: int) -> float:
    return min(times(fn, repeats))


def gemm_rate(dtype: object, repeats: int) -> float:
    """The best FLOP/s of square matrix products (1024 to 4096) in ``dtype``, plain and packed."""
    import torch

    from pdfabric.kernels.linear_cpu import can_pack
    from pdfabric.kernels.linear_onednn import PackedLinear

    best = 0.0
    for n in (1024, 2048, 4096):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        best = max(best, 2 * n**3 / best_time(lambda a=a, b=b: a @ b, max(repeats, 5)))
        layer = torch.nn.Linear(n, n, bias=False, dtype=dtype)
        if can_pack(layer, "onednn"):  # on some CPUs (MKL on AMD) faster than a @ b
            packed = PackedLinear(layer)
            best = max(best, 2 * n**3 / best_time(lambda a=a, f=packed: f(a), max(repeats, 5)))
    return best


def read_rate(repeats: int, nbytes: int = 512 * 2**20) -> float:
    """Memory read bandwidth: bytes summed per second over a buffer far larger than the caches."""
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32)
    return nbytes / best_time(lambda: src.sum(), max(2 * repeats, 10))


def copy_rate(repeats: int, nbytes: int = 256 * 2**20) -> float:
    """Memory traffic of a large copy, bytes read plus bytes written per second (best of tries)."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return 2 * nbytes / best_time(lambda: dst.copy_(src), max(2 * repeats, 10))


def cpu_name() -> str:
    """The CPU's model name and whether it multiplies bfloat16 natively, for the record."""
    from pdfabric.kernels.cpu_build import cpu_has_half_math

    name = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name} ({'native bf16' if cpu_has_half_math() else 'no native bf16'})"
