"""The host KV store: block files checked on reading, tiers bounded and least-recently-used, crash
safety (a writer killed mid-write leaves nothing readable as valid), the admission rule, and with the
real model: prompts whose prefixes the pool evicted, or that a restarted worker never computed, read
them from the store and give the reference's tokens, with no block leaked."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pdfabric.control import Generate, Prefill, Reserve, Reserved, StepOutputs, TokenDelta
from pdfabric.decode.core import ColocatedCore, DecodeCore
from pdfabric.engine.block_pool import chain_hashes
from pdfabric.kvtransfer.host_store import HostKVStore
from pdfabric.kvtransfer.state import TransferResult, TransferState
from pdfabric.kvtransfer.store_tier import HEADER, TMP_PREFIX, TierDir
from pdfabric.profile import WorkerProfile
from pdfabric.sampling_params import SamplingParams
from pdfabric.worker.core import WorkerCore
from pdfabric.worker.kv import PushKV
from pdfabric.worker.spec import FixedProfile
from pdfabric.worker_config import WorkerConfig
from tests.core_helpers import core_spec
from tests.test_worker_core import _tokens

KEY = bytes(range(16))


def _files(path: Path) -> list[Path]:
    return sorted(path.glob("*.kv"))


def test_a_block_file_reads_back_only_whole_and_unchanged(tmp_path: Path) -> None:
    tier = TierDir("ram", tmp_path, 1 << 20)
    payload = os.urandom(1000)
    assert tier.write(KEY, payload) and tier.read(KEY, 1000) == payload
    assert tier.read(KEY, 999) is None  # another length than the layout's: never served
    assert tier.read(b"\x01" * 16, 1000) is None and tier.stats.bad == 1  # the miss is not bad
    tier.write(KEY, payload)
    path = tier.file(KEY)
    data = bytearray(path.read_bytes())
    data[HEADER.size + 500] ^= 1  # one bit flipped on disk
    path.write_bytes(data)
    assert tier.read(KEY, 1000) is None and not path.exists() and tier.stats.bad == 2  # dropped
    tier.write(KEY, payload)
    path.write_bytes(path.read_bytes()[:-10])  # torn
    assert tier.read(KEY, 1000) is None and not path.exists()
    other = bytes(16)
    tier.write(other, payload)
    tier.file(other).rename(tier.file(KEY))  # a file under another block's name
    assert tier.read(KEY, 1000) is None


def test_a_tier_stays_within_its_capacity_dropping_the_least_recently_used(tmp_path: Path) -> None:
    tier = TierDir("disk", tmp_path, 10 * (HEADER.size + 1000))
    keys = [bytes([i]) * 16 for i in range(12)]
    for i, key in enumerate(keys):
        tier.write(key, bytes([i]) * 1000)
        os.utime(tier.file(key), (1000 + i, 1000 + i))  # written one after the other
        if i == 5:
            tier.read(keys[0], 1000)  # read back: the most recent now
            os.utime(tier.file(keys[0]), (1005.5, 1005.5))
        if tier.over():
            tier.evict()
    held = {TierDir.key_of(p) for p in _files(tmp_path)}
    assert keys[0] in held and keys[1] not in held and keys[11] in held
    assert tier.used <= tier.capacity and tier.stats.evictions >= 2
    assert TierDir("disk", tmp_path, tier.capacity).used == tier.used  # a new process counts the same


def _footprint(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir())


def test_a_full_tier_writes_its_next_blocks_over_the_files_it_evicted(tmp_path: Path) -> None:
    block = HEADER.size + 1000
    tier = TierDir("disk", tmp_path, 20 * block)
    payloads = {bytes([i]) * 16: bytes([i]) * 1000 for i in range(60)}
    for n, (key, payload) in enumerate(payloads.items()):
        assert tier.write(key, payload)
        if tier.over():
            tier.evict()  # two blocks down to the low-water mark: kept as spares, not deleted
            spares = {p.stat().st_ino for p in tmp_path.glob(f"{TMP_PREFIX}*")}
            assert spares and tier.spares.bytes == len(spares) * block
        elif n > 20:
            assert tier.file(key).stat().st_ino in spares  # written over an evicted file
        assert _footprint(tmp_path) <= tier.capacity  # blocks and spares within the capacity
    held = _files(tmp_path)
    assert len(held) >= 18 and tier.stats.evictions == 60 - len(held)
    for path in held:
        key = TierDir.key_of(path)
        assert key is not None and tier.read(key, 1000) == payloads[key]
    assert TierDir("disk", tmp_path, tier.capacity).used == tier.used + tier.spares.bytes  # others' count
    tier.close()
    assert not list(tmp_path.glob(f"{TMP_PREFIX}*")) and len(_files(tmp_path)) == len(held)


def test_a_spare_file_a_reader_holds_is_not_written_over(tmp_path: Path) -> None:
    import fcntl

    tier = TierDir("ram", tmp_path, 10 * (HEADER.size + 1000))
    first, second = b"\x01" * 16, b"\x02" * 16
    tier.write(first, b"a" * 1000)
    data = tier.file(first).read_bytes()
    with open(tier.file(first), "rb") as reader:  # a reader mid-read holds its shared lock
        fcntl.flock(reader, fcntl.LOCK_SH)
        tier.remove(tier.file(first))  # evicted: a spare now
        assert tier.spares.bytes and tier.write(second, b"b" * 1000)
        assert tier.file(second).stat().st_ino != os.fstat(reader.fileno()).st_ino  # a new file
        assert reader.read() == data  # the reader's bytes are the block it opened, whole
    assert tier.read(second, 1000) == b"b" * 1000 and tier.read(first, 1000) is None
    assert tier.stats.bad == 0


def test_readers_beside_a_recycling_writer_get_whole_blocks_or_misses(tmp_path: Path) -> None:
    tier = TierDir("ram", tmp_path, 8 * (HEADER.size + 20_000))
    keys = [i.to_bytes(16, "little") for i in range(64)]
    stop = threading.Event()
    reads: list[int] = []

    def read() -> None:
        buf = memoryview(bytearray(HEADER.size + 20_000))
        while not stop.is_set():
            for i, key in enumerate(keys):
                if tier.read_into(key, buf, used=False):
                    assert bytes(buf[HEADER.size :]) == bytes([i]) * 20_000
                    reads.append(i)

    readers = [threading.Thread(target=read) for _ in range(2)]
    for t in readers:
        t.start()
    try:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            for i, key in enumerate(keys):
                tier.write(key, bytes([i]) * 20_000)
                if tier.over():
                    tier.evict()
    finally:
        stop.set()
        for t in readers:
            t.join(timeout=10)
    assert reads and tier.stats.bad == 0 and tier.stats.evictions > 64


def test_a_failed_write_keeps_nothing_and_makes_room(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = TierDir("disk", tmp_path, 4 * (HEADER.size + 100))
    for i in range(4):
        tier.write(bytes([i]) * 16, bytes(100))
    real_replace = os.replace

    def full(src: str, dst: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    assert not tier.write(KEY, bytes(100))
    monkeypatch.setattr(os, "replace", real_replace)
    assert not tier.has(KEY) and tier.stats.write_errors == 1
    assert not list(tmp_path.glob(f"{TMP_PREFIX}*"))  # the temporary file is gone
    assert len(_files(tmp_path)) < 4  # room was made for the next write
    assert tier.write(KEY, bytes(100)) and tier.read(KEY, 100) == bytes(100)


_WRITER = """
import os, sys
from pdfabric.kvtransfer.store_tier import TierDir
tier = TierDir("disk", sys.argv[1], int(sys.argv[2]))
print("ready", flush=True)
i = 0
while True:
    if tier.write(i.to_bytes(16, "little"), bytes([i % 251]) * 200_000) and tier.over():
        tier.evict()
    i += 1
