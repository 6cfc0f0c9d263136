"""The decode side of KV transfer: ``KVReceiver`` lands a request's blocks in the blocks it reserved.

A request's transfer, as the decode worker's loop polls it (never blocking):

1. WAITING: ``expect()`` registers its reserved blocks (in ``BlockReservations``) and a deadline;
2. TRANSFERRING: chunks arrive in order and are checked (known request, sequence, layer range,
   dtype, size, blocks owned by this request, crc32 when sent) and written into the reserved blocks;
3. DONE once every layer has landed: the sender is acknowledged and the blocks are handed over to
   the caller (not released); FAILED on a bad chunk, an ``KVAbort`` from the sender, ``abort()`` here,
   the deadline, or no progress for ``idle_timeout_s`` (sender gone): the blocks are released once
   and the sender is told. Where a sender may write into them directly (shared memory), they are
   released only after ``quarantine_s``, or as soon as the sender says it has stopped (its ``KVAbort``).
   ``poll()`` returns each ended transfer once; the metrics hook sees it too.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field

import torch
import zmq

from pdfabric.cluster_secret import REFUSED_EVENTS, Refusals, authenticate
from pdfabric.kv_config import TransferConfig
from pdfabric.kvtransfer.frames import check_blocks, layout_of
from pdfabric.kvtransfer.messages import Ack, Hello, KVAbort, KVChunk, PeerInfo
from pdfabric.kvtransfer.reservations import BlockReservations
from pdfabric.kvtransfer.state import MetricsHook, Transfer, TransferResult, TransferState
from pdfabric.kvtransfer.transport import Incoming, RecvPath, dist_ready, host_id
from pdfabric.wire import decode, encode

log = logging.getLogger(__name__)
_REMEMBER_ENDED = 4096  # ended request ids kept to answer late chunks with the real reason


@dataclass
class _In(Transfer):
    peer: bytes = b""  # the sender's ZeroMQ identity, once it has sent a chunk
    next_seq: int = 0
    landed: list[bool] = field(default_factory=list)
    pending: list[Incoming] = field(default_factory=list)


class KVReceiver:
    """Binds the decode worker's KV endpoint and accepts blocks only into reserved blocks."""

    def __init__(
        self,
        kv_caches: list[torch.Tensor],
        config: TransferConfig,
        reservations: BlockReservations,
        bind: str = "tcp://127.0.0.1:*",
        shm_paths: tuple[str, ...] = (),
        metrics: MetricsHook | None = None,
        *,
        tiled: bool = False,
    ) -> None:
        self.caches = kv_caches
        self.layout = layout_of(kv_caches, tiled)
        self.num_blocks = kv_caches[0].shape[1]
        self.config = config
        self.reservations = reservations
        self.metrics = metrics
        self.paths = make_recv_paths(config.transport, shm_paths, config.dist_allowed)
        self._quarantine_s = config.quarantine_s if "shm" in self.paths else 0.0
        ctx = zmq.Context.instance()
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if config.socket_buffer_bytes:
            self.sock.setsockopt(zmq.SNDBUF, config.socket_buffer_bytes)
            self.sock.setsockopt(zmq.RCVBUF, config.socket_buffer_bytes)
        self.refusals = Refusals(f"{config.name} KV")  # handshakes refused: peers without the secret
        self._monitor: zmq.Socket | None = None
        if config.secret is not None:
            authenticate(ctx, config.secret)
            config.secret.serve(self.sock, config.encrypt)
            self._monitor = self.sock.get_monitor_socket(REFUSED_EVENTS)
        self.sock.bind(bind)
        self.endpoint: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._in: dict[str, _In] = {}
        self._ended: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._finished: list[TransferResult] = []
        self._quarantine: list[tuple[float, str]] = []  # (release at, request id), in time order

    # -- API -------------------------------------------------------------------------------------

    def expect(self, request_id: str, blocks: tuple[int, ...]) -> None:
        """Reserves ``blocks`` for ``request_id`` (``ValueError`` if taken or out of range) and waits."""
        blocks = tuple(blocks)
        reason = check_blocks(blocks, self.num_blocks)
        if reason:
            raise ValueError(f"request {request_id!r}: {reason}")
        if request_id in self._in:
            raise ValueError(f"request {request_id!r} is already expected")
        self.reservations.reserve(request_id, blocks)
        self._ended.pop(request_id, None)
        now = time.monotonic()
        self._in[request_id] = _In(
            request_id,
            blocks,
            self.layout.num_layers,
            now + self.config.timeout_s,
            now,
            landed=[False] * self.layout.num_layers,
        )

    def state(self, request_id: str) -> TransferState | None:
        t = self._in.get(request_id)
        return None if t is None else t.state

    def layers_ready(self, request_id: str) -> int:
        """How many layers of the request have landed and been checked so far."""
        t = self._in.get(request_id)
        return 0 if t is None else t.layers_done

    def abort(self, request_id: str, reason: str) -> None:
        """Fails the transfer, releases its reserved blocks and tells the sender (if it has spoken)."""
        t = self._in.get(request_id)
        if t is not None:
            self._end(
                t, TransferState.FAILED, f"aborted by receiver: {reason}", tell=KVAbort(request_id, reason)
            )

    @property
    def busy(self) -> bool:
        return bool(self._in)

    @property
    def quarantined(self) -> int:
        """Failed shm transfers whose blocks are still held, waiting out ``quarantine_s``."""
        return len(self._quarantine)

    def wait(self, timeout_s: float) -> None:
        """Sleeps until a message may have arrived, at most ``timeout_s`` (a worker loop polls ``sock``
        in its own poller instead)."""
        self.sock.poll(max(0, int(timeout_s * 1000)))

    def poll(self) -> list[TransferResult]:
        """Takes what arrived, finishes landed chunks, enforces deadlines; returns ended transfers."""
        for _ in range(self.config.max_messages_per_poll):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            self._on_message(frames[0].bytes, frames[1:])
        now = time.monotonic()
        if self._monitor is not None:
            self.refusals.drain(self._monitor, now)
        while self._quarantine and self._quarantine[0][0] <= now:
            self.reservations.release(self._quarantine.pop(0)[1])
        for t in list(self._in.values()):
            self._advance(t)
            if t.state.finished:
                continue
            if now > t.deadline:
                what = "no KV arrived" if t.state is TransferState.WAITING else "transfer not complete"
                self._fail(t, f"{what} within {self.config.timeout_s:g}s")
            elif t.state is TransferState.TRANSFERRING and now - t.last_progress > self.config.idle_timeout_s:
                self._fail(
                    t, f"sender stalled: no progress for {self.config.idle_timeout_s:g}s (sender gone?)"
                )
        results, self._finished = self._finished, []
        return results

    def close(self) -> None:
        for t in list(self._in.values()):
            self._fail(t, "receiver closed")
        for _, request_id in self._quarantine:  # the pool goes away with us: nobody writes any more
            self.reservations.release(request_id)
        self._quarantine.clear()
        for path in self.paths.values():
            path.close()
        if self._monitor is not None:
            self.sock.disable_monitor()
            self._monitor.close(linger=0)
        self.sock.close(linger=0)

    # -- internals -------------------------------------------------------------------------------

    def _on_message(self, peer: bytes, frames: list[zmq.Frame]) -> None:
        if not frames:
            return
        try:
            msg = decode(frames[0].buffer)
        except ValueError as exc:
            log.warning("kv receiver: dropped a message: %s", exc)
            return
        if isinstance(msg, Hello):
            extra: dict = {}
            for path in self.paths.values():
                extra.update(path.info())
            info = PeerInfo(
                self.config.transport,
                self.layout,
                self.num_blocks,
                host=host_id(),
                name=self.config.name,
                **extra,
            )
            self._reply(peer, info)
        elif isinstance(msg, KVAbort):
            t = self._in.get(msg.request_id)
            if t is not None:
                self._end(
                    t, TransferState.FAILED, f"aborted by sender: {msg.reason}", tell=None, sender_done=True
                )
            else:
                self._lift_quarantine(msg.request_id)
        elif isinstance(msg, KVChunk):
            self._on_chunk(peer, msg, frames[1:])
        else:
            log.warning("kv receiver: dropped a %s, which is no message of this channel", type(msg).__name__)

    def _lift_quarantine(self, request_id: str) -> None:
        """The sender has stopped writing for ``request_id``: its quarantined blocks can go back now."""
        for i, (_, rid) in enumerate(self._quarantine):
            if rid == request_id:
                del self._quarantine[i]
                self.reservations.release(rid)
                return

    def _on_chunk(self, peer: bytes, chunk: KVChunk, frames: list[zmq.Frame]) -> None:
        t = self._in.get(chunk.request_id)
        if t is None:
            ended = self._ended.get(chunk.request_id)
            reason = f"transfer already ended: {ended}" if ended else "unknown request"
            self._reply(peer, Ack(chunk.request_id, False, reason))
            return
        t.peer = peer
        own = self.config.transport
        t.transport = chunk.transport or (own if own != "auto" else "zmq")  # unnamed: frames ride along
        reason = self._check(t, chunk)
        path = self.paths.get(t.transport)
        if path is None and not reason:
            reason = f"transport {t.transport!r} not accepted here"
        incoming = path.begin(chunk, frames, self.caches) if path is not None and not reason else reason
        if isinstance(incoming, str):
            self._fail(t, incoming)
            return
        t.next_seq += 1
        t.last_progress = time.monotonic()
        t.state = TransferState.TRANSFERRING
        t.pending.append(incoming)
        self._advance(t)

    def _check(self, t: _In, c: KVChunk) -> str:
        lay = self.layout
        if c.seq != t.next_seq:
            return f"chunk {c.seq} out of order (expected {t.next_seq})"
        if not 0 <= c.layer_start < c.layer_end <= lay.num_layers:
            return f"layer range [{c.layer_start}, {c.layer_end}) outside 0..{lay.num_layers}"
        if any(t.landed[c.layer_start : c.layer_end]) or any(
            p.chunk.layer_start < c.layer_end and c.layer_start < p.chunk.layer_end for p in t.pending
        ):
            return f"layers [{c.layer_start}, {c.layer_end}) sent twice"
        if c.dtype != lay.dtype:
            return f"dtype {c.dtype} differs from the cache's {lay.dtype}"
        if not self.reservations.owns(t.request_id, c.blocks):
            return "destination blocks are not the ones reserved for this request"
        if c.frame_nbytes != len(c.blocks) * lay.block_bytes:
            want = len(c.blocks) * lay.block_bytes
            return f"frame size {c.frame_nbytes} does not match {len(c.blocks)} blocks ({want} bytes)"
        if c.checksums and len(c.checksums) != c.num_frames:
            return f"{len(c.checksums)} checksums for {c.num_frames} frames"
        return ""

    def _advance(self, t: _In) -> None:
        while t.pending and t.pending[0].done() and not t.state.finished:
            incoming = t.pending.pop(0)
            reason = incoming.finish()
            if reason:
                self._fail(t, reason)
                return
            c = incoming.chunk
            for layer in range(c.layer_start, c.layer_end):
                t.landed[layer] = True
            t.meta.update(c.meta)
            t.progress(incoming.nbytes, c.layer_end - c.layer_start)
        if not t.state.finished and all(t.landed):
            self._end(t, TransferState.DONE, "", tell=Ack(t.request_id, True))

    def _fail(self, t: _In, reason: str) -> None:
        self._end(t, TransferState.FAILED, reason, tell=Ack(t.request_id, False, reason))

    def _reply(self, peer: bytes, msg: PeerInfo | Ack | KVAbort) -> None:
        """Sends without blocking; ROUTER drops messages to a peer that is gone or full."""
        try:
            self.sock.send_multipart([peer, encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("kv receiver: reply %s not sent: %s", type(msg).__name__, exc)

    def _end(
        self, t: _In, state: TransferState, reason: str, tell: Ack | KVAbort | None, sender_done: bool = False
    ) -> None:
        t.state, t.reason = state, reason
        quarantine = 0.0 if sender_done else self._quarantine_s
        if state is TransferState.DONE:
            self.reservations.hand_over(t.request_id)
        elif quarantine > 0:
            self._quarantine.append((time.monotonic() + quarantine, t.request_id))
        else:
            self.reservations.release(t.request_id)
        if state is TransferState.FAILED:
            self._ended[t.request_id] = reason
            while len(self._ended) > _REMEMBER_ENDED:
                self._ended.popitem(last=False)
        if tell is not None and t.peer:
            self._reply(t.peer, tell)
        del self._in[t.request_id]
        t.pending.clear()
        result = t.result()
        self._finished.append(result)
        if self.metrics is not None:
            self.metrics(result)


def make_recv_paths(
    transport: str, shm_paths: tuple[str, ...] = (), dist_allowed: bool = True
) -> dict[str, RecvPath]:
    """The receiver's halves it accepts: ``transport`` alone, or for ``auto`` ZeroMQ plus shared memory
    (when its cache is in a ``SharedKVPool``, ``shm_paths``) plus torch.distributed (when initialised
    and ``dist_allowed``: ``TransferConfig.dist_allowed``)."""
    if transport == "auto":
        dist = dist_allowed and dist_ready()
        names = ["zmq"] + (["shm"] if shm_paths else []) + (["dist"] if dist else [])
    else:
        names = [transport]
    return {name: _recv_path(name, shm_paths) for name in names}


def _recv_path(transport: str, shm_paths: tuple[str, ...]) -> RecvPath:
    if transport == "zmq":
        from pdfabric.kvtransfer.transport_zmq import ZmqRecvPath

        return ZmqRecvPath()
    if transport == "shm":
        from pdfabric.kvtransfer.transport_shm import ShmRecvPath

        return ShmRecvPath(shm_paths)
    if transport == "dist":
        from pdfabric.kvtransfer.transport_dist import DistRecvPath

        return DistRecvPath()
    raise ValueError(f"unknown transport {transport!r}")
