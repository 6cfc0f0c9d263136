"""Settings of one KV sender or receiver, validated once; no torch here."""

from __future__ import annotations

from dataclasses import dataclass

from pdfabric.cluster_secret import ClusterSecret

TRANSPORTS = ("zmq", "shm", "dist")
CHOICES = ("auto", *TRANSPORTS)


@dataclass(frozen=True)
class TransferConfig:
    """``transport``: how tensor bytes move (``zmq`` frames, ``shm`` direct writes, ``dist`` p2p), or
    ``auto``: per peer, ``dist`` where both sides are in one torch.distributed group with GPU caches,
    ``shm`` where the receiver's cache is in shared memory on the sender's host, else ``zmq``. A
    receiver set to one transport accepts only that one; ``auto`` accepts each it can. Control always
    rides ZeroMQ. ``timeout_s`` bounds a whole transfer (receiver: from ``expect``;
    sender: from ``start`` to the acknowledgement). ``idle_timeout_s`` fails a receiver's transfer that
    started but made no progress for that long (a sender gone mid-transfer). ``shm_quarantine_s``
    (default: ``timeout_s``): with ``shm`` a sender writes into the receiver's blocks directly, so the
    blocks of a transfer that failed on the receiver's side go back to the pool only after this long,
    when no sender can still be writing into them (the result is reported at once).
    ``socket_buffer_bytes``: larger kernel socket buffers than the OS default roughly double what
    ZeroMQ tcp moves per second on loopback (``bench transfer``'s ``tcp-raw`` row is the ceiling).
    ``chunk_bytes``: over ZeroMQ, layers sent together leave in chunks of at most this many bytes
    (at least one layer each): libzmq allocates every received frame on its I/O thread, whose glibc
    arena grows in 64 MiB heaps and unmaps each as soon as it empties, so a message of 64 MiB or more
    was page-faulted afresh on every transfer; smaller chunks also let the receiver copy one while
    the next is on the wire. ``secret``: the cluster secret; with it the KV channel speaks ZeroMQ CURVE
    (the receiver's endpoint takes only senders that hold it; every message is encrypted), without it
    (tests, benchmarks) plain ZeroMQ. ``encrypt=False`` (a network the operator trusts): the secret
    still authenticates both ends, but over ZeroMQ PLAIN, so the KV bytes cross the wire unencrypted
    (faster over tcp; no different over shared memory, where the bytes do not use the socket:
    docs/security.md has the measurement). ``trust_dist``: torch.distributed's own connections
    (gloo, NCCL and their rendezvous) are not authenticated by the secret, so with a secret ``auto``
    never picks ``dist`` and ``transport="dist"`` is refused, unless this is True (a process group on
    a network the fabric owns)."""

    transport: str = "auto"
    timeout_s: float = 30.0
    idle_timeout_s: float = 5.0
    checksum: bool = False
    max_messages_per_poll: int = 64
    name: str = "kv"
    shm_quarantine_s: float | None = None
    socket_buffer_bytes: int = 4 << 20  # kernel send/receive buffers of the ZeroMQ sockets (0: the OS's)
    chunk_bytes: int = 16 << 20  # ZeroMQ: a larger layer range leaves as several chunks (>= 1 layer each)
    secret: ClusterSecret | None = None
    encrypt: bool = True
    trust_dist: bool = False  # with a secret: may torch.distributed, unauthenticated, carry KV?

    def __post_init__(self) -> None:
        if self.transport not in CHOICES:
            raise ValueError(f"transport must be one of {', '.join(CHOICES)}, got {self.transport!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        if not self.idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s must be positive, got {self.idle_timeout_s}")
        if self.shm_quarantine_s is not None and not self.shm_quarantine_s >= 0:
            raise ValueError(f"shm_quarantine_s must be >= 0, got {self.shm_quarantine_s}")
        if self.socket_buffer_bytes < 0:
            raise ValueError(f"socket_buffer_bytes must be >= 0, got {self.socket_buffer_bytes}")
        if self.chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {self.chunk_bytes}")
        if self.max_messages_per_poll < 1:
            raise ValueError(f"max_messages_per_poll must be >= 1, got {self.max_messages_per_poll}")
        if self.transport == "dist" and not self.dist_allowed:
            raise ValueError(
                "transport 'dist' with a cluster secret: torch.distributed's connections are not "
                "authenticated by it; set trust_dist=True only for a process group on a network the "
                "fabric owns"
            )

    @property
    def dist_allowed(self) -> bool:
        """Whether torch.distributed may carry KV: without a secret, or with one and ``trust_dist``."""
        return self.secret is None or self.trust_dist

    @property
    def quarantine_s(self) -> float:
        """How long a failed transfer's blocks stay held before release (0 unless ``shm`` may be used)."""
        if self.transport not in ("shm", "auto"):
            return 0.0
        return self.timeout_s if self.shm_quarantine_s is None else self.shm_quarantine_s