"""


@pytest.mark.parametrize("capacity", [1 << 30, 8 * 200_100], ids=["room", "full"])
def test_a_writer_killed_mid_write_leaves_no_block_that_reads_as_valid(tmp_path: Path, capacity: int) -> None:
    # full: the writer evicts as it goes and writes over the files it evicted
    cmd = [sys.executable, "-c", _WRITER, str(tmp_path), str(capacity)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        time.sleep(0.3)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    tier = TierDir("disk", tmp_path, 1 << 30)  # the next start: dead writers' temporaries removed
    assert not list(tmp_path.glob(f"{TMP_PREFIX}*"))
    files = _files(tmp_path)
    assert files
    for path in files:
        key = TierDir.key_of(path)
        assert key is not None
        i = int.from_bytes(key, "little")
        assert tier.read(key, 200_000) == bytes([i % 251]) * 200_000


def _caches(num_blocks: int = 8) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(2, num_blocks, 4, 2, 8, generator=gen).to(torch.bfloat16) for _ in range(3)]


def _store(caches: list[torch.Tensor], tmp_path: Path, salt: bytes = b"s", **kw: object) -> HostKVStore:
    kw.setdefault("kv_store_ram_mb", 1)
    kw.setdefault("kv_store_ram_dir", str(tmp_path / "ram"))
    cfg = WorkerConfig(kind="colocated", **kw)  # type: ignore[arg-type]
    return HostKVStore(cfg, salt, lambda: caches)


def _settle(store: HostKVStore) -> None:
    store.flush([], [])


def test_saved_blocks_load_into_other_blocks_and_only_under_their_salt(tmp_path: Path) -> None:
    caches = _caches()
    store = _store(caches, tmp_path)
    try:
        hashes = [b"a" * 16, b"b" * 16, b"c" * 16]
        store.save([5, 1, 6], hashes)
        _settle(store)
        assert store.find([*hashes, b"d" * 16]) == 3 and store.find([b"d" * 16, *hashes]) == 0
        before = [c.clone() for c in caches]
        assert store.load(hashes[:2], [2, 3]) == 2
        for cache, old in zip(caches, before, strict=True):
            assert torch.equal(cache[:, 2], old[:, 5]) and torch.equal(cache[:, 3], old[:, 1])
            assert torch.equal(cache[:, 4], old[:, 4])  # nothing else written
        other = _store(caches, tmp_path, salt=b"another model")
        assert other.find(hashes) == 0 and other.load(hashes, [0, 1, 2]) == 0
        other.close()
        assert store.ram is not None and (store.ram.stats.hits, store.ram.stats.writes) == (2, 3)
    finally:
        store.close()


def stalled(write: Callable[..., None], until: threading.Event) -> Callable[..., None]:
    """``write`` that first waits for ``until`` (a writer thread busy elsewhere)."""

    def wait_then_write(*args: object) -> None:
        until.wait(30)
        write(*args)

    return wait_then_write


def test_one_prompts_evictions_are_never_dropped_whatever_queue_mb_says(tmp_path: Path) -> None:
    """A decode worker's reservation of a prompt, or a hit read from the store, may evict up to a
    longest prompt's blocks in one allocation: the staging buffers hold at least ``burst_blocks`` (a
    dropped block would end every later hit of its prefix there), even with the writer busy."""
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, 200, 4, 2, 64, generator=gen).to(torch.bfloat16) for _ in range(3)]
    hashes = [i.to_bytes(16, "little") for i in range(1, 201)]
    cfg = WorkerConfig(
        kind="colocated", kv_store_ram_mb=4, kv_store_ram_dir=str(tmp_path / "ram"), kv_store_queue_mb=1
    )
    for burst, dropped in ((0, True), (200, False)):  # 1 MiB: 10 buffers of 16 such blocks
        store = HostKVStore(cfg, bytes([burst % 251]), lambda: caches, burst_blocks=burst)
        busy = threading.Event()
        store.writer._write = stalled(store.writer._write, busy)  # type: ignore[method-assign]
        try:
            store.save(list(range(200)), hashes)  # while the writer has written nothing yet
            assert (store.dropped > 0) is dropped
            busy.set()
            _settle(store)
            assert (store.find(hashes) == 200) is not dropped
        finally:
            busy.set()
            store.close()


def test_a_full_write_queue_drops_saves_instead_of_waiting(tmp_path: Path) -> None:
    caches = _caches()
    store = _store(caches, tmp_path)
    store.writer.buffers = 1
    held = store.writer.buffer()  # the one staging buffer, as if the writer were still busy with it
    try:
        store.save([0, 1], [b"a" * 16, b"b" * 16])
        assert store.dropped == 2 and store.find([b"a" * 16]) == 0
        assert held is not None
        store.writer._free.put(held)  # written
        store.save([0, 1], [b"a" * 16, b"b" * 16])
        _settle(store)
        assert store.find([b"a" * 16, b"b" * 16]) == 2 and store.dropped == 2
    finally:
        store.close()


def test_the_disk_takes_what_ram_lets_go_by_the_admission_rule(tmp_path: Path) -> None:
    caches = _caches(64)
    one = (2 * 3 * 4 * 2 * 8 * 2) + HEADER.size  # a block file: 3 layers of keys and values
    hashes = [bytes([i]) * 16 for i in range(40)]
    for admission in ("all", "reused"):
        disk = tmp_path / f"disk-{admission}"
        store = _store(caches, tmp_path / admission, kv_store_disk_dir=str(disk), kv_store_disk_mb=1,
                       kv_store_disk_admission=admission)  # fmt: skip
        assert store.ram is not None
        store.ram.capacity = 10 * one
        try:
            store.save(list(range(20)), hashes[:20])
            _settle(store)
            assert len(_files(tmp_path / admission / "ram")) <= 10
            on_disk = len(_files(disk))
            if admission == "all":
                assert on_disk >= 10 and store.find(hashes[:20]) == 20  # nothing lost, RAM or disk
            else:
                assert on_disk == 0  # each offered once: none admitted
                assert store.load(hashes[15:17], [40, 41]) == 2  # read back: admitted when they leave
                store.save(list(range(10)), hashes[:10])  # those that left RAM, offered again
                store.save(list(range(20, 40)), hashes[20:40])  # pushes everything out of RAM
                _settle(store)
                held = {TierDir.key_of(p) for p in _files(disk)}
                assert {store.key(h) for h in hashes[:10] + hashes[15:17]} <= held
                assert not {store.key(h) for h in hashes[10:15] + hashes[17:20]} & held
        finally:
            store.close()
    restarted = _store(caches, tmp_path / "all", kv_store_disk_dir=str(tmp_path / "disk-all"),
                       kv_store_disk_mb=1)  # fmt: skip
    try:
        assert restarted.find(hashes[:20]) == 20 and restarted.load(hashes[:20], list(range(20, 40))) == 20
    finally:
        restarted.close()


def test_a_block_moves_down_as_it_was_and_one_the_disk_holds_is_not_written_again(tmp_path: Path) -> None:
    """RAM's oldest block goes to the disk as RAM held it, header and all; a disk hit copied up to RAM
    that leaves RAM again only has its disk file's recency refreshed, not written a second time."""
    caches = _caches(64)
    one = (2 * 3 * 4 * 2 * 8 * 2) + HEADER.size
    hashes = [bytes([i + 1]) * 16 for i in range(40)]
    store = _store(caches, tmp_path, kv_store_disk_dir=str(tmp_path / "disk"), kv_store_disk_mb=1,
                   kv_store_disk_admission="all")  # fmt: skip
    assert store.ram is not None and store.disk is not None
    store.ram.capacity = 10 * one
    try:
        store.save([0], hashes[:1])
        _settle(store)
        in_ram = store.ram.file(store.key(hashes[0])).read_bytes()
        store.save(list(range(1, 20)), hashes[1:20])  # the first block goes down
        _settle(store)
        on_disk = store.disk.file(store.key(hashes[0]))
        assert not store.ram.has(store.key(hashes[0])) and on_disk.read_bytes() == in_ram
        assert store.load(hashes[:1], [40]) == 1  # a disk hit: copied up to RAM
        _settle(store)
        assert store.ram.has(store.key(hashes[0]))
        inode = on_disk.stat().st_ino
        os.utime(on_disk, (1, 1))
        store.save(list(range(20, 40)), hashes[20:40])  # pushes it out of RAM again
        _settle(store)
        assert not store.ram.has(store.key(hashes[0]))
        assert on_disk.stat().st_ino == inode and on_disk.stat().st_mtime > 1  # kept, refreshed
        assert store.disk.stats.writes == len(_files(tmp_path / "disk"))  # each block written once
        assert store.load(hashes[:1], [41]) == 1
        for cache in caches:
            assert torch.equal(cache[:, 41], cache[:, 0])
    finally:
        store.close()


