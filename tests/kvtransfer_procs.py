"""Entry points of the two-process KV-transfer tests (spawned; importable by module name)."""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from multiprocessing.queues import Queue

import torch

from pdfabric.kv_config import TransferConfig
from pdfabric.kvtransfer.receiver import KVReceiver
from pdfabric.kvtransfer.sender import KVSender
from pdfabric.kvtransfer.shm_pool import SharedKVPool
from pdfabric.kvtransfer.state import TransferState
from tests.kvtransfer_helpers import FakePool, digest, make_caches

LAYERS, BLOCKS, SEED = 4, 160, 7
Plan = list[tuple[str, tuple[int, ...], tuple[int, ...], bool]]  # (request id, local, remote, layer-wise)


def _init_dist(port: int, rank: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)


def _reporting(main: Callable[..., None]) -> Callable[..., None]:
    """Puts a child's traceback on its queue (the last queue argument) so tests fail fast."""

    def run(*args: object) -> None:
        out = [a for a in args if isinstance(a, Queue)][-1]
        try:
            main(*args)
        except BaseException:
            out.put(("error", traceback.format_exc()))
            raise

    return run


def receiver_main(cfg: TransferConfig, bind: str, dist_port: int, out: Queue, inbox: Queue) -> None:
    _reporting(_receiver)(cfg, bind, dist_port, out, inbox)


def sender_main(cfg: TransferConfig, inbox: Queue, dist_port: int, plan: Plan, out: Queue, die: bool) -> None:
    """Joins the process group (dist) first, then takes the receiver's endpoint from ``inbox``."""
    _reporting(_sender)(cfg, inbox, dist_port, plan, out, die)


def _receiver(cfg: TransferConfig, bind: str, dist_port: int, out: Queue, inbox: Queue) -> None:
    torch.set_num_threads(1)
    if cfg.transport == "dist":
        _init_dist(dist_port, rank=1)
    pool = FakePool(BLOCKS)
    # anonymous, as a decode worker's: a receiver the test kills leaves nothing in /dev/shm
    shm = (
        SharedKVPool.create(LAYERS, BLOCKS, 4, 2, 8, torch.bfloat16, anonymous=True)
        if cfg.transport == "shm"
        else None
    )
    caches = shm.caches if shm else make_caches(LAYERS, BLOCKS, torch.bfloat16, None)
    receiver = KVReceiver(caches, cfg, pool.reservations(), bind, shm.paths if shm else ())
    out.put(receiver.endpoint)
    plan: Plan = inbox.get(timeout=60)
    for rid, _, remote, _ in plan:
        receiver.expect(rid, pool.take(remote))
    out.put("ready")
    results = []
    end = time.monotonic() + 30
    while len(results) < len(plan) and time.monotonic() < end:
        results += receiver.poll()
        time.sleep(0.0005)
    blocks = {rid: remote for rid, _, remote, _ in plan}
    report = [(r.request_id, r.state.value, r.reason, digest(caches, blocks[r.request_id])) for r in results]
    for r in results:
        if r.ok:
            pool.release(r.request_id, blocks[r.request_id])
    receiver.close()
    if shm:
        shm.close()
    out.put((report, pool.all_free))
    inbox.get(timeout=60)  # stay up (and in the process group) until the sender is done too


def _sender(cfg: TransferConfig, inbox: Queue, dist_port: int, plan: Plan, out: Queue, die: bool) -> None:
    torch.set_num_threads(1)
    if cfg.transport == "dist":
        _init_dist(dist_port, rank=0)
    endpoint = inbox.get(timeout=60)
    pool = FakePool(BLOCKS)
    sender = KVSender(make_caches(LAYERS, BLOCKS, torch.bfloat16, SEED), cfg, pool.reservations())
    for rid, local, remote, layerwise in plan:
        sender.start(rid, endpoint, pool.take(local), remote)
        if die:
            sender.send_layers(rid, 0, 1)
            end = time.monotonic() + 5
            while time.monotonic() < end and sender.state(rid) is TransferState.WAITING:
                sender.poll()
            time.sleep(0.2)  # let the first layer leave, then vanish without a word
            os._exit(0)
        if layerwise:
            for layer in range(LAYERS):
                sender.send_layers(rid, layer, layer + 1)
        else:
            sender.send(rid)
    results = []
    end = time.monotonic() + 30
    while len(results) < len(plan) and time.monotonic() < end:
        results += sender.poll()
        time.sleep(0.0005)
    sender.close()
    out.put(([(r.request_id, r.state.value, r.reason) for r in results], pool.all_free))
