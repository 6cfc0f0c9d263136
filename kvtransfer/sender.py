"""The prefill side of KV transfer: ``KVSender`` ships a request's blocks to a decode worker.

A request's transfer, as the prefill worker's loop polls it (never blocking):

1. WAITING: ``start()`` holds its local blocks; chunks queue until the receiver's ``PeerInfo``
   (asked with ``Hello`` once per endpoint) arrives and matches our layout;
2. TRANSFERRING: ``send_layers(l0, l1)`` ships layers as they are computed (``send()`` ships all);
3. DONE when the receiver acknowledges every layer; FAILED on a refusal, an ``KVAbort`` from the
   receiver, ``abort()`` here, or the deadline. Either way its local blocks are released once, the
   receiver is told on failure, and the result is returned by ``poll()`` and given to the metrics hook.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
import zmq

from pdfabric.kv_config import TransferConfig
from pdfabric.kvtransfer.frames import dtype_name, layout_of
from pdfabric.kvtransfer.messages import Ack, Hello, KVAbort, KVChunk, Meta, PeerInfo
from pdfabric.kvtransfer.reservations import BlockReservations
from pdfabric.kvtransfer.state import MetricsHook, Transfer, TransferResult, TransferState
from pdfabric.kvtransfer.transport import Outgoing, SendPath, choose_transport
from pdfabric.wire import decode, encode

log = logging.getLogger(__name__)


@dataclass
class _Peer:
    endpoint: str
    sock: zmq.Socket
    info: PeerInfo | None = None
    path: SendPath | None = None
    transport: str = ""
    error: str = ""


@dataclass
class _Out(Transfer):
    endpoint: str = ""
    remote_blocks: tuple[int, ...] = ()
    queued: list[tuple[range, Meta]] = field(default_factory=list)
    inflight: list[Outgoing] = field(default_factory=list)  # buffers referenced until the transfer ends
    next_seq: int = 0


class KVSender:
    """Pushes requests' blocks from ``kv_caches`` to decode workers' KV endpoints."""

    def __init__(
        self,
        kv_caches: list[torch.Tensor],
        config: TransferConfig,
        held: BlockReservations | None = None,
        metrics: MetricsHook | None = None,
        *,
        tiled: bool = False,
    ) -> None:
        self.caches = kv_caches
        self.layout = layout_of(kv_caches, tiled)
        self.config = config
        self.held = held if held is not None else BlockReservations(exclusive=False)  # reads share blocks
        self.metrics = metrics
        self.ctx = zmq.Context.instance()
        self.poller = zmq.Poller()
        self._peers: dict[str, _Peer] = {}
        self._out: dict[str, _Out] = {}
        self._finished: list[TransferResult] = []

    # -- API -------------------------------------------------------------------------------------

    def start(
        self, request_id: str, endpoint: str, local_blocks: tuple[int, ...], remote_blocks: tuple[int, ...]
    ) -> None:
        """Registers a transfer of ``local_blocks`` into the receiver's reserved ``remote_blocks``."""
        if request_id in self._out:
            raise ValueError(f"transfer {request_id!r} already started")
        local_blocks, remote_blocks = tuple(local_blocks), tuple(remote_blocks)
        self.held.reserve(request_id, local_blocks)
        now = time.monotonic()
        out = _Out(request_id, local_blocks, self.layout.num_layers, now + self.config.timeout_s, now)
        out.endpoint, out.remote_blocks = endpoint, remote_blocks
        self._out[request_id] = out
        if len(local_blocks) != len(remote_blocks):
            self._fail(out, f"{len(local_blocks)} local blocks but {len(remote_blocks)} reserved remotely")
            return
        self._peer(endpoint)

    def send_layers(
        self, request_id: str, layer_start: int, layer_end: int, meta: Meta | None = None
    ) -> None:
        """Ships layers ``[layer_start, layer_end)`` now if the receiver is known, else queues them."""
        out = self._out.get(request_id)
        if out is None or out.state.finished:
            return
        if not 0 <= layer_start < layer_end <= self.layout.num_layers:
            raise ValueError(f"layer range [{layer_start}, {layer_end}) outside 0..{self.layout.num_layers}")
        out.queued.append((range(layer_start, layer_end), dict(meta or {})))
        self._pump(out)

    def send(self, request_id: str, meta: Meta | None = None) -> None:
        """Ships every layer (whole-request mode): one chunk, or over ZeroMQ chunks of at most
        ``chunk_bytes``."""
        self.send_layers(request_id, 0, self.layout.num_layers, meta)

    def state(self, request_id: str) -> TransferState | None:
        out = self._out.get(request_id)
        return None if out is None else out.state

    def abort(self, request_id: str, reason: str) -> None:
        """Fails the transfer here, releases its local blocks and tells the receiver."""
        out = self._out.get(request_id)
        if out is not None and not out.state.finished:
            self._end(out, TransferState.FAILED, f"aborted by sender: {reason}", notify=reason)

    @property
    def busy(self) -> bool:
        return bool(self._out)

    def sockets(self) -> list[zmq.Socket]:
        """One control socket per receiver so far (a worker loop polls them beside its own)."""
        return [peer.sock for peer in self._peers.values()]

    def wait(self, timeout_s: float) -> None:
        """Sleeps until a receiver may have answered, at most ``timeout_s``; for loops with nothing
        else to do (a worker loop registers ``poller``'s sockets in its own poller instead)."""
        if self._peers:
            self.poller.poll(max(0, int(timeout_s * 1000)))
        else:
            time.sleep(timeout_s)

    def poll(self) -> list[TransferResult]:
        """Advances every transfer; returns those that ended since the last call."""
        for peer in list(self._peers.values()):
            self._drain(peer)
        now = time.monotonic()
        for out in list(self._out.values()):
            if out.state.finished:
                continue
            self._pump(out)
            if now > out.deadline:
                peer = self._peers.get(out.endpoint)
                what = "no acknowledgement" if peer is not None and peer.info else "receiver did not answer"
                self._fail(out, f"{what} within {self.config.timeout_s:g}s (receiver gone?)")
        results, self._finished = self._finished, []
        return results

    def close(self) -> None:
        for out in list(self._out.values()):
            if not out.state.finished:
                self._fail(out, "sender closed")
        for peer in self._peers.values():
            if peer.path is not None:
                peer.path.close()
            peer.sock.close(linger=0)
        self._peers.clear()

    # -- internals -------------------------------------------------------------------------------

    def _peer(self, endpoint: str) -> _Peer:
        peer = self._peers.get(endpoint)
        if peer is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            if self.config.socket_buffer_bytes:
                sock.setsockopt(zmq.SNDBUF, self.config.socket_buffer_bytes)
                sock.setsockopt(zmq.RCVBUF, self.config.socket_buffer_bytes)
            if self.config.secret is not None:
                self.config.secret.connect(sock, self.config.encrypt)
            sock.connect(endpoint)  # without ZMQ_IMMEDIATE: messages queue until the peer is up
            try:
                sock.send(encode(Hello(self.config.name)), zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # the transfers to this endpoint then time out, with this logged
                log.warning("kv sender: cannot greet %s: %s", endpoint, exc)
            self.poller.register(sock, zmq.POLLIN)
            peer = self._peers[endpoint] = _Peer(endpoint, sock)
        return peer

    def _drain(self, peer: _Peer) -> None:
        for _ in range(self.config.max_messages_per_poll):
            try:
                raw = peer.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode(raw)
            except ValueError as exc:
                log.warning("kv sender: bad message from %s: %s", peer.endpoint, exc)
                continue
            if isinstance(msg, PeerInfo):
                self._on_info(peer, msg)
            elif isinstance(msg, Ack | KVAbort):
                self._on_reply(msg)
            else:
                kind = type(msg).__name__
                log.warning("kv sender: %s sent a %s, no message of this channel", peer.endpoint, kind)

    def _on_info(self, peer: _Peer, info: PeerInfo) -> None:
        peer.info = info
        who = f"receiver {info.name}" if info.name else "receiver"
        if info.layout != self.layout:
            peer.error = f"receiver layout {info.layout} differs from ours {self.layout} ({who})"
        else:
            peer.transport = choose_transport(
                self.config.transport, info, self.caches, self.config.dist_allowed
            )
            try:
                peer.path = make_send_path(peer.transport, info)
            except ValueError as exc:
                peer.error = f"cannot reach {who} over {peer.transport}: {exc}"
        for out in list(self._out.values()):
            if out.endpoint == peer.endpoint and not out.state.finished:
                self._pump(out)

    def _on_reply(self, msg: Ack | KVAbort) -> None:
        out = self._out.get(msg.request_id)
        if out is None or out.state.finished:
            return
        # After a failure on the receiver's side, the KVAbort sent back says that nothing more will be
        # written, so that the receiver can give blocks that a shared-memory write could reach back early.
        if isinstance(msg, KVAbort):
            self._end(out, TransferState.FAILED, f"aborted by receiver: {msg.reason}", notify="stopped")
        elif not msg.ok:
            self._end(out, TransferState.FAILED, f"receiver refused: {msg.reason}", notify="stopped")
        elif out.layers_done < out.num_layers:
            self._fail(out, f"receiver acknowledged after {out.layers_done} of {out.num_layers} layers")
        else:
            self._end(out, TransferState.DONE, "", notify=None)

    def _pump(self, out: _Out) -> None:
        peer = self._peers.get(out.endpoint)
        if peer is None or peer.info is None or out.state.finished:
            return
        if peer.error:
            self._fail(out, peer.error)
            return
        while out.queued:
            layers, meta = out.queued.pop(0)
            for part in self._parts(peer, out, layers):
                if not self._ship(peer, out, part, meta if part.stop == layers.stop else {}):
                    return

    def _parts(self, peer: _Peer, out: _Out, layers: range) -> list[range]:
        """``layers`` as the chunks they leave in: over ZeroMQ a range of more than ``chunk_bytes``
        is split (at least one layer a chunk), so that the receiver holds less in flight and copies
        one chunk while the next is on the wire; other transports send a range as one chunk."""
        layer_bytes = 2 * len(out.blocks) * self.layout.block_bytes
        step = max(1, self.config.chunk_bytes // layer_bytes)
        if peer.transport != "zmq" or len(layers) <= step:
            return [layers]
        return [range(l0, min(l0 + step, layers.stop)) for l0 in range(layers.start, layers.stop, step)]

    def _ship(self, peer: _Peer, out: _Out, layers: range, meta: Meta) -> bool:
        """Moves ``layers`` and sends their ``KVChunk``; False when the transfer failed instead."""
        assert peer.path is not None  # set with info when there is no error
        sent = peer.path.send(self.caches, out.blocks, out.remote_blocks, layers, self.config.checksum)
        chunk = KVChunk(
            request_id=out.request_id,
            seq=out.next_seq,
            layer_start=layers.start,
            layer_end=layers.stop,
            blocks=out.remote_blocks,
            dtype=dtype_name(self.caches[0].dtype),
            frame_nbytes=sent.nbytes // (2 * len(layers)),
            checksums=sent.checksums,
            tag=sent.tag,
            src_rank=sent.src_rank,
            meta=meta,
            transport=peer.transport,
        )
        try:
            peer.sock.send_multipart([encode(chunk), *sent.frames], copy=False, flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # never block the worker loop: fail this request instead
            self._fail(out, f"cannot send to {out.endpoint}: {exc}")
            return False
        out.next_seq += 1
        out.transport = peer.transport
        out.inflight.append(sent)
        out.progress(sent.nbytes, len(layers))
        return True

    def _fail(self, out: _Out, reason: str) -> None:
        self._end(out, TransferState.FAILED, reason, notify=reason)

    def _end(self, out: _Out, state: TransferState, reason: str, notify: str | None) -> None:
        """Ends the transfer once, releasing its local blocks; ``notify``: the reason told to the receiver."""
        out.state, out.reason = state, reason
        peer = self._peers.get(out.endpoint)
        if notify is not None and peer is not None:
            try:
                peer.sock.send(encode(KVAbort(out.request_id, notify)), zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                log.warning("kv sender: could not tell %s about %s: %s", out.endpoint, out.request_id, exc)
        self.held.release(out.request_id)
        del self._out[out.request_id]
        result = out.result()
        self._finished.append(result)
        if self.metrics is not None:
            self.metrics(result)


def make_send_path(transport: str, info: PeerInfo) -> SendPath:
    """The sender's half of ``transport`` towards the receiver that announced ``info``."""
    if transport == "zmq":
        from pdfabric.kvtransfer.transport_zmq import ZmqSendPath

        return ZmqSendPath()
    if transport == "shm":
        from pdfabric.kvtransfer.transport_shm import ShmSendPath

        return ShmSendPath(info)
    if transport == "dist":
        from pdfabric.kvtransfer.transport_dist import DistSendPath

        return DistSendPath(info)
    raise ValueError(f"unknown transport {transport!r}")