def test_a_store_reports_the_prefixes_of_the_blocks_it_deleted_by_their_owner(tmp_path: Path) -> None:
    """What the writer deletes to make room (not what RAM moves down to disk) comes back as prefix
    hashes: its own model's blocks for its own view of the store, another model's by the identity of
    the store that wrote them (kept through RAM's move down to disk); the router drops each from the
    view it was credited to."""
    from dataclasses import replace

    from pdfabric.control import Heartbeat, Register
    from pdfabric.router.routing.registry import Registry, store_key

    caches = _caches(64)
    one = (2 * 3 * 4 * 2 * 8 * 2) + HEADER.size  # a block file
    hashes = [bytes([i + 1]) * 16 for i in range(30)]  # (sixteen zero bytes mean "no prefix hash")
    store = _store(caches, tmp_path, kv_store_disk_dir=str(tmp_path / "disk"), kv_store_disk_mb=1,
                   kv_store_disk_admission="all")  # fmt: skip
    other = _store(caches, tmp_path, salt=b"another model")  # the same RAM directory
    assert store.ram is not None and store.disk is not None and other.ram is not None
    store.ram.capacity, store.disk.capacity = 10 * one, 6 * one
    try:
        other.save([0, 1], [b"x" * 16, b"y" * 16])
        _settle(other)
        store.save(list(range(20)), hashes[:20])  # RAM lets 10 or more go, the disk keeps 6 of them
        _settle(store)
        dropped = store.take_dropped()
        assert dropped and store.take_dropped() == ()
        assert set(dropped) <= set(hashes[:20])  # never the other model's two blocks
        assert all(store.find([h]) == 0 for h in dropped)  # gone from both tiers
        kept = [h for h in hashes[:20] if h not in dropped]
        assert all(store.find([h]) == 1 for h in kept)  # what moved to the disk is not reported
        assert len(kept) > 10 and len(_files(tmp_path / "disk")) > 0  # RAM's ten and the disk's
        # the other model's two blocks, the oldest, went down to the disk and off it first
        theirs = (b"x" * 16, b"y" * 16)
        assert all(other.find([h]) == 0 for h in theirs)
        assert store.take_dropped_others() == {other.ident: theirs} and store.take_dropped_others() == {}
        reg = Register("w", "colocated", "default", "tiny", 4096, 4, 8, "", 1, 8, 512, 1000, WorkerProfile(),
                       kv_store=store.ident, kv_store_blocks=store.capacity_blocks)  # fmt: skip
        reg_other = replace(reg, worker_id="v", model="other", kv_store=other.ident)
        registry = Registry()
        registry.register(reg)
        registry.register(reg_other)
        beat = Heartbeat("w", 0, 0, 0, 8, 8, 0.0, 0, 0.0, WorkerProfile())
        registry.heartbeat(replace(beat, worker_id="v", evicted=theirs))
        registry.heartbeat(replace(beat, evicted=tuple(hashes[:20])))
        assert registry.stores.cached_blocks(store_key(reg_other), theirs) == 2
        registry.heartbeat(replace(beat, store_dropped=dropped, store_dropped_others={other.ident: theirs}))
        held = [h for h in hashes[:20] if registry.stores.cached_blocks(store_key(reg), [h])]
        assert held == kept
        assert registry.stores.cached_blocks(store_key(reg_other), theirs) == 0
    finally:
        store.close()
        other.close()


