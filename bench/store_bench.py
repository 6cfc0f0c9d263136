"""The host KV store's tiers: how fast blocks go in and come back, beside a memcpy and plain file I/O of
the same bytes, in one run (``pdfabric bench store``).

For each tier (RAM: a directory in shared memory; disk: a directory on a file system) and each
layout, ``--blocks`` blocks of a model's KV are saved through ``HostKVStore.save`` (the gather out of
the cache, the queue and the writer thread's checked files, timed until the last is published) and
read back through ``find`` and ``load`` (each file read and checked, then written into the cache's
blocks). Beside them, the same bytes as one memcpy, written as plain files (one per block, no header
or check) and read back as plain files. The disk tier's reads come from the page cache when the
files are still in it (they are, right after writing, unless memory is short): the row measures the
store's own cost, not the device. Then the write-back: the same blocks saved through a RAM tier a
quarter of their size onto a disk tier that holds them all (``save, RAM full``) and onto one half of
their size (``save, both full``), with the writer thread's CPU time per block.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# (layers, kv heads, head dim): the KV of one token in each layer; bfloat16, blocks of 16 tokens
LAYOUTS = {"smollm2-135m": (30, 3, 64), "cpu-small": (12, 8, 64)}
BLOCK = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"subset of {','.join(LAYOUTS)}")
    parser.add_argument("--blocks", type=int, default=256, help="blocks saved and loaded per repeat")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per row (median reported)")
    parser.add_argument(
        "--ram-dir", help="the RAM tier's directory (default: a fresh one beside the store's default)"
    )
    parser.add_argument("--disk-dir", help="the disk tier's directory (default: a fresh one in the temp dir)")
    parser.add_argument("--json", help="write the results here as JSON")


def run(args: argparse.Namespace) -> int:
    import torch

    from pdfabric.kvtransfer.host_store import default_ram_dir

    layouts = [name for name in args.layouts.split(",") if name]
    if any(name not in LAYOUTS for name in layouts) or args.blocks < 1 or args.repeats < 1:
        print(
            f"bench store: layouts must be among {', '.join(LAYOUTS)}; blocks, repeats >= 1", file=sys.stderr
        )
        return 2
    torch.set_num_threads(1)
    tag = f"pdfabric-store-bench-{os.getpid()}"
    dirs = {
        "ram": Path(args.ram_dir or default_ram_dir().parent / tag),
        "disk": Path(args.disk_dir or Path(tempfile.gettempdir()) / tag),
    }
    rows: list[dict[str, Any]] = []
    try:
        for name in layouts:
            for tier, where in dirs.items():
                rows += _tier_rows(name, tier, where / name, args.blocks, args.repeats)
                print(_table(rows[-5:]), flush=True)
            for disk_full in (False, True):
                rows.append(_moving_down_row(name, dirs, args.blocks, args.repeats, disk_full))
                print(_moving_down_line(rows[-1]), flush=True)
    finally:
        for where in dirs.values():
            if not (args.ram_dir if where == dirs["ram"] else args.disk_dir):
                shutil.rmtree(where, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"blocks": args.blocks, "rows": rows}, indent=2))
    return 0


def _tier_rows(layout: str, tier: str, where: Path, blocks: int, repeats: int) -> list[dict[str, Any]]:
    """The five rows of one tier and layout: memcpy, plain write, store save, plain read, store load."""
    import torch

    from pdfabric.kvtransfer.host_store import HostKVStore
    from pdfabric.worker_config import WorkerConfig

    caches = _caches(layout, 2 * blocks)
    mb = _store_mb(layout, (repeats + 1) * blocks)  # every repeat's blocks
    settings = {"kv_store_ram_mb": mb, "kv_store_ram_dir": str(where / "store")} if tier == "ram" else {
        "kv_store_disk_dir": str(where / "store"), "kv_store_disk_mb": mb, "kv_store_disk_admission": "all",
    }  # fmt: skip
    cfg = WorkerConfig(kind="colocated", **settings)  # type: ignore[arg-type]
    times: dict[str, list[float]] = {k: [] for k in ("memcpy", "file write", "save", "file read", "load")}
    shutil.rmtree(where, ignore_errors=True)
    store = HostKVStore(cfg, b"bench", lambda: caches)
    try:
        for r in range(repeats):  # one store, as a worker has: its staging buffers are reused
            shutil.rmtree(where / "plain", ignore_errors=True)
            (where / "plain").mkdir(parents=True)
            for op, seconds in _one_repeat(store, where / "plain", blocks, r).items():
                times[op].append(seconds)
            if not all(torch.equal(c[:, :blocks], c[:, blocks:]) for c in caches):
                raise RuntimeError(f"{tier} tier: the loaded blocks differ from those saved")
    finally:
        store.close()
        shutil.rmtree(where, ignore_errors=True)
    nbytes = store.payload_bytes * blocks
    return [
        {"layout": layout, "tier": tier, "op": op, "bytes": nbytes, "seconds": statistics.median(t),
         "gb_per_s": nbytes / statistics.median(t) / 1e9}
        for op, t in times.items()
    ]  # fmt: skip


def _one_repeat(store: Any, plain: Path, blocks: int, r: int) -> dict[str, float]:
    """Seconds of each operation on blocks ``0 .. blocks - 1``, loaded back into the blocks after them
    (under prefix hashes of repeat ``r``'s own)."""
    ids = list(range(blocks))
    hashes = [(r * blocks + i).to_bytes(16, "little") for i in ids]
    payload = store.gather(ids)  # the bytes every row moves: [blocks, layers, 2, block bytes]
    copy = payload.clone()  # its pages touched: the memcpy row is the copy alone
    marks = [time.perf_counter()]
    copy.copy_(payload)
    marks.append(time.perf_counter())
    for i, row in enumerate(payload):
        (plain / f"{i}.bin").write_bytes(memoryview(row.reshape(-1).numpy()))
    marks.append(time.perf_counter())
    store.flush(ids, hashes, timeout_s=600)  # gather, queue, write and publish every block
    marks.append(time.perf_counter())
    for i in ids:
        (plain / f"{i}.bin").read_bytes()
    marks.append(time.perf_counter())
    loaded = store.load(hashes, [blocks + i for i in ids])  # read, check, scatter into the cache
    marks.append(time.perf_counter())
    if loaded != blocks:
        raise RuntimeError(f"loaded {loaded} of {blocks} blocks")
    ops = ("memcpy", "file write", "save", "file read", "load")
    return {op: marks[i + 1] - marks[i] for i, op in enumerate(ops)}


def _caches(layout: str, num_blocks: int) -> list[Any]:
    """A cache of ``num_blocks`` blocks of random bfloat16 KV per layer of ``layout``."""
    import torch

    layers, heads, dim = LAYOUTS[layout]
    return [torch.randn(2, num_blocks, BLOCK, heads, dim).to(torch.bfloat16) for _ in range(layers)]


def _store_mb(layout: str, blocks: int) -> int:
    """MiB a tier needs for ``blocks`` blocks of ``layout``, headers and slack included."""
    layers, heads, dim = LAYOUTS[layout]
    return layers * 2 * blocks * BLOCK * heads * dim * 2 // 2**20 + 16


def _moving_down_row(
    layout: str, dirs: dict[str, Path], blocks: int, repeats: int, disk_full: bool
) -> dict[str, Any]:
    """Saves through a RAM tier a quarter of ``blocks`` in size, the rest moving down to disk; a disk
    tier half of ``blocks`` in size if ``disk_full`` (both tiers evict, as on a host that has run a
    while), else one that holds them all."""

    from pdfabric.kvtransfer.host_store import HostKVStore
    from pdfabric.kvtransfer.store_tier import HEADER
    from pdfabric.worker_config import WorkerConfig

    caches = _caches(layout, blocks)
    ram, disk = dirs["ram"] / layout / "down", dirs["disk"] / layout / "down"
    mb = _store_mb(layout, blocks)
    seconds: list[float] = []
    cpu: list[float] = []
    for r in range(repeats):
        for where in (ram, disk):
            shutil.rmtree(where, ignore_errors=True)
        cfg = WorkerConfig(
            kind="colocated", kv_store_ram_dir=str(ram), kv_store_ram_mb=mb, kv_store_disk_dir=str(disk),
            kv_store_disk_mb=mb, kv_store_disk_admission="all",
        )  # fmt: skip
        store = HostKVStore(cfg, b"bench", lambda: caches)
        try:
            assert store.ram is not None and store.disk is not None
            block = HEADER.size + store.payload_bytes
            store.ram.capacity = max(1, blocks // 4) * block
            if disk_full:
                store.disk.capacity = max(1, blocks // 2) * block
            before, start = _thread_cpu(store.writer.native_id), time.perf_counter()
            ids = list(range(blocks))
            store.flush(ids, [(r * blocks + i).to_bytes(16, "little") for i in ids], timeout_s=600)
            seconds.append(time.perf_counter() - start)
            after = _thread_cpu(store.writer.native_id)
            if before is not None and after is not None:
                cpu.append((after - before) / blocks)
            if store.disk.stats.writes == 0:
                raise RuntimeError("moving down: RAM let nothing go to the disk")
        finally:
            store.close()
            for where in (ram, disk):
                shutil.rmtree(where, ignore_errors=True)
    nbytes = store.payload_bytes * blocks
    return {
        "layout": layout, "tier": "ram>disk", "op": "save, both full" if disk_full else "save, RAM full",
        "bytes": nbytes,
        "seconds": statistics.median(seconds), "gb_per_s": nbytes / statistics.median(seconds) / 1e9,
        "writer_cpu_ms_per_block": statistics.median(cpu) * 1e3 if cpu else None,
    }  # fmt: skip


def _thread_cpu(tid: int | None) -> float | None:
    """CPU seconds (user and kernel) thread ``tid`` of this process has used, or ``None`` (no ``/proc``)."""
    try:
        fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _moving_down_line(row: dict[str, Any]) -> str:
    cpu = row["writer_cpu_ms_per_block"]
    per_block = f", the writer thread's CPU {cpu:.2f} ms a block" if cpu is not None else ""
    onto = "a full disk tier" if row["op"] == "save, both full" else "disk"
    return (
        f"{row['layout']}: saved through a full RAM tier onto {onto}, {row['bytes'] / 2**20:.1f} MiB in "
        f"{row['seconds'] * 1e3:.1f} ms, {row['gb_per_s']:.2f} GB/s{per_block}\n"
    )


def _table(rows: list[dict[str, Any]]) -> str:
    head = f"{'layout':<14}{'tier':<6}{'operation':<12}{'MiB':>8}{'ms':>10}{'GB/s':>8}"
    lines = [head, "-" * len(head)]
    for row in rows:
        lines.append(
            f"{row['layout']:<14}{row['tier']:<6}{row['op']:<12}{row['bytes'] / 2**20:>8.1f}"
            f"{row['seconds'] * 1e3:>10.1f}{row['gb_per_s']:>8.2f}"
        )
    return "\n".join(lines)
