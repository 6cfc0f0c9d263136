"""The cluster secret: what the fabric's own processes share and every peer on its inner sockets must
prove it holds.

The router's control socket and each decode worker's KV endpoint speak ZeroMQ CURVE, with one key
pair derived from the secret (``keys``): the binding side is the CURVE server, every connecting side
a client with that same key pair, and the binding side's authentication handler (ZAP, one per ZeroMQ
context: ``authenticate``) accepts a client only if its public key is the cluster's. A process
without the secret cannot complete the handshake: it sends nothing that is delivered and receives
nothing; the refusal is logged and counted. CURVE also encrypts every frame.

A KV channel on a network the operator trusts may skip the encryption (``encrypt=False``: ZeroMQ
PLAIN, with a password derived from the secret): peers are still authenticated, but the password
and the KV bytes cross the wire in the clear, so anyone who can read the traffic can replay it.

Where the secret comes from: ``pdfabric serve`` reads ``[serve] cluster_secret_file``, else the
environment variable ``PDFABRIC_CLUSTER_SECRET``, else makes a random one for its run; it hands the
secret to the workers it starts in their environment (never on a command line, which other users of
the host can read). ``pdfabric worker`` takes it from ``--secret-file`` or the same variable.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.utils.monitor
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from pdfabric import envs

ENV = "PDFABRIC_CLUSTER_SECRET"
MIN_LENGTH = 16  # characters of a secret given as text
_DOMAIN = b"pdfabric cluster key v1\x00"
_PLAIN = b"pdfabric plain channel v1"
_USER = b"pdfabric"

log = logging.getLogger("pdfabric.cluster_secret")


@dataclass(frozen=True)
class ClusterSecret:
    """The shared secret (never shown in a repr) and the CURVE key pair derived from it."""

    text: str = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.text) < MIN_LENGTH or self.text != self.text.strip():
            raise ValueError(
                f"a cluster secret is at least {MIN_LENGTH} characters without surrounding spaces"
            )

    @classmethod
    def generate(cls) -> ClusterSecret:
        """A random secret (256 bits), for a deployment whose workers all come from its launcher."""
        return cls(secrets.token_hex(32))

    @classmethod
    def load(cls, path: str | Path) -> ClusterSecret:
        """The secret in the file at ``path`` (its first line); ``ValueError`` if the file can be read
        by other users of the host (``chmod 600`` it) or holds no valid secret."""
        p = Path(path)
        mode = p.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError(f"cluster secret file {p} is open to other users: chmod 600 {p}")
        lines = p.read_text().splitlines()
        return cls(lines[0].strip() if lines else "")

    @classmethod
    def from_env(cls) -> ClusterSecret | None:
        """The secret in ``PDFABRIC_CLUSTER_SECRET``, or None when it is not set."""
        text = envs.get(ENV)
        return cls(text) if text else None

    def env(self) -> dict[str, str]:
        """The environment entry that hands the secret to a child process."""
        return {ENV: self.text}

    @property
    def keys(self) -> tuple[bytes, bytes]:
        """The cluster's CURVE key pair (public, secret), Z85-encoded."""
        seed = hashlib.sha256(_DOMAIN + self.text.encode()).digest()
        secret_key = z85.encode(seed)
        return zmq.curve_public(secret_key), secret_key

    @property
    def password(self) -> bytes:
        """The password of an unencrypted (PLAIN) channel: derived from the secret, never the secret."""
        return hmac.new(self.text.encode(), _PLAIN, hashlib.sha256).hexdigest().encode()

    def serve(self, sock: zmq.Socket, encrypt: bool = True) -> None:
        """Makes a socket that will bind a CURVE server (a PLAIN one without ``encrypt``), before
        ``bind``."""
        if encrypt:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self.keys[1])
        else:
            sock.setsockopt(zmq.PLAIN_SERVER, 1)

    def connect(self, sock: zmq.Socket, encrypt: bool = True) -> None:
        """Makes a socket that will connect a client holding the cluster's keys (CURVE) or password
        (PLAIN, without ``encrypt``), before ``connect``."""
        if encrypt:
            public, secret = self.keys
            sock.setsockopt(zmq.CURVE_SERVERKEY, public)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        else:
            sock.setsockopt(zmq.PLAIN_USERNAME, _USER)
            sock.setsockopt(zmq.PLAIN_PASSWORD, self.password)


class _Door:
    """The ZAP credentials check: a client's public key must be the cluster's."""

    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.public


_lock = threading.Lock()
# id(context) -> (the public key it accepts, its authenticator)
_authenticators: dict[int, tuple[bytes, ThreadAuthenticator]] = {}


def authenticate(ctx: zmq.Context, secret: ClusterSecret) -> None:
    """Starts the one authentication handler of ``ctx`` (a thread; for an asyncio context too, on a
    blocking shadow of the same ZeroMQ context), accepting only clients with the cluster's key (or,
    on a PLAIN socket, its password).
    Idempotent per context; a second, different secret is a ``ValueError``. Call it before a CURVE
    server socket binds."""
    public = secret.keys[0]
    with _lock:
        known = _authenticators.get(id(ctx))
        if known is not None:
            if known[0] != public:
                raise ValueError("this ZeroMQ context already authenticates another cluster secret")
            return
        auth = ThreadAuthenticator(zmq.Context.shadow(ctx.underlying), log=log)
        auth.start()
        auth.configure_curve_callback("*", _Door(public))
        auth.configure_plain("*", {_USER.decode(): secret.password.decode()})
        _authenticators[id(ctx)] = (public, auth)


def stop_authenticating(ctx: zmq.Context) -> None:
    """Stops ``ctx``'s authentication handler, if it has one (before the context is closed)."""
    with _lock:
        known = _authenticators.pop(id(ctx), None)
    if known is not None:
        known[1].stop()


# Handshakes a peer failed: no CURVE (a plain client), another server key (another secret), or a
# client key that is not the cluster's (turned away by the handler).
REFUSED_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
LOG_EVERY_S = 10.0


class Refusals:
    """Counts the handshakes a bound socket refused (from its monitor's events) and logs them at most
    every ``LOG_EVERY_S`` seconds, with the count since the last line (ZeroMQ does not say the peer's
    address). ``note`` takes one event of the socket's monitor
    (``sock.get_monitor_socket(REFUSED_EVENTS)``); ``drain`` takes every event waiting on it."""

    def __init__(self, channel: str) -> None:
        self.channel = channel
        self.count = 0
        self._unlogged = 0
        self._logged_at = float("-inf")

    def note(self, frames: list[bytes], now: float) -> None:
        event = zmq.utils.monitor.parse_monitor_message(frames)
        if not event["event"] & REFUSED_EVENTS:
            return
        self.count += 1
        self._unlogged += 1
        if now - self._logged_at >= LOG_EVERY_S:
            log.warning(
                "%s socket (%s): refused %d handshake(s) from peers without the cluster secret",
                self.channel, event["endpoint"].decode(errors="replace"), self._unlogged,
            )  # fmt: skip
            self._unlogged, self._logged_at = 0, now

    def drain(self, monitor: zmq.Socket, now: float) -> None:
        """Takes every event waiting on a (blocking-API) monitor socket, without waiting."""
        while True:
            try:
                frames = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.note(frames, now)
