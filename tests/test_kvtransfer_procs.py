"""Two real processes on loopback: a receiver and a sender, for every transport, plus a sender that dies."""

from __future__ import annotations

import multiprocessing as mp
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from pdfabric.kv_config import TransferConfig
from tests import kvtransfer_procs as procs
from tests.kvtransfer_helpers import digest, make_caches

CTX = mp.get_context("spawn")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _stopping(*ps: mp.Process) -> Iterator[None]:
    try:
        yield
    finally:
        for p in ps:
            p.join(timeout=10)
        for p in ps:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def _get(q: mp.Queue, timeout: float) -> object:
    item = q.get(timeout=timeout)
    if isinstance(item, tuple) and item and item[0] == "error":
        pytest.fail(f"child process failed:\n{item[1]}")
    return item


def _plan() -> procs.Plan:
    """Whole and layer-wise transfers, contiguous and scattered blocks, 1 to 40 blocks."""
    return [
        ("one", (0,), (159,), False),
        ("run", tuple(range(10, 50)), tuple(range(60, 100)), True),
        ("scatter", tuple(range(100, 140, 2)), tuple(range(101, 141, 2)), False),
        ("mixed", (150, 3, 151, 4), (0, 1, 2, 5), True),
    ]


@pytest.mark.parametrize("kind", ["zmq-tcp", "zmq-ipc", "shm", "dist"])
def test_two_processes_round_trip(kind: str, tmp_path: Path) -> None:
    transport = kind.split("-")[0]
    bind = f"ipc://{tmp_path}/kv.sock" if kind == "zmq-ipc" else "tcp://127.0.0.1:*"
    cfg = TransferConfig(transport=transport, timeout_s=30, checksum=True)
    port = _free_port()
    plan = _plan()
    rx_out, rx_in, tx_out, tx_in = CTX.Queue(), CTX.Queue(), CTX.Queue(), CTX.Queue()
    rx = CTX.Process(target=procs.receiver_main, args=(cfg, bind, port, rx_out, rx_in), daemon=True)
    tx = CTX.Process(target=procs.sender_main, args=(cfg, tx_in, port, plan, tx_out, False), daemon=True)
    rx.start()
    tx.start()
    try:
        endpoint = _get(rx_out, 60)
        rx_in.put(plan)
        assert _get(rx_out, 30) == "ready"
        tx_in.put(endpoint)
        received, rx_clean = _get(rx_out, 60)  # type: ignore[misc]
        sent, tx_clean = _get(tx_out, 60)  # type: ignore[misc]
    finally:
        rx_in.put("bye")
        with _stopping(rx, tx):
            pass
    src = make_caches(procs.LAYERS, procs.BLOCKS, torch.bfloat16, procs.SEED)
    want = {rid: digest(src, local) for rid, local, _, _ in plan}
    assert sorted((rid, state, reason) for rid, state, reason, _ in received) == [
        (rid, "done", "") for rid in sorted(want)
    ]
    assert {rid: d for rid, _, _, d in received} == want  # bit-identical in the other process
    assert sorted(sent) == [(rid, "done", "") for rid in sorted(want)]
    assert rx_clean and tx_clean


@pytest.mark.parametrize("transport", ["zmq", "dist"])
def test_sender_process_dies_mid_transfer(transport: str) -> None:
    cfg = TransferConfig(transport=transport, timeout_s=30, idle_timeout_s=0.5)
    plan = [("doomed", tuple(range(8)), tuple(range(8, 16)), True)]
    port = _free_port()
    rx_out, rx_in, tx_out, tx_in = CTX.Queue(), CTX.Queue(), CTX.Queue(), CTX.Queue()
    rx = CTX.Process(
        target=procs.receiver_main, args=(cfg, "tcp://127.0.0.1:*", port, rx_out, rx_in), daemon=True
    )
    tx = CTX.Process(target=procs.sender_main, args=(cfg, tx_in, port, plan, tx_out, True), daemon=True)
    rx.start()
    tx.start()
    try:
        endpoint = _get(rx_out, 60)
        rx_in.put(plan)
        assert _get(rx_out, 30) == "ready"
        tx_in.put(endpoint)
        received, rx_clean = _get(rx_out, 60)  # type: ignore[misc]
    finally:
        rx_in.put("bye")
        with _stopping(rx, tx):
            pass
    [(rid, state, reason, _)] = received
    assert (rid, state) == ("doomed", "failed") and reason.startswith("sender stalled"), reason
    assert rx_clean