def test_a_block_that_fails_its_check_as_another_model_moves_it_down_is_reported_to_its_owner(
    tmp_path: Path,
) -> None:
    """A worker moving RAM's oldest blocks down to disk that finds another model's file corrupted
    deletes it and, its header being intact (the header has a checksum of its own), reports it by
    its owner; its own model's corrupted block once, in ``take_dropped``. A file whose header is
    damaged names nobody that could be trusted: deleted, and reported by no one."""
    caches = _caches(64)
    one = (2 * 3 * 4 * 2 * 8 * 2) + HEADER.size  # a block file
    hashes = [bytes([i + 1]) * 16 for i in range(20)]
    store = _store(caches, tmp_path, kv_store_disk_dir=str(tmp_path / "disk"), kv_store_disk_mb=1,
                   kv_store_disk_admission="all")  # fmt: skip
    other = _store(caches, tmp_path, salt=b"another model", kv_store_disk_dir=str(tmp_path / "disk"),
                   kv_store_disk_mb=1)  # fmt: skip
    assert store.ram is not None and store.disk is not None and other.ram is not None
    store.ram.capacity = 10 * one
    theirs = (b"x" * 16, b"y" * 16, b"z" * 16)
    try:
        other.save([0, 1, 2], list(theirs))
        _settle(other)
        store.save([3], hashes[:1])
        _settle(store)
        for key, at in ((other.key(theirs[0]), HEADER.size + 7), (other.key(theirs[1]), 20),
                        (store.key(hashes[0]), HEADER.size + 3)):  # fmt: skip
            path = store.ram.file(key)
            data = bytearray(path.read_bytes())
            data[at] ^= 1  # a payload's bit, the second one's header's, our own block's payload
            path.write_bytes(data)
        store.save(list(range(4, 19)), hashes[1:16])  # RAM lets the oldest go down to the disk
        _settle(store)
        assert store.ram.stats.bad == 3 and all(other.find([h]) == 0 for h in theirs[:2])
        assert other.find(theirs[2:]) == 1  # moved down whole: not reported
        assert store.take_dropped_others() == {other.ident: theirs[:1]}
        assert store.take_dropped() == tuple(hashes[:1]) and store.find(hashes[:1]) == 0
    finally:
        store.close()
        other.close()


