"""The cluster secret keeps strangers off the fabric's inner sockets.

A rogue process that can reach the router's control socket but lacks the secret (no CURVE at all, or
another secret) sends a well-formed ``Register``: it never becomes a worker and is counted; a worker
with the secret registers. A rogue KV sender pushes a transfer into a decode worker's reserved
blocks: nothing lands, no block changes, the refusal is counted; the same push with the secret lands
bit for bit, encrypted (CURVE) or, with ``kv_encryption`` off, authenticated in the clear (PLAIN).
``pdfabric worker`` refuses to start without the secret. (The whole fabric, started by ``pdfabric
serve``, runs with a secret in every end-to-end test.)
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import zmq
import zmq.asyncio

from pdfabric.cluster_secret import ENV, ClusterSecret
from pdfabric.control import Heartbeat, Register
from pdfabric.kv_config import TransferConfig
from pdfabric.kvtransfer.receiver import KVReceiver
from pdfabric.kvtransfer.sender import KVSender
from pdfabric.kvtransfer.state import TransferState
from pdfabric.profile import WorkerProfile
from pdfabric.router.dispatch.dispatcher import Dispatcher
from pdfabric.wire import encode
from tests.fabric import post_json, running_fabric
from tests.kvtransfer_helpers import FakePool, digest, make_caches, pump

SECRET = ClusterSecret("the fabric's own secret, 0123456789")  # one per process: one per ZeroMQ context
OTHER = ClusterSecret("somebody else's secret, 9876543210")
PROFILE = WorkerProfile(prefill=(2e-3, 4e-5, 0.0), decode=(5e-3, 1e-3, 0.0))


def test_a_secret_is_long_hidden_and_makes_one_key_pair(tmp_path: Path) -> None:
    assert SECRET.keys == ClusterSecret(SECRET.text).keys != OTHER.keys
    assert SECRET.text not in repr(SECRET)
    with pytest.raises(ValueError, match="at least 16"):
        ClusterSecret("short")
    path = tmp_path / "secret"
    path.write_text(SECRET.text + "\n")
    path.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        ClusterSecret.load(path)
    path.chmod(0o600)
    assert ClusterSecret.load(path) == SECRET


def _register(worker_id: str) -> list[bytes]:
    reg = Register(worker_id, "colocated", "default", "tiny", 4096, 16, 64, "", os.getpid(), 8, 512, 1000,
                   PROFILE)  # fmt: skip
    return [encode(reg), encode(Heartbeat(worker_id, 0, 0, 0, 64, 64, 1.0, 0, 0.0, PROFILE))]


async def _joins(
    ctx: zmq.asyncio.Context, address: str, worker_id: str, secret: ClusterSecret | None
) -> zmq.asyncio.Socket:
    """A process's control socket that registers as ``worker_id``; kept open by the caller."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, worker_id.encode())
    sock.setsockopt(zmq.LINGER, 0)
    if secret is not None:
        secret.connect(sock)
    sock.connect(address)
    for frame in _register(worker_id):
        await sock.send(frame)
    return sock


def test_only_a_worker_with_the_secret_registers() -> None:
    async def main() -> tuple[set[str], int]:
        dispatcher = Dispatcher("tcp://127.0.0.1:0", worker_timeout_s=30.0, secret=SECRET)
        await dispatcher.start()
        ctx = zmq.asyncio.Context()
        try:
            socks = [  # noqa: F841 - held open: a closed socket would end its handshake
                await _joins(ctx, dispatcher.address, "rogue-plain", None),
                await _joins(ctx, dispatcher.address, "rogue-other", OTHER),
                await _joins(ctx, dispatcher.address, "worker-0", SECRET),
            ]
            deadline = time.monotonic() + 10
            while "worker-0" not in dispatcher.fleet or dispatcher.fleet.refused_peers < 2:
                fleet = dispatcher.fleet
                assert time.monotonic() < deadline, (set(fleet.workers), fleet.refused_peers)
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)  # room for a rogue's message to arrive, were it let through
            return set(dispatcher.fleet.workers), dispatcher.fleet.refused_peers
        finally:
            await dispatcher.close()
            ctx.destroy(linger=0)

    workers, refused = asyncio.run(main())
    assert workers == {"worker-0"} and refused >= 2


