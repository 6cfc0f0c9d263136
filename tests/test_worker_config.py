"""A worker process gets its config whole: ``pdfabric serve`` passes one serialized ``WorkerConfig``
that the worker reads back through the deployment config's loader, flags only override it, and every
setting (``heartbeat_s`` included) takes effect in the worker."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from dataclasses import fields, replace
from pathlib import Path

import pytest
import zmq

from pdfabric.cli import supervisor, worker_cli
from pdfabric.cluster_secret import ClusterSecret, authenticate, stop_authenticating
from pdfabric.config import ServeConfig, load_serve_config
from pdfabric.control import Heartbeat, Register, Shutdown
from pdfabric.wire import decode, encode
from pdfabric.worker_config import WorkerConfig, worker_config_from_json

DEPLOYMENT = """
[serve]
model = "tiny"
dtype = "float32"
prefill = 1
decode = 1

[worker]
block_size = 8
num_blocks = 96
kv_memory_mb = 64
max_batch_tokens = 128
max_running = 7
kv_host = "127.0.0.2"
heartbeat_s = 0.1
device = "cpu"
threads = 1
profile_seconds = 0.5

[[workers]]
kind = "decode"
pool = "tight"
max_running = 2
heartbeat_s = 0.05
"""


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    worker_cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_every_setting_of_the_launch_plan_reaches_the_worker(tmp_path: Path) -> None:
    path = tmp_path / "deploy.toml"
    path.write_text(DEPLOYMENT)
    cfg = load_serve_config(path, {})
    plan = cfg.launch_plan()
    assert [wid for wid, _ in plan] == ["prefill-0", "decode-0", "decode-tight-0"]
    for worker_id, planned in plan:
        cmd = supervisor.worker_command(cfg, planned, "tcp://127.0.0.1:5999", "DEBUG")
        assert cmd[3:5] == ["worker", "--worker-config"]  # one serialized config, no per-setting flags
        got = worker_cli.config_from_args(parse(cmd[4:]))
        assert got == replace(planned, join="tcp://127.0.0.1:5999")
        assert got.worker_id == worker_id and got.model == "tiny" and got.dtype == "float32"
    tight = plan[2][1]
    assert (tight.pool, tight.max_running, tight.heartbeat_s, tight.block_size) == ("tight", 2, 0.05, 8)
    assert plan[0][1].heartbeat_s == 0.1 and plan[0][1].kv_host == "127.0.0.2"


def test_the_launcher_gives_each_worker_its_share_of_the_cores() -> None:
    cfg = ServeConfig(prefill=1, decode=1)
    (_, planned), _ = cfg.launch_plan()
    cmd = supervisor.worker_command(cfg, planned, "tcp://127.0.0.1:1", "INFO")
    assert worker_cli.config_from_args(parse(cmd[4:])).threads == max(1, (os.cpu_count() or 1) // 2)


def test_flags_override_and_default_to_the_dataclass(tmp_path: Path) -> None:
    bare = worker_cli.config_from_args(parse(["--kind", "decode", "--join", "tcp://h:1"]))
    assert bare == WorkerConfig(kind="decode", join="tcp://h:1")  # no flag carries a default of its own
    whole = WorkerConfig(kind="prefill", join="tcp://h:1", pool="p", heartbeat_s=2.0, max_running=3)
    got = worker_cli.config_from_args(parse(["--worker-config", whole.to_json(), "--heartbeat-s", "0.5"]))
    assert got == replace(whole, heartbeat_s=0.5)
    path = tmp_path / "deploy.toml"
    path.write_text(DEPLOYMENT)
    argv = ["--config", str(path), "--kind", "decode", "--join", "tcp://h:2"]
    from_toml = worker_cli.config_from_args(parse(argv))
    assert from_toml == replace(load_serve_config(path, {}).worker, kind="decode", join="tcp://h:2")
    assert from_toml.heartbeat_s == 0.1 and from_toml.dtype == "float32"
    with pytest.raises(ValueError, match="--kind"):
        worker_cli.config_from_args(parse(["--join", "tcp://h:1"]))
    with pytest.raises(ValueError, match="--join"):
        worker_cli.config_from_args(parse(["--kind", "decode"]))


def test_a_serialized_config_is_checked_like_a_deployment_config(tmp_path: Path) -> None:
    good = json.loads(WorkerConfig(kind="decode", join="tcp://h:1").to_json())
    assert worker_config_from_json(json.dumps(good)) == WorkerConfig(kind="decode", join="tcp://h:1")
    cases = [
        ({**good, "max_runing": 3}, "unknown key.*max_runing"),
        ({k: v for k, v in good.items() if k != "heartbeat_s"}, "lacks heartbeat_s"),
        ({**good, "block_size": "16"}, "block_size must be int"),
        ({**good, "max_running": True}, "max_running must be int"),
        ({**good, "heartbeat_s": 0}, "heartbeat_s must be positive"),
        ({**good, "kind": "both"}, "kind must be one of"),
        ({**good, "linears": "mkl"}, "linears must be one of"),
    ]
    for data, message in cases:
        with pytest.raises(ValueError, match=message):
            worker_config_from_json(json.dumps(data))
    with pytest.raises(ValueError, match="not valid JSON"):
        worker_config_from_json("{")
    toml = tmp_path / "bad.toml"
    for body, message in (("block_size = '16'", r"\[worker\]: block_size must be int"),
                          ("heartbeat_s = 0", "heartbeat_s must be positive"),
                          ("join = 'tcp://h:1'", r"unknown key\(s\) in \[worker\]: join")):  # fmt: skip
        toml.write_text(f"[worker]\n{body}\n")
        with pytest.raises(ValueError, match=message):
            load_serve_config(toml, {})
    toml.write_text("[[workers]]\nkind = 'decode'\nheartbeat_s = 'fast'\n")
    with pytest.raises(ValueError, match=r"\[\[workers\]\]: heartbeat_s must be"):
        load_serve_config(toml, {})


def test_every_worker_field_is_a_deployment_key_or_fixed_per_process() -> None:
    from pdfabric.worker_config import WORKER_KEYS

    per_process = {"kind", "join", "model", "dtype", "worker_id", "served"}
    assert {f.name for f in fields(WorkerConfig)} == WORKER_KEYS | per_process
    assert {name for name, _, _ in worker_cli.OVERRIDES} == WORKER_KEYS | per_process


def test_a_worker_process_sends_heartbeats_at_its_configured_interval() -> None:
    """A worker started as the launcher starts it honours ``heartbeat_s``: with 30 s, the heartbeat
    sent on registering is followed by no other for a second and a half (the default sends six)."""
    secret = ClusterSecret.generate()
    ctx = zmq.Context()
    authenticate(ctx, secret)
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    secret.serve(sock)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    planned = WorkerConfig(kind="colocated", worker_id="hb-0", num_blocks=32, profile_seconds=0.0,
                           heartbeat_s=30.0, threads=1, device="cpu")  # fmt: skip
    cfg = ServeConfig(prefill=0, decode=0, colocated=1, worker=planned)
    cmd = supervisor.worker_command(cfg, planned, f"tcp://127.0.0.1:{port}", "WARNING")
    proc = subprocess.Popen(cmd, env={**os.environ, **secret.env()})
    try:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        seen: list[type] = []
        deadline = time.monotonic() + 120.0
        while Heartbeat not in seen:
            assert time.monotonic() < deadline and proc.poll() is None, "the worker never reported"
            if poller.poll(200):
                seen.append(type(decode(sock.recv_multipart()[1])))
        assert seen[0] is Register
        quiet_until = time.monotonic() + 1.5
        while (left := quiet_until - time.monotonic()) > 0:
            if poller.poll(int(left * 1000) + 1):
                msg = decode(sock.recv_multipart()[1])
                assert not isinstance(msg, Heartbeat), "a second heartbeat came before heartbeat_s"
        sock.send_multipart([b"hb-0", encode(Shutdown("test over"))])
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sock.close()
        stop_authenticating(ctx)
        ctx.term()


def test_the_kv_budget_is_sized_by_the_model_unless_set() -> None:
    """``kv_memory_mb = 0`` (the default): room for ``max_running`` sequences of 1,024 tokens, never
    below 256 MB; an explicit budget or block count is used as given."""
    smollm2 = 23_040  # bytes a token: 30 layers x 3 KV heads x 64 dims x K and V x bfloat16
    auto = WorkerConfig(kind="decode")
    assert auto.kv_memory_mb == 0
    assert auto.kv_blocks(smollm2) == 64 * 1024 // 16  # 1.4 GiB
    assert replace(auto, max_running=8).kv_blocks(smollm2) == 256 * 2**20 // (smollm2 * 16)  # the floor
    assert auto.kv_blocks(512) == 256 * 2**20 // (512 * 16)  # tiny: 256 MB, as before
    assert replace(auto, kv_memory_mb=64).kv_blocks(smollm2) == 64 * 2**20 // (smollm2 * 16)
    assert replace(auto, num_blocks=10).kv_blocks(smollm2) == 10
    with pytest.raises(ValueError, match="kv_memory_mb"):
        WorkerConfig(kind="decode", kv_memory_mb=-1)


def test_a_memory_budget_gives_the_kv_cache_what_the_weights_leave() -> None:
    from pdfabric.worker.loop import build_engine

    per_token = 23_040
    budget = WorkerConfig(kind="decode", memory_mb=1024)
    assert budget.kv_blocks(per_token, 300 * 2**20) == (1024 - 300) * 2**20 // (per_token * 16)
    kv64 = replace(budget, kv_memory_mb=64)
    assert kv64.kv_blocks(per_token, 300 * 2**20) == 64 * 2**20 // (per_token * 16)
    with pytest.raises(ValueError, match="leaves no KV block beside 1100 MiB of weights"):
        budget.kv_blocks(per_token, 1100 * 2**20)
    with pytest.raises(ValueError, match="memory_mb"):
        WorkerConfig(kind="decode", memory_mb=-1)
    # a worker holding its weights in int8 gets the bytes they free as KV blocks, and says how many
    base = WorkerConfig(kind="colocated", model="cpu-small", dtype="float32", device="cpu", memory_mb=1024)
    full, int8 = build_engine(base), build_engine(replace(base, quantization="int8"))
    assert full.runner.weight_bytes > 500 * 2**20
    assert int8.runner.weight_bytes < 0.4 * full.runner.weight_bytes
    block = full.runner.config.kv_bytes_per_token * base.block_size
    for engine in (full, int8):
        want = (1024 * 2**20 - engine.runner.weight_bytes) // block
        assert engine.spec.num_blocks == engine.runner.num_blocks == want
        assert engine.runner.kv_caches[0].shape[1] == want
        reg = engine.spec.registration("", engine.profile.profile(force=True))
        assert reg.weight_bytes == engine.runner.weight_bytes and reg.num_blocks == want
    assert int8.spec.num_blocks > full.spec.num_blocks


def test_the_linears_setting_picks_the_runners_kernel() -> None:
    from pdfabric.kernels.linear import LINEAR_KINDS
    from pdfabric.kernels.linear_cpu import InvariantLinear
    from pdfabric.worker.loop import build_engine

    assert LINEAR_KINDS == ("invariant", "onednn", "cublas")
    base = WorkerConfig(kind="colocated", model="tiny", dtype="float32", device="cpu", num_blocks=8)
    assert WorkerConfig(kind="decode").linears == "invariant"
    layer = build_engine(base).runner.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(layer, InvariantLinear)
    vendor = build_engine(replace(base, linears="onednn")).runner.model.model.layers[0].self_attn.qkv_proj
    assert not isinstance(vendor, InvariantLinear)
    with pytest.raises(ValueError, match="does not run on cpu"):
        build_engine(replace(base, linears="cublas"))