# --- with the real model --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny() -> tuple:
    from pdfabric.engine.generate import ReferenceEngine

    return ReferenceEngine("tiny"), Path(ReferenceEngine("tiny").path)


def _worker(path: Path, tmp_path: Path, num_blocks: int, **store: object) -> tuple:
    from pdfabric.engine.loader import load_model
    from pdfabric.engine.runner import ModelRunner
    from pdfabric.engine.stepper import Stepper

    runner = ModelRunner(load_model(path), num_blocks, 16)
    cfg = dict(block_size=16, max_model_len=2048, max_running=4, max_batch_tokens=64, model="tiny",
               prefix_caching=True, kv_store_ram_mb=4, kv_store_ram_dir=str(tmp_path / "ram"),
               kv_store_disk_dir=str(tmp_path / "disk"), kv_store_disk_mb=8, **store)  # fmt: skip
    spec = core_spec("colocated", num_blocks, **cfg)
    store = HostKVStore(spec.config, b"tiny", lambda: runner.kv_caches, runner.kv_tiled)
    return ColocatedCore(spec, FixedProfile(WorkerProfile()), store=store), Stepper(runner), store


def _drain(core: WorkerCore, stepper: object) -> list[object]:
    """Steps ``core`` with the real model until it has no work; every message its steps sent."""
    sent: list[object] = []
    while core.has_work:
        step = core.schedule()
        assert step is not None
        sent += core.complete(step, stepper.run(step.chunks, core.tables), 0.01)  # type: ignore[attr-defined]
    return sent


def _deltas(sent: list[object]) -> list[TokenDelta]:
    return [d for m in sent if isinstance(m, StepOutputs) for d in m.deltas]


def _serve(core: ColocatedCore, stepper: object, requests: dict[str, tuple[int, ...]]) -> list[TokenDelta]:
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    for rid, prompt in requests.items():
        core.handle(Generate(rid, prompt, params, ()))
    return _deltas(_drain(core, stepper))


def test_prefixes_the_pool_evicted_or_a_restart_lost_come_back_from_the_store_token_exact(
    tiny: tuple, tmp_path: Path
) -> None:
    reference, path = tiny
    prompts = {f"p{i}": tuple(range(10 + i, 10 + i + 100)) for i in range(4)}  # 7 full blocks each
    want = {r: reference.generate(list(p), SamplingParams(max_tokens=8, ignore_eos=True)).token_ids
            for r, p in prompts.items()}  # fmt: skip
    core, stepper, store = _worker(path, tmp_path, num_blocks=12)  # one prompt at a time fits
    try:
        first = _serve(core, stepper, prompts)
        _settle(store)  # the evicted blocks written (a later prompt may miss them otherwise)
        again: list[TokenDelta] = []
        for rid, prompt in prompts.items():  # one at a time: each finds the pool to itself
            again += _serve(core, stepper, {f"{rid}-again": prompt})
            _settle(store)
        for rid in prompts:
            assert _tokens(first, rid) == want[rid] and _tokens(again, f"{rid}-again") == want[rid]
        hits = {d.request_id: d.cached_tokens for d in again if d.index == 0}
        assert all(hits[f"{r}-again"] == 96 for r in prompts)  # 6 blocks each, from the pool or the store
        assert core.scheduler.prefix.tier_hit_tokens >= 3 * 96  # the pool held one prompt's blocks
        pool = core.tables.pool
        assert pool.num_free == pool.num_blocks
        reg, hb = core.registration(), core.heartbeat(1e9)
        assert (reg.kv_store, reg.kv_store_blocks) == (store.ident, store.capacity_blocks) and reg.kv_store
        assert hb is not None and len(hb.evicted) == 12  # the latest saved, at most a pool's worth
        assert hb.kv_store["hit_tokens"] >= 3 * 96
        store.flush(*pool.cached_blocks())  # the worker stops
    finally:
        store.close()
    core, stepper, store = _worker(path, tmp_path, num_blocks=12)  # a new process: an empty pool
    try:
        restarted: list[TokenDelta] = []
        for rid, prompt in prompts.items():
            restarted += _serve(core, stepper, {rid: prompt})
        for rid in prompts:
            assert _tokens(restarted, rid) == want[rid]
        assert core.scheduler.prefix.tier_hit_tokens == 4 * 96
        assert core.tables.pool.num_free == core.tables.pool.num_blocks
    finally:
        store.close()