@pytest.mark.parametrize(
    ("sender_secret", "sender_encrypts", "receiver_encrypts"),
    [
        (None, True, True),
        (OTHER, True, True),
        (SECRET, True, True),
        (SECRET, False, False),  # kv_encryption off: PLAIN, with a password derived from the secret
        (OTHER, False, False),
        (None, False, False),
        (SECRET, True, False),  # a deployment whose workers disagree: refused, not half-secure
    ],
    ids=["no-secret", "other-secret", "secret", "plain", "plain-other-secret", "plain-no-secret", "mixed"],
)
def test_a_kv_push_lands_only_with_the_secret(
    sender_secret: ClusterSecret | None, sender_encrypts: bool, receiver_encrypts: bool
) -> None:
    lands = sender_secret is SECRET and sender_encrypts == receiver_encrypts
    layers, blocks = 2, 16
    rpool, spool = FakePool(blocks), FakePool(blocks)
    dst = make_caches(layers, blocks, torch.bfloat16, None)
    src = make_caches(layers, blocks, torch.bfloat16, 5)
    fast = dict(transport="zmq", timeout_s=1.5, idle_timeout_s=1.0)
    rcfg = TransferConfig(**fast, secret=SECRET, encrypt=receiver_encrypts)
    scfg = TransferConfig(**fast, secret=sender_secret, encrypt=sender_encrypts)
    receiver = KVReceiver(dst, rcfg, rpool.reservations())
    sender = KVSender(src, scfg, spool.reservations())
    try:
        remote, local = rpool.allocate(3, scattered=True), spool.allocate(3)
        before = digest(dst, remote)
        receiver.expect("r", remote)
        sender.start("r", receiver.endpoint, local, remote)
        sender.send("r")
        sent, got = pump(sender, receiver, 1, timeout_s=5)
        if lands:
            assert got[0].state is TransferState.DONE and digest(dst, remote) == digest(src, local)
            assert receiver.refusals.count == 0
            rpool.release("r", remote)
        else:  # the receiver's deadline fails it; not a byte of its blocks changed
            assert got[0].state is TransferState.FAILED and digest(dst, remote) == before
            assert sent[0].state is TransferState.FAILED
            assert receiver.refusals.count >= 1
    finally:
        sender.close()
        receiver.close()
    assert rpool.all_free and spool.all_free


def test_a_worker_does_not_start_without_the_secret() -> None:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    cmd = [sys.executable, "-m", "pdfabric.cli", "worker", "--kind", "colocated", "--join", "tcp://127.0.0.1:9"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "cluster secret" in out.stderr


@pytest.mark.parametrize("transport", ["zmq", "auto"])
def test_a_fabric_with_kv_encryption_off_serves_the_same_tokens(tmp_path: Path, transport: str) -> None:
    """``[worker] kv_encryption = false``: prefill and decode workers still authenticate each other
    with the secret (PLAIN) and the text is the encrypted deployment's."""
    body = {"model": "tiny", "prompt": [5, 17, 99, 3, 42] * 8, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    tokens = []
    for encrypt in ("true", "false"):
        config = tmp_path / f"deploy-{encrypt}.toml"
        config.write_text(f'[worker]\nkv_encryption = {encrypt}\nkv_transport = "{transport}"\n')
        flags = ("--model", "tiny", "--num-blocks", "64", "--prefill", "1", "--decode", "1")
        with running_fabric("--config", str(config), *flags) as url:
            status, data = post_json(url + "/v1/completions", body)
            assert status == 200, data
            tokens.append(data["choices"][0]["token_ids"])
    assert tokens[0] == tokens[1] and len(tokens[0]) == 12


def test_with_a_secret_torch_distributed_carries_kv_only_if_trusted(monkeypatch: pytest.MonkeyPatch) -> None:
    """gloo / NCCL connections are not authenticated by the secret: an authenticated fabric neither
    offers nor picks them unless the operator says the process group's network is the fabric's own."""
    from pdfabric.kv_config import TransferConfig
    from pdfabric.kvtransfer import receiver, transport_dist

    monkeypatch.setattr(receiver, "dist_ready", lambda: True)  # as if a process group were up
    monkeypatch.setattr(transport_dist, "_check_group", lambda: None)
    offered = lambda config: set(receiver.make_recv_paths("auto", (), config.dist_allowed))  # noqa: E731
    assert offered(TransferConfig()) == {"zmq", "dist"}
    assert offered(TransferConfig(secret=SECRET)) == {"zmq"}
    assert offered(TransferConfig(secret=SECRET, trust_dist=True)) == {"zmq", "dist"}
    with pytest.raises(ValueError, match="trust_dist"):
        TransferConfig(transport="dist", secret=SECRET)
    assert TransferConfig(transport="dist", secret=SECRET, trust_dist=True).dist_allowed
