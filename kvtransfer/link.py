"""What prefill and decode workers call to move one request's KV blocks: ``KVSender`` and ``KVReceiver``.

Both are polled from the worker's loop and never block. The decode worker's receiver binds a ZeroMQ
ROUTER socket (its KV endpoint); a prefill worker's sender connects a DEALER to it and, per request,
sends one message: a msgpack header and one raw frame per layer holding the request's blocks packed
contiguously (``[2, n, block_size, kv_heads, head_dim]``, sent zero-copy and kept alive until
acknowledged). The receiver checks the frame against what it reserved, scatters it into the reserved
blocks and acknowledges; the first sampled token rides on the header.

A transfer ends DONE or FAILED with a reason (bad frame, unknown request, abort, timeout); every wait
has a deadline.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import torch
import zmq

from pdfabric.kernels import gather_blocks, scatter_blocks


@dataclass(frozen=True)
class TransferResult:
    request_id: str
    ok: bool
    reason: str = ""
    first_token: int = -1
    first_logprob: float = 0.0
    nbytes: int = 0
    seconds: float = 0.0


@dataclass
class _Outgoing:
    started: float
    deadline: float
    buffers: list[torch.Tensor]  # kept alive until the receiver acknowledges
    nbytes: int


class KVSender:
    """The prefill side: pushes requests' blocks to decode workers' KV endpoints."""

    def __init__(self, kv_caches: list[torch.Tensor], block_size: int, timeout_s: float = 30.0) -> None:
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.timeout_s = timeout_s
        self.ctx = zmq.Context.instance()
        self.poller = zmq.Poller()
        self._socks: dict[str, zmq.Socket] = {}
        self._out: dict[str, _Outgoing] = {}
        self._done: list[TransferResult] = []
        self.on_new_socket: Callable[[zmq.Socket], None] | None = None  # e.g. the worker loop's poller

    @property
    def busy(self) -> bool:
        return bool(self._out)

    def _sock(self, endpoint: str) -> zmq.Socket:
        sock = self._socks.get(endpoint)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            self.poller.register(sock, zmq.POLLIN)
            if self.on_new_socket is not None:
                self.on_new_socket(sock)
            self._socks[endpoint] = sock
        return sock

    def start(
        self,
        request_id: str,
        endpoint: str,
        local_blocks: tuple[int, ...],
        remote_blocks: tuple[int, ...],
        first_token: int,
        first_logprob: float,
    ) -> None:
        """Packs the request's blocks layer by layer and sends them in one message."""
        now = time.monotonic()
        if len(local_blocks) != len(remote_blocks):
            self._done.append(
                TransferResult(
                    request_id,
                    False,
                    f"{len(local_blocks)} blocks computed but {len(remote_blocks)} reserved",
                )
            )
            return
        ids = torch.tensor(local_blocks, dtype=torch.int64, device=self.kv_caches[0].device)
        buffers = [gather_blocks(cache, ids).cpu() for cache in self.kv_caches]
        first = buffers[0]
        header = {
            "request_id": request_id,
            "blocks": list(remote_blocks),
            "dtype": str(first.dtype),
            "shape": list(first.shape),
            "layers": len(buffers),
            "first_token": first_token,
            "first_logprob": first_logprob,
        }
        frames = [msgpack.packb(header)] + [b.view(torch.uint8).numpy() for b in buffers]
        self._sock(endpoint).send_multipart(frames, copy=False)
        nbytes = sum(b.numel() * b.element_size() for b in buffers)
        self._out[request_id] = _Outgoing(now, now + self.timeout_s, buffers, nbytes)

    def poll(self) -> list[TransferResult]:
        """Acknowledgements received, transfers timed out, and failures found at start."""
        results, self._done = self._done, []
        if self._out:
            for sock, _ in self.poller.poll(0):
                while True:
                    try:
                        ack = msgpack.unpackb(sock.recv(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                    out = self._out.pop(ack.get("request_id"), None)
                    if out is not None:
                        results.append(
                            TransferResult(
                                ack["request_id"],
                                bool(ack.get("ok")),
                                ack.get("reason", ""),
                                nbytes=out.nbytes,
                                seconds=time.monotonic() - out.started,
                            )
                        )
        now = time.monotonic()
        for rid, out in list(self._out.items()):
            if now > out.deadline:
                del self._out[rid]
                results.append(TransferResult(rid, False, f"no acknowledgement within {self.timeout_s:.0f}s"))
        return results

    def abort(self, request_id: str, reason: str) -> None:
        """Forgets the transfer (the receiver's reservation is aborted by the router)."""
        self._out.pop(request_id, None)

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(linger=0)


class KVReceiver:
    """The decode side: accepts blocks only for requests it reserved, into exactly those blocks."""

    def __init__(
        self, kv_caches: list[torch.Tensor], block_size: int, host: str, timeout_s: float = 60.0
    ) -> None:
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.timeout_s = timeout_s
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self._expected: dict[
            str, tuple[tuple[int, ...], float, float]
        ] = {}  # id -> (blocks, since, deadline)

    @property
    def busy(self) -> bool:
        return bool(self._expected)

    def expect(self, request_id: str, blocks: tuple[int, ...]) -> None:
        now = time.monotonic()
        self._expected[request_id] = (blocks, now, now + self.timeout_s)

    def poll(self) -> list[TransferResult]:
        results = []
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            result = self._accept(frames)
            if result is not None:
                results.append(result)
        now = time.monotonic()
        for rid, (_, _, deadline) in list(self._expected.items()):
            if now > deadline:
                del self._expected[rid]
                results.append(TransferResult(rid, False, f"no KV arrived within {self.timeout_s:.0f}s"))
        return results

    def _accept(self, frames: list[zmq.Frame]) -> TransferResult | None:
        identity = frames[0].bytes
        try:
            header = msgpack.unpackb(frames[1].bytes)
            rid = str(header["request_id"])
        except (IndexError, ValueError, KeyError, TypeError, msgpack.ExtraData, msgpack.FormatError):
            return None  # not even a request id to answer to
        entry = self._expected.get(rid)
        reason = "unknown request" if entry is None else self._check(header, frames[2:], entry[0])
        if reason:
            self.sock.send_multipart(
                [identity, msgpack.packb({"request_id": rid, "ok": False, "reason": reason})]
            )
            if entry is None:
                return None
            del self._expected[rid]
            return TransferResult(rid, False, reason)
        blocks, since, _ = entry
        ids = torch.tensor(blocks, dtype=torch.int64, device=self.kv_caches[0].device)
        shape, dtype = tuple(header["shape"]), self.kv_caches[0].dtype
        nbytes = 0
        for cache, frame in zip(self.kv_caches, frames[2:], strict=True):
            with warnings.catch_warnings():  # the frame is read-only and only read here
                warnings.simplefilter("ignore", UserWarning)
                packed = torch.frombuffer(frame.buffer, dtype=dtype).view(shape)
            scatter_blocks(cache, ids, packed.to(cache.device))
            nbytes += len(frame.buffer)
        del self._expected[rid]
        self.sock.send_multipart([identity, msgpack.packb({"request_id": rid, "ok": True})])
        return TransferResult(
            rid,
            True,
            "",
            int(header["first_token"]),
            float(header["first_logprob"]),
            nbytes,
            time.monotonic() - since,
        )

    def _check(self, header: dict, frames: list[zmq.Frame], blocks: tuple[int, ...]) -> str:
        cache = self.kv_caches[0]
        want_shape = [2, len(blocks), *cache.shape[2:]]
        if list(header.get("blocks", ())) != list(blocks):
            return "destination blocks differ from the reservation"
        if header.get("dtype") != str(cache.dtype):
            return f"dtype {header.get('dtype')} differs from the cache's {cache.dtype}"
        if list(header.get("shape", ())) != want_shape or header.get("layers") != len(self.kv_caches):
            return (
                f"layout {header.get('shape')} x {header.get('layers')} layers, expected {want_shape} x "
                f"{len(self.kv_caches)}"
            )
        nbytes = cache.element_size() * int(torch.Size(want_shape).numel())
        if len(frames) != len(self.kv_caches) or any(len(f.buffer) != nbytes for f in frames):
            return "truncated or missing layer frames"
        return ""

    def abort(self, request_id: str, reason: str) -> None:
        self._expected.pop(request_id, None)

    def close(self) -> None:
        self.sock.close(linger=0)