@pytest.mark.parametrize("write_through", [False, True])
def test_a_prefix_served_again_is_in_the_store_for_the_hosts_other_workers_with_write_through(
    tiny: tuple, tmp_path: Path, write_through: bool
) -> None:
    """Worker A computes a prompt and serves its prefix again from its pool (a second prompt with the
    same 96 tokens); its pool never evicts. With write-through, worker B on the same host reads the
    prefix from the store; without, B computes it. Both token-exact; A's heartbeat says what it
    saved, and the router's view of the store holds it."""
    from pdfabric.router.routing.registry import Registry, store_key

    reference, path = tiny
    shared = tuple(range(30, 126))  # 6 full blocks
    prompts = {"a1": (*shared, 7, 8), "a2": (*shared, 9), "b1": (*shared, 11, 12, 13)}
    want = {r: reference.generate(list(p), SamplingParams(max_tokens=8, ignore_eos=True)).token_ids
            for r, p in prompts.items()}  # fmt: skip
    a, a_stepper, a_store = _worker(path, tmp_path, 32, kv_store_write_through=write_through)
    b, b_stepper, b_store = _worker(path, tmp_path, 32, kv_store_write_through=write_through)
    try:
        got = _serve(a, a_stepper, {"a1": prompts["a1"]}) + _serve(a, a_stepper, {"a2": prompts["a2"]})
        _settle(a_store)
        got += _serve(b, b_stepper, {"b1": prompts["b1"]})
        for rid in prompts:
            assert _tokens(got, rid) == want[rid]
        hits = {d.request_id: d.cached_tokens for d in got if d.index == 0}
        assert hits["a2"] == 96  # from A's pool
        assert hits["b1"] == (96 if write_through else 0)  # from the store, or computed
        assert b.scheduler.prefix.tier_hit_tokens == hits["b1"]
        hb = a.heartbeat(1e9)
        assert hb is not None and hb.evicted == ()  # nothing left A's pool
        shared_hashes = chain_hashes(shared, 16, a.scheduler.prefix.salt, [])
        assert set(hb.stored) == (set(shared_hashes) if write_through else set())
        registry = Registry()
        registry.register(a.registration())
        registry.heartbeat(hb)
        assert registry.stores.cached_blocks(store_key(a.registration()), shared_hashes) == (
            6 if write_through else 0
        )
        for core in (a, b):
            assert core.tables.pool.num_free == core.tables.pool.num_blocks
    finally:
        a_store.close()
        b_store.close()


def _restarted_after(path: Path, tmp_path: Path, num_blocks: int, prompt: tuple[int, ...]) -> tuple:
    """A worker that served ``prompt`` and stopped (its pool saved to the store), started again: an
    empty pool beside the store that holds the prompt's blocks."""
    core, stepper, store = _worker(path, tmp_path, num_blocks)
    try:
        _serve(core, stepper, {"first": prompt})
        store.flush(*core.tables.pool.cached_blocks())  # the worker stops
    finally:
        store.close()
    return _worker(path, tmp_path, num_blocks)


def test_a_queued_prompts_store_hit_is_read_ahead_while_the_worker_steps(tiny: tuple, tmp_path: Path) -> None:
    """A prompt queued behind a step: the store's reader reads its blocks then, and the scheduling
    pass only copies them into the cache; token-exact."""
    reference, path = tiny
    prompt = tuple(range(40, 140))  # 6 full blocks
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    want = reference.generate(list(prompt), params).token_ids
    core, stepper, store = _restarted_after(path, tmp_path, 32, prompt)
    try:
        core.handle(Generate("again", prompt, params, ()))
        deadline = time.monotonic() + 10
        while len(store.ahead) < 6 and time.monotonic() < deadline:  # the reader at work
            time.sleep(0.01)
        got = _serve(core, stepper, {})
        assert _tokens(got, "again") == want
        assert store.ahead_hits == 6 and core.scheduler.prefix.tier_hit_tokens == 96
        assert not len(store.ahead) and core.tables.pool.num_free == core.tables.pool.num_blocks
    finally:
        store.close()


