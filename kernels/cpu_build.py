"""Builds pdfabric's C kernels for this CPU once, caches the shared library on disk, loads it by ctypes.

The sources under ``kernels/csrc`` are plain C (no torch headers), so a build takes well under a
second. Each library is compiled with ``-O3 -march=native`` for the machine it runs on and cached as
``$PDFABRIC_CACHE_DIR/kernels/<name>-<hash>.so``, the hash covering the source and the shared headers
in ``csrc``, the compiler's identity, the flags and the CPU's model and feature flags, so a cache
directory shared between machines never hands one CPU another's code. Where no C compiler is found,
or the build fails, ``load`` returns ``None`` and callers use their torch reference; the reason is
logged once.
``profiled`` labels a kernel call for the torch profiler.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from pdfabric import envs

log = logging.getLogger(__name__)

SOURCES = Path(__file__).parent / "csrc"
# -fopenmp binds to libgomp.so.1, which torch has already loaded: the kernels share torch's threads.
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=c11", "-Wall", "-fopenmp")


def _cpu_identity() -> str:
    """The CPU's model name and feature flags (what ``-march=native`` compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


@functools.cache
def cpu_has_half_math() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX); read once from /proc/cpuinfo."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in flags for flag in ("avx512_bf16", "amx_bf16"))


def _compiler() -> str | None:
    return shutil.which(envs.get("CC") or "cc")


@functools.cache
def _compiler_version(cc: str) -> str:
    done = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=False)
    return done.stdout


def library_path(name: str, cc: str) -> Path:
    """Where the library built from ``csrc/<name>.c`` by ``cc`` for this CPU is cached."""
    source = (SOURCES / f"{name}.c").read_bytes()
    headers = b"".join(h.read_bytes() for h in sorted(SOURCES.glob("*.h")))  # what the sources include
    digest = hashlib.sha256()
    identity = (_compiler_version(cc), " ".join(FLAGS), _cpu_identity())
    for part in (source, headers, *(text.encode() for text in identity)):
        digest.update(part)
        digest.update(b"\0")
    root = Path(envs.get("PDFABRIC_CACHE_DIR")) / "kernels"
    return root / f"{name}-{digest.hexdigest()[:16]}.so"


def _build(name: str, cc: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [cc, *FLAGS, "-o", tmp, str(SOURCES / f"{name}.c"), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")
        os.replace(tmp, target)  # atomic: a concurrent worker loads either nothing or the whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """The library built from ``csrc/<name>.c``, built first if not cached; ``None`` if it cannot be."""
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler found (set CC): using the torch reference for %s", name)
        return None
    try:
        target = library_path(name, cc)
        if not target.is_file():
            _build(name, cc, target)
        return ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("could not build the C kernel %s, using the torch reference: %s", name, exc)
        return None


def profiled(name: str) -> contextlib.AbstractContextManager:
    """A ``pdfabric::<name>`` label for a C kernel call in the torch profiler (``bench engine
    --op-profile``); a no-op, not a few microseconds a call, when no profiler is running."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(f"pdfabric::{name}")
    return contextlib.nullcontext()
