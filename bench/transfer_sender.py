"""The sending side of ``pdfabric bench transfer`` (``bench_session``, ``TransferBench``): one sender
per transport and layout in this process, timing each row against a receiver process
(``bench.transfer_receiver``) and a one-core memcpy of the same bytes; ``RawPair`` is the plain TCP
ceiling. ``cli.profile_cmd`` measures a worker's KV rates with it too."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

from pdfabric.bench.transfer_receiver import init_dist, receiver_main, secret_of

PAYLOAD = (4, 16, 8, 32)  # layers, block_size, kv_heads, head_dim: 64 KiB per block in bfloat16
CPU_SMALL = (12, 16, 8, 64)  # 24576 bytes per token
CPU_SMALL_PARAMS = 12 * (2 * 1024 * 1024 + 2 * 1024 * 512 + 3 * 1024 * 2816)  # matmul weights
# A "-curve" row is the transport with the cluster secret, as pdfabric serve runs it: ZeroMQ CURVE
# (every message encrypted); a "-plain" row with the secret and kv_encryption off (ZeroMQ PLAIN);
# the others without one.
TRANSPORTS = ("tcp-raw", "zmq-tcp", "zmq-tcp-curve", "zmq-tcp-plain", "zmq-ipc", "shm", "shm-curve", "dist")
LAYERWISE_TOKENS = 2048  # the layer-wise row's prompt
RAW = "tcp-raw"  # the loopback ceiling: one plain TCP socket pair, bytes received straight into place


def _memcpy_gbps(torch: Any, nbytes: int, repeats: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(max(10, repeats)):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def gemm_flops(torch: Any) -> float:
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    t0 = time.perf_counter()
    for _ in range(5):
        a @ b
    return 5 * 2 * 1024**3 / (time.perf_counter() - t0)


@contextlib.contextmanager
def bench_session(kinds: list[str], repeats: int, checksum: bool, progress: Any) -> Iterator[TransferBench]:
    """The sending side in this process and a receiver process (spawned), both gone on exit. ``dist``
    in ``kinds`` reserves a port for the torch.distributed group."""
    import multiprocessing as mp
    import socket
    import tempfile

    import torch

    dist_port = 0
    if "dist" in kinds:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dist_port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=receiver_main, args=(there, dist_port), daemon=True)
    child.start()
    try:
        with tempfile.TemporaryDirectory(prefix="pdfabric-kv-") as tmpdir:
            yield TransferBench(torch, (here, child), repeats, checksum, tmpdir, dist_port, progress)
    finally:
        if child.is_alive():
            here.send(("quit",))
            child.join(timeout=10)
        if child.is_alive():
            child.kill()


class TransferBench:
    """The sending side of every row: one sender per (transport, layout), receivers set up remotely."""

    def __init__(
        self,
        torch: Any,
        receiver: tuple[Connection, Any],
        repeats: int,
        checksum: bool,
        tmpdir: str,
        dist_port: int,
        progress: Any,
    ) -> None:
        self.torch, self.tmpdir = torch, tmpdir
        self.conn, self.child = receiver  # the pipe to the receiver process, and the process
        self.repeats, self.checksum = repeats, checksum
        self.dist_port, self.progress = dist_port, progress
        self.count = 0
        self.started = time.monotonic()
        self.memcpy: dict[int, float] = {}  # bytes -> one-core memcpy GB/s, measured once per size
        self.results: list[dict[str, Any]] = []
        self.layerwise: list[dict[str, Any]] = []

    def measure(
        self,
        kind: str,
        dims: tuple[int, int, int, int],
        rows: list[tuple[str, int]],
        prefill_ms: float,
        raw_beside: bool = False,
    ) -> None:
        """One receiver and sender for ``kind`` and ``dims``; each row timed ``repeats`` times.
        ``raw_beside``: the ``tcp-raw`` row is timed in the same loop, alternating with ``kind``, so
        that the ratio of the two compares the same moments of a machine whose load moves."""
        if kind == RAW:
            with self._raw_pair(dims, rows) as raw:
                for label, n in rows:
                    self._row(RAW, label, raw.nbytes(n), [raw(n) for _ in range(self.repeats)])
            return
        with contextlib.ExitStack() as stack:
            raw = stack.enter_context(self._raw_pair(dims, rows)) if raw_beside else None
            most = max([n for _, n in rows] + [LAYERWISE_TOKENS // dims[1]] * (prefill_ms > 0))
            sender, endpoint = self.open(kind, dims, most)
            stack.callback(self._call, "teardown")
            stack.callback(sender.close)
            # warm up: the handshake, the connection, and every block once (a sender's first write
            # into a block of a shared pool fills its page tables; serving pays that once per block)
            self.transfer(sender, endpoint, most)
            for label, n in rows:
                times, raw_times = [], []
                for i in range(self.repeats):
                    if raw is not None and i % 2:
                        raw_times.append(raw(n))
                    times.append(self.transfer(sender, endpoint, n))
                    if raw is not None and not i % 2:
                        raw_times.append(raw(n))
                if raw is not None:
                    self._row(RAW, label, raw.nbytes(n), raw_times)
                self._row(kind, label, sender.layout.transfer_bytes(n), times)
            if prefill_ms > 0:
                self.layerwise.append(_layerwise(self, sender, endpoint, kind, prefill_ms))

    def _row(self, kind: str, label: str, nbytes: int, times: list[float]) -> None:
        if nbytes not in self.memcpy:
            self.memcpy[nbytes] = _memcpy_gbps(self.torch, nbytes, self.repeats)
        base, p50 = self.memcpy[nbytes], statistics.median(times)
        self.results.append(
            {
                "transport": kind,
                "payload": label,
                "bytes": nbytes,
                "latency_ms": p50 * 1e3,
                "latency_min_ms": min(times) * 1e3,
                "gbps": nbytes / p50 / 1e9,
                "memcpy_gbps": base,
                "ratio": nbytes / p50 / 1e9 / base,
            }
        )
        done = len(self.results)
        self.progress.update(done, done, {}, time.monotonic() - self.started)

    @contextlib.contextmanager
    def _raw_pair(self, dims: tuple[int, int, int, int], rows: list[tuple[str, int]]) -> Iterator[RawPair]:
        """One plain TCP socket pair to the receiver process (a thread there receives)."""
        import socket

        layers, bs, heads, dim = dims
        per_block = 2 * layers * bs * heads * dim * 2  # bfloat16, keys and values
        most = max(n for _, n in rows) * per_block
        port = self._call("raw", most)
        src = self.torch.randn(most // 2).to(self.torch.bfloat16).view(self.torch.uint8)
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            raw = RawPair(sock, memoryview(src.numpy()), per_block)
            raw(1)  # warm up the connection
            yield raw

    def _call(self, *msg: Any) -> Any:
        self.conn.send(msg)
        return self._answer(msg[0])

    def _answer(self, what: str) -> Any:
        deadline = time.monotonic() + 120
        while not self.conn.poll(0.5):
            if not self.child.is_alive():
                code = self.child.exitcode
                raise RuntimeError(f"receiver process exited ({code}) before answering {what!r}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"receiver process did not answer {what!r}")
        reply = self.conn.recv()
        if isinstance(reply, tuple) and reply[:1] == ("error",):
            raise RuntimeError(f"receiver process failed {what!r}: {reply[1]}")
        return reply

    def open(self, kind: str, dims: tuple[int, int, int, int], blocks: int) -> tuple[Any, str]:
        from pdfabric.kv_config import TransferConfig
        from pdfabric.kvtransfer.sender import KVSender

        layers, bs, heads, dim = dims
        ipc = kind == "zmq-ipc" or kind.startswith("shm")
        bind = f"ipc://{self.tmpdir}/kv-{self.count}.sock" if ipc else "tcp://127.0.0.1:*"
        self.conn.send(("setup", kind, self.checksum, dims, blocks, bind))
        if kind == "dist":  # joined only now, so the gloo group is idle for the other transports
            init_dist(self.dist_port, rank=0)
        endpoint = self._answer("setup")
        caches = [self.torch.randn(2, blocks, bs, heads, dim).to(self.torch.bfloat16) for _ in range(layers)]
        cfg = TransferConfig(
            transport=kind.split("-")[0], timeout_s=120, checksum=self.checksum, secret=secret_of(kind),
            encrypt=not kind.endswith("-plain"),
        )  # fmt: skip
        return KVSender(caches, cfg), endpoint

    def transfer(self, sender: Any, endpoint: str, n: int, spin_per_layer_s: float = 0.0) -> float:
        """Seconds from start to acknowledgement of an ``n``-block transfer (blocks 0..n-1 both sides)."""
        self.count += 1
        rid, blocks = f"t{self.count}", tuple(range(n))
        self._call("expect", rid, blocks)
        t0 = time.perf_counter()
        sender.start(rid, endpoint, blocks, blocks)
        if spin_per_layer_s:
            for layer in range(sender.layout.num_layers):
                end = time.perf_counter() + spin_per_layer_s
                while time.perf_counter() < end:  # the model computing this layer
                    sender.poll()
                sender.send_layers(rid, layer, layer + 1)
        else:
            sender.send(rid)
        while True:
            sender.wait(0.05)  # wakes on the acknowledgement
            results = sender.poll()
            if results:
                if not results[0].ok:
                    raise RuntimeError(f"transfer failed: {results[0].reason}")
                return time.perf_counter() - t0


class RawPair:
    """``raw(n)``: seconds to send ``n`` blocks' bytes over the socket and get the one-byte answer."""

    def __init__(self, sock: Any, view: memoryview, per_block: int) -> None:
        self.sock, self.view, self.per_block = sock, view, per_block

    def nbytes(self, blocks: int) -> int:
        return blocks * self.per_block

    def __call__(self, blocks: int) -> float:
        nbytes = self.nbytes(blocks)
        t0 = time.perf_counter()
        self.sock.sendall(nbytes.to_bytes(8, "little"))
        self.sock.sendall(self.view[:nbytes])
        if self.sock.recv(1) != b"k":
            raise RuntimeError("raw tcp receiver went away")
        return time.perf_counter() - t0


def _layerwise(
    bench: TransferBench, sender: Any, endpoint: str, kind: str, prefill_ms: float
) -> dict[str, Any]:
    """A 2048-token prompt: compute stand-in then send (whole) vs send each layer as computed."""
    n = LAYERWISE_TOKENS // sender.layout.block_size
    spin = prefill_ms / 1e3 / sender.layout.num_layers
    layered = bench.transfer(sender, endpoint, n, spin_per_layer_s=spin)
    t0 = time.perf_counter()
    end = t0 + prefill_ms / 1e3
    while time.perf_counter() < end:
        pass
    whole = (time.perf_counter() - t0) + bench.transfer(sender, endpoint, n)
    return {
        "transport": kind,
        "tokens": LAYERWISE_TOKENS,
        "prefill_ms": prefill_ms,
        "layerwise_total_ms": layered * 1e3,
        "layerwise_overhead": layered * 1e3 / prefill_ms - 1,
        "whole_total_ms": whole * 1e3,
        "whole_overhead": whole * 1e3 / prefill_ms - 1,
    }