def test_a_store_hit_cut_short_by_a_full_pool_continues_from_the_store(tiny: tuple, tmp_path: Path) -> None:
    """A prompt whose six stored blocks do not fit beside a running request takes the four the pool
    has free, waits, and once the request ends reads the other two from the store instead of
    computing them; token-exact, and its usage counts all six."""
    reference, path = tiny
    prompt, hog = tuple(range(40, 140)), tuple(range(130, 250))  # 6 full blocks; 8 blocks
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    want = {"p": reference.generate(list(prompt), params).token_ids,
            "hog": reference.generate(list(hog), params).token_ids}  # fmt: skip
    core, stepper, store = _restarted_after(path, tmp_path, 12, prompt)
    try:
        got = _serve(core, stepper, {"hog": hog, "p": prompt})  # p is scheduled with 4 blocks free
        assert _tokens(got, "hog") == want["hog"] and _tokens(got, "p") == want["p"]
        assert [d.cached_tokens for d in got if d.index == 0 and d.request_id == "p"] == [96]
        assert core.scheduler.prefix.tier_hit_tokens == 96
        assert core.tables.pool.num_free == core.tables.pool.num_blocks
    finally:
        store.close()


@pytest.mark.parametrize("reader_first", [False, True])
def test_a_block_that_fails_its_check_is_recomputed_not_served(
    tiny: tuple, tmp_path: Path, reader_first: bool
) -> None:
    """A corrupted block file is deleted and recomputed, never served, and the worker reports it
    gone, whether its loop or its read-ahead thread found it bad."""
    reference, path = tiny
    prompt = tuple(range(30, 130))
    want = reference.generate(list(prompt), SamplingParams(max_tokens=8, ignore_eos=True)).token_ids
    core, stepper, store = _worker(path, tmp_path, num_blocks=12)
    try:
        _serve(core, stepper, {"a": prompt})
        store.flush(*core.tables.pool.cached_blocks())
    finally:
        store.close()
    hashes = chain_hashes(prompt, 16, core.scheduler.config.prefix_salt or b"")
    files = [Path(tmp_path / "ram" / f"{store.key(h).hex()}.kv") for h in hashes]
    data = bytearray(files[3].read_bytes())
    data[-1] ^= 0x40  # the fourth block corrupted
    files[3].write_bytes(data)
    core, stepper, store = _worker(path, tmp_path, num_blocks=12)
    try:
        if reader_first:  # the reader thread finds the bad file before the prompt's pass looks
            store.read_ahead(hashes)
            deadline = time.monotonic() + 10
            while store.ram is not None and not store.ram.stats.bad and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not files[3].exists()
        out = _serve(core, stepper, {"b": prompt})
        hb = core.heartbeat(1e9)
        assert hb is not None and hashes[3] in hb.store_dropped  # the router's view drops it too
    finally:
        store.close()  # (its reader too, which may be the one that found the bad block)
    assert _tokens(out, "b") == want
    assert [d.cached_tokens for d in out if d.index == 0] == [48]  # three blocks, then recomputed
    assert store.ram is not None and store.ram.stats.bad == 1
    assert not files[3].exists()  # dropped, and not written again


def _disaggregated_pair(path: Path, tmp_path: Path, num_blocks: int) -> tuple:
    """A prefill core and a decode core on the tiny model, each with its runner and stepper; the
    decode core with a host store (prefix caching on both)."""
    from pdfabric.engine.loader import load_model
    from pdfabric.engine.runner import ModelRunner
    from pdfabric.engine.stepper import Stepper
    from pdfabric.prefill.core import PrefillCore

    cfg = dict(block_size=16, max_model_len=2048, max_running=4, max_batch_tokens=64, model="tiny",
               prefix_caching=True, kv_store_ram_mb=4, kv_store_ram_dir=str(tmp_path / "ram"))  # fmt: skip
    pre_runner, dec_runner = (ModelRunner(load_model(path), num_blocks, 16) for _ in range(2))
    pre = PrefillCore(core_spec("prefill", num_blocks, **cfg), FixedProfile(WorkerProfile()))
    spec = core_spec("decode", num_blocks, **cfg)
    store = HostKVStore(spec.config, b"tiny", lambda: dec_runner.kv_caches, dec_runner.kv_tiled)
    dec = DecodeCore(spec, FixedProfile(WorkerProfile()), "kv://d", store=store)
    return (pre, Stepper(pre_runner), pre_runner), (dec, Stepper(dec_runner), dec_runner), store


