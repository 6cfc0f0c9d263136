"""The receiving process of ``pdfabric bench transfer``: a ``KVReceiver`` (and, for the ``tcp-raw``
row, a plain TCP socket pair's receiving thread) in a spawned process, serving the sending side's
setup / expect / raw / teardown requests over a pipe while it polls its receiver."""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any


def init_dist(port: int, rank: int) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)


def _open_receiver(
    dist_port: int, kind: str, checksum: bool, dims: tuple[int, ...], blocks: int, bind: str
) -> tuple[Any, Any]:
    """A receiver over ``kind`` with a zeroed bfloat16 cache, and its ``SharedKVPool`` for shm: anonymous,
    as a decode worker's, so that a receiver ended without its teardown leaves nothing in /dev/shm."""
    import torch

    from pdfabric.kv_config import TransferConfig
    from pdfabric.kvtransfer.receiver import KVReceiver
    from pdfabric.kvtransfer.reservations import BlockReservations
    from pdfabric.kvtransfer.shm_pool import SharedKVPool

    if kind == "dist":
        init_dist(dist_port, rank=1)  # the parent joins at the same time
    layers, bs, heads, dim = dims
    transport = kind.split("-")[0]
    shm = (
        SharedKVPool.create(layers, blocks, bs, heads, dim, torch.bfloat16, anonymous=True)
        if transport == "shm"
        else None
    )
    caches = (
        shm.caches
        if shm
        else [torch.zeros(2, blocks, bs, heads, dim, dtype=torch.bfloat16) for _ in range(layers)]
    )
    cfg = TransferConfig(
        transport=transport, timeout_s=120, idle_timeout_s=60, checksum=checksum, secret=secret_of(kind),
        encrypt=not kind.endswith("-plain"),
    )  # fmt: skip
    return KVReceiver(caches, cfg, BlockReservations(), bind, shm.paths if shm else ()), shm


BENCH_SECRET = "pdfabric bench transfer: a cluster secret for the curve rows"


def secret_of(kind: str) -> Any:
    """The cluster secret a row's two ends share: the bench's own for a "-curve" or "-plain" row, else
    None."""
    from pdfabric.cluster_secret import ClusterSecret

    return ClusterSecret(BENCH_SECRET) if kind.endswith(("-curve", "-plain")) else None


def receiver_main(conn: Connection, dist_port: int) -> None:
    """The receiving process: serves setup / expect / raw / teardown requests while polling its
    receiver. A request that raises is answered ``("error", text)``, which the parent raises."""
    import torch
    import zmq

    torch.set_num_threads(1)
    state: dict[str, Any] = {"receiver": None, "shm": None, "off_socket": False}
    poller = zmq.Poller()
    poller.register(conn.fileno(), zmq.POLLIN)
    while True:  # sleep until the sender or the parent says something
        receiver = state["receiver"]
        if receiver is not None:
            poller.register(receiver.sock, zmq.POLLIN)
        # dist: chunk completions end off the socket, so a busy receiver polls each 1 ms
        ready = dict(poller.poll(1 if state["off_socket"] and receiver.busy else 50))
        if receiver is not None:
            receiver.poll()
            poller.unregister(receiver.sock)
        if conn.fileno() not in ready:
            continue
        cmd, *rest = conn.recv()
        if cmd == "quit":
            if state["receiver"] is not None:  # a session that ended without its teardown
                _receiver_request(state, dist_port, "teardown", [])
            return
        try:
            conn.send(_receiver_request(state, dist_port, cmd, rest))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _receiver_request(state: dict[str, Any], dist_port: int, cmd: str, rest: list[Any]) -> Any:
    if cmd == "setup":
        state["receiver"], state["shm"] = _open_receiver(dist_port, *rest)
        state["off_socket"] = rest[0] == "dist"
        return state["receiver"].endpoint
    if cmd == "expect":
        state["receiver"].expect(*rest)
        return "ok"
    if cmd == "raw":
        return _raw_server(*rest)
    if cmd == "teardown":
        state["receiver"].close()
        if state["shm"] is not None:
            state["shm"].close()
        state.update(receiver=None, shm=None, off_socket=False)
        return "ok"
    raise ValueError(f"unknown request {cmd!r}")


def _raw_server(nbytes: int) -> int:
    """Listens on loopback; a daemon thread receives each ``[8-byte length][bytes]`` message into one
    destination buffer and acknowledges it with one byte. Returns the port."""
    import socket
    import threading

    import torch

    listener = socket.create_server(("127.0.0.1", 0))
    dest = torch.empty(nbytes, dtype=torch.uint8)

    def serve() -> None:
        sock, _ = listener.accept()
        listener.close()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        view = memoryview(dest.numpy())
        with sock:
            while True:
                head = sock.recv(8, socket.MSG_WAITALL)
                if len(head) < 8:
                    return
                n, got = int.from_bytes(head, "little"), 0
                while got < n:
                    got += sock.recv_into(view[got:n])
                sock.sendall(b"k")

    threading.Thread(target=serve, name="pdfabric-raw-tcp", daemon=True).start()
    return listener.getsockname()[1]