def _through(pair: tuple, rid: str, prompt: tuple[int, ...], params: SamplingParams) -> tuple:
    """One request through the pair, its KV copied from the prefill runner's blocks into the decode
    runner's reserved ones; returns (its tokens, the decode core's Reserved)."""
    (pre, pre_stepper, pre_runner), (dec, dec_stepper, dec_runner) = pair
    _, reserved = dec.handle(Reserve(rid, prompt, params, ()))
    assert isinstance(reserved, Reserved) and reserved.block_ids
    pre.handle(Prefill(rid, prompt, params, (), "kv://d", reserved.block_ids, reserved.cached_blocks))
    sent = _drain(pre, pre_stepper)
    deltas = _deltas(sent)
    [push] = [m for m in sent if isinstance(m, PushKV)]
    src, dst = (torch.tensor(b, dtype=torch.int64) for b in (push.local_blocks, push.remote_blocks))
    for mine, theirs in zip(pre_runner.kv_caches, dec_runner.kv_caches, strict=True):
        theirs.index_copy_(1, dst, mine.index_select(1, src))
    meta = {"first_token": push.first_token, "first_logprob": push.first_logprob}
    done = TransferResult(rid, TransferState.DONE, nbytes=1, seconds=0.001, meta=meta)
    dec.transfer_ended(done)
    pre.transfer_ended(done)
    deltas += _deltas(_drain(dec, dec_stepper))
    return _tokens(deltas, rid), reserved


@pytest.mark.parametrize("corrupt", [False, True])
def test_a_decode_reservation_reads_its_store_hit_while_the_kv_travels(
    tiny: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, corrupt: bool
) -> None:
    """A decode worker started again over its host store: a reservation finds the prompt's blocks
    there and is answered without reading them (the prefill worker ships only the rest); they are
    read in when the KV has arrived. A block that fails its check then is recomputed on the decode
    worker, never served. Token-exact; no block leaked."""
    reference, path = tiny
    prompt = tuple(range(40, 140))  # 6 full blocks
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    want = reference.generate(list(prompt), params).token_ids
    pre, dec, store = _disaggregated_pair(path, tmp_path, 32)
    try:
        got, first = _through((pre, dec), "first", prompt, params)
        assert got == want and first.cached_blocks == 0
        store.flush(*dec[0].tables.pool.cached_blocks())  # the decode worker stops
    finally:
        store.close()
    if corrupt:
        salt = dec[0].scheduler.config.prefix_salt or b""
        bad = tmp_path / "ram" / f"{store.key(chain_hashes(prompt, 16, salt)[3]).hex()}.kv"
        data = bytearray(bad.read_bytes())
        data[-1] ^= 0x40
        bad.write_bytes(data)
    pre, dec, store = _disaggregated_pair(path, tmp_path, 32)  # started again: empty pools
    loads: list[int] = []
    real_load = store.load

    def load(hashes: list[bytes], blocks: list[int]) -> int:
        loads.append(len(blocks))
        return real_load(hashes, blocks)

    monkeypatch.setattr(store, "load", load)
    try:
        core = dec[0]
        original = core.handle

        def handle(msg: object) -> object:  # no store read while a reservation is answered
            out = original(msg)
            if isinstance(msg, Reserve):
                assert loads == []
            return out

        monkeypatch.setattr(core, "handle", handle)
        widest: list[int] = [0]  # the longest chunk the decode worker computed
        real_run = dec[1].run

        def run(chunks: list, tables: object) -> object:
            widest[0] = max([widest[0]] + [c.stop - c.start for c in chunks])
            return real_run(chunks, tables)

        monkeypatch.setattr(dec[1], "run", run)
        got, again = _through((pre, dec), "again", prompt, params)
        assert got == want
        assert again.cached_blocks == 6 and len(again.block_ids) == 1  # only the last block travels
        assert loads  # read in once the KV had arrived
        hit = core.scheduler.prefix.tier_hit_tokens
        assert hit == (48 if corrupt else 96)  # three good blocks before the bad one, or all six
        assert widest[0] == (101 - 48 if corrupt else 1)  # computed again past the 3 good blocks, or not
        for c in (pre[0], core):
            assert c.tables.pool.num_free == c.tables.pool.num_blocks
    finally:
        store.close()
    if corrupt:
        assert store.ram is not None and store.ram.stats.bad == 1 and not bad.exists()


def test_the_store_salt_names_what_makes_kv_bytes_differ(tmp_path: Path) -> None:
    from dataclasses import replace

    from pdfabric.kvtransfer.host_store import store_salt
    from pdfabric.kvtransfer.messages import KVLayout

    (tmp_path / "model.safetensors").write_bytes(b"weights")
    cfg = WorkerConfig(kind="prefill", model="m")
    layout = KVLayout(30, 16, 3, 64, "bfloat16", 2, tiled=True)
    salt = store_salt(cfg, tmp_path, layout)
    assert store_salt(replace(cfg, kind="decode"), tmp_path, layout) == salt  # the kinds share blocks
    others = [
        store_salt(replace(cfg, quantization="int8"), tmp_path, layout),
        store_salt(replace(cfg, kv_cache_dtype="int8"), tmp_path, layout),
        store_salt(replace(cfg, served="m@v2"), tmp_path, layout),
        store_salt(replace(cfg, linears="onednn"), tmp_path, layout),
        store_salt(cfg, tmp_path, replace(layout, tiled=False)),
        store_salt(cfg, tmp_path, replace(layout, block_size=32)),
    ]
    (tmp_path / "model.safetensors").write_bytes(b"other weights")  # the checkpoint changed on disk
    others.append(store_salt(cfg, tmp_path, layout))
    assert len({salt, *others}) == len(others) + 1
